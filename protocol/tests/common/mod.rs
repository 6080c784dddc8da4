// Shared proptest strategies and fixtures (included with `mod common;`).
#![allow(dead_code)]

use kvtier_protocol::*;
use proptest::collection::vec;
use proptest::prelude::*;

/// A small valid geometry (2 layers, GQA 4/2, head dim 4, bf16, blocks of 16).
pub fn tiny_geometry() -> Geometry {
    Geometry {
        layers: 2,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 4,
        dtype: DType::Bf16,
        block_tokens: 16,
    }
}

pub fn dtype() -> impl Strategy<Value = DType> {
    prop_oneof![Just(DType::Bf16), Just(DType::F16), Just(DType::F32)]
}

pub fn geometry() -> impl Strategy<Value = Geometry> {
    (
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
        dtype(),
        any::<u32>(),
    )
        .prop_map(
            |(layers, q_heads, kv_heads, head_dim, dtype, block_tokens)| {
                Geometry::new(layers, q_heads, kv_heads, head_dim, dtype, block_tokens)
            },
        )
}

pub fn policy() -> impl Strategy<Value = Policy> {
    (
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
        prop::option::of(any::<u32>()),
    )
        .prop_map(|(sink, local, top_k, candidates)| match candidates {
            Some(c) => Policy::sketch(sink, local, top_k, c),
            None => Policy::bound(sink, local, top_k),
        })
}

pub fn text() -> impl Strategy<Value = String> {
    prop_oneof![Just(String::new()), "[a-z0-9_-]{1,12}", "\\PC{0,8}"]
}

pub fn session_info() -> impl Strategy<Value = SessionInfo> {
    (
        (any::<u64>(), any::<u32>(), text(), geometry(), policy()),
        (any::<[u64; 6]>(), any::<bool>(), any::<u64>(), any::<u64>()),
    )
        .prop_map(
            |((session, owner_uid, label, geometry, policy), (n, pinned, created, last))| {
                SessionInfo {
                    session,
                    owner_uid,
                    label,
                    geometry,
                    policy,
                    tokens_min: n[0],
                    tokens_max: n[1],
                    blocks: n[2],
                    host_bytes: n[3],
                    nvme_bytes: n[4],
                    remote_bytes: n[5],
                    pinned,
                    damaged: false,
                    created_unix_ms: created,
                    last_access_unix_ms: last,
                }
            },
        )
}

pub fn decode_stats() -> impl Strategy<Value = DecodeStats> {
    (
        any::<[u32; 5]>(),
        any::<[u64; 2]>(),
        vec(vec(any::<u32>(), 0..6), 0..4),
    )
        .prop_map(|(a, b, selected)| DecodeStats {
            blocks_total: a[0],
            blocks_selected: a[1],
            bytes_touched: b[0],
            bytes_moved: b[1],
            cache_hits: a[2],
            blocks_ram: a[3],
            blocks_nvme: a[4],
            selected,
        })
}

/// Owned DECODE entry; `as_ref` borrows it as the wire type.
#[derive(Debug, Clone)]
pub struct OwnedEntry {
    pub session: u64,
    pub position: u64,
    pub q: Vec<u8>,
    pub k: Vec<u8>,
    pub v: Vec<u8>,
}

impl OwnedEntry {
    pub fn as_ref(&self) -> DecodeEntryRef<'_> {
        DecodeEntryRef {
            session: self.session,
            position: self.position,
            q: &self.q,
            k: &self.k,
            v: &self.v,
        }
    }
}

pub fn entry() -> impl Strategy<Value = OwnedEntry> {
    (
        any::<u64>(),
        any::<u64>(),
        0usize..8,
        vec(any::<u8>(), 0..24),
    )
        .prop_flat_map(|(session, position, q_f32s, k)| {
            let n = k.len();
            (vec(any::<u8>(), q_f32s * 4), vec(any::<u8>(), n)).prop_map(move |(q, v)| OwnedEntry {
                session,
                position,
                q,
                k: k.clone(),
                v,
            })
        })
}

/// Owned mirror of `Request<'_>`.
#[derive(Debug, Clone)]
pub enum OwnedRequest {
    Hello(HelloRequest),
    Create(CreateSessionRequest),
    AppendInline(u64, u64, u32, Vec<u8>),
    AppendShm(u64, u64, u32, u64, u64),
    Decode(u32, bool, Vec<OwnedEntry>),
    SessionInfo(u64),
    Close(u64),
    List,
    Stats,
    Evict(u64),
    Demote(u64),
    Promote(u64),
    Pin(u64),
    Unpin(u64),
    Lease(u64),
    Release(u64),
    Reserve(u64, u32),
    Commit(u64, u32, Option<(u32, u32)>),
}

impl OwnedRequest {
    pub fn as_request(&self) -> Request<'_> {
        match self {
            OwnedRequest::Hello(h) => Request::Hello(h.clone()),
            OwnedRequest::Create(c) => Request::CreateSession(c.clone()),
            OwnedRequest::AppendInline(session, start_pos, n_tokens, p) => {
                Request::AppendKv(AppendKvRequest {
                    session: *session,
                    start_pos: *start_pos,
                    n_tokens: *n_tokens,
                    data: AppendData::Inline(p),
                })
            }
            OwnedRequest::AppendShm(session, start_pos, n_tokens, offset, len) => {
                Request::AppendKv(AppendKvRequest {
                    session: *session,
                    start_pos: *start_pos,
                    n_tokens: *n_tokens,
                    data: AppendData::Shm {
                        offset: *offset,
                        len: *len,
                    },
                })
            }
            OwnedRequest::Decode(layer, want_stats, entries) => Request::Decode(DecodeRequest {
                layer: *layer,
                want_stats: *want_stats,
                entries: entries.iter().map(OwnedEntry::as_ref).collect(),
            }),
            OwnedRequest::SessionInfo(s) => Request::SessionInfo { session: *s },
            OwnedRequest::Close(s) => Request::CloseSession { session: *s },
            OwnedRequest::List => Request::ListSessions,
            OwnedRequest::Stats => Request::Stats,
            OwnedRequest::Evict(s) => Request::Evict { session: *s },
            OwnedRequest::Demote(s) => Request::Demote { session: *s },
            OwnedRequest::Promote(s) => Request::Promote { session: *s },
            OwnedRequest::Pin(s) => Request::Pin { session: *s },
            OwnedRequest::Unpin(s) => Request::Unpin { session: *s },
            OwnedRequest::Lease(s) => Request::Lease { session: *s },
            OwnedRequest::Release(s) => Request::Release { session: *s },
            OwnedRequest::Reserve(session, tokens) => Request::Reserve {
                session: *session,
                tokens: *tokens,
            },
            OwnedRequest::Commit(session, tokens, layers) => Request::Commit {
                session: *session,
                tokens: *tokens,
                layers: *layers,
            },
        }
    }
}

pub fn request() -> impl Strategy<Value = OwnedRequest> {
    prop_oneof![
        (any::<u16>(), any::<u16>(), text()).prop_map(|(a, b, n)| OwnedRequest::Hello(
            HelloRequest {
                min_version: a,
                max_version: b,
                client_name: n
            }
        )),
        (geometry(), policy(), text()).prop_map(|(geometry, policy, label)| {
            OwnedRequest::Create(CreateSessionRequest {
                geometry,
                policy,
                label,
            })
        }),
        (
            any::<u64>(),
            any::<u64>(),
            any::<u32>(),
            vec(any::<u8>(), 0..64)
        )
            .prop_map(|(a, b, c, p)| OwnedRequest::AppendInline(a, b, c, p)),
        (
            any::<u64>(),
            any::<u64>(),
            any::<u32>(),
            any::<u64>(),
            any::<u64>()
        )
            .prop_map(|(a, b, c, d, e)| OwnedRequest::AppendShm(a, b, c, d, e)),
        (any::<u32>(), any::<bool>(), vec(entry(), 0..4))
            .prop_map(|(l, s, e)| OwnedRequest::Decode(l, s, e)),
        any::<u64>().prop_map(OwnedRequest::SessionInfo),
        any::<u64>().prop_map(OwnedRequest::Close),
        Just(OwnedRequest::List),
        Just(OwnedRequest::Stats),
        any::<u64>().prop_map(OwnedRequest::Evict),
        any::<u64>().prop_map(OwnedRequest::Demote),
        any::<u64>().prop_map(OwnedRequest::Promote),
        any::<u64>().prop_map(OwnedRequest::Pin),
        any::<u64>().prop_map(OwnedRequest::Unpin),
        any::<u64>().prop_map(OwnedRequest::Lease),
        any::<u64>().prop_map(OwnedRequest::Release),
        (any::<u64>(), any::<u32>()).prop_map(|(s, t)| OwnedRequest::Reserve(s, t)),
        (any::<u64>(), any::<u32>(), any::<Option<(u32, u32)>>())
            .prop_map(|(s, t, l)| OwnedRequest::Commit(s, t, l)),
    ]
}

fn error_code() -> impl Strategy<Value = ErrorCode> {
    proptest::sample::select(ErrorCode::ALL.to_vec())
}

pub fn response() -> impl Strategy<Value = Response> {
    let out = vec(-1.0e6f32..1.0e6f32, 0..12);
    prop_oneof![
        (any::<u16>(), any::<u32>(), text(), text()).prop_map(|(v, m, n, s)| Response::Hello(
            HelloReply {
                version: v,
                max_frame_bytes: m,
                server_name: n,
                server_version: s
            }
        )),
        any::<u64>().prop_map(|session| Response::CreateSession { session }),
        any::<u64>().prop_map(|tokens| Response::AppendKv { tokens }),
        vec((out, proptest::option::of(decode_stats())), 0..4).prop_map(|e| {
            Response::Decode(DecodeReply {
                entries: e
                    .into_iter()
                    .map(|(out, stats)| DecodeOutput { out, stats })
                    .collect(),
            })
        }),
        session_info().prop_map(Response::SessionInfo),
        Just(Response::CloseSession),
        vec(session_info(), 0..4).prop_map(Response::ListSessions),
        vec((text(), any::<u64>()), 0..6)
            .prop_map(|entries| Response::Stats(StatsReply { entries })),
        Just(Response::Evict),
        any::<u64>().prop_map(|blocks| Response::Demote { blocks }),
        any::<u64>().prop_map(|blocks| Response::Promote { blocks }),
        Just(Response::Pin),
        Just(Response::Unpin),
        (
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            vec((any::<u64>(), vec(any::<u64>(), 0..4)), 0..3)
        )
            .prop_map(|(instance, arena_bytes, run_bytes, layers)| {
                Response::Lease(LeaseReply {
                    instance,
                    arena_bytes,
                    run_bytes,
                    layers: layers
                        .into_iter()
                        .map(|(tokens, offsets)| LeaseLayer { tokens, offsets })
                        .collect(),
                })
            }),
        Just(Response::Release),
        (
            any::<u64>(),
            any::<u32>(),
            vec(vec(any::<u64>(), 0..4), 0..3)
        )
            .prop_map(|(start, tokens, layers)| Response::Reserve(ReserveReply {
                start,
                tokens,
                layers
            })),
        any::<u64>().prop_map(|tokens| Response::Commit { tokens }),
        (error_code(), text())
            .prop_map(|(code, message)| Response::Error(ErrorReply { code, message })),
    ]
}

/// Split a frame into its decoded header and body.
pub fn split(frame: &[u8]) -> (Header, &[u8]) {
    let mut h = [0u8; HEADER_LEN];
    h.copy_from_slice(&frame[..HEADER_LEN]);
    let header = Header::decode(&h).expect("encoder wrote a valid header");
    assert_eq!(header.body_len as usize, frame.len() - HEADER_LEN);
    (header, &frame[HEADER_LEN..])
}
