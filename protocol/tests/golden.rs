//! Golden vectors: encoded frames stored as hex in tests/golden/*.hex. The Python client's
//! tests check its encoder and decoder against the same files. Regenerate after an intended
//! wire change with `KVTIER_BLESS=1 cargo test -p kvtier-protocol --test golden`.

mod common;

use std::path::PathBuf;

use common::tiny_geometry;
use kvtier_protocol::*;

fn bf16_bytes(values: impl IntoIterator<Item = f32>) -> Vec<u8> {
    // Golden values are exactly representable in bf16, so truncation is exact.
    values
        .into_iter()
        .flat_map(|v| {
            assert_eq!(v.to_bits() & 0xFFFF, 0, "{v} is not exact in bf16");
            ((v.to_bits() >> 16) as u16).to_le_bytes()
        })
        .collect()
}

fn f32_bytes(values: impl IntoIterator<Item = f32>) -> Vec<u8> {
    values.into_iter().flat_map(f32::to_le_bytes).collect()
}

/// The sketch selector with 32 candidates, spelled out: the golden bytes fix the wire format,
/// not the default policy of new sessions.
fn golden_policy() -> Policy {
    Policy::sketch(1, 4, 32, 32)
}

fn info(session: u64, label: &str, pinned: bool) -> SessionInfo {
    SessionInfo {
        session,
        owner_uid: 1000,
        label: label.into(),
        geometry: tiny_geometry(),
        policy: golden_policy(),
        tokens_min: 2,
        tokens_max: 3,
        blocks: 2,
        host_bytes: 4096,
        nvme_bytes: 0,
        remote_bytes: 8192,
        pinned,
        damaged: false,
        created_unix_ms: 1_763_800_000_000,
        last_access_unix_ms: 1_763_800_000_500,
    }
}

/// The frame `encode_frame` (a request's or a response's) writes for request id `id`.
fn frame<E: std::fmt::Debug>(
    id: u64,
    encode_frame: impl FnOnce(u64, &mut Vec<u8>) -> Result<(), E>,
) -> Vec<u8> {
    let mut f = Vec::new();
    encode_frame(id, &mut f).unwrap();
    f
}

/// (file stem, description, frame bytes)
fn vectors() -> Vec<(&'static str, String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut req = |name: &'static str, id: u64, r: Request<'_>, what: &str| {
        out.push((
            name,
            what.to_string(),
            frame(id, |id, f| r.encode_frame(id, f)),
        ));
    };

    req(
        "hello_request",
        1,
        Request::Hello(HelloRequest {
            min_version: 2,
            max_version: 5,
            client_name: "kvtier-golden".into(),
        }),
        "HELLO request, id 1: min_version 2, max_version 5, client_name \"kvtier-golden\"",
    );
    req(
        "create_session_request",
        2,
        Request::CreateSession(CreateSessionRequest {
            geometry: tiny_geometry(),
            policy: golden_policy(),
            label: "golden".into(),
        }),
        "CREATE_SESSION request, id 2: layers 2, q_heads 4, kv_heads 2, head_dim 4, bf16, \
         block_tokens 16; sink 1, local 4, top_k 32, sketch selector (1) with 32 candidates; label \"golden\"",
    );
    // 2 layers x (K then V) x 1 token x 2 kv heads x 4 dims = 32 bf16 values: i * 0.25.
    let payload = bf16_bytes((0..32).map(|i| i as f32 * 0.25));
    req(
        "append_kv_inline_request",
        3,
        Request::AppendKv(AppendKvRequest {
            session: 7,
            start_pos: 0,
            n_tokens: 1,
            data: AppendData::Inline(&payload),
        }),
        "APPEND_KV inline request, id 3: session 7, start_pos 0, n_tokens 1, \
         payload = 32 bf16 values i*0.25 for i in 0..32",
    );
    req(
        "append_kv_shm_request",
        4,
        Request::AppendKv(AppendKvRequest {
            session: 7,
            start_pos: 1,
            n_tokens: 1,
            data: AppendData::Shm { offset: 0, len: 64 },
        }),
        "APPEND_KV shm request (flag 1), id 4: session 7, start_pos 1, n_tokens 1, offset 0, len 64",
    );
    let q1 = f32_bytes((0..16).map(|i| i as f32 * 0.125 - 1.0));
    let k1 = bf16_bytes((0..8).map(|i| i as f32 * 0.5));
    let v1 = bf16_bytes((0..8).map(|i| -(i as f32)));
    let q2 = f32_bytes((0..16).map(|i| 1.0 - i as f32 * 0.0625));
    let k2 = bf16_bytes((0..8).map(|i| i as f32 + 1.0));
    let v2 = bf16_bytes((0..8).map(|i| i as f32 * -0.25));
    req(
        "decode_request",
        5,
        Request::Decode(DecodeRequest {
            layer: 1,
            want_stats: true,
            entries: vec![
                DecodeEntryRef {
                    session: 7,
                    position: 2,
                    q: &q1,
                    k: &k1,
                    v: &v1,
                },
                DecodeEntryRef {
                    session: 9,
                    position: 0,
                    q: &q2,
                    k: &k2,
                    v: &v2,
                },
            ],
        }),
        "DECODE request, id 5: layer 1, want_stats; entry 0: session 7, position 2, \
         q[i] = i*0.125-1, k[i] = bf16(i*0.5), v[i] = bf16(-i); entry 1: session 9, position 0, \
         q[i] = 1-i*0.0625, k[i] = bf16(i+1), v[i] = bf16(-0.25*i)",
    );
    req(
        "session_info_request",
        6,
        Request::SessionInfo { session: 7 },
        "SESSION_INFO request, id 6: session 7",
    );
    req(
        "list_sessions_request",
        7,
        Request::ListSessions,
        "LIST_SESSIONS request, id 7",
    );
    req("stats_request", 8, Request::Stats, "STATS request, id 8");
    req(
        "close_session_request",
        10,
        Request::CloseSession { session: 7 },
        "CLOSE_SESSION request, id 10: session 7",
    );
    req(
        "evict_request",
        11,
        Request::Evict { session: 9 },
        "EVICT request, id 11: session 9",
    );

    // Requests that name only a session.
    for (name, id, r) in [
        ("demote_request", 12, Request::Demote { session: 7 }),
        ("promote_request", 13, Request::Promote { session: 7 }),
        ("offload_request", 24, Request::Offload { session: 7 }),
        ("pin_request", 14, Request::Pin { session: 7 }),
        ("unpin_request", 15, Request::Unpin { session: 7 }),
        ("lease_request", 16, Request::Lease { session: 7 }),
        ("release_request", 17, Request::Release { session: 7 }),
    ] {
        let what = format!("{} request, id {id}: session 7", r.opcode().name());
        req(name, id, r, &what);
    }
    req(
        "reserve_request",
        18,
        Request::Reserve {
            session: 7,
            tokens: 3,
        },
        "RESERVE request, id 18: session 7, tokens 3",
    );
    req(
        "commit_request",
        19,
        Request::Commit {
            session: 7,
            tokens: 2,
            layers: None,
        },
        "COMMIT request, id 19: session 7, tokens 2",
    );
    req(
        "commit_layers_request",
        20,
        Request::Commit {
            session: 7,
            tokens: 2,
            layers: Some((1, 3)),
        },
        "COMMIT request, id 20: session 7, tokens 2, layers 1..4",
    );

    let mut resp = |name: &'static str, id: u64, r: Response, what: &str| {
        out.push((
            name,
            what.to_string(),
            frame(id, |id, f| r.encode_frame(id, f)),
        ));
    };
    resp(
        "hello_reply",
        1,
        Response::Hello(HelloReply {
            version: 5,
            max_frame_bytes: 16 << 20,
            server_name: "tierd".into(),
            server_version: "0.1.0".into(),
        }),
        "HELLO reply, id 1: version 5, max_frame_bytes 16777216, server \"tierd\" \"0.1.0\"",
    );
    resp(
        "create_session_reply",
        2,
        Response::CreateSession { session: 7 },
        "CREATE_SESSION reply, id 2: session 7",
    );
    resp(
        "append_kv_reply",
        3,
        Response::AppendKv { tokens: 1 },
        "APPEND_KV reply, id 3: tokens 1",
    );
    resp(
        "decode_reply",
        5,
        Response::Decode(DecodeReply {
            entries: vec![
                DecodeOutput {
                    out: (0..16).map(|i| i as f32 * 0.5).collect(),
                    stats: Some(DecodeStats {
                        blocks_total: 3,
                        blocks_selected: 6,
                        bytes_touched: 1024,
                        bytes_moved: 512,
                        cache_hits: 2,
                        blocks_ram: 4,
                        blocks_nvme: 0,
                        selected: vec![vec![0, 1, 2], vec![0, 1, 2]],
                    }),
                },
                DecodeOutput {
                    out: (0..16).map(|i| -(i as f32)).collect(),
                    stats: Some(DecodeStats {
                        blocks_total: 1,
                        blocks_selected: 2,
                        bytes_touched: 256,
                        bytes_moved: 0,
                        cache_hits: 0,
                        blocks_ram: 2,
                        blocks_nvme: 0,
                        selected: vec![vec![0], vec![0]],
                    }),
                },
            ],
        }),
        "DECODE reply, id 5: entry 0 out[i] = i*0.5, stats {3, 6, 1024, 512, 2, 4, 0, \
         [[0,1,2],[0,1,2]]}; entry 1 out[i] = -i, stats {1, 2, 256, 0, 0, 2, 0, [[0],[0]]}",
    );
    resp(
        "session_info_reply",
        6,
        Response::SessionInfo(info(7, "golden", false)),
        "SESSION_INFO reply, id 6: session 7, uid 1000, label \"golden\", golden geometry, \
         default policy, tokens 2..3, blocks 2, host 4096, nvme 0, not pinned, \
         created 1763800000000, last access 1763800000500, remote 8192 (version 4)",
    );
    resp(
        "list_sessions_reply",
        7,
        Response::ListSessions(vec![info(7, "golden", false), info(9, "", true)]),
        "LIST_SESSIONS reply, id 7: session 7 as in session_info_reply; session 9 with empty \
         label and pinned",
    );
    resp(
        "stats_reply",
        8,
        Response::Stats(StatsReply {
            entries: vec![("uptime_ms".into(), 1234), ("sessions".into(), 2)],
        }),
        "STATS reply, id 8: uptime_ms 1234, sessions 2",
    );
    resp(
        "error_reply",
        9,
        Response::Error(ErrorReply::new(ErrorCode::NotFound, "session 42 not found")),
        "error reply, id 9: NOT_FOUND \"session 42 not found\"",
    );
    resp(
        "owned_elsewhere_reply",
        25,
        Response::Error(ErrorReply::new(ErrorCode::OwnedElsewhere, "node-b")),
        "error reply, id 25: OWNED_ELSEWHERE \"node-b\" (protocol version 3: the owner's name)",
    );
    resp(
        "close_session_reply",
        10,
        Response::CloseSession,
        "CLOSE_SESSION reply, id 10 (empty body)",
    );
    resp(
        "evict_reply",
        11,
        Response::Evict,
        "EVICT reply, id 11 (empty body)",
    );
    resp(
        "demote_reply",
        12,
        Response::Demote { blocks: 4 },
        "DEMOTE reply, id 12: blocks 4",
    );
    resp(
        "promote_reply",
        13,
        Response::Promote { blocks: 3 },
        "PROMOTE reply, id 13: blocks 3",
    );
    resp(
        "offload_reply",
        24,
        Response::Offload { blocks: 6 },
        "OFFLOAD reply, id 24: blocks 6",
    );
    resp(
        "pin_reply",
        14,
        Response::Pin,
        "PIN reply, id 14 (empty body)",
    );
    resp(
        "unpin_reply",
        15,
        Response::Unpin,
        "UNPIN reply, id 15 (empty body)",
    );
    resp(
        "lease_reply",
        16,
        Response::Lease(LeaseReply {
            instance: 0x0123_4567_89ab_cdef,
            arena_bytes: 1 << 20,
            run_bytes: 512,
            layers: vec![
                LeaseLayer {
                    tokens: 20,
                    offsets: vec![0, 4096],
                },
                LeaseLayer {
                    tokens: 20,
                    offsets: vec![8192, LeaseLayer::COLD],
                },
            ],
        }),
        "LEASE reply, id 16: instance 0x0123456789abcdef, arena 1048576 bytes, runs of 512 \
         bytes; layer 0: 20 tokens at offsets [0, 4096]; layer 1: 20 tokens at [8192, cold]",
    );
    resp(
        "release_reply",
        17,
        Response::Release,
        "RELEASE reply, id 17 (empty body)",
    );
    resp(
        "reserve_reply",
        18,
        Response::Reserve(ReserveReply {
            start: 20,
            tokens: 3,
            layers: vec![vec![4096], vec![12288]],
        }),
        "RESERVE reply, id 18: start 20, tokens 3; layer 0 runs at [4096], layer 1 at [12288]",
    );
    resp(
        "commit_reply",
        19,
        Response::Commit { tokens: 22 },
        "COMMIT reply, id 19: tokens 22",
    );
    out
}

/// Header line, then the body 16 bytes per line; `#` lines are comments.
fn to_hex(what: &str, frame: &[u8]) -> String {
    let mut s = format!("# {what}\n# header (24 bytes)\n");
    let line = |bytes: &[u8]| {
        bytes
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    s.push_str(&line(&frame[..HEADER_LEN]));
    s.push('\n');
    s.push_str(&format!("# body ({} bytes)\n", frame.len() - HEADER_LEN));
    for chunk in frame[HEADER_LEN..].chunks(16) {
        s.push_str(&line(chunk));
        s.push('\n');
    }
    s
}

fn parse_hex(text: &str) -> Vec<u8> {
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .flat_map(str::split_whitespace)
        .map(|h| u8::from_str_radix(h, 16).expect("hex byte"))
        .collect()
}

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

#[test]
fn golden_vectors_match() {
    let bless = std::env::var_os("KVTIER_BLESS").is_some();
    let mut failures = Vec::new();
    for (name, what, frame) in vectors() {
        let path = golden_dir().join(format!("{name}.hex"));
        let text = to_hex(&what, &frame);
        if bless {
            std::fs::create_dir_all(golden_dir()).unwrap();
            std::fs::write(&path, &text).unwrap();
            continue;
        }
        match std::fs::read_to_string(&path) {
            Ok(stored) if parse_hex(&stored) == frame => {}
            Ok(_) => failures.push(format!("{name}: encoding differs from {}", path.display())),
            Err(e) => failures.push(format!("{name}: cannot read {}: {e}", path.display())),
        }
    }
    assert!(
        failures.is_empty(),
        "golden mismatch (KVTIER_BLESS=1 regenerates after an intended change):\n{}",
        failures.join("\n")
    );
}

#[test]
fn golden_files_decode_back() {
    for (name, _, frame) in vectors() {
        let path = golden_dir().join(format!("{name}.hex"));
        let Ok(stored) = std::fs::read_to_string(&path) else {
            panic!("missing {}", path.display());
        };
        let bytes = parse_hex(&stored);
        let mut h = [0u8; HEADER_LEN];
        h.copy_from_slice(&bytes[..HEADER_LEN]);
        let header = Header::decode(&h).unwrap();
        let body = &bytes[HEADER_LEN..];
        if header.is_reply() {
            let r = Response::decode(&header, body).unwrap();
            let mut again = Vec::new();
            r.encode_frame(header.request_id, &mut again).unwrap();
            assert_eq!(again, frame, "{name}");
        } else {
            let r = Request::decode(&header, body).unwrap();
            let mut again = Vec::new();
            r.encode_frame(header.request_id, &mut again).unwrap();
            assert_eq!(again, frame, "{name}");
        }
    }
}

#[test]
fn hello_request_bytes_by_hand() {
    // Spelled out independently of the encoder, as in docs/protocol.md.
    let (_, _, frame) = vectors().into_iter().next().unwrap();
    let mut want = Vec::new();
    want.extend_from_slice(b"KVT1");
    want.extend_from_slice(&21u32.to_le_bytes()); // 2 + 2 + 4 + 13
    want.extend_from_slice(&1u64.to_le_bytes());
    want.extend_from_slice(&[0x01, 0x00, 0x00, 0x00, 0, 0, 0, 0]);
    want.extend_from_slice(&[2, 0, 5, 0, 13, 0, 0, 0]);
    want.extend_from_slice(b"kvtier-golden");
    assert_eq!(frame, want);
}

#[test]
fn every_opcode_has_a_request_and_a_reply_vector() {
    let mut requests = std::collections::BTreeSet::new();
    let mut replies = std::collections::BTreeSet::new();
    for (_, _, frame) in vectors() {
        let mut h = [0u8; HEADER_LEN];
        h.copy_from_slice(&frame[..HEADER_LEN]);
        let header = Header::decode(&h).unwrap();
        let set = if header.is_reply() {
            &mut replies
        } else {
            &mut requests
        };
        set.insert(header.opcode & !REPLY_BIT);
    }
    for op in Opcode::ALL {
        assert!(
            requests.contains(&op.as_u16()),
            "no request vector for {}",
            op.name()
        );
        assert!(
            replies.contains(&op.as_u16()),
            "no reply vector for {}",
            op.name()
        );
    }
}

/// A version 2 or 3 connection gets SESSION_INFO and LIST_SESSIONS as version 4 lays them out
/// without its last field (`remote_bytes`), and such a reply decodes with it 0.
#[test]
fn a_version_3_session_info_is_version_4_without_remote_bytes() {
    let resp = Response::ListSessions(vec![info(7, "golden", false), info(9, "", true)]);
    let (mut v3, mut v4) = (Vec::new(), Vec::new());
    resp.encode_frame_for(3, 7, &mut v3).unwrap();
    resp.encode_frame_for(4, 7, &mut v4).unwrap();
    assert_eq!(v4.len(), v3.len() + 2 * 8);
    let mut h = [0u8; HEADER_LEN];
    h.copy_from_slice(&v3[..HEADER_LEN]);
    let header = Header::decode(&h).unwrap();
    let Response::ListSessions(got) = Response::decode_for(&header, &v3[HEADER_LEN..], 3).unwrap()
    else {
        panic!("a session list");
    };
    assert_eq!(got.len(), 2);
    for s in got {
        assert_eq!(s.remote_bytes, 0);
        assert_eq!(s.host_bytes, 4096);
    }
    assert!(Response::decode_for(&header, &v3[HEADER_LEN..], 4).is_err());
}
