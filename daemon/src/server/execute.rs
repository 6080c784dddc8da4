//! What each request does, and where it runs: one [`Class`] per opcode, one exhaustive match
//! over the requests.

use std::os::fd::{AsRawFd, OwnedFd};

use kvtier_protocol::{
    AppendData, HelloReply, Opcode, Request, Response, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION,
};

use super::connection::Connection;
use super::reply::encode_reply;
use crate::error::{ServiceError, ServiceResult};
use crate::service::Service;

/// Where a request runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Class {
    /// On the event loop: answered from memory without waiting on a lock a step may hold.
    EventLoop,
    /// In place, off the event loop: takes a session's lock (a decode may hold it) or may
    /// write to the NVMe tier and fsync; a slow or full disk must not stall every connection.
    Blocking,
    /// Like [`Class::Blocking`], under an execution slot (admission control): the requests
    /// that compute, on the compute pool's threads.
    Compute,
}

impl Class {
    pub(super) fn of(op: Opcode) -> Class {
        match op {
            Opcode::Hello
            | Opcode::SessionInfo
            | Opcode::ListSessions
            | Opcode::Stats
            | Opcode::Release => Class::EventLoop,
            Opcode::CreateSession
            | Opcode::CloseSession
            | Opcode::Evict
            | Opcode::Pin
            | Opcode::Unpin
            | Opcode::Lease
            | Opcode::Reserve
            | Opcode::Commit => Class::Blocking,
            Opcode::AppendKv
            | Opcode::Decode
            | Opcode::Demote
            | Opcode::Promote
            | Opcode::Offload => Class::Compute,
        }
    }
}

/// What a request gives its connection to write.
pub(super) enum Outcome {
    Reply(Response),
    /// A granted LEASE's encoded reply: the arena's descriptor goes with it.
    Lease(Vec<u8>),
}

impl Connection {
    /// Runs one decoded request (`fd`: a shared-memory APPEND_KV's payload descriptor).
    pub(super) fn execute(
        &mut self,
        service: &Service,
        request_id: u64,
        req: Request<'_>,
        fd: Option<OwnedFd>,
    ) -> ServiceResult<Outcome> {
        let peer = &self.peer;
        let reply = match req {
            Request::Hello(h) => {
                if self.version.is_some() {
                    return Err(ServiceError::precondition(
                        "HELLO was already sent on this connection",
                    ));
                }
                // The newest version both speak.
                let version = h.max_version.min(PROTOCOL_VERSION);
                if version < h.min_version.max(MIN_PROTOCOL_VERSION) {
                    return Err(ServiceError::precondition(format!(
                        "no common protocol version: client speaks {}..={}, server {MIN_PROTOCOL_VERSION}..={PROTOCOL_VERSION}",
                        h.min_version, h.max_version
                    )));
                }
                self.version = Some(version);
                tracing::debug!(client = %h.client_name, uid = peer.uid, "hello");
                Response::Hello(HelloReply {
                    version,
                    max_frame_bytes: self.shared.settings.max_frame_bytes,
                    server_name: "tierd".into(),
                    server_version: env!("CARGO_PKG_VERSION").into(),
                })
            }
            Request::SessionInfo { session } => Response::SessionInfo(service.info(peer, session)?),
            Request::ListSessions => Response::ListSessions(service.list(peer)),
            Request::Stats => Response::Stats(service.stats()),
            Request::AppendKv(a) => {
                let tokens = match a.data {
                    AppendData::Inline(payload) => {
                        service.append(peer, a.session, a.start_pos, a.n_tokens, payload)?
                    }
                    AppendData::Shm { offset, len } => {
                        let fd = fd.ok_or_else(|| {
                            ServiceError::invalid("shared-memory APPEND_KV without a descriptor")
                        })?;
                        let limit = service.arena().bytes_total() as u64;
                        let payload = SharedPayload::open(fd, offset, len, limit)?;
                        service.append(peer, a.session, a.start_pos, a.n_tokens, payload.bytes())?
                    }
                };
                Response::AppendKv { tokens }
            }
            Request::Decode(d) => {
                Response::Decode(service.decode(peer, d.layer, d.want_stats, &d.entries)?)
            }
            Request::Demote { session } => Response::Demote {
                blocks: service.demote(peer, session)?,
            },
            Request::Promote { session } => Response::Promote {
                blocks: service.promote(peer, session)?,
            },
            Request::Offload { session } => Response::Offload {
                blocks: service.offload(peer, session)?,
            },
            Request::CreateSession(c) => Response::CreateSession {
                session: service.create(peer, &c)?,
            },
            Request::CloseSession { session } => {
                service.close(peer, session)?;
                Response::CloseSession
            }
            Request::Evict { session } => {
                service.evict(peer, session)?;
                Response::Evict
            }
            Request::Pin { session } => {
                service.pin(peer, session, true)?;
                Response::Pin
            }
            Request::Unpin { session } => {
                service.pin(peer, session, false)?;
                Response::Unpin
            }
            Request::Lease { session } => return self.lease(service, request_id, session),
            Request::Release { session } => {
                if !self.leases.remove(&session) {
                    return Err(ServiceError::precondition(format!(
                        "this connection holds no lease on session {session}"
                    )));
                }
                service.abort_reservation(session, self.id);
                service.release_lease(session);
                Response::Release
            }
            Request::Reserve { session, tokens } => {
                if !self.leases.contains(&session) {
                    return Err(ServiceError::precondition(format!(
                        "RESERVE needs this connection's LEASE of session {session}: the engine \
                         writes through the leased arena"
                    )));
                }
                Response::Reserve(service.reserve(peer, session, self.id, tokens)?)
            }
            Request::Commit {
                session,
                tokens,
                layers,
            } => Response::Commit {
                tokens: service.commit(peer, session, self.id, tokens, layers)?,
            },
        };
        Ok(Outcome::Reply(reply))
    }

    /// LEASE: the session's extent table, encoded here so that a table too large for a frame
    /// leaves no lease behind (the engine would get no table).
    fn lease(
        &mut self,
        service: &Service,
        request_id: u64,
        session: u64,
    ) -> ServiceResult<Outcome> {
        let new = !self.leases.contains(&session);
        let table = service.lease(&self.peer, session, new)?;
        let max = self.shared.settings.max_frame_bytes;
        match encode_reply(
            request_id,
            &Response::Lease(table),
            max,
            self.reply_version(),
        ) {
            Ok(frame) => {
                self.leases.insert(session);
                Ok(Outcome::Lease(frame))
            }
            Err(e) => {
                if new {
                    service.release_lease(session);
                }
                Err(e)
            }
        }
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
