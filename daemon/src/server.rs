//! The socket side of tierd: binding the Unix socket safely, accepting connections, reading
//! frames exactly (so SCM_RIGHTS descriptors arrive with their own frame), running requests,
//! and shutting down gracefully.
//!
//! Each connection is one task that executes its requests in order. Cheap operations run on the
//! event loop; APPEND_KV and DECODE take an execution slot (admission control) and run in place
//! (`block_in_place`: the worker thread becomes a blocking one and its other tasks move to
//! another worker), where the kernels use the compute pool's threads.

use std::collections::HashSet;
use std::future::Future;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

use kvtier_protocol::fdpass::{recv_with_fds, send_with_fd};
use kvtier_protocol::{
    AppendData, ErrorCode, ErrorReply, Header, HelloReply, Opcode, Request, Response, HEADER_LEN,
    PROTOCOL_VERSION,
};

use crate::config::ByteSize;
use crate::error::{ServiceError, ServiceResult};
use crate::metrics::Rejection;
use crate::notify::{self, Notifier};
use crate::service::{Peer, Service};

mod slots;
use slots::ConnectionSlots;

/// Socket-side settings (from the `[server]` and `[admission]` config sections).
#[derive(Debug, Clone)]
pub struct ServerSettings {
    pub max_frame_bytes: u32,
    pub max_connections: usize,
    /// Connections one non-admin uid may hold at once (0: only `max_connections`).
    pub max_connections_per_uid: usize,
    /// Of `max_connections`, the slots only admins may take.
    pub admin_connections: usize,
    pub max_concurrent_requests: usize,
    pub max_queued_requests: usize,
    pub shutdown_grace: Duration,
    /// Close a connection that has not completed HELLO this long after it was accepted,
    /// whatever it sends meanwhile (None: never).
    pub handshake_timeout: Option<Duration>,
    /// Close a connection that completes no request for this long (None: never).
    pub idle_timeout: Option<Duration>,
    /// Removed when the server stops accepting.
    pub socket_path: Option<PathBuf>,
    /// The service manager to tell READY=1 / STATUS= / STOPPING=1 (sd_notify), if any.
    pub notifier: Option<Arc<Notifier>>,
    /// Send WATCHDOG=1 this often (half of WatchdogSec), from the accept loop.
    pub watchdog: Option<Duration>,
}

/// Why the socket could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    #[error("another tierd is already serving {0}")]
    InUse(PathBuf),
    #[error("{0} exists and is not a socket; refusing to replace it")]
    NotASocket(PathBuf),
    #[error("unknown group {0:?} (server.socket_group)")]
    UnknownGroup(String),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

/// Binds the Unix socket at `path`: creates the parent directory if missing, replaces a stale
/// socket left by a dead daemon (but never a live one or a non-socket file), then applies
/// `mode` and `group` so only the intended users can connect.
pub fn bind(
    path: &Path,
    mode: u32,
    group: Option<&str>,
) -> Result<std::os::unix::net::UnixListener, BindError> {
    let io_err = |what, source| BindError::Io {
        what,
        path: path.into(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.exists() {
            std::fs::create_dir_all(dir).map_err(|e| io_err("creating socket directory", e))?;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
                .map_err(|e| io_err("setting permissions of socket directory", e))?;
        }
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            match std::os::unix::net::UnixStream::connect(path) {
                Ok(_) => return Err(BindError::InUse(path.into())),
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                    tracing::warn!(path = %path.display(), "removing stale socket");
                    std::fs::remove_file(path).map_err(|e| io_err("removing stale socket", e))?;
                }
                Err(e) => return Err(io_err("probing existing socket", e)),
            }
        }
        Ok(_) => return Err(BindError::NotASocket(path.into())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err("inspecting socket path", e)),
    }
    let listener =
        std::os::unix::net::UnixListener::bind(path).map_err(|e| io_err("binding socket", e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| io_err("setting socket mode", e))?;
    if let Some(group) = group {
        let gid = resolve_group(group)?;
        // Under the shipped unit the socket already has the service's group, and the syscall
        // filter denies chown: only change what differs.
        let current = std::fs::metadata(path)
            .map_err(|e| io_err("inspecting socket", e))?
            .gid();
        if current != gid {
            std::os::unix::fs::chown(path, None, Some(gid))
                .map_err(|e| io_err("setting socket group", e))?;
        }
    }
    listener
        .set_nonblocking(true)
        .map_err(|e| io_err("configuring socket", e))?;
    Ok(listener)
}

/// A group name or numeric id to a gid.
fn resolve_group(group: &str) -> Result<u32, BindError> {
    if let Ok(gid) = group.parse() {
        return Ok(gid);
    }
    let name = std::ffi::CString::new(group).map_err(|_| BindError::UnknownGroup(group.into()))?;
    let mut grp = std::mem::MaybeUninit::<libc::group>::zeroed();
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    let mut result: *mut libc::group = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call: `grp` for one struct, `buf` for its stated
    // length; getgrnam_r stores into them and sets `result` to `grp` or null.
    let rc = unsafe {
        libc::getgrnam_r(
            name.as_ptr(),
            grp.as_mut_ptr(),
            buf.as_mut_ptr(),
            buf.len(),
            &mut result,
        )
    };
    if rc != 0 || result.is_null() {
        return Err(BindError::UnknownGroup(group.into()));
    }
    // SAFETY: getgrnam_r succeeded and returned `grp`, which it initialised.
    Ok(unsafe { grp.assume_init() }.gr_gid)
}

/// Bounds executing and waiting APPEND_KV / DECODE requests.
struct Admission {
    slots: Arc<Semaphore>,
    queued: AtomicUsize,
    max_queued: usize,
}

impl Admission {
    async fn enter(&self, service: &Service) -> ServiceResult<OwnedSemaphorePermit> {
        if let Ok(p) = self.slots.clone().try_acquire_owned() {
            return Ok(p);
        }
        if self.queued.fetch_add(1, Ordering::AcqRel) >= self.max_queued {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            service.record_rejection(Rejection::QueueFull);
            return Err(ServiceError::exhausted(format!(
                "request queue full ({} waiting; admission.max_queued_requests)",
                self.max_queued
            )));
        }
        let p = self.slots.clone().acquire_owned().await;
        self.queued.fetch_sub(1, Ordering::AcqRel);
        p.map_err(|_| ServiceError::new(ErrorCode::Unavailable, "shutting down"))
    }
}

struct Shared {
    service: Arc<Service>,
    settings: ServerSettings,
    admission: Admission,
}

/// One line for `systemctl status`: what the daemon holds right now.
fn status_line(service: &Service) -> String {
    let s = service.snapshot();
    Notifier::status_line(&format!(
        "serving: {} sessions, host tier {} of {} in use",
        s.sessions,
        ByteSize(s.host_bytes_used),
        ByteSize(s.host_bytes_capacity)
    ))
}

/// Serves `listener` until `shutdown` resolves, then stops accepting, removes the socket file,
/// lets every connection finish the request it is executing (up to the grace period), and
/// returns.
///
/// Everything the daemon needs (the service and its tiers, the bound socket) exists before this
/// is called, so it reports READY=1 first thing; WATCHDOG=1 keep-alives come from this loop,
/// so a wedged event loop (or a session table that stays locked) stops them and systemd
/// restarts the daemon.
pub async fn run(
    listener: UnixListener,
    service: Arc<Service>,
    settings: ServerSettings,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    let shared = Arc::new(Shared {
        admission: Admission {
            slots: Arc::new(Semaphore::new(settings.max_concurrent_requests)),
            queued: AtomicUsize::new(0),
            max_queued: settings.max_queued_requests,
        },
        service,
        settings,
    });
    let connections = Arc::new(ConnectionSlots::new(&shared.settings));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = JoinSet::new();
    tokio::pin!(shutdown);
    let notifier = shared.settings.notifier.clone();
    shared.service.set_ready(true);
    notify::send(
        notifier.as_deref(),
        &format!("READY=1\n{}", status_line(&shared.service)),
    );
    let mut watchdog = shared.settings.watchdog.map(|every| {
        let mut t = tokio::time::interval(every);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    });
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            _ = async {
                match watchdog.as_mut() {
                    Some(t) => t.tick().await,
                    None => std::future::pending().await,
                }
            } => {
                if shared.service.responsive() {
                    notify::send(
                        notifier.as_deref(),
                        &format!("WATCHDOG=1\n{}", status_line(&shared.service)),
                    );
                } else {
                    tracing::warn!("session table stayed locked; withholding the watchdog keep-alive");
                }
            }
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        // EMFILE and friends: back off instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                };
                let peer = match stream.peer_cred() {
                    Ok(c) => Peer { uid: c.uid(), gid: c.gid(), pid: c.pid() },
                    Err(e) => {
                        tracing::warn!(error = %e, "no peer credentials; dropping connection");
                        continue;
                    }
                };
                match connections.take(peer.uid, shared.service.is_admin(&peer)) {
                    Ok(slot) => {
                        let conn = Connection { stream, peer, shared: shared.clone(), stop: stop_rx.clone(), hello: false, leases: HashSet::new(), id: crate::service::next_connection_id() };
                        tasks.spawn(async move {
                            conn.serve().await;
                            drop(slot);
                        });
                    }
                    Err(err) => {
                        shared.service.record_rejection(Rejection::ConnectionLimit);
                        shared.service.record_error(err.code);
                        tasks.spawn(async move {
                            let mut stream = stream;
                            let _ = stream.write_all(&error_frame(0, &err)).await;
                        });
                    }
                }
            }
        }
    }
    drop(listener);
    shared.service.set_ready(false);
    notify::send(
        notifier.as_deref(),
        "STOPPING=1\nSTATUS=draining in-flight requests",
    );
    if let Some(path) = &shared.settings.socket_path {
        if let Err(e) = std::fs::remove_file(path) {
            tracing::warn!(path = %path.display(), error = %e, "could not remove socket");
        }
    }
    tracing::info!(
        connections = tasks.len(),
        "shutting down: draining in-flight requests"
    );
    let _ = stop_tx.send(true);
    shared.admission.slots.close();
    let drained = tokio::time::timeout(shared.settings.shutdown_grace, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            remaining = tasks.len(),
            "grace period over; dropping connections"
        );
        tasks.abort_all();
    }
    Ok(())
}

fn error_frame(request_id: u64, e: &ServiceError) -> Vec<u8> {
    let mut buf = Vec::new();
    Response::Error(ErrorReply::new(e.code, e.message.clone()))
        .encode_frame(request_id, &mut buf)
        .expect("error replies always encode");
    buf
}

/// Encodes a reply, replacing it with RESOURCE_EXHAUSTED if it would exceed the frame limit.
fn reply_frame(
    request_id: u64,
    result: ServiceResult<Response>,
    max: u32,
    service: &Service,
) -> Vec<u8> {
    result
        .and_then(|resp| encode_reply(request_id, &resp, max))
        .unwrap_or_else(|e| error_reply(request_id, e, service))
}

/// A reply's frame; RESOURCE_EXHAUSTED when its body exceeds `max`.
fn encode_reply(request_id: u64, resp: &Response, max: u32) -> ServiceResult<Vec<u8>> {
    let mut buf = Vec::new();
    resp.encode_frame(request_id, &mut buf)
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
fn error_reply(request_id: u64, e: ServiceError, service: &Service) -> Vec<u8> {
    if e.code == ErrorCode::PermissionDenied {
        service.record_rejection(Rejection::Permission);
    }
    service.record_error(e.code);
    error_frame(request_id, &e)
}

/// Decodes a request body; a malformed one is a rejection (protocol.md §5.7).
fn decode_request<'b>(
    service: &Service,
    header: &Header,
    body: &'b [u8],
) -> ServiceResult<Request<'b>> {
    Request::decode(header, body).map_err(|e| {
        service.record_rejection(Rejection::Malformed);
        ServiceError::from(e)
    })
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

struct Connection {
    stream: UnixStream,
    peer: Peer,
    shared: Arc<Shared>,
    stop: watch::Receiver<bool>,
    hello: bool,
    /// Sessions this connection holds a LEASE on; released when it closes (see `Drop`).
    leases: HashSet<u64>,
    /// Names this connection's in-place appends (RESERVE), which need its lease.
    id: u64,
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
    async fn serve(mut self) {
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
            let deadline = if self.hello {
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
                    let _ = self.stream.write_all(&error_frame(0, &e)).await;
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
    /// granted LEASE).
    async fn handle(
        &mut self,
        header: &Header,
        body: &mut [u8],
        fds: &mut Vec<OwnedFd>,
    ) -> (Vec<u8>, bool) {
        let frame = match Opcode::from_u16(header.opcode) {
            Ok(Opcode::Lease | Opcode::Release | Opcode::Reserve | Opcode::Commit)
                if self.hello && fds.is_empty() =>
            {
                return self.handle_lease(header, body);
            }
            _ => self.handle_other(header, body, fds).await,
        };
        (frame, false)
    }

    /// Every request but a well-formed LEASE, RELEASE, RESERVE or COMMIT after HELLO (those
    /// change or need this connection's leases: [`Self::handle_lease`]); the checks here refuse
    /// the rest of them.
    async fn handle_other(
        &mut self,
        header: &Header,
        body: &mut [u8],
        fds: &mut Vec<OwnedFd>,
    ) -> Vec<u8> {
        let service = self.shared.service.clone();
        let max = self.shared.settings.max_frame_bytes;
        let rid = header.request_id;
        let opcode = Opcode::from_u16(header.opcode).ok();
        let shm = opcode == Some(Opcode::AppendKv)
            && header.flags & kvtier_protocol::FLAG_APPEND_SHM != 0;
        let fd = match (shm, fds.len()) {
            (true, 1) => fds.pop(),
            (false, 0) => None,
            (true, n) => {
                return reply_frame(
                    rid,
                    Err(ServiceError::invalid(format!(
                        "a shared-memory APPEND_KV carries exactly one file descriptor, got {n}"
                    ))),
                    max,
                    &service,
                );
            }
            (false, n) => {
                fds.clear();
                return reply_frame(
                    rid,
                    Err(ServiceError::invalid(format!(
                        "{n} unexpected file descriptor(s) with a frame that takes none"
                    ))),
                    max,
                    &service,
                );
            }
        };
        if !self.hello && opcode != Some(Opcode::Hello) {
            let e = ServiceError::precondition("the first request on a connection must be HELLO");
            return reply_frame(rid, Err(e), max, &service);
        }
        match opcode {
            // Off the event loop: compute (under an admission slot), and anything that may
            // write to the NVMe tier and fsync (a slow or full disk must not stall every
            // connection).
            Some(
                op @ (Opcode::AppendKv
                | Opcode::Decode
                | Opcode::Demote
                | Opcode::Promote
                | Opcode::CreateSession
                | Opcode::CloseSession
                | Opcode::Evict
                | Opcode::Pin
                | Opcode::Unpin),
            ) => {
                let compute = matches!(
                    op,
                    Opcode::AppendKv | Opcode::Decode | Opcode::Demote | Opcode::Promote
                );
                let permit = if compute {
                    match self.shared.admission.enter(&service).await {
                        Ok(p) => Some(p),
                        Err(e) => return reply_frame(rid, Err(e), max, &service),
                    }
                } else {
                    None
                };
                let (peer, header) = (self.peer, *header);
                // On this thread, which tokio turns into a blocking one while its other tasks
                // move to another worker: no hand-off to a blocking-pool thread and back on the
                // request's path (two thread wake-ups, most of a small request's latency).
                let joined = tokio::task::block_in_place(|| {
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        let result = execute_heavy(&service, &peer, &header, body, fd);
                        reply_frame(header.request_id, result, max, &service)
                    }))
                });
                drop(permit);
                match joined {
                    Ok(frame) => frame,
                    Err(_) => reply_frame(
                        rid,
                        Err(ServiceError::internal(
                            "request task failed (a bug: it panicked)",
                        )),
                        max,
                        &service,
                    ),
                }
            }
            _ => {
                let result = decode_request(&service, header, body)
                    .and_then(|req| self.execute_light(&service, req));
                reply_frame(rid, result, max, &service)
            }
        }
    }

    /// LEASE and RELEASE, which change this connection's leases, and RESERVE and COMMIT, which
    /// need one. Returns the reply frame and whether the arena's descriptor goes with it (a
    /// granted LEASE).
    fn handle_lease(&mut self, header: &Header, body: &[u8]) -> (Vec<u8>, bool) {
        let service = self.shared.service.clone();
        let max = self.shared.settings.max_frame_bytes;
        let rid = header.request_id;
        let refused = |e| (error_reply(rid, e, &service), false);
        match decode_request(&service, header, body) {
            Ok(Request::Lease { session }) => {
                let new = !self.leases.contains(&session);
                // Takes the session lock (a decode may hold it): off the event loop.
                let table =
                    match tokio::task::block_in_place(|| service.lease(&self.peer, session, new)) {
                        Ok(t) => t,
                        Err(e) => return refused(e),
                    };
                match encode_reply(rid, &Response::Lease(table), max) {
                    Ok(frame) => {
                        self.leases.insert(session);
                        (frame, true)
                    }
                    Err(e) => {
                        // A table too large for a frame: the engine gets no table, so no lease.
                        if new {
                            service.release_lease(session);
                        }
                        refused(e)
                    }
                }
            }
            Ok(Request::Release { session }) => {
                if !self.leases.remove(&session) {
                    return refused(ServiceError::precondition(format!(
                        "this connection holds no lease on session {session}"
                    )));
                }
                service.abort_reservation(session, self.id);
                service.release_lease(session);
                (
                    reply_frame(rid, Ok(Response::Release), max, &service),
                    false,
                )
            }
            Ok(Request::Reserve { session, tokens }) => {
                if !self.leases.contains(&session) {
                    return refused(ServiceError::precondition(format!(
                        "RESERVE needs this connection's LEASE of session {session}: the engine \
                         writes through the leased arena"
                    )));
                }
                // Takes the session lock and may promote or zero frames: off the event loop.
                let r = tokio::task::block_in_place(|| {
                    service.reserve(&self.peer, session, self.id, tokens)
                });
                (
                    reply_frame(rid, r.map(Response::Reserve), max, &service),
                    false,
                )
            }
            Ok(Request::Commit { session, tokens }) => {
                let r = tokio::task::block_in_place(|| {
                    service.commit(&self.peer, session, self.id, tokens)
                });
                let r = r.map(|tokens| Response::Commit { tokens });
                (reply_frame(rid, r, max, &service), false)
            }
            Ok(other) => unreachable!("{:?} is LEASE, RELEASE, RESERVE or COMMIT", other.opcode()),
            Err(e) => refused(e),
        }
    }

    fn execute_light(&mut self, service: &Service, req: Request<'_>) -> ServiceResult<Response> {
        let peer = &self.peer;
        Ok(match req {
            Request::Hello(h) => {
                if self.hello {
                    return Err(ServiceError::precondition(
                        "HELLO was already sent on this connection",
                    ));
                }
                if !(h.min_version..=h.max_version).contains(&PROTOCOL_VERSION) {
                    return Err(ServiceError::precondition(format!(
                        "no common protocol version: client speaks {}..={}, server {PROTOCOL_VERSION}",
                        h.min_version, h.max_version
                    )));
                }
                self.hello = true;
                tracing::debug!(client = %h.client_name, uid = peer.uid, "hello");
                Response::Hello(HelloReply {
                    version: PROTOCOL_VERSION,
                    max_frame_bytes: self.shared.settings.max_frame_bytes,
                    server_name: "tierd".into(),
                    server_version: env!("CARGO_PKG_VERSION").into(),
                })
            }
            Request::SessionInfo { session } => Response::SessionInfo(service.info(peer, session)?),
            Request::ListSessions => Response::ListSessions(service.list(peer)),
            Request::Stats => Response::Stats(service.stats()),
            _ => unreachable!("requests that may block run in place, off the event loop"),
        })
    }
}

/// Requests that compute or may write to the NVMe tier, on a blocking thread.
fn execute_heavy(
    service: &Service,
    peer: &Peer,
    header: &Header,
    body: &[u8],
    fd: Option<OwnedFd>,
) -> ServiceResult<Response> {
    match decode_request(service, header, body)? {
        Request::AppendKv(a) => {
            let tokens = match a.data {
                AppendData::Inline(payload) => {
                    service.append(peer, a.session, a.start_pos, a.n_tokens, payload)?
                }
                AppendData::Shm { offset, len } => {
                    let fd = fd.ok_or_else(|| {
                        ServiceError::invalid("shared-memory APPEND_KV without a descriptor")
                    })?;
                    let payload =
                        SharedPayload::open(fd, offset, len, service.arena().bytes_total() as u64)?;
                    service.append(peer, a.session, a.start_pos, a.n_tokens, payload.bytes())?
                }
            };
            Ok(Response::AppendKv { tokens })
        }
        Request::Decode(d) => Ok(Response::Decode(service.decode(
            peer,
            d.layer,
            d.want_stats,
            &d.entries,
        )?)),
        Request::Demote { session } => Ok(Response::Demote {
            blocks: service.demote(peer, session)?,
        }),
        Request::Promote { session } => Ok(Response::Promote {
            blocks: service.promote(peer, session)?,
        }),
        Request::CreateSession(c) => Ok(Response::CreateSession {
            session: service.create(peer, &c)?,
        }),
        Request::CloseSession { session } => {
            service.close(peer, session)?;
            Ok(Response::CloseSession)
        }
        Request::Evict { session } => {
            service.evict(peer, session)?;
            Ok(Response::Evict)
        }
        Request::Pin { session } => {
            service.pin(peer, session, true)?;
            Ok(Response::Pin)
        }
        Request::Unpin { session } => {
            service.pin(peer, session, false)?;
            Ok(Response::Unpin)
        }
        _ => unreachable!("HELLO, SESSION_INFO, LIST_SESSIONS and STATS run on the event loop"),
    }
}

/// The payload range of a passed descriptor: mapped when the descriptor is a memfd sealed
/// against shrinking and writing (so the bytes cannot change or vanish while we read them),
/// otherwise read into memory with pread.
enum SharedPayload {
    Mapped(memmap2::Mmap),
    Read(Vec<u8>),
}

impl SharedPayload {
    fn open(fd: OwnedFd, offset: u64, len: u64, limit: u64) -> ServiceResult<Self> {
        let file = std::fs::File::from(fd);
        let size = file
            .metadata()
            .map_err(|e| {
                ServiceError::invalid(format!("cannot stat the shared-memory descriptor: {e}"))
            })?
            .len();
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= size)
            .ok_or_else(|| {
                ServiceError::invalid(format!(
                    "range {offset}+{len} lies outside the {size}-byte file"
                ))
            })?;
        if len > limit {
            return Err(ServiceError::exhausted(format!(
                "payload of {len} bytes exceeds the host tier ({limit} bytes)"
            )));
        }
        if len == 0 {
            return Ok(SharedPayload::Read(Vec::new()));
        }
        // SAFETY: F_GET_SEALS only reads the descriptor's seal set.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        let needed = libc::F_SEAL_SHRINK | libc::F_SEAL_WRITE;
        if seals >= 0 && seals & needed == needed {
            // SAFETY: the memfd is sealed against shrinking and writing, so the mapped range
            // (inside the file, checked above) stays valid and unchanged while mapped.
            let map = unsafe {
                memmap2::MmapOptions::new()
                    .offset(offset)
                    .len(len as usize)
                    .map(&file)
            }
            .map_err(|e| {
                ServiceError::internal(format!("mapping the shared-memory payload: {e}"))
            })?;
            return Ok(SharedPayload::Mapped(map));
        }
        // Unsealed memfds and regular files could be truncated under a mapping (SIGBUS) or
        // change between validation and copy: read them instead.
        let mut buf = vec![0u8; len as usize];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut buf, offset).map_err(|e| {
            ServiceError::invalid(format!(
                "reading the shared-memory payload ({end} bytes): {e}"
            ))
        })?;
        Ok(SharedPayload::Read(buf))
    }

    fn bytes(&self) -> &[u8] {
        match self {
            SharedPayload::Mapped(m) => m,
            SharedPayload::Read(v) => v,
        }
    }
}
