//! Value types shared by several bodies: geometry, policy, session info, decode stats.

use crate::error::ProtoError;
use crate::wire::{put_len, put_str, put_u32, put_u64, put_u8, Reader};

pub use kvtier_model::{DType, Geometry, Policy, Selector};

/// Wire length of a geometry: layers u32, q_heads u32, kv_heads u32, head_dim u32, dtype u8,
/// block_tokens u32.
pub const GEOMETRY_WIRE_LEN: usize = 21;
/// Wire length of a policy: sink_blocks u32, local_blocks u32, top_k u32, selector u32,
/// candidates u32.
pub const POLICY_WIRE_LEN: usize = 20;

/// The element type of a wire code (0 bf16, 1 f16, 2 f32); queries and outputs are always f32.
pub fn dtype_from_wire(value: u8) -> Result<DType, ProtoError> {
    DType::from_code(value).ok_or(ProtoError::BadDtype { value })
}

pub(crate) fn put_geometry(g: &Geometry, buf: &mut Vec<u8>) {
    put_u32(buf, g.layers);
    put_u32(buf, g.q_heads);
    put_u32(buf, g.kv_heads);
    put_u32(buf, g.head_dim);
    put_u8(buf, g.dtype.code());
    put_u32(buf, g.block_tokens);
}

pub(crate) fn get_geometry(r: &mut Reader<'_>) -> Result<Geometry, ProtoError> {
    Ok(Geometry {
        layers: r.u32("geometry.layers")?,
        q_heads: r.u32("geometry.q_heads")?,
        kv_heads: r.u32("geometry.kv_heads")?,
        head_dim: r.u32("geometry.head_dim")?,
        dtype: dtype_from_wire(r.u8("geometry.dtype")?)?,
        block_tokens: r.u32("geometry.block_tokens")?,
    })
}

pub(crate) fn put_policy(p: &Policy, buf: &mut Vec<u8>) {
    put_u32(buf, p.sink_blocks);
    put_u32(buf, p.local_blocks);
    put_u32(buf, p.top_k);
    put_u32(buf, p.selector.code());
    put_u32(buf, p.selector.candidates());
}

pub(crate) fn get_policy(r: &mut Reader<'_>) -> Result<Policy, ProtoError> {
    Ok(Policy {
        sink_blocks: r.u32("policy.sink_blocks")?,
        local_blocks: r.u32("policy.local_blocks")?,
        top_k: r.u32("policy.top_k")?,
        selector: {
            let (code, candidates) = (r.u32("policy.selector")?, r.u32("policy.candidates")?);
            Selector::from_code(code, candidates).ok_or(ProtoError::BadSelector { value: code })?
        },
    })
}

/// One session as reported by SESSION_INFO and LIST_SESSIONS.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct SessionInfo {
    #[cfg_attr(feature = "serde", serde(rename = "id"))]
    pub session: u64,
    pub owner_uid: u32,
    pub label: String,
    pub geometry: Geometry,
    pub policy: Policy,
    /// Smallest token count over the layers (they differ while a decode step is under way).
    pub tokens_min: u64,
    /// Largest token count over the layers.
    pub tokens_max: u64,
    /// Stored (layer, block) runs.
    pub blocks: u64,
    pub host_bytes: u64,
    pub nvme_bytes: u64,
    /// KV bytes of the session the remote tier holds (0 without it). Protocol version 4 on:
    /// an older version's reply has none, and decodes as 0.
    pub remote_bytes: u64,
    pub pinned: bool,
    /// Its stored data failed verification at startup: listed so an operator sees it, every
    /// use answers DATA_LOSS, CLOSE deletes what remains (wire: bit 1 of the state byte).
    pub damaged: bool,
    pub created_unix_ms: u64,
    pub last_access_unix_ms: u64,
}

impl SessionInfo {
    /// Encoded size with an empty label in versions 2 and 3 (4 adds 8 bytes): the minimum
    /// size of one list element.
    pub const MIN_WIRE_LEN: usize =
        8 + 4 + 4 + GEOMETRY_WIRE_LEN + POLICY_WIRE_LEN + 8 * 5 + 1 + 8 * 2;

    pub(crate) fn put(&self, buf: &mut Vec<u8>, version: u16) -> Result<(), ProtoError> {
        put_u64(buf, self.session);
        put_u32(buf, self.owner_uid);
        put_str(buf, &self.label, "session label")?;
        put_geometry(&self.geometry, buf);
        put_policy(&self.policy, buf);
        put_u64(buf, self.tokens_min);
        put_u64(buf, self.tokens_max);
        put_u64(buf, self.blocks);
        put_u64(buf, self.host_bytes);
        put_u64(buf, self.nvme_bytes);
        put_u8(buf, u8::from(self.pinned) | u8::from(self.damaged) << 1);
        put_u64(buf, self.created_unix_ms);
        put_u64(buf, self.last_access_unix_ms);
        if version >= 4 {
            put_u64(buf, self.remote_bytes);
        }
        Ok(())
    }

    pub(crate) fn get(r: &mut Reader<'_>, version: u16) -> Result<Self, ProtoError> {
        let (session, owner_uid) = (r.u64("session")?, r.u32("owner_uid")?);
        let label = r.str("session label")?.to_owned();
        let (geometry, policy) = (get_geometry(r)?, get_policy(r)?);
        let (tokens_min, tokens_max) = (r.u64("tokens_min")?, r.u64("tokens_max")?);
        let (blocks, host_bytes, nvme_bytes) =
            (r.u64("blocks")?, r.u64("host_bytes")?, r.u64("nvme_bytes")?);
        let state = r.flags("session state", 0b11)?;
        Ok(Self {
            session,
            owner_uid,
            label,
            geometry,
            policy,
            tokens_min,
            tokens_max,
            blocks,
            host_bytes,
            nvme_bytes,
            pinned: state & 1 != 0,
            damaged: state & 2 != 0,
            created_unix_ms: r.u64("created_unix_ms")?,
            last_access_unix_ms: r.u64("last_access_unix_ms")?,
            remote_bytes: if version >= 4 {
                r.u64("remote_bytes")?
            } else {
                0
            },
        })
    }
}

/// Per-entry statistics of a DECODE step (when asked for with the want-stats flag).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DecodeStats {
    /// Blocks in the layer (per kv head) when the step ran.
    pub blocks_total: u32,
    /// Selected (block, kv head) tiles, summed over kv heads.
    pub blocks_selected: u32,
    /// KV bytes read by attention over the keep-set.
    pub bytes_touched: u64,
    /// Bytes transferred between tiers for this step (host -> GPU, NVMe -> host).
    pub bytes_moved: u64,
    /// Selected tiles already resident in the GPU block cache.
    pub cache_hits: u32,
    /// Selected tiles served from host RAM.
    pub blocks_ram: u32,
    /// Selected tiles read from NVMe.
    pub blocks_nvme: u32,
    /// Selected block ids, ascending, one list per kv head.
    pub selected: Vec<Vec<u32>>,
}

impl DecodeStats {
    /// Encoded size with no kv heads.
    pub const MIN_WIRE_LEN: usize = 4 + 4 + 8 + 8 + 4 + 4 + 4 + 4;

    pub(crate) fn put(&self, buf: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_u32(buf, self.blocks_total);
        put_u32(buf, self.blocks_selected);
        put_u64(buf, self.bytes_touched);
        put_u64(buf, self.bytes_moved);
        put_u32(buf, self.cache_hits);
        put_u32(buf, self.blocks_ram);
        put_u32(buf, self.blocks_nvme);
        put_len(buf, self.selected.len(), "selected kv heads")?;
        for ids in &self.selected {
            put_len(buf, ids.len(), "selected block ids")?;
            for id in ids {
                put_u32(buf, *id);
            }
        }
        Ok(())
    }

    pub(crate) fn get(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let mut s = Self {
            blocks_total: r.u32("blocks_total")?,
            blocks_selected: r.u32("blocks_selected")?,
            bytes_touched: r.u64("bytes_touched")?,
            bytes_moved: r.u64("bytes_moved")?,
            cache_hits: r.u32("cache_hits")?,
            blocks_ram: r.u32("blocks_ram")?,
            blocks_nvme: r.u32("blocks_nvme")?,
            selected: Vec::new(),
        };
        let heads = r.count("selected kv heads", 4)?;
        s.selected.reserve(heads);
        for _ in 0..heads {
            let n = r.count("selected block ids", 4)?;
            let mut ids = Vec::with_capacity(n);
            for _ in 0..n {
                ids.push(r.u32("selected block id")?);
            }
            s.selected.push(ids);
        }
        Ok(s)
    }
}

/// Names of the initial STATS keys. The list is open: servers may add keys without a
/// version bump and clients must ignore keys they do not know.
pub mod stats_keys {
    crate::key_list! {
        UPTIME_MS = "uptime_ms";
        SESSIONS = "sessions";
        HOST_BYTES_USED = "host_bytes_used";
        HOST_BYTES_CAPACITY = "host_bytes_capacity";
        HOST_EXTENTS_USED = "host_extents_used";
        DECODE_REQUESTS_TOTAL = "decode_requests_total";
        DECODE_ENTRIES_TOTAL = "decode_entries_total";
        APPEND_TOKENS_TOTAL = "append_tokens_total";
        ERRORS_TOTAL = "errors_total";
        REJECTED_TOTAL = "rejected_total";
        BYTES_TOUCHED_TOTAL = "bytes_touched_total";
    }
}

/// LEASE's reply: where a session's block runs are in the daemon's shared host arena (whose
/// memfd comes with the frame, SCM_RIGHTS). Wire: `instance u64, arena_bytes u64,
/// run_bytes u64, layers u32`, then per layer `tokens u64, blocks u32, offset u64 x blocks`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseReply {
    /// Random per daemon start: a different value than a previous lease's means the daemon
    /// restarted (and the arena is a different one).
    pub instance: u64,
    /// Length of the arena mapping.
    pub arena_bytes: u64,
    /// Bytes of one block run (`geometry.block_bytes()`; its extent is this rounded up to
    /// 4 KiB).
    pub run_bytes: u64,
    pub layers: Vec<LeaseLayer>,
}

/// One layer of a [`LeaseReply`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseLayer {
    /// Tokens stored: the last block holds `tokens - (blocks - 1) * block_tokens` rows, the
    /// rest of its run is zero.
    pub tokens: u64,
    /// Per block, the byte offset of its run in the arena, or [`LeaseLayer::COLD`] for a block
    /// only on NVMe (not in host RAM: PROMOTE it, then LEASE again).
    pub offsets: Vec<u64>,
}

impl LeaseLayer {
    /// The offset of a block that is not in host RAM.
    pub const COLD: u64 = u64::MAX;
}

impl LeaseReply {
    pub(crate) fn put(&self, buf: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_u64(buf, self.instance);
        put_u64(buf, self.arena_bytes);
        put_u64(buf, self.run_bytes);
        put_len(buf, self.layers.len(), "lease layers")?;
        for l in &self.layers {
            put_u64(buf, l.tokens);
            put_len(buf, l.offsets.len(), "lease blocks")?;
            for &o in &l.offsets {
                put_u64(buf, o);
            }
        }
        Ok(())
    }

    pub(crate) fn get(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let instance = r.u64("instance")?;
        let arena_bytes = r.u64("arena_bytes")?;
        let run_bytes = r.u64("run_bytes")?;
        let n = r.count("lease layers", 12)?;
        let mut layers = Vec::with_capacity(n);
        for _ in 0..n {
            let tokens = r.u64("tokens")?;
            let blocks = r.count("lease blocks", 8)?;
            let mut offsets = Vec::with_capacity(blocks);
            for _ in 0..blocks {
                offsets.push(r.u64("block offset")?);
            }
            layers.push(LeaseLayer { tokens, offsets });
        }
        Ok(LeaseReply {
            instance,
            arena_bytes,
            run_bytes,
            layers,
        })
    }
}

/// RESERVE's reply: where the reserved rows go in the leased arena. Wire: `start u64, tokens
/// u32, layers u32`, then per layer `blocks u32, offset u64 x blocks`: the runs of the blocks
/// holding rows `start..start + tokens`, the first being block `start / block_tokens` (the
/// partial tail block when `start` is inside one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReserveReply {
    /// Position of the first reserved row: every layer's stored tokens.
    pub start: u64,
    pub tokens: u32,
    /// Per layer, the arena byte offsets of the runs the rows go to.
    pub layers: Vec<Vec<u64>>,
}

impl ReserveReply {
    pub(crate) fn put(&self, buf: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_u64(buf, self.start);
        put_u32(buf, self.tokens);
        put_len(buf, self.layers.len(), "reserve layers")?;
        for offsets in &self.layers {
            put_len(buf, offsets.len(), "reserve blocks")?;
            for &o in offsets {
                put_u64(buf, o);
            }
        }
        Ok(())
    }

    pub(crate) fn get(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let start = r.u64("start")?;
        let tokens = r.u32("tokens")?;
        let n = r.count("reserve layers", 4)?;
        let mut layers = Vec::with_capacity(n);
        for _ in 0..n {
            let blocks = r.count("reserve blocks", 8)?;
            let mut offsets = Vec::with_capacity(blocks);
            for _ in 0..blocks {
                offsets.push(r.u64("block offset")?);
            }
            layers.push(offsets);
        }
        Ok(ReserveReply {
            start,
            tokens,
            layers,
        })
    }

    /// Wire bytes of a reply over `layers` layers of `blocks` runs each.
    pub fn wire_len(layers: usize, blocks: usize) -> u64 {
        12 + 4 + layers as u64 * (4 + 8 * blocks as u64)
    }
}
