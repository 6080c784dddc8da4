//! Reply frames: encoding a request's result within the frame limit, and counting errors.

use kvtier_protocol::{ErrorCode, ErrorReply, Header, Request, Response, HEADER_LEN};

use crate::error::{ServiceError, ServiceResult};
use crate::metrics::Rejection;
use crate::service::Service;

/// An error's frame for a client that chose protocol `version` (a code newer than it is sent
/// as the code it knows: [`ErrorCode::for_version`]).
pub(super) fn error_frame(request_id: u64, e: &ServiceError, version: u16) -> Vec<u8> {
    let mut buf = Vec::new();
    let (code, message) = e.code.for_version(version, &e.message);
    Response::Error(ErrorReply::new(code, message))
        .encode_frame(request_id, &mut buf)
        .expect("error replies always encode");
    buf
}

/// Encodes a reply, replacing it with RESOURCE_EXHAUSTED if it would exceed the frame limit.
pub(super) fn reply_frame(
    request_id: u64,
    result: ServiceResult<Response>,
    max: u32,
    version: u16,
    service: &Service,
) -> Vec<u8> {
    result
        .and_then(|resp| encode_reply(request_id, &resp, max, version))
        .unwrap_or_else(|e| error_reply(request_id, e, version, service))
}

/// A reply's frame in protocol `version`; RESOURCE_EXHAUSTED when its body exceeds `max`.
pub(super) fn encode_reply(
    request_id: u64,
    resp: &Response,
    max: u32,
    version: u16,
) -> ServiceResult<Vec<u8>> {
    let mut buf = Vec::new();
    resp.encode_frame_for(version, request_id, &mut buf)
        .map_err(|e| ServiceError::internal(format!("encoding reply: {e}")))?;
    if buf.len() - HEADER_LEN > max as usize {
        return Err(ServiceError::exhausted(format!(
            "reply of {} bytes exceeds max_frame_bytes {max}",
            buf.len() - HEADER_LEN
        )));
    }
    Ok(buf)
}

/// An error's frame, counted in the metrics.
pub(super) fn error_reply(
    request_id: u64,
    e: ServiceError,
    version: u16,
    service: &Service,
) -> Vec<u8> {
    if e.code == ErrorCode::PermissionDenied {
        service.record_rejection(Rejection::Permission);
    }
    service.record_error(e.code);
    error_frame(request_id, &e, version)
}

/// Decodes a request body; a malformed one is a rejection (protocol.md §5.7).
pub(super) fn decode_request<'b>(
    service: &Service,
    header: &Header,
    body: &'b [u8],
) -> ServiceResult<Request<'b>> {
    Request::decode(header, body).map_err(|e| {
        service.record_rejection(Rejection::Malformed);
        ServiceError::from(e)
    })
}
