//! The daemon's state and the semantics of every operation, independent of the socket: sessions
//! (ownership, admission), appends, batched decode steps, and the counters behind STATS.
//!
//! Locking: the session table is a read-write lock held only to look sessions up; each session's
//! state (KV cache, NVMe watermark) has its own mutex, held for the duration of one operation. A
//! batch decode locks its sessions in ascending id order, so two batches can never deadlock;
//! demotion under memory pressure only `try_lock`s other sessions, so it never waits on them.
//!
//! Tiering: with the NVMe tier enabled, a session's blocks are written to it (copy-on-write
//! pages + manifest commit) on demotion, on write-through appends and at clean shutdown. A
//! demoted block keeps its summary in RAM, so selection never touches NVMe; blocks a keep-set
//! needs are promoted back (read, verified) before attention.
//!
//! # Layout
//!
//! - this file: the session table, ownership and quotas (lookup, CREATE, INFO, LIST, CLOSE,
//!   EVICT);
//! - `decode`: the data path, APPEND_KV and DECODE (CPU or the CUDA decoder);
//! - `tiering`: NVMe policy: persistence, DEMOTE, PROMOTE, PIN, memory pressure, shutdown;
//! - `recovery`: warm restart from the manifest, damaged sessions;
//! - `remote`: the remote tier (a Redis Cluster): claims, OFFLOAD, resuming a session another
//!   node wrote, write-through to the cluster; `arrival`: a resumed session served from its
//!   summaries while its blocks arrive;
//! - `session`: one session's identity and state, and how a stored one is restored;
//! - `stats`: counters, STATS and the metric series' refresh.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::{Mutex, MutexGuard, RwLock};

use kvtier_kernels::{decode_step, Cpu, DecodeEntry, KernelError, StageTimings, StepReport};
use kvtier_protocol::{
    stats_keys, CreateSessionRequest, DecodeEntryRef, DecodeOutput, DecodeReply, DecodeStats,
    SessionInfo, StatsReply,
};
use kvtier_storage::nvme::manifest::{GeometryRecord, PolicyRecord, SessionRecord};
use kvtier_storage::nvme::{BlockRun, NvmeError, NvmeTier, TierSource};
use kvtier_storage::ColdSource;
use kvtier_storage::{Geometry, HostArena, HostQuota, KvCache, Policy, StorageError, StoredBlock};

use crate::error::{ServiceError, ServiceResult};
use crate::gpu::GpuDecoder;
use crate::metrics::{Metrics, Rejection};
use kvtier_protocol::ErrorCode;

mod arrival;
mod coalesce;
mod compaction;
mod decode;
mod lease;
pub use lease::next_connection_id;
mod recovery;
mod remote;
pub use remote::Remote;
mod session;
pub use session::Session;
use session::{Durable, SessionState};
mod stats;
#[cfg(test)]
mod testing;
mod tiering;

pub use crate::metrics::Snapshot;
use stats::NvmeSeries;
pub use stats::{extra_stats_keys, Counters};
use tiering::nvme_error;

/// Who is asking, from SO_PEERCRED.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    pub uid: u32,
    pub gid: u32,
    pub pid: Option<i32>,
}

/// Limits and identity the service enforces.
#[derive(Debug, Clone)]
pub struct ServiceLimits {
    /// Open sessions at once, all uids (`admission.max_sessions`).
    pub max_sessions: usize,
    /// Sessions one uid may hold (admins exempt; 0: no limit beyond `max_sessions`).
    pub max_sessions_per_uid: usize,
    /// Share of the host tier's extents one uid may hold (admin uids exempt; 1.0: none).
    pub host_share_per_uid: f64,
    /// Share of the NVMe tier's pages one uid may reference (admin uids exempt; 1.0: none).
    pub nvme_share_per_uid: f64,
    /// Largest reply body (`server.max_frame_bytes`): a DECODE whose reply could not fit is
    /// refused before it appends anything.
    pub max_reply_bytes: usize,
    /// Run concurrent DECODEs as one step (`backend.coalesce`, resolved).
    pub coalesce: bool,
    /// Peers with one of these uids or gids are admins (`auth.admin_uids`, `auth.admin_gids`):
    /// exempt from quotas, and the only ones allowed admin operations.
    pub admin_uids: Vec<u32>,
    pub admin_gids: Vec<u32>,
}

/// How the service uses the NVMe tier.
#[derive(Debug, Clone)]
pub struct TierSettings {
    pub write_through: bool,
    pub high_water: f64,
    pub low_water: f64,
    /// Candidates per kv-head beyond the keep-set promoted ahead of need (0: no prefetch).
    pub prefetch_blocks: u32,
}

pub struct Service {
    limits: ServiceLimits,
    arena: HostArena,
    tier: Option<(Arc<NvmeTier>, TierSettings)>,
    /// The remote tier, shared with other nodes (`[remote]`).
    remote: Option<Remote>,
    /// The CUDA decode path, for the sessions it supports (cold blocks a step needs are
    /// promoted first); everything else (and any GPU failure, which happens before the step
    /// changes anything) runs on the CPU backend.
    gpu: Option<GpuDecoder>,
    /// Concurrent DECODEs (of any layers), run as one device call: one coalescer per decoder
    /// lane (a request goes to its first session's lane), so lanes run their calls at once.
    coalescers: Vec<coalesce::Coalescer<decode::Job<'static>, ServiceResult<DecodeReply>>>,
    prefetcher: Option<crate::prefetch::Prefetcher>,
    sessions: RwLock<HashMap<u64, Arc<Session>>>,
    /// Each uid's extents in the host tier, capped by `host_share_per_uid`; shared by its
    /// sessions.
    host_quotas: Mutex<HashMap<u32, Arc<HostQuota>>>,
    next_id: AtomicU64,
    /// Random per start: LEASE reports it, so an engine can tell a restarted daemon.
    instance: u64,
    pub counters: Counters,
    metrics: Metrics,
    /// The fetch-stage histogram, registered only when a colder tier exists to fetch from.
    fetch_seconds: Option<metrics::Histogram>,
    /// NVMe tier series, registered only when the tier exists; refreshed at scrape time.
    nvme_metrics: Option<NvmeSeries>,
    /// Remote tier series, registered only with the remote tier.
    remote_metrics: Option<crate::metrics::RemoteMetrics>,
    ready: AtomicBool,
    started: Instant,
    started_unix_ms: u64,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// 64 random bits from the kernel; None where getrandom fails (very old kernels).
fn getrandom_u64() -> Option<u64> {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most `b.len()` bytes into `b`.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    (n == b.len() as isize).then(|| u64::from_le_bytes(b))
}

/// 64 random bits (the clock and pid, should getrandom fail).
fn random_u64() -> u64 {
    getrandom_u64().unwrap_or_else(|| {
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        t ^ (u64::from(std::process::id()) << 40)
    })
}

impl Service {
    pub fn new(arena: HostArena, limits: ServiceLimits) -> Self {
        Self::with_tier(arena, limits, None, None)
    }

    /// An engine whose sessions tier to `tier`.
    pub fn with_tier(
        arena: HostArena,
        limits: ServiceLimits,
        tier: Option<(Arc<NvmeTier>, TierSettings)>,
        gpu: Option<GpuDecoder>,
    ) -> Self {
        let prefetcher = tier.as_ref().and_then(|(t, s)| {
            (s.prefetch_blocks > 0)
                .then(|| crate::prefetch::Prefetcher::start(t.clone(), s.prefetch_blocks))
                .and_then(|r| {
                    r.map_err(|e| tracing::warn!(error = %e, "no prefetch thread"))
                        .ok()
                })
        });
        Service {
            limits,
            arena,
            tier,
            remote: None,
            coalescers: (0..gpu.as_ref().map_or(1, GpuDecoder::lanes))
                .map(|_| Default::default())
                .collect(),
            gpu,
            prefetcher,
            sessions: RwLock::new(HashMap::new()),
            host_quotas: Mutex::new(HashMap::new()),
            // Only where getrandom is missing (`fresh_id`): unique, from the clock.
            next_id: AtomicU64::new(now_ms() << 12),
            instance: random_u64(),
            counters: Counters::default(),
            metrics: Metrics::disabled(),
            fetch_seconds: None,
            nvme_metrics: None,
            remote_metrics: None,
            ready: AtomicBool::new(false),
            started: Instant::now(),
            started_unix_ms: now_ms(),
        }
    }

    /// Records into `metrics` from now on.
    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
        self.fetch_seconds = self.tier.is_some().then(|| metrics.register_fetch_stage());
        self.nvme_metrics = self.tier.is_some().then(|| NvmeSeries {
            usage: metrics.register_tier("nvme"),
            read: metrics.register_link("nvme_to_host"),
            written: metrics.register_link("host_to_nvme"),
            counters: metrics.register_nvme(),
        });
        self.metrics = metrics;
        self
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Marks the daemon as serving (true) or draining (false); reported by STATS and metrics.
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }

    /// An error reply is being sent.
    pub fn record_error(&self, code: ErrorCode) {
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        if code.is_daemons() {
            self.counters.daemon_errors.fetch_add(1, Ordering::Relaxed);
        }
        self.metrics.error(code);
    }

    /// A request was refused by an admission limit.
    pub fn record_rejection(&self, why: Rejection) {
        self.counters.rejected.fetch_add(1, Ordering::Relaxed);
        self.metrics.rejection(why);
    }

    /// Whether the session table can be locked right now: the watchdog's liveness probe (a
    /// writer stuck while holding it would wedge every request).
    pub fn responsive(&self) -> bool {
        self.sessions
            .try_read_for(Duration::from_millis(50))
            .is_some()
    }

    pub fn arena(&self) -> &HostArena {
        &self.arena
    }

    pub fn is_admin(&self, peer: &Peer) -> bool {
        self.limits.admin_uids.contains(&peer.uid) || self.limits.admin_gids.contains(&peer.gid)
    }

    /// The arena handle a session of `uid` allocates through: charged to the uid's share of
    /// the host tier, unless the uid is an admin or there is no quota.
    /// Every uid's bytes are counted (memory pressure demotes by fair share, see
    /// `make_room`); only the cap is waived.
    fn arena_for(&self, uid: u32) -> HostArena {
        let share = self.limits.host_share_per_uid;
        let limit = if share >= 1.0 || self.limits.admin_uids.contains(&uid) {
            usize::MAX
        } else {
            ((self.arena.bytes_total() as f64 * share).floor() as usize).max(1)
        };
        let q = self
            .host_quotas
            .lock()
            .entry(uid)
            .or_insert_with(|| HostQuota::new(limit))
            .clone();
        self.arena.with_quota(q)
    }

    /// Whether `uid`'s own share of the host tier (`quota.host_share_per_uid`) cannot take
    /// `need` more bytes: no demotion of others can help such a request.
    pub(super) fn share_refuses(&self, uid: u32, need: usize) -> bool {
        self.host_quotas
            .lock()
            .get(&uid)
            .is_some_and(|q| q.used().saturating_add(need) > q.limit())
    }

    /// The uids holding more than their fair share of the host tier: its bytes divided
    /// equally among the uids holding any.
    pub(super) fn over_fair_share(&self) -> Vec<u32> {
        let quotas = self.host_quotas.lock();
        let holders: Vec<(u32, usize)> = quotas
            .iter()
            .map(|(uid, q)| (*uid, q.used()))
            .filter(|&(_, used)| used > 0)
            .collect();
        let fair = self.arena.bytes_total() / holders.len().max(1);
        holders
            .into_iter()
            .filter(|&(_, used)| used > fair)
            .map(|(uid, _)| uid)
            .collect()
    }

    pub fn session_count(&self) -> usize {
        self.sessions.read().len()
    }

    /// Looks a session up for `peer`: NOT_FOUND if absent or another uid's, the same answer
    /// for both, so ids cannot be probed (admins may read any session, `admin_ok`).
    fn lookup(&self, peer: &Peer, id: u64, admin_ok: bool) -> ServiceResult<Arc<Session>> {
        let s = self
            .sessions
            .read()
            .get(&id)
            .filter(|s| s.owner_uid == peer.uid || (admin_ok && self.is_admin(peer)))
            .cloned()
            .ok_or_else(|| ServiceError::not_found(id))?;
        Ok(s)
    }

    /// [`Service::lookup`], and a session this node does not hold is looked for in the remote
    /// tier and resumed here (only where a request may wait on the cluster: not on the event
    /// loop, so SESSION_INFO and LIST show what this node holds).
    fn lookup_or_resume(
        &self,
        peer: &Peer,
        id: u64,
        admin_ok: bool,
    ) -> ServiceResult<Arc<Session>> {
        match self.lookup(peer, id, admin_ok) {
            Err(e) if e.code == ErrorCode::NotFound => self
                .resume(peer, id, admin_ok)?
                .filter(|s| s.owner_uid == peer.uid || (admin_ok && self.is_admin(peer)))
                .ok_or(e),
            r => r,
        }
    }

    /// [`Service::lookup`] for an operation on the session's data: DATA_LOSS for a session
    /// whose stored data failed verification at startup.
    fn lookup_live(&self, peer: &Peer, id: u64) -> ServiceResult<Arc<Session>> {
        self.lookup_live_as(peer, id, false)
    }

    /// [`Service::lookup_live`], for any uid's session when `admin_ok` and `peer` is an admin.
    fn lookup_live_as(&self, peer: &Peer, id: u64, admin_ok: bool) -> ServiceResult<Arc<Session>> {
        let s = self.lookup_or_resume(peer, id, admin_ok)?;
        self.check_claim(id)?;
        if let Some(reason) = &s.damaged {
            return Err(ServiceError::new(
                ErrorCode::DataLoss,
                format!(
                    "session {id} is damaged ({}); CLOSE it to delete what remains",
                    reason
                ),
            ));
        }
        Ok(s)
    }

    /// A fresh session id: random (ids say nothing about other sessions), never 0, never one
    /// in use or on NVMe.
    fn fresh_id(&self, table: &HashMap<u64, Arc<Session>>) -> u64 {
        loop {
            // No getrandom (very old kernels): unique, if predictable.
            let id = getrandom_u64()
                .map(|r| r >> 1)
                .unwrap_or_else(|| self.next_id.fetch_add(1, Ordering::Relaxed));
            let on_nvme = self
                .tier
                .as_ref()
                .is_some_and(|(t, _)| t.session(id).is_some());
            if id != 0 && !table.contains_key(&id) && !on_nvme {
                return id;
            }
        }
    }

    pub fn create(&self, peer: &Peer, req: &CreateSessionRequest) -> ServiceResult<u64> {
        let (geometry, policy) = (req.geometry, req.policy);
        policy.validate().map_err(StorageError::from)?;
        let kv = KvCache::new_with(
            geometry,
            self.arena_for(peer.uid),
            policy.selector.needs_sketches(),
        )?;
        let mut sessions = self.sessions.write();
        let per_uid = self.limits.max_sessions_per_uid;
        if per_uid > 0
            && !self.is_admin(peer)
            && sessions
                .values()
                .filter(|s| s.owner_uid == peer.uid)
                .count()
                >= per_uid
        {
            self.record_rejection(Rejection::SessionLimit);
            return Err(ServiceError::exhausted(format!(
                "uid {} holds {per_uid} sessions, its quota (quota.max_sessions_per_uid)",
                peer.uid
            )));
        }
        if sessions.len() >= self.limits.max_sessions {
            self.record_rejection(Rejection::SessionLimit);
            return Err(ServiceError::exhausted(format!(
                "session limit reached ({} sessions; admission.max_sessions)",
                self.limits.max_sessions
            )));
        }
        let id = self.fresh_id(&sessions);
        let session = Arc::new(Session::new(
            id,
            peer.uid,
            req.label.clone(),
            policy,
            kv,
            false,
        ));
        if self.tier.as_ref().is_some_and(|(_, t)| t.write_through) {
            // Write-through: an acknowledged session survives a crash even before its first
            // append.
            let mut st = session.state.lock();
            self.persist_locked(&session, &mut st, tiering::Write::Serving)?;
        }
        sessions.insert(id, session);
        self.gpu_open(id, &geometry, &policy);
        tracing::info!(session = id, uid = peer.uid, label = %req.label, ?geometry, ?policy, "session created");
        Ok(id)
    }

    fn info_of(&self, s: &Session) -> SessionInfo {
        let st = s.state.lock();
        let page = self
            .tier
            .as_ref()
            .map_or(0, |(t, _)| t.store().page_bytes(s.geometry.block_bytes()));
        let nvme_pages: u64 = if st.stored {
            st.persisted.iter().map(|&t| s.geometry.blocks_for(t)).sum()
        } else {
            0
        };
        SessionInfo {
            session: s.id,
            owner_uid: s.owner_uid,
            label: s.label.clone(),
            geometry: s.geometry,
            policy: s.policy,
            // A damaged session's cache is empty: report what its manifest record holds.
            tokens_min: match s.damaged {
                Some(_) => st.persisted.iter().copied().min().unwrap_or(0),
                None => st.kv.min_tokens(),
            },
            tokens_max: match s.damaged {
                Some(_) => st.persisted.iter().copied().max().unwrap_or(0),
                None => st.kv.max_tokens_stored(),
            },
            blocks: st.kv.blocks() as u64,
            host_bytes: st.kv.host_bytes() as u64,
            nvme_bytes: nvme_pages * page,
            // The runs of the blocks the cluster's copy holds tokens of.
            remote_bytes: match &self.remote {
                Some(_) => {
                    let blocks: u64 = st
                        .remote_persisted
                        .iter()
                        .map(|&t| s.geometry.blocks_for(t))
                        .sum();
                    blocks * s.geometry.block_bytes() as u64
                }
                None => 0,
            },
            pinned: s.pinned.load(Ordering::Relaxed),
            damaged: s.damaged.is_some(),
            created_unix_ms: s.created_unix_ms,
            last_access_unix_ms: s.last_access_unix_ms.load(Ordering::Relaxed),
        }
    }

    pub fn info(&self, peer: &Peer, id: u64) -> ServiceResult<SessionInfo> {
        let s = self.lookup(peer, id, true)?;
        Ok(self.info_of(&s))
    }

    /// Every session for admins, the caller's own otherwise; ascending ids.
    pub fn list(&self, peer: &Peer) -> Vec<SessionInfo> {
        let admin = self.is_admin(peer);
        let mut v: Vec<Arc<Session>> = self
            .sessions
            .read()
            .values()
            .filter(|s| admin || s.owner_uid == peer.uid)
            .cloned()
            .collect();
        v.sort_by_key(|s| s.id);
        v.iter().map(|s| self.info_of(s)).collect()
    }

    pub fn close(&self, peer: &Peer, id: u64) -> ServiceResult<()> {
        self.lookup_or_resume(peer, id, false)?;
        self.remove(id)?;
        tracing::info!(session = id, uid = peer.uid, "session closed");
        Ok(())
    }

    pub fn evict(&self, peer: &Peer, id: u64) -> ServiceResult<()> {
        if !self.is_admin(peer) {
            return Err(ServiceError::denied(
                "EVICT needs an admin peer (auth.admin_uids / auth.admin_gids)",
            ));
        }
        self.lookup(peer, id, true)?;
        self.remove(id)?;
        tracing::info!(session = id, uid = peer.uid, "session evicted");
        Ok(())
    }

    /// Drops a session and its NVMe copy; its extents return to the arena once in-flight
    /// requests release it. The durable copy goes first: if deleting it fails (a full
    /// filesystem cannot commit the manifest), the session stays, served as before, rather
    /// than vanishing now and coming back after a restart.
    fn remove(&self, id: u64) -> ServiceResult<()> {
        let s = self
            .sessions
            .read()
            .get(&id)
            .cloned()
            .ok_or_else(|| ServiceError::not_found(id))?;
        {
            // Held across the table removal, so no request persists the session again in
            // between (the table lock is never held while waiting for a session's).
            let mut st = s.state.lock();
            if st.closed {
                return Err(ServiceError::not_found(id));
            }
            s.check_unleased("removing the session")?;
            self.remove_remote(id)?;
            self.forget_locked(&s, &mut st)?;
        }
        self.gpu_close(id);
        Ok(())
    }

    /// Drops a session from this node, its lock held: the NVMe copy first (if deleting it
    /// fails, the session stays, served as before, rather than vanishing now and coming back
    /// after a restart), then its table entry. The caller closes its device state once the
    /// lock is released ([`Service::gpu_close`]).
    fn forget_locked(&self, s: &Session, st: &mut SessionState) -> ServiceResult<()> {
        if let (Some((tier, _)), true) = (&self.tier, st.stored) {
            tier.delete_session(s.id).map_err(nvme_error)?;
            st.stored = false;
        }
        st.closed = true;
        self.sessions.write().remove(&s.id);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_storage::ArenaOptions;

    fn service() -> Service {
        let arena = HostArena::new(&ArenaOptions::new(1 << 20, 4096)).unwrap();
        Service::new(arena, testing::limits(4, false))
    }

    #[test]
    fn a_stuck_session_table_is_not_responsive() {
        let e = service();
        assert!(e.responsive());
        let held = e.sessions.write();
        assert!(
            !e.responsive(),
            "the watchdog probe must notice a held table lock"
        );
        drop(held);
        assert!(e.responsive());
    }

    #[test]
    fn readiness_and_recorded_failures_reach_stats() {
        let e = service();
        let get = |k| e.stats().get(k).unwrap();
        assert_eq!(get(extra_stats_keys::READY), 0, "not ready before serving");
        e.set_ready(true);
        assert_eq!(get(extra_stats_keys::READY), 1);
        e.record_error(ErrorCode::NotFound);
        e.record_rejection(Rejection::QueueFull);
        assert_eq!(get(stats_keys::ERRORS_TOTAL), 1);
        assert_eq!(get(stats_keys::REJECTED_TOTAL), 1);
        assert!(get(extra_stats_keys::STARTED_UNIX_MS) > 1_700_000_000_000);
        for k in extra_stats_keys::ALL.iter().chain(stats_keys::ALL) {
            assert!(e.stats().get(k).is_some(), "STATS lacks {k}");
        }
    }
}
