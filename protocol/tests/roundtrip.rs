//! Property tests: every request and reply round-trips; truncated bodies and random bytes
//! give errors, never panics.

mod common;

use common::*;
use kvtier_protocol::*;
use proptest::prelude::*;

fn with_len(h: &Header, len: usize) -> Header {
    Header {
        body_len: len as u32,
        ..*h
    }
}

/// Every proper prefix of the body of `frame` fails to `decode` (the decoded value shown if
/// not), and one extra byte is trailing garbage.
fn truncations_fail(
    frame: &[u8],
    decode: impl Fn(&Header, &[u8]) -> Result<String, ProtoError>,
) -> Result<(), TestCaseError> {
    let (header, body) = split(frame);
    for cut in 0..body.len() {
        let err = decode(&with_len(&header, cut), &body[..cut]);
        prop_assert!(
            err.is_err(),
            "prefix of {} / {} bytes decoded: {:?}",
            cut,
            body.len(),
            err
        );
    }
    let mut longer = body.to_vec();
    longer.push(0);
    prop_assert_eq!(
        decode(&with_len(&header, longer.len()), &longer),
        Err(ProtoError::TrailingBytes { extra: 1 })
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn request_roundtrip(owned in request(), id in any::<u64>()) {
        let req = owned.as_request();
        let mut frame = Vec::new();
        req.encode_frame(id, &mut frame).unwrap();
        let (header, body) = split(&frame);
        prop_assert_eq!(header.request_id, id);
        prop_assert_eq!(header.opcode, req.opcode().as_u16());
        prop_assert_eq!(header.flags, req.flags());
        prop_assert_eq!(Request::decode(&header, body).unwrap(), req);
    }

    #[test]
    fn response_roundtrip(resp in response(), id in any::<u64>()) {
        let mut frame = Vec::new();
        resp.encode_frame(id, &mut frame).unwrap();
        let (header, body) = split(&frame);
        prop_assert_eq!(header.request_id, id);
        prop_assert_eq!(header.opcode, resp.opcode());
        prop_assert_eq!(Response::decode(&header, body).unwrap(), resp);
    }

    #[test]
    fn truncated_request_bodies_error(owned in request()) {
        let req = owned.as_request();
        let mut frame = Vec::new();
        req.encode_frame(1, &mut frame).unwrap();
        truncations_fail(&frame, |h, b| Request::decode(h, b).map(|r| format!("{r:?}")))?;
    }

    #[test]
    fn truncated_response_bodies_error(resp in response()) {
        let mut frame = Vec::new();
        resp.encode_frame(1, &mut frame).unwrap();
        truncations_fail(&frame, |h, b| Response::decode(h, b).map(|r| format!("{r:?}")))?;
    }

    #[test]
    fn random_bytes_never_panic(
        header in any::<[u8; HEADER_LEN]>(),
        op in prop_oneof![any::<u16>(), (1u16..=9), (1u16..=9).prop_map(|o| o | 0x8000), Just(0xFFFF)],
        flags in prop_oneof![Just(0u16), Just(1u16), any::<u16>()],
        body in proptest::collection::vec(any::<u8>(), 0..256),
    ) {
        let _ = Header::decode(&header);
        let h = Header { body_len: body.len() as u32, request_id: 7, opcode: op, flags };
        let _ = Request::decode(&h, &body);
        let _ = Response::decode(&h, &body);
    }

    #[test]
    fn mutated_frames_never_panic(
        owned in request(),
        resp in response(),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
    ) {
        let req = owned.as_request();
        for which in 0..2 {
            let mut frame = Vec::new();
            if which == 0 {
                req.encode_frame(1, &mut frame).unwrap();
            } else {
                resp.encode_frame(1, &mut frame).unwrap();
            }
            let mut body = frame[HEADER_LEN..].to_vec();
            if body.is_empty() {
                continue;
            }
            for (i, b) in &edits {
                let at = i.index(body.len());
                body[at] = *b;
            }
            let (header, _) = split(&frame);
            let _ = Request::decode(&header, &body);
            let _ = Response::decode(&header, &body);
        }
    }
}
