//! What the service's unit tests share: a small geometry, one peer, limits without quotas,
//! and a session filled with random KV.

use kvtier_protocol::{CreateSessionRequest, DType, Geometry, Policy};
use kvtier_storage::testing::Rng;

use super::*;

/// One block run (a layer's block of 16 tokens) is 2 kv heads x K, V x 16 x 32 x 2 bytes =
/// 4 KiB.
pub(super) const GEO: Geometry = Geometry {
    layers: 2,
    q_heads: 4,
    kv_heads: 2,
    head_dim: 32,
    dtype: DType::Bf16,
    block_tokens: 16,
};

pub(super) const PEER: Peer = Peer {
    uid: 1000,
    gid: 1000,
    pid: None,
};

/// Up to `max_sessions` sessions, no per-uid quota, no admins.
pub(super) fn limits(max_sessions: usize, coalesce: bool) -> ServiceLimits {
    ServiceLimits {
        max_sessions,
        max_sessions_per_uid: 0,
        host_share_per_uid: 1.0,
        nvme_share_per_uid: 1.0,
        max_reply_bytes: 1 << 20,
        coalesce,
        admin_uids: vec![],
        admin_gids: vec![],
    }
}

/// A new session of [`GEO`] (the key bound, 1 sink, 1 local, top 1) on each service, all
/// holding the same `tokens` of random KV; their ids.
pub(super) fn open(services: &[&Service], tokens: u32, rng: &mut Rng) -> Vec<u64> {
    let req = CreateSessionRequest {
        geometry: GEO,
        policy: Policy::bound(1, 1, 1),
        label: String::new(),
    };
    let n = (tokens * GEO.layers * 2 * GEO.kv_heads * GEO.head_dim) as usize;
    let payload = GEO.dtype.encode_vec(&rng.normals(n));
    services
        .iter()
        .map(|s| {
            let id = s.create(&PEER, &req).unwrap();
            s.append(&PEER, id, 0, tokens, &payload).unwrap();
            id
        })
        .collect()
}
