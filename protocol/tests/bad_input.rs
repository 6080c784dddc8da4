//! Every kind of malformed input gets its specific typed error and the error code a server
//! answers with.

mod common;

use common::tiny_geometry;
use kvtier_protocol::*;

fn hdr(opcode: u16, flags: u16, body: &[u8]) -> Header {
    Header {
        body_len: body.len() as u32,
        request_id: 9,
        opcode,
        flags,
    }
}

fn req(op: Opcode, flags: u16, body: &[u8]) -> Result<Request<'_>, ProtoError> {
    Request::decode(&hdr(op.as_u16(), flags, body), body)
}

fn body_of(r: &Request<'_>) -> Vec<u8> {
    let mut b = Vec::new();
    r.encode(&mut b).unwrap();
    b
}

fn create_body() -> Vec<u8> {
    body_of(&Request::CreateSession(CreateSessionRequest {
        geometry: tiny_geometry(),
        policy: Policy::default(),
        label: "abc".into(),
    }))
}

#[test]
fn unknown_opcode_is_unimplemented() {
    let err = Request::decode(&hdr(0x0042, 0, &[]), &[]).unwrap_err();
    assert_eq!(err, ProtoError::UnknownOpcode { opcode: 0x42 });
    assert_eq!(err.error_code(), ErrorCode::Unimplemented);
    // Reserved tier opcodes too, even with a plausible body.
    for op in RESERVED_TIER_OPCODES {
        let body = 7u64.to_le_bytes();
        let err = Request::decode(&hdr(op, 0, &body), &body).unwrap_err();
        assert_eq!(err.error_code(), ErrorCode::Unimplemented);
    }
}

#[test]
fn reply_opcode_sent_as_request() {
    let err = Request::decode(&hdr(0x8001, 0, &[]), &[]).unwrap_err();
    assert_eq!(err, ProtoError::NotARequest { opcode: 0x8001 });
    assert_eq!(err.error_code(), ErrorCode::InvalidArgument);
    let err = Response::decode(&hdr(0x0001, 0, &[]), &[]).unwrap_err();
    assert_eq!(err, ProtoError::NotAReply { opcode: 1 });
}

#[test]
fn header_flags_checked_per_opcode() {
    let body = 1u64.to_le_bytes();
    assert_eq!(
        req(Opcode::SessionInfo, FLAG_APPEND_SHM, &body),
        Err(ProtoError::BadFlags {
            opcode: 5,
            flags: 1
        })
    );
    let append = body_of(&Request::AppendKv(AppendKvRequest {
        session: 1,
        start_pos: 0,
        n_tokens: 1,
        data: AppendData::Inline(&[1, 2]),
    }));
    assert_eq!(
        req(Opcode::AppendKv, 0x0002, &append),
        Err(ProtoError::BadFlags {
            opcode: 3,
            flags: 2
        })
    );
    let reply_hdr = Header {
        flags: 1,
        ..hdr(Opcode::Stats.reply(), 0, &[0, 0, 0, 0])
    };
    assert!(matches!(
        Response::decode(&reply_hdr, &[0, 0, 0, 0]),
        Err(ProtoError::BadFlags { .. })
    ));
}

#[test]
fn body_length_must_match_header() {
    let body = [0u8; 8];
    let h = Header {
        body_len: 9,
        ..hdr(Opcode::CloseSession.as_u16(), 0, &body)
    };
    assert_eq!(
        Request::decode(&h, &body),
        Err(ProtoError::BodyLenMismatch {
            announced: 9,
            actual: 8
        })
    );
}

#[test]
fn trailing_bytes_rejected_for_every_request_kind() {
    let mut body = create_body();
    body.push(0);
    assert_eq!(
        req(Opcode::CreateSession, 0, &body),
        Err(ProtoError::TrailingBytes { extra: 1 })
    );
    for op in [Opcode::ListSessions, Opcode::Stats] {
        assert_eq!(
            req(op, 0, &[0, 0]),
            Err(ProtoError::TrailingBytes { extra: 2 })
        );
    }
    for op in [
        Opcode::SessionInfo,
        Opcode::CloseSession,
        Opcode::Evict,
        Opcode::Demote,
        Opcode::Promote,
        Opcode::Pin,
        Opcode::Unpin,
    ] {
        assert_eq!(
            req(op, 0, &[0; 9]),
            Err(ProtoError::TrailingBytes { extra: 1 })
        );
        assert!(matches!(
            req(op, 0, &[0; 7]),
            Err(ProtoError::Truncated {
                what: "session",
                ..
            })
        ));
    }
}

/// Decoding a CREATE_SESSION body changed by `corrupt`: an INVALID_ARGUMENT refusal, which
/// this returns.
fn invalid_create(corrupt: impl FnOnce(&mut [u8])) -> ProtoError {
    let mut body = create_body();
    corrupt(&mut body);
    let err = req(Opcode::CreateSession, 0, &body).unwrap_err();
    assert_eq!(err.error_code(), ErrorCode::InvalidArgument);
    err
}

#[test]
fn bad_dtype() {
    // Layers, q_heads, kv_heads, head_dim, then dtype.
    let err = invalid_create(|body| body[16] = 3);
    assert_eq!(err, ProtoError::BadDtype { value: 3 });
}

#[test]
fn bad_selector() {
    // Geometry (21 bytes), then sink, local, top_k, selector (u32 each).
    let err = invalid_create(|body| body[21 + 12..21 + 16].copy_from_slice(&2u32.to_le_bytes()));
    assert_eq!(err, ProtoError::BadSelector { value: 2 });
}

#[test]
fn invalid_utf8_label() {
    let mut body = create_body();
    let n = body.len();
    body[n - 1] = 0xFF;
    assert_eq!(
        req(Opcode::CreateSession, 0, &body),
        Err(ProtoError::InvalidUtf8 {
            what: "session label"
        })
    );
}

#[test]
fn string_length_beyond_body() {
    let mut body = create_body();
    let at = body.len() - 3 - 4;
    body[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        req(Opcode::CreateSession, 0, &body),
        Err(ProtoError::Truncated {
            what: "session label",
            ..
        })
    ));
}

fn append_body(flags: u16) -> Vec<u8> {
    let data = if flags & FLAG_APPEND_SHM != 0 {
        AppendData::Shm { offset: 0, len: 64 }
    } else {
        AppendData::Inline(&[5; 16])
    };
    body_of(&Request::AppendKv(AppendKvRequest {
        session: 1,
        start_pos: 0,
        n_tokens: 1,
        data,
    }))
}

#[test]
fn append_reserved_field_must_be_zero() {
    for flags in [0, FLAG_APPEND_SHM] {
        let mut body = append_body(flags);
        body[20] = 1;
        assert_eq!(
            req(Opcode::AppendKv, flags, &body),
            Err(ProtoError::ReservedNonZero { value: 1 })
        );
    }
}

#[test]
fn append_payload_len_must_match_body() {
    let mut body = append_body(0);
    body[24..32].copy_from_slice(&17u64.to_le_bytes());
    assert!(matches!(
        req(Opcode::AppendKv, 0, &body),
        Err(ProtoError::Truncated {
            what: "append payload",
            needed: 17,
            available: 16
        })
    ));
    body[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(req(Opcode::AppendKv, 0, &body).is_err());
    body[24..32].copy_from_slice(&15u64.to_le_bytes());
    assert_eq!(
        req(Opcode::AppendKv, 0, &body),
        Err(ProtoError::TrailingBytes { extra: 1 })
    );
    // An inline body read as shm (flag set) does not fit the shm layout.
    assert!(req(Opcode::AppendKv, FLAG_APPEND_SHM, &append_body(0)).is_err());
}

#[test]
fn append_payload_is_borrowed_not_copied() {
    let body = append_body(0);
    let Request::AppendKv(a) = req(Opcode::AppendKv, 0, &body).unwrap() else {
        panic!("wrong variant")
    };
    let AppendData::Inline(p) = a.data else {
        panic!("not inline")
    };
    assert_eq!(p.as_ptr(), body[32..].as_ptr());
}

fn decode_body(entries: u32, q_len: u32, kv_len: u32, flags: u32) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&3u32.to_le_bytes()); // layer
    b.extend_from_slice(&flags.to_le_bytes());
    b.extend_from_slice(&entries.to_le_bytes());
    for _ in 0..entries.min(4) {
        b.extend_from_slice(&1u64.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        b.extend_from_slice(&q_len.to_le_bytes());
        b.extend_from_slice(&kv_len.to_le_bytes());
        b.extend(std::iter::repeat_n(0x3Fu8, (q_len + 2 * kv_len) as usize));
    }
    b
}

#[test]
fn decode_entries_borrow_from_body() {
    let body = decode_body(2, 8, 4, DECODE_WANT_STATS);
    let Request::Decode(d) = req(Opcode::Decode, 0, &body).unwrap() else {
        panic!("wrong variant")
    };
    assert!(d.want_stats);
    assert_eq!(d.layer, 3);
    assert_eq!(d.entries.len(), 2);
    let e = d.entries[1];
    let base = body.as_ptr() as usize;
    assert_eq!(e.q.as_ptr() as usize - base, 12 + 24 + 16 + 24);
    assert_eq!(e.k.len(), 4);
    let mut q = [0f32; 2];
    e.read_q_into(&mut q).unwrap();
    let want = f32::from_le_bytes([0x3F; 4]);
    assert_eq!(q, [want, want]);
    assert_eq!(e.q_f32().collect::<Vec<_>>(), vec![want, want]);
    assert!(e.read_q_into(&mut [0f32; 3]).is_err());
}

/// Ragged q bytes; unknown body flags.
#[test]
fn decode_q_must_be_whole_f32s_and_body_flags_known() {
    for (q_len, flags, want) in [
        (
            6,
            0,
            ProtoError::Misaligned {
                what: "decode q",
                len: 6,
                multiple: 4,
            },
        ),
        (
            4,
            0x2,
            ProtoError::BadFlags {
                opcode: 4,
                flags: 2,
            },
        ),
    ] {
        let body = decode_body(1, q_len, 4, flags);
        assert_eq!(req(Opcode::Decode, 0, &body), Err(want));
    }
}

#[test]
fn forged_counts_fail_fast_without_allocating() {
    // Four billion entries announced in a 12-byte body.
    let body = decode_body(u32::MAX, 0, 0, 0);
    let mut short = body[..12].to_vec();
    short.extend_from_slice(&[0; 8]);
    assert!(matches!(
        req(Opcode::Decode, 0, &short),
        Err(ProtoError::Truncated {
            what: "decode entries",
            ..
        })
    ));
    // Replies: list and stats counts.
    let resp = |op: Opcode, body: &[u8]| Response::decode(&hdr(op.reply(), 0, body), body);
    assert!(matches!(
        resp(Opcode::ListSessions, &u32::MAX.to_le_bytes()),
        Err(ProtoError::Truncated { .. })
    ));
    assert!(matches!(
        resp(Opcode::Stats, &u32::MAX.to_le_bytes()),
        Err(ProtoError::Truncated { .. })
    ));
    assert!(matches!(
        resp(Opcode::Decode, &u32::MAX.to_le_bytes()),
        Err(ProtoError::Truncated { .. })
    ));
}

#[test]
fn decode_kv_lengths_checked() {
    let mut body = decode_body(1, 4, 4, 0);
    body.truncate(body.len() - 1);
    assert!(matches!(
        req(Opcode::Decode, 0, &body),
        Err(ProtoError::Truncated {
            what: "decode v",
            ..
        })
    ));
}

#[test]
fn encoder_rejects_mismatched_k_and_v() {
    let one = |q, k, v| {
        Request::Decode(DecodeRequest {
            layer: 0,
            want_stats: false,
            entries: vec![DecodeEntryRef {
                session: 1,
                position: 0,
                q,
                k,
                v,
            }],
        })
    };
    let q = [0u8; 4];
    let r = one(&q, &[0; 4], &[0; 2]);
    let mut buf = vec![0xAA];
    assert!(r.encode_frame(1, &mut buf).is_err());
    // A failed frame encode leaves the buffer as it was.
    assert_eq!(buf, vec![0xAA]);
    let r = one(&q[..3], &[], &[]);
    assert!(matches!(
        r.encode(&mut Vec::new()),
        Err(ProtoError::Misaligned { .. })
    ));
}

#[test]
fn unknown_error_code_and_bad_bool_in_replies() {
    let mut body = Vec::new();
    body.extend_from_slice(&77u16.to_le_bytes());
    body.extend_from_slice(&0u32.to_le_bytes());
    assert_eq!(
        Response::decode(&hdr(ERROR_OPCODE, 0, &body), &body),
        Err(ProtoError::UnknownErrorCode { code: 77 })
    );

    let info = SessionInfo {
        session: 1,
        owner_uid: 2,
        label: String::new(),
        geometry: tiny_geometry(),
        policy: Policy::default(),
        tokens_min: 0,
        tokens_max: 0,
        blocks: 0,
        host_bytes: 0,
        nvme_bytes: 0,
        remote_bytes: 0,
        pinned: true,
        damaged: true,
        created_unix_ms: 0,
        last_access_unix_ms: 0,
    };
    let mut body = Vec::new();
    Response::SessionInfo(info.clone())
        .encode(&mut body)
        .unwrap();
    assert_eq!(
        body.len(),
        SessionInfo::MIN_WIRE_LEN + 8,
        "version 4 adds remote_bytes"
    );
    assert_eq!(
        body[SessionInfo::MIN_WIRE_LEN - 17],
        3,
        "pinned | damaged << 1"
    );
    assert_eq!(
        Response::decode(&hdr(Opcode::SessionInfo.reply(), 0, &body), &body),
        Ok(Response::SessionInfo(info))
    );
    body[SessionInfo::MIN_WIRE_LEN - 17] = 4; // an unknown state bit
    assert_eq!(
        Response::decode(&hdr(Opcode::SessionInfo.reply(), 0, &body), &body),
        Err(ProtoError::BadFlagBits {
            what: "session state",
            value: 4
        })
    );
}

#[test]
fn error_reply_from_proto_error() {
    let e = ProtoError::FrameTooLarge {
        body_len: 10,
        max: 5,
    };
    let r = ErrorReply::from(&e);
    assert_eq!(r.code, ErrorCode::ResourceExhausted);
    assert!(r.message.contains("10"));
    for code in ErrorCode::ALL {
        assert_eq!(ErrorCode::from_u16(code.as_u16()), Ok(code));
    }
    assert!(ErrorCode::from_u16(0).is_err());
    assert!(ErrorCode::from_u16(11).is_err());
}

/// A code newer than the client's protocol version is sent as the code that version knows.
#[test]
fn owned_elsewhere_is_failed_precondition_for_version_2() {
    assert_eq!(
        ErrorCode::OwnedElsewhere.for_version(3, "node-b"),
        (ErrorCode::OwnedElsewhere, "node-b".to_string())
    );
    assert_eq!(
        ErrorCode::OwnedElsewhere.for_version(2, "node-b"),
        (
            ErrorCode::FailedPrecondition,
            "the session is owned by node node-b".to_string()
        )
    );
    for code in ErrorCode::ALL {
        if code != ErrorCode::OwnedElsewhere {
            assert_eq!(code.for_version(2, "m"), (code, "m".to_string()));
        }
    }
}

#[test]
fn geometry_size_helpers() {
    let g = Geometry::QWEN2_5_7B;
    assert_eq!(g.q_bytes(), Some(28 * 128 * 4));
    assert_eq!(g.kv_token_bytes(), Some(4 * 128 * 2));
    // 57,344 bytes of KV per token over all layers (DESIGN.md).
    assert_eq!(g.append_payload_bytes(1), Some(57_344));
    let huge = Geometry {
        layers: u32::MAX,
        kv_heads: u32::MAX,
        head_dim: u32::MAX,
        ..g
    };
    assert_eq!(huge.append_payload_bytes(u32::MAX), None);
}
