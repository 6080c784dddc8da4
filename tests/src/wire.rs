//! Below the client: raw frames on a socket, and the error replies tests expect.

use std::io::Read;
use std::os::unix::net::UnixStream;

use kvtier_protocol::client::ClientError;
use kvtier_protocol::{ErrorCode, Header, HelloRequest, Request, Response, HEADER_LEN};

/// `req` encoded as one frame with request id `id`.
pub fn frame(req: &Request<'_>, id: u64) -> Vec<u8> {
    let mut out = Vec::new();
    req.encode_frame(id, &mut out).unwrap();
    out
}

/// A HELLO frame offering versions `min..=max`.
pub fn hello_frame(id: u64, min: u16, max: u16, client_name: &str) -> Vec<u8> {
    frame(
        &Request::Hello(HelloRequest {
            min_version: min,
            max_version: max,
            client_name: client_name.into(),
        }),
        id,
    )
}

/// A frame with any opcode and body (flags 0), valid or not.
pub fn raw_frame(opcode: u16, id: u64, body: &[u8]) -> Vec<u8> {
    let h = Header {
        body_len: body.len() as u32,
        request_id: id,
        opcode,
        flags: 0,
    };
    let mut f = h.encode().to_vec();
    f.extend_from_slice(body);
    f
}

/// Reads one reply frame; None when the server closed the connection.
pub fn read_reply(s: &mut UnixStream) -> Option<(Header, Response)> {
    let mut head = [0u8; HEADER_LEN];
    if s.read_exact(&mut head).is_err() {
        return None;
    }
    let h = Header::decode(&head).unwrap();
    let mut body = vec![0u8; h.body_len as usize];
    s.read_exact(&mut body).unwrap();
    Some((h, Response::decode(&h, &body).unwrap()))
}

/// The code of an error reply (panics on any other reply).
pub fn error_code(r: &Response) -> ErrorCode {
    match r {
        Response::Error(e) => e.code,
        other => panic!("expected an error reply, got {other:?}"),
    }
}

/// The server's error code and message (panics on success or a client-side error).
pub fn server_error<T: std::fmt::Debug>(r: Result<T, ClientError>) -> (ErrorCode, String) {
    match r {
        Err(ClientError::Server { code, message }) => (code, message),
        other => panic!("expected a server error, got {other:?}"),
    }
}

/// The server's error code (panics on success or a client-side error).
pub fn code<T: std::fmt::Debug>(r: Result<T, ClientError>) -> ErrorCode {
    server_error(r).0
}
