//! What the cluster store sends and parses: the claim-checked Lua scripts (each over one
//! session's hash-tagged keys) and the packed lists its pending notes hold.

use redis::{Script, Value};

// Each script takes the session's keys, all under one hash tag, and checks the claim first:
// ARGV[1] is the claim value "<token> <node>" the caller holds. A refusal is {0, holder}.

/// KEYS claim, fence; ARGV node, ttl_ms → {1, token} or {0, owner, pttl}.
pub(super) const CLAIM: &str = r"
local cur = redis.call('GET', KEYS[1])
if cur then
  local holder = string.sub(cur, string.find(cur, ' ') + 1)
  if holder ~= ARGV[1] then return {0, holder, redis.call('PTTL', KEYS[1])} end
end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], token .. ' ' .. ARGV[1], 'PX', ARGV[2])
return {1, token}
";

/// KEYS claim, fence; ARGV value, ttl_ms. A claim that lapsed (its key gone) is taken back,
/// same token, when no claim was issued since (the fence is still at its token): no other node
/// can have written the session meanwhile, every write being checked against a claim.
pub(super) const RENEW: &str = r"
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1}
end
if cur then return {0, cur} end
local token = string.sub(ARGV[1], 1, string.find(ARGV[1], ' ') - 1)
if redis.call('GET', KEYS[2]) ~= token then return {0, ''} end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {1}
";

/// KEYS claim, fence; ARGV value. The fence moves on, so that a renewal still in flight
/// cannot take a claim given up back ([`RENEW`]).
pub(super) const GIVE_UP: &str = r"
local cur = redis.call('GET', KEYS[1])
if cur ~= ARGV[1] then return {0, cur or ''} end
redis.call('DEL', KEYS[1])
redis.call('INCR', KEYS[2])
return {1}
";

/// KEYS claim, gen, pending; ARGV value, runs → {1, generation}.
pub(super) const BEGIN: &str = r"
local cur = redis.call('GET', KEYS[1])
if cur ~= ARGV[1] then return {0, cur or ''} end
local g = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[3], tostring(g), ARGV[2])
return {1, g}
";

/// KEYS claim, record, pending; ARGV value, generation, record, superseded (empty: none).
pub(super) const COMMIT: &str = r"
local cur = redis.call('GET', KEYS[1])
if cur ~= ARGV[1] then return {0, cur or ''} end
redis.call('SET', KEYS[2], ARGV[3])
redis.call('HDEL', KEYS[3], ARGV[2])
if ARGV[4] ~= '' then redis.call('HSET', KEYS[3], 'del:' .. ARGV[2], ARGV[4]) end
return {1}
";

/// KEYS claim, pending; ARGV value, fields... (what a cleanup finished).
pub(super) const CLEARED: &str = r"
local cur = redis.call('GET', KEYS[1])
if cur ~= ARGV[1] then return {0, cur or ''} end
for i = 2, #ARGV do redis.call('HDEL', KEYS[2], ARGV[i]) end
return {1}
";

/// KEYS claim, record, pending; ARGV value, pages to delete → {1}: the record is gone and
/// its pages are listed for deletion.
pub(super) const DELETE: &str = r"
local cur = redis.call('GET', KEYS[1])
if cur ~= ARGV[1] then return {0, cur or ''} end
redis.call('DEL', KEYS[2])
if ARGV[2] ~= '' then redis.call('HSET', KEYS[3], 'del:all', ARGV[2]) end
return {1}
";

pub(super) struct Scripts {
    pub(super) claim: Script,
    pub(super) renew: Script,
    pub(super) give_up: Script,
    pub(super) begin: Script,
    pub(super) commit: Script,
    pub(super) cleared: Script,
    pub(super) delete: Script,
}

/// (layer, block) pairs, 8 bytes each, little-endian.
pub(super) fn pack_runs(runs: impl Iterator<Item = (u32, u32)>) -> Vec<u8> {
    runs.flat_map(|(l, b)| l.to_le_bytes().into_iter().chain(b.to_le_bytes()))
        .collect()
}

/// (layer, block, generation), 16 bytes each.
pub(super) fn pack_pages(pages: impl Iterator<Item = (u32, u32, u64)>) -> Vec<u8> {
    pages
        .flat_map(|(l, b, g)| {
            l.to_le_bytes()
                .into_iter()
                .chain(b.to_le_bytes())
                .chain(g.to_le_bytes())
        })
        .collect()
}

pub(super) fn unpack_pages(bytes: &[u8]) -> Vec<(u32, u32, u64)> {
    bytes
        .chunks_exact(16)
        .map(|c| {
            (
                u32::from_le_bytes(c[0..4].try_into().expect("4")),
                u32::from_le_bytes(c[4..8].try_into().expect("4")),
                u64::from_le_bytes(c[8..16].try_into().expect("8")),
            )
        })
        .collect()
}

pub(super) fn unpack_runs(bytes: &[u8], generation: u64) -> Vec<(u32, u32, u64)> {
    bytes
        .chunks_exact(8)
        .map(|c| {
            (
                u32::from_le_bytes(c[0..4].try_into().expect("4")),
                u32::from_le_bytes(c[4..8].try_into().expect("4")),
                generation,
            )
        })
        .collect()
}

/// Cuts `sizes` (bytes of each item, in order) into consecutive ranges of about `limit` bytes
/// (at least one item each).
pub(super) fn batches(
    sizes: impl Iterator<Item = usize>,
    limit: usize,
) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut bytes, mut n) = (0, 0, 0);
    for size in sizes {
        if n > start && bytes + size > limit {
            out.push(start..n);
            (start, bytes) = (n, 0);
        }
        bytes += size;
        n += 1;
    }
    if n > start {
        out.push(start..n);
    }
    out
}

pub(super) fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        _ => None,
    }
}

pub(super) fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

/// The node named in a claim value "<token> <node>" ('' or nil: none).
pub(super) fn holder_of(v: Option<&Value>) -> Option<String> {
    let s = text(v?)?;
    let (_, node) = s.split_once(' ')?;
    Some(node.to_string())
}
