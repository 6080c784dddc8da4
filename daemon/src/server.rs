//! The socket side of tierd: binding the Unix socket safely, accepting connections, admission
//! control, and shutting down gracefully.
//!
//! Each connection is one task that executes its requests in order (`connection`). Where a
//! request runs is its opcode's class (`execute::Class`): on the event loop, or in place off it
//! (`block_in_place`: the worker thread becomes a blocking one and its other tasks move to
//! another worker), requests that compute under an execution slot and using the compute pool's
//! threads.

use std::collections::HashSet;
use std::future::Future;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::UnixListener;
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

use kvtier_protocol::{ErrorCode, MIN_PROTOCOL_VERSION};

use crate::config::ByteSize;
use crate::error::{ServiceError, ServiceResult};
use crate::metrics::Rejection;
use crate::notify::{self, Notifier};
use crate::service::{Peer, Service};

mod connection;
mod execute;
mod reply;
mod slots;
use connection::Connection;
use reply::error_frame;
use slots::ConnectionSlots;

/// Socket-side settings (from the `[server]` and `[admission]` config sections).
#[derive(Debug, Clone)]
pub struct ServerSettings {
    /// Largest request or reply body (`server.max_frame_bytes`).
    pub max_frame_bytes: u32,
    /// Open connections at once; more are refused with RESOURCE_EXHAUSTED.
    pub max_connections: usize,
    /// Connections one non-admin uid may hold at once (0: only `max_connections`).
    pub max_connections_per_uid: usize,
    /// Of `max_connections`, the slots only admins may take.
    pub admin_connections: usize,
    /// APPEND_KV / DECODE requests executing at once (`admission.max_concurrent_requests`).
    pub max_concurrent_requests: usize,
    /// Requests waiting for an execution slot; beyond this, RESOURCE_EXHAUSTED.
    pub max_queued_requests: usize,
    /// How long shutdown waits for in-flight requests before dropping them.
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

/// Bounds executing and waiting requests of the compute class (`execute::Class::Compute`).
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
                        let conn = Connection { stream, peer, shared: shared.clone(), stop: stop_rx.clone(), version: None, leases: HashSet::new(), id: crate::service::next_connection_id() };
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
                            let _ = stream.write_all(&error_frame(0, &err, MIN_PROTOCOL_VERSION)).await;
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
