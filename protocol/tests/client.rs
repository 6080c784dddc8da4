//! The blocking client against an in-process server on a real Unix socket. The server here
//! is a small test double built from this crate's codec (the real daemon lives in tierd);
//! it checks what actually arrived, including memfds passed with SCM_RIGHTS, which it maps
//! read-only like the daemon does.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use kvtier_protocol::client::{read_frame, Client, ClientError};
use kvtier_protocol::*;
use kvtier_tests::wire::{hello_frame, raw_frame, server_error};

const MAX_FRAME: u32 = 1 << 16;

struct Session {
    geometry: Geometry,
    policy: Policy,
    label: String,
    tokens: Vec<u64>,
}

#[derive(Default)]
struct State {
    next_id: u64,
    sessions: HashMap<u64, Session>,
    /// Every payload accepted by APPEND_KV, with how it came (true = shm).
    appended: Vec<(u64, bool, Vec<u8>)>,
}

type Shared = Arc<Mutex<State>>;

struct Server {
    _dir: tempfile::TempDir,
    path: PathBuf,
    state: Shared,
}

fn spawn_server() -> Server {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tierd.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let state: Shared = Arc::default();
    let st = state.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let st = st.clone();
            std::thread::spawn(move || serve(conn.unwrap(), st));
        }
    });
    Server {
        _dir: dir,
        path,
        state,
    }
}

fn err(code: ErrorCode, msg: impl Into<String>) -> Response {
    Response::Error(ErrorReply::new(code, msg))
}

fn serve(mut stream: UnixStream, state: Shared) {
    let mut body = Vec::new();
    let mut hello_done = false;
    loop {
        let mut fds = Vec::new();
        let header = match read_frame(&stream, MAX_FRAME, &mut body, &mut fds) {
            Ok(Some(h)) => h,
            Ok(None) => return,
            Err(ClientError::Proto(e)) => {
                // Header-level failure: answer with id 0 and drop the connection.
                let mut out = Vec::new();
                Response::Error(ErrorReply::from(&e))
                    .encode_frame(0, &mut out)
                    .unwrap();
                let _ = stream.write_all(&out);
                return;
            }
            Err(_) => return,
        };
        let resp = match Request::decode(&header, &body) {
            Err(e) => Response::Error(ErrorReply::from(&e)),
            Ok(Request::Hello(h)) => {
                if h.min_version > PROTOCOL_VERSION || h.max_version < PROTOCOL_VERSION {
                    err(ErrorCode::FailedPrecondition, "no common version")
                } else {
                    hello_done = true;
                    Response::Hello(HelloReply {
                        version: PROTOCOL_VERSION,
                        max_frame_bytes: MAX_FRAME,
                        server_name: "test-server".into(),
                        server_version: "0".into(),
                    })
                }
            }
            Ok(_) if !hello_done => err(ErrorCode::FailedPrecondition, "HELLO first"),
            Ok(req) => handle(req, fds, &mut state.lock().unwrap()),
        };
        let mut out = Vec::new();
        resp.encode_frame(header.request_id, &mut out).unwrap();
        stream.write_all(&out).unwrap();
    }
}

fn handle(req: Request<'_>, mut fds: Vec<OwnedFd>, st: &mut State) -> Response {
    let is_shm = matches!(
        req,
        Request::AppendKv(AppendKvRequest {
            data: AppendData::Shm { .. },
            ..
        })
    );
    if fds.len() != usize::from(is_shm) {
        return err(
            ErrorCode::InvalidArgument,
            format!("{} descriptors", fds.len()),
        );
    }
    match req {
        Request::Hello(_) => unreachable!("handled by serve"),
        Request::CreateSession(c) => {
            st.next_id += 1;
            let id = st.next_id;
            st.sessions.insert(
                id,
                Session {
                    geometry: c.geometry,
                    policy: c.policy,
                    label: c.label,
                    tokens: vec![0; c.geometry.layers as usize],
                },
            );
            Response::CreateSession { session: id }
        }
        Request::AppendKv(a) => {
            let Some(s) = st.sessions.get_mut(&a.session) else {
                return err(ErrorCode::NotFound, "no such session");
            };
            if a.payload_len() != s.geometry.append_payload_bytes(a.n_tokens).unwrap() {
                return err(ErrorCode::InvalidArgument, "payload size");
            }
            if s.tokens.iter().any(|t| *t != a.start_pos) {
                return err(ErrorCode::FailedPrecondition, "start_pos");
            }
            let bytes = match a.data {
                AppendData::Inline(p) => p.to_vec(),
                AppendData::Shm { offset, len } => {
                    let file = File::from(fds.pop().unwrap());
                    if file.metadata().unwrap().len() < offset + len {
                        return err(ErrorCode::InvalidArgument, "range beyond file");
                    }
                    // SAFETY: test double; the client seals its memfds against changes and
                    // the test files are not modified while mapped.
                    let map = unsafe {
                        memmap2::MmapOptions::new()
                            .offset(offset)
                            .len(len as usize)
                            .map(&file)
                            .unwrap()
                    };
                    map.to_vec()
                }
            };
            st.appended.push((a.session, is_shm, bytes));
            for t in &mut s.tokens {
                *t += u64::from(a.n_tokens);
            }
            Response::AppendKv {
                tokens: a.start_pos + u64::from(a.n_tokens),
            }
        }
        Request::Decode(d) => {
            let mut entries = Vec::new();
            for e in &d.entries {
                let Some(s) = st.sessions.get_mut(&e.session) else {
                    return err(ErrorCode::NotFound, "no such session");
                };
                let layer = d.layer as usize;
                if layer >= s.tokens.len() {
                    return err(ErrorCode::InvalidArgument, "layer");
                }
                if e.position != s.tokens[layer] {
                    return err(ErrorCode::FailedPrecondition, "position");
                }
                s.tokens[layer] += 1;
                let blocks = s.tokens[layer].div_ceil(u64::from(s.geometry.block_tokens)) as u32;
                // Output = 2 * q, so the test can see its own query came through intact.
                let out = e.q_f32().map(|x| 2.0 * x).collect();
                let stats = d.want_stats.then(|| DecodeStats {
                    blocks_total: blocks,
                    blocks_selected: blocks * s.geometry.kv_heads,
                    selected: vec![(0..blocks).collect(); s.geometry.kv_heads as usize],
                    ..Default::default()
                });
                entries.push(DecodeOutput { out, stats });
            }
            Response::Decode(DecodeReply { entries })
        }
        Request::SessionInfo { session } => match st.sessions.get(&session) {
            Some(s) => Response::SessionInfo(info(session, s)),
            None => err(ErrorCode::NotFound, format!("session {session} not found")),
        },
        Request::CloseSession { session } => match st.sessions.remove(&session) {
            Some(_) => Response::CloseSession,
            None => err(ErrorCode::NotFound, format!("session {session} not found")),
        },
        Request::ListSessions => {
            let mut v: Vec<_> = st.sessions.iter().map(|(id, s)| info(*id, s)).collect();
            v.sort_by_key(|i| i.session);
            Response::ListSessions(v)
        }
        Request::Stats => Response::Stats(StatsReply {
            entries: vec![(stats_keys::SESSIONS.into(), st.sessions.len() as u64)],
        }),
        Request::Evict { .. } => err(ErrorCode::PermissionDenied, "admin only"),
        Request::Demote { .. }
        | Request::Promote { .. }
        | Request::Pin { .. }
        | Request::Unpin { .. } => {
            err(ErrorCode::Unimplemented, "no NVMe tier in this test double")
        }
        Request::Offload { .. } => err(
            ErrorCode::Unimplemented,
            "no remote tier in this test double",
        ),
        Request::Lease { .. }
        | Request::Release { .. }
        | Request::Reserve { .. }
        | Request::Commit { .. } => err(
            ErrorCode::Unimplemented,
            "no shared arena in this test double",
        ),
    }
}

fn info(session: u64, s: &Session) -> SessionInfo {
    SessionInfo {
        session,
        owner_uid: 1000,
        label: s.label.clone(),
        geometry: s.geometry,
        policy: s.policy,
        tokens_min: *s.tokens.iter().min().unwrap(),
        tokens_max: *s.tokens.iter().max().unwrap(),
        blocks: 0,
        host_bytes: 0,
        nvme_bytes: 0,
        remote_bytes: 0,
        pinned: false,
        damaged: false,
        created_unix_ms: 1,
        last_access_unix_ms: 2,
    }
}

fn geometry() -> Geometry {
    Geometry {
        layers: 3,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 8,
        dtype: DType::F16,
        block_tokens: 4,
    }
}

fn payload(n_tokens: u32, seed: u8) -> Vec<u8> {
    let len = geometry().append_payload_bytes(n_tokens).unwrap() as usize;
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn full_session_lifecycle() {
    let srv = spawn_server();
    let mut c = Client::connect(&srv.path).unwrap();
    assert_eq!(c.server().server_name, "test-server");
    assert_eq!(c.server().max_frame_bytes, MAX_FRAME);

    let s = c
        .create_session(geometry(), Policy::default(), "lifecycle")
        .unwrap();
    let inline = payload(5, 1);
    assert_eq!(c.append_kv(s, 0, 5, &inline).unwrap(), 5);
    let shm = payload(3, 2);
    assert_eq!(c.append_kv_shm(s, 5, 3, &shm).unwrap(), 8);
    {
        let st = srv.state.lock().unwrap();
        assert_eq!(st.appended.len(), 2);
        assert_eq!(st.appended[0], (s, false, inline.clone()));
        assert_eq!(st.appended[1], (s, true, shm.clone()));
    }

    let info = c.session_info(s).unwrap();
    assert_eq!(info.label, "lifecycle");
    assert_eq!(info.geometry, geometry());
    assert_eq!((info.tokens_min, info.tokens_max), (8, 8));

    let q: Vec<f32> = (0..32).map(|i| i as f32 * 0.5 - 3.0).collect();
    let qb = f32_le_bytes(&q);
    let kv = vec![0u8; 2 * 8 * 2];
    let entry = DecodeEntryRef {
        session: s,
        position: 8,
        q: &qb,
        k: &kv,
        v: &kv,
    };
    let out = c.decode(1, entry, true).unwrap();
    assert_eq!(out.out, q.iter().map(|x| 2.0 * x).collect::<Vec<_>>());
    let stats = out.stats.unwrap();
    assert_eq!(stats.blocks_total, 3); // 9 tokens / 4 per block
    assert_eq!(stats.selected, vec![vec![0, 1, 2]; 2]);
    let info = c.session_info(s).unwrap();
    assert_eq!((info.tokens_min, info.tokens_max), (8, 9));

    // Batch: a second session at the same layer.
    let s2 = c.create_session(geometry(), Policy::default(), "").unwrap();
    let q2: Vec<f32> = (0..32).map(|i| -(i as f32)).collect();
    let q2b = f32_le_bytes(&q2);
    let e2 = DecodeEntryRef {
        session: s2,
        position: 0,
        q: &q2b,
        k: &kv,
        v: &kv,
    };
    let e1 = DecodeEntryRef {
        position: 9,
        ..entry
    };
    let outs = c.decode_batch(1, &[e1, e2], false).unwrap();
    assert_eq!(outs.len(), 2);
    assert!(outs.iter().all(|o| o.stats.is_none()));
    assert_eq!(outs[1].out[5], -10.0);

    let list = c.list_sessions().unwrap();
    assert_eq!(
        list.iter().map(|i| i.session).collect::<Vec<_>>(),
        vec![s, s2]
    );
    assert_eq!(c.stats().unwrap().get(stats_keys::SESSIONS), Some(2));

    c.close(s).unwrap();
    let (code, msg) = server_error(c.session_info(s));
    assert_eq!(code, ErrorCode::NotFound);
    assert!(msg.contains(&s.to_string()));
    let e = c.close(s).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::NotFound));
    assert_eq!(
        server_error(c.evict(s2)),
        (ErrorCode::PermissionDenied, "admin only".into())
    );
    // Still usable after errors.
    assert_eq!(c.list_sessions().unwrap().len(), 1);
}

#[test]
fn server_errors_keep_code_and_connection() {
    let srv = spawn_server();
    let mut c = Client::connect(&srv.path).unwrap();
    let s = c
        .create_session(geometry(), Policy::default(), "x")
        .unwrap();
    let (code, _) = server_error(c.append_kv(s, 0, 2, &payload(1, 0)));
    assert_eq!(code, ErrorCode::InvalidArgument);
    let (code, _) = server_error(c.append_kv(s, 3, 1, &payload(1, 0)));
    assert_eq!(code, ErrorCode::FailedPrecondition);
    let (code, _) = server_error(c.append_kv_shm(s, 0, 2, &payload(1, 0)));
    assert_eq!(code, ErrorCode::InvalidArgument);
    let (code, _) = server_error(c.append_kv(s + 100, 0, 1, &payload(1, 0)));
    assert_eq!(code, ErrorCode::NotFound);
    assert_eq!(c.append_kv(s, 0, 1, &payload(1, 0)).unwrap(), 1);
}

#[test]
fn oversized_request_refused_before_sending() {
    let srv = spawn_server();
    let mut c = Client::connect(&srv.path).unwrap();
    let s = c.create_session(geometry(), Policy::default(), "").unwrap();
    let big = vec![0u8; MAX_FRAME as usize];
    match c.append_kv(s, 0, 1, &big) {
        Err(ClientError::FrameTooLarge { len, max }) => {
            assert_eq!(max, MAX_FRAME);
            assert!(len > big.len());
        }
        other => panic!("expected FrameTooLarge, got {other:?}"),
    }
    // Nothing was sent, so the stream is still in sync; the shm path has no size limit.
    let p = payload(1, 9);
    assert_eq!(c.append_kv(s, 0, 1, &p).unwrap(), 1);
}

#[test]
fn append_from_a_regular_file_at_an_offset() {
    let srv = spawn_server();
    let mut c = Client::connect(&srv.path).unwrap();
    let s = c.create_session(geometry(), Policy::default(), "").unwrap();
    let p = payload(2, 5);
    let mut f = tempfile::tempfile().unwrap();
    f.write_all(&[0xEE; 100]).unwrap();
    f.write_all(&p).unwrap();
    assert_eq!(
        c.append_kv_fd(s, 0, 2, f.as_fd(), 100, p.len() as u64)
            .unwrap(),
        2
    );
    let (code, msg) = server_error(c.append_kv_fd(s, 2, 2, f.as_fd(), 101, p.len() as u64));
    assert_eq!(
        (code, msg.as_str()),
        (ErrorCode::InvalidArgument, "range beyond file")
    );
    assert_eq!(srv.state.lock().unwrap().appended[0].2, p);
}

fn raw_roundtrip(stream: &mut UnixStream, frame: &[u8]) -> Option<(Header, Vec<u8>)> {
    stream.write_all(frame).unwrap();
    let mut body = Vec::new();
    let h = read_frame(stream, u32::MAX, &mut body, &mut Vec::new()).unwrap()?;
    Some((h, body))
}

fn error_of(h: &Header, body: &[u8]) -> ErrorReply {
    match Response::decode(h, body).unwrap() {
        Response::Error(e) => e,
        other => panic!("expected an error reply, got {other:?}"),
    }
}

#[test]
fn raw_protocol_unknown_opcode_and_handshake_rules() {
    let srv = spawn_server();
    let mut s = UnixStream::connect(&srv.path).unwrap();

    // Anything before HELLO: FAILED_PRECONDITION.
    let (h, b) = raw_roundtrip(&mut s, &raw_frame(Opcode::Stats.as_u16(), 5, &[])).unwrap();
    assert_eq!((h.opcode, h.request_id), (ERROR_OPCODE, 5));
    assert_eq!(error_of(&h, &b).code, ErrorCode::FailedPrecondition);

    let (h, _) = raw_roundtrip(&mut s, &hello_frame(6, 1, PROTOCOL_VERSION, "raw")).unwrap();
    assert_eq!((h.opcode, h.request_id), (Opcode::Hello.reply(), 6));

    // Unknown and reserved opcodes: UNIMPLEMENTED, same id, connection stays usable.
    for (op, id) in [(0x0042u16, 7u64), (0x0010, 8)] {
        let (h, b) = raw_roundtrip(&mut s, &raw_frame(op, id, &9u64.to_le_bytes())).unwrap();
        assert_eq!(h.request_id, id);
        assert_eq!(error_of(&h, &b).code, ErrorCode::Unimplemented);
    }
    // Malformed body: INVALID_ARGUMENT.
    let (h, b) =
        raw_roundtrip(&mut s, &raw_frame(Opcode::SessionInfo.as_u16(), 9, &[1, 2])).unwrap();
    assert_eq!(error_of(&h, &b).code, ErrorCode::InvalidArgument);
    let (h, _) = raw_roundtrip(&mut s, &raw_frame(Opcode::Stats.as_u16(), 10, &[])).unwrap();
    assert_eq!((h.opcode, h.request_id), (Opcode::Stats.reply(), 10));

    // Oversized frame: refused from the header alone, id 0, then the server hangs up.
    let big = Header {
        body_len: MAX_FRAME + 1,
        request_id: 11,
        opcode: Opcode::AppendKv.as_u16(),
        flags: 0,
    };
    let (h, b) = raw_roundtrip(&mut s, &big.encode()).unwrap();
    assert_eq!(h.request_id, 0);
    assert_eq!(error_of(&h, &b).code, ErrorCode::ResourceExhausted);
    let mut body = Vec::new();
    assert!(read_frame(&s, u32::MAX, &mut body, &mut Vec::new())
        .unwrap()
        .is_none());
}

#[test]
fn client_rejects_mismatched_reply_id_and_closed_server() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.sock");
    let listener = UnixListener::bind(&path).unwrap();
    std::thread::spawn(move || {
        // First connection: answers HELLO with the wrong request id.
        let (mut s, _) = listener.accept().unwrap();
        let mut body = Vec::new();
        let h = read_frame(&s, 1024, &mut body, &mut Vec::new())
            .unwrap()
            .unwrap();
        let mut out = Vec::new();
        Response::Hello(HelloReply {
            version: 1,
            max_frame_bytes: 1024,
            server_name: "bad".into(),
            server_version: "0".into(),
        })
        .encode_frame(h.request_id + 1, &mut out)
        .unwrap();
        s.write_all(&out).unwrap();
        // Second connection: hangs up without answering.
        let (s, _) = listener.accept().unwrap();
        drop(s);
    });
    match Client::connect(&path) {
        Err(ClientError::RequestIdMismatch {
            expected: 1,
            got: 2,
        }) => {}
        other => panic!("expected RequestIdMismatch, got {:?}", other.err()),
    }
    match Client::connect(&path) {
        Err(ClientError::Closed) | Err(ClientError::Io(_)) => {}
        other => panic!("expected Closed, got {:?}", other.err()),
    }
}
