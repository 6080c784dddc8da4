//! One connection: reading frames exactly (so SCM_RIGHTS descriptors arrive with their own
//! frame), the checks every request passes, and running each request where its class says
//! ([`Class`]), in order.

use std::collections::HashSet;
use std::future::Future;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::Instant;

use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::UnixStream;
use tokio::sync::watch;

use kvtier_protocol::fdpass::{recv_with_fds, send_with_fd};
use kvtier_protocol::{Header, Opcode, HEADER_LEN, MIN_PROTOCOL_VERSION};

use super::execute::{Class, Outcome};
use super::reply::{decode_request, error_frame, reply_frame};
use super::Shared;
use crate::error::{ServiceError, ServiceResult};
use crate::metrics::Rejection;
use crate::service::{Peer, Service};

pub(super) struct Connection {
    pub(super) stream: UnixStream,
    pub(super) peer: Peer,
    pub(super) shared: Arc<Shared>,
    pub(super) stop: watch::Receiver<bool>,
    /// The protocol version HELLO chose; none before HELLO.
    pub(super) version: Option<u16>,
    /// Sessions this connection holds a LEASE on; released when it closes (see `Drop`).
    pub(super) leases: HashSet<u64>,
    /// Names this connection's in-place appends (RESERVE), which need its lease.
    pub(super) id: u64,
}

impl Drop for Connection {
    /// However the connection ends (the peer closed or was killed, a timeout, shutdown, a
    /// panic in its task), its leases end with it: the daemon may free those extents again.
    fn drop(&mut self) {
        for id in self.leases.drain() {
            self.shared.service.abort_reservation(id, self.id);
            self.shared.service.release_lease(id);
        }
    }
}

/// Writes `frame` with the host arena's descriptor attached (SCM_RIGHTS, on the first
/// bytes), the rest as plain bytes.
async fn write_with_fd(stream: &UnixStream, frame: &[u8], fd: BorrowedFd<'_>) -> io::Result<()> {
    let sent = loop {
        stream.writable().await?;
        match stream.try_io(Interest::WRITABLE, || {
            send_with_fd(stream.as_fd(), &[frame], fd)
        }) {
            Ok(n) => break n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    };
    let mut rest = &frame[sent..];
    while !rest.is_empty() {
        stream.writable().await?;
        match stream.try_write(rest) {
            Ok(n) => rest = &rest[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl Connection {
    /// The protocol version replies are encoded for: HELLO's choice, the oldest before it.
    pub(super) fn reply_version(&self) -> u16 {
        self.version.unwrap_or(MIN_PROTOCOL_VERSION)
    }

    pub(super) async fn serve(mut self) {
        let max = self.shared.settings.max_frame_bytes;
        let mut head = [0u8; HEADER_LEN];
        let mut body = Vec::new();
        let mut fds = Vec::new();
        tracing::debug!(uid = self.peer.uid, pid = ?self.peer.pid, "connection opened");
        let opened = Instant::now();
        // The last request answered after HELLO: idleness counts from it, not from the last
        // byte, so trickling bytes (or a request every so often before HELLO) holds no slot.
        let mut last_done = opened;
        loop {
            if *self.stop.borrow() {
                break;
            }
            fds.clear();
            let settings = &self.shared.settings;
            let deadline = if self.version.is_some() {
                settings.idle_timeout.map(|d| last_done + d)
            } else {
                settings.handshake_timeout.map(|d| opened + d)
            };
            let got = tokio::select! {
                _ = self.stop.changed() => break,
                r = until(deadline, recv_exact(&self.stream, &mut head, &mut fds)) => r,
            };
            match got {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => {
                    tracing::debug!(uid = self.peer.uid, error = %e, "closing the connection");
                    break;
                }
            }
            // A bad header or an oversized body: the stream cannot be trusted (or we will not
            // read it), so answer with request id 0 and close.
            let header = match Header::decode(&head).and_then(|h| h.check_len(max).map(|_| h)) {
                Ok(h) => h,
                Err(e) => {
                    let e = ServiceError::from(e);
                    self.shared.service.record_rejection(Rejection::Malformed);
                    self.shared.service.record_error(e.code);
                    let _ = self
                        .stream
                        .write_all(&error_frame(0, &e, self.reply_version()))
                        .await;
                    break;
                }
            };
            body.resize(header.body_len as usize, 0);
            match until(deadline, recv_exact(&self.stream, &mut body, &mut fds)).await {
                Ok(true) => {}
                Ok(false) if body.is_empty() => {}
                _ => break,
            }
            let (frame, attach_arena) = self.handle(&header, &mut body, &mut fds).await;
            let written = match self.shared.service.arena().shared_fd() {
                Some(fd) if attach_arena => write_with_fd(&self.stream, &frame, fd).await,
                _ => self.stream.write_all(&frame).await,
            };
            if written.is_err() {
                break;
            }
            last_done = Instant::now();
        }
        tracing::debug!(uid = self.peer.uid, "connection closed");
    }

    /// The reply frame to one request, and whether the arena's descriptor goes with it (a
    /// granted LEASE). Descriptors and HELLO are checked first; then the request runs where its
    /// opcode's [`Class`] says: on the event loop, or in place off it (`block_in_place`: the
    /// worker thread becomes a blocking one while its other tasks move to another worker, so no
    /// hand-off to a blocking-pool thread and back on the request's path), compute under an
    /// admission slot.
    async fn handle(
        &mut self,
        header: &Header,
        body: &mut [u8],
        fds: &mut Vec<OwnedFd>,
    ) -> (Vec<u8>, bool) {
        let service = self.shared.service.clone();
        let max = self.shared.settings.max_frame_bytes;
        let rid = header.request_id;
        let version = self.reply_version();
        let refused = |e| (reply_frame(rid, Err(e), max, version, &service), false);
        let opcode = Opcode::from_u16(header.opcode).ok();
        let shm = opcode == Some(Opcode::AppendKv)
            && header.flags & kvtier_protocol::FLAG_APPEND_SHM != 0;
        let fd = match (shm, fds.len()) {
            (true, 1) => fds.pop(),
            (false, 0) => None,
            (true, n) => {
                return refused(ServiceError::invalid(format!(
                    "a shared-memory APPEND_KV carries exactly one file descriptor, got {n}"
                )));
            }
            (false, n) => {
                fds.clear();
                return refused(ServiceError::invalid(format!(
                    "{n} unexpected file descriptor(s) with a frame that takes none"
                )));
            }
        };
        if self.version.is_none() && opcode != Some(Opcode::Hello) {
            return refused(ServiceError::precondition(
                "the first request on a connection must be HELLO",
            ));
        }
        // An unknown opcode fails to decode, on the event loop.
        let class = opcode.map_or(Class::EventLoop, Class::of);
        if class == Class::EventLoop {
            let outcome = self.execute_frame(&service, header, body, fd);
            return self.reply(header, outcome);
        }
        let permit = if class == Class::Compute {
            match self.shared.admission.enter(&service).await {
                Ok(p) => Some(p),
                Err(e) => return refused(e),
            }
        } else {
            None
        };
        let joined = tokio::task::block_in_place(|| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let outcome = self.execute_frame(&service, header, body, fd);
                self.reply(header, outcome)
            }))
        });
        drop(permit);
        joined.unwrap_or_else(|_| {
            refused(ServiceError::internal(
                "request task failed (a bug: it panicked)",
            ))
        })
    }

    /// Decodes the request in `body` and runs it.
    fn execute_frame(
        &mut self,
        service: &Service,
        header: &Header,
        body: &[u8],
        fd: Option<OwnedFd>,
    ) -> ServiceResult<Outcome> {
        let req = decode_request(service, header, body)?;
        self.execute(service, header.request_id, req, fd)
    }

    /// A request's outcome as the frame to write, and whether the arena's descriptor goes
    /// with it.
    fn reply(&self, header: &Header, outcome: ServiceResult<Outcome>) -> (Vec<u8>, bool) {
        let (service, max) = (&self.shared.service, self.shared.settings.max_frame_bytes);
        let result = match outcome {
            Ok(Outcome::Lease(frame)) => return (frame, true),
            Ok(Outcome::Reply(resp)) => Ok(resp),
            Err(e) => Err(e),
        };
        let version = self.reply_version();
        (
            reply_frame(header.request_id, result, max, version, service),
            false,
        )
    }
}

/// Reads exactly `buf.len()` bytes with recvmsg, collecting passed descriptors. Returns
/// `Ok(false)` on a clean end of stream before the first byte.
async fn recv_exact(
    stream: &UnixStream,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> io::Result<bool> {
    let mut off = 0;
    while off < buf.len() {
        stream.readable().await?;
        match stream.try_io(Interest::READABLE, || {
            recv_with_fds(stream.as_fd(), &mut buf[off..], fds)
        }) {
            Ok(0) if off == 0 => return Ok(false),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => off += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// `io` cut off at `deadline` (then an error of kind TimedOut).
async fn until<T>(
    deadline: Option<Instant>,
    io: impl Future<Output = io::Result<T>>,
) -> io::Result<T> {
    match deadline {
        None => io.await,
        Some(d) => tokio::time::timeout_at(d.into(), io)
            .await
            .unwrap_or_else(|_| Err(io::Error::new(io::ErrorKind::TimedOut, "timed out"))),
    }
}
