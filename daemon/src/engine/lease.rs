//! LEASE / RELEASE: an engine process reads a session's block runs in place, from the shared
//! host arena it maps itself (the in-engine data path, docs/architecture.md).
//!
//! The rule that makes it safe: while any connection holds a lease on a session, no host
//! extent the lease named is freed, moved or reused. The only ways an extent leaves a session
//! are demotion (DEMOTE, memory pressure), CLOSE and EVICT, and each refuses (or, under memory
//! pressure, skips) a leased session, checking under the session lock that LEASE takes too.
//! Appends add extents and only write rows past the stored tokens; promotion gives cold blocks
//! (absent from a lease's table) new extents. A lease ends with RELEASE or when its connection
//! closes, which is how a killed engine's leases are reclaimed: the kernel closes its socket.

use std::sync::atomic::Ordering;

use kvtier_protocol::{LeaseLayer, LeaseReply};

use super::{Engine, Peer, Session};
use crate::error::{ServiceError, ServiceResult};

impl Engine {
    /// The block table of session `id` for a lease; `new_lease` counts a lease the caller did
    /// not hold yet (a connection's repeated LEASE refreshes the table).
    ///
    /// The descriptor a lease hands out maps the whole arena, every session's runs: only
    /// trusted engines may have it: admin peers, which may lease any session, and the daemon's
    /// own uid, which may lease its own sessions.
    pub fn lease(&self, peer: &Peer, id: u64, new_lease: bool) -> ServiceResult<LeaseReply> {
        if self.arena.shared_fd().is_none() {
            return Err(ServiceError::precondition(
                "LEASE needs the host arena shared with engines: set host.shared = true",
            ));
        }
        // SAFETY: geteuid has no preconditions and cannot fail.
        let own_uid = unsafe { libc::geteuid() };
        if !self.is_admin(peer) && peer.uid != own_uid {
            return Err(ServiceError::denied(
                "LEASE maps the whole host arena (every session's KV): only admin peers \
                 (auth.admin_uids / auth.admin_gids) and tierd's own uid may lease",
            ));
        }
        let s = self.lookup_live_as(peer, id, true)?;
        let st = s.state.lock();
        if st.closed {
            return Err(ServiceError::not_found(id));
        }
        let mut layers = Vec::with_capacity(s.geometry.layers as usize);
        for l in 0..s.geometry.layers {
            let v = st.kv.layer(l)?;
            let offsets = (0..v.blocks())
                .map(|b| v.frame(b).map_or(LeaseLayer::COLD, |f| f.offset() as u64))
                .collect();
            layers.push(LeaseLayer {
                tokens: v.tokens(),
                offsets,
            });
        }
        if new_lease {
            // Under the session lock, which every path that frees an extent holds while it
            // checks the count.
            s.leases.fetch_add(1, Ordering::AcqRel);
        }
        Ok(LeaseReply {
            instance: self.instance,
            arena_bytes: self.arena.bytes_total() as u64,
            run_bytes: s.geometry.block_bytes() as u64,
            layers,
        })
    }

    /// Ends one lease of session `id` (RELEASE, or its connection closed). A session removed
    /// meanwhile has nothing to release.
    pub fn release_lease(&self, id: u64) {
        if let Some(s) = self.sessions.read().get(&id) {
            let _ = s
                .leases
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        }
    }
}

impl Session {
    /// Connections holding a lease on this session now.
    pub(crate) fn leases(&self) -> u32 {
        self.leases.load(Ordering::Acquire)
    }

    /// FAILED_PRECONDITION if an engine holds a lease: `what` would free extents it may read.
    pub(crate) fn check_unleased(&self, what: &str) -> ServiceResult<()> {
        match self.leases() {
            0 => Ok(()),
            n => Err(ServiceError::precondition(format!(
                "session {} is leased by {n} engine connection(s): {what} would free host \
                 memory they read; RELEASE first",
                self.id
            ))),
        }
    }
}
