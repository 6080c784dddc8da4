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
//!
//! RESERVE / COMMIT let a leasing engine append by writing rows in place (the DMA path of a
//! prefill or a hand-off): RESERVE takes the extents of the blocks the rows open and says where
//! every row goes; the engine writes them through its own mapping; COMMIT checks them and
//! adopts them exactly as an append of the same rows. Until then no reader sees them (rows past
//! the stored tokens are never read) and the session takes no other append or decode. An
//! in-place append ends with COMMIT, or is dropped (its rows zeroed, its extents freed) when its
//! connection releases the lease or closes.

use std::sync::atomic::{AtomicU64, Ordering};

use kvtier_protocol::{LeaseLayer, LeaseReply, ReserveReply};
use kvtier_storage::InPlaceAppend;

use super::{Peer, Service, Session, SessionState};
use crate::error::{ServiceError, ServiceResult};

/// An open in-place append of a session, and the connection it belongs to.
pub(crate) struct Reservation {
    conn: u64,
    append: InPlaceAppend,
}

/// A process-unique id per connection, naming the owner of its reservations.
pub fn next_connection_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// FAILED_PRECONDITION while an engine is writing the session in place.
pub(super) fn check_unreserved(s: &Session, st: &SessionState) -> ServiceResult<()> {
    match &st.reserved {
        None => Ok(()),
        Some(r) => Err(ServiceError::precondition(format!(
            "session {} has an in-place append of {} tokens open (RESERVE): COMMIT it first",
            s.id,
            r.append.tokens()
        ))),
    }
}

impl Service {
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
                .map(|b| v.extent(b).map_or(LeaseLayer::COLD, |f| f.offset() as u64))
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

impl Service {
    /// RESERVE: opens an in-place append of `tokens` tokens to every layer of session `id`
    /// for connection `conn`, which holds its lease (the caller checks). Returns where each
    /// row goes.
    pub fn reserve(
        &self,
        peer: &Peer,
        id: u64,
        conn: u64,
        tokens: u32,
    ) -> ServiceResult<ReserveReply> {
        if tokens == 0 {
            return Err(ServiceError::invalid("RESERVE of 0 tokens"));
        }
        let s = self.lookup_live_as(peer, id, true)?;
        let mut st = s.state.lock();
        if st.closed {
            return Err(ServiceError::not_found(id));
        }
        check_unreserved(&s, &st)?;
        let g = s.geometry;
        let start = st.kv.min_tokens();
        // The block table goes in one reply frame: refused before anything is taken.
        let blocks = (g.blocks_for(start + tokens as u64) - start / g.block_tokens as u64) as usize;
        let len = ReserveReply::wire_len(g.layers as usize, blocks);
        if len > self.limits.max_reply_bytes as u64 {
            return Err(ServiceError::exhausted(format!(
                "RESERVE of {tokens} tokens names {blocks} blocks per layer, a {len}-byte \
                 reply over max_frame_bytes {}: reserve fewer tokens at a time",
                self.limits.max_reply_bytes
            )));
        }
        let need = Self::append_need(&st, start + tokens as u64);
        let tails = st.kv.cold_tails();
        let append = self.with_room(&s, need, &mut st, |st| {
            self.promote_tails(&s, st, &tails)?;
            Ok(st.kv.begin_in_place(tokens as u64)?)
        })?;
        let reply = ReserveReply {
            start: append.start(),
            tokens,
            layers: st.kv.in_place_offsets(&append),
        };
        st.reserved = Some(Reservation { conn, append });
        Ok(reply)
    }

    /// COMMIT: adopts the first `tokens` rows connection `conn` wrote in place since its
    /// RESERVE of session `id` (0: drops them); returns the session's stored tokens. With
    /// `layers` (first, count) only those layers are checked and summarized now: the append
    /// stays open, and lands with the COMMIT that leaves no layer uncommitted. A row that is
    /// not finite, or any other error, is refused and nothing is appended: the append is over.
    pub fn commit(
        &self,
        peer: &Peer,
        id: u64,
        conn: u64,
        tokens: u32,
        layers: Option<(u32, u32)>,
    ) -> ServiceResult<u64> {
        let s = self.lookup_live_as(peer, id, true)?;
        s.used_now();
        let mut st = s.state.lock();
        let mut r = match st.reserved.take() {
            Some(r) if r.conn == conn => r,
            other => {
                st.reserved = other;
                return Err(ServiceError::precondition(format!(
                    "this connection has no in-place append of session {id} open (RESERVE first)"
                )));
            }
        };
        let start = r.append.start();
        // COMMIT 0 drops the append in either form (commit_in_place aborts it).
        if let Some((first, count)) = layers.filter(|_| tokens > 0) {
            let range = first as usize..first as usize + count as usize;
            if let Err(e) = st.kv.stage_in_place(&mut r.append, tokens as u64, range) {
                st.kv.abort_in_place(r.append);
                return Err(e.into());
            }
            if r.append.layers_left() > 0 {
                st.reserved = Some(r);
                return Ok(st.kv.min_tokens());
            }
        }
        st.kv.commit_in_place(r.append, tokens as u64)?;
        self.appended(&s, st, start)
    }

    /// Drops connection `conn`'s in-place append of session `id`, if it has one (its lease
    /// ended: RELEASE, or the connection closed).
    pub fn abort_reservation(&self, id: u64, conn: u64) {
        let Some(s) = self.sessions.read().get(&id).cloned() else {
            return;
        };
        let mut st = s.state.lock();
        match st.reserved.take() {
            Some(r) if r.conn == conn => st.kv.abort_in_place(r.append),
            other => st.reserved = other,
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
