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

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::{Mutex, MutexGuard, RwLock};

use kvtier_kernels::{decode_layer_timed, DecodeEntry, StageTimings};
use kvtier_protocol::{
    stats_keys, CreateSessionRequest, DecodeEntryRef, DecodeOutput, DecodeReply, DecodeStats,
    SessionInfo, StatsReply,
};
use kvtier_storage::nvme::manifest::{GeometryRecord, PolicyRecord, SessionRecord};
use kvtier_storage::nvme::{BlockRun, NvmeError, NvmeTier, TierSource};
use kvtier_storage::ColdSource;
use kvtier_storage::{
    DType, FrameQuota, Geometry, HostArena, KvCache, Policy, StorageError, StoredBlock,
};

use crate::error::{storage_code, ServiceError, ServiceResult};
use crate::metrics::{Metrics, Rejection};

/// STATS keys tierd reports beyond the protocol's initial set (docs/protocol.md §5.7).
pub mod extra_stats_keys {
    /// 1 while the daemon accepts requests, 0 once shutdown has begun (draining).
    pub const READY: &str = "ready";
    /// Wall-clock start time, ms since the Unix epoch.
    pub const STARTED_UNIX_MS: &str = "started_unix_ms";
    /// Selected (block, kv-head) tiles over all decode entries.
    pub const SELECTED_TILES_TOTAL: &str = "selected_tiles_total";
    /// Summed wall time of the stages of CPU-path DECODE requests, ns.
    pub const DECODE_APPEND_NS_TOTAL: &str = "decode_append_ns_total";
    pub const DECODE_SELECT_NS_TOTAL: &str = "decode_select_ns_total";
    pub const DECODE_FETCH_NS_TOTAL: &str = "decode_fetch_ns_total";
    pub const DECODE_ATTEND_NS_TOTAL: &str = "decode_attend_ns_total";

    pub const ALL: [&str; 7] = [
        READY,
        STARTED_UNIX_MS,
        SELECTED_TILES_TOTAL,
        DECODE_APPEND_NS_TOTAL,
        DECODE_SELECT_NS_TOTAL,
        DECODE_FETCH_NS_TOTAL,
        DECODE_ATTEND_NS_TOTAL,
    ];
}
use crate::gpu::{GpuDecoder, GpuEntry, GpuError};
use kvtier_protocol::ErrorCode;

/// Who is asking, from SO_PEERCRED.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    pub uid: u32,
    pub gid: u32,
    pub pid: Option<i32>,
}

/// Limits and identity the engine enforces.
#[derive(Debug, Clone)]
pub struct EngineLimits {
    pub max_sessions: usize,
    /// Sessions one uid may hold (admins exempt; 0: no limit beyond `max_sessions`).
    pub max_sessions_per_uid: usize,
    /// Share of the host tier's frames one uid may hold (admin uids exempt; 1.0: none).
    pub host_share_per_uid: f64,
    /// Share of the NVMe tier's pages one uid may reference (admin uids exempt; 1.0: none).
    pub nvme_share_per_uid: f64,
    /// Largest reply body (`server.max_frame_bytes`): a DECODE whose reply could not fit is
    /// refused before it appends anything.
    pub max_reply_bytes: usize,
    pub admin_uids: Vec<u32>,
    pub admin_gids: Vec<u32>,
}

/// How the engine uses the NVMe tier.
#[derive(Debug, Clone)]
pub struct TierSettings {
    pub write_through: bool,
    pub high_water: f64,
    pub low_water: f64,
    /// Candidates per kv-head beyond the keep-set promoted ahead of need (0: no prefetch).
    pub prefetch_blocks: u32,
}

/// One session: its identity, policy and state.
pub struct Session {
    pub id: u64,
    pub owner_uid: u32,
    pub label: String,
    pub geometry: Geometry,
    pub policy: Policy,
    pub created_unix_ms: u64,
    last_access_unix_ms: AtomicU64,
    pinned: std::sync::atomic::AtomicBool,
    /// Set at startup when its stored data could not be read back (see [`Damage`]).
    damaged: Option<Damage>,
    state: Mutex<SessionState>,
}

/// Why a stored session could not be restored. It stays listed (SESSION_INFO, LIST) so the
/// loss is visible; every use answers DATA_LOSS; CLOSE deletes its NVMe record and pages.
/// Until then its record and pages stay untouched on NVMe.
#[derive(Debug, Clone)]
pub struct Damage {
    pub reason: String,
    /// Tokens per layer the manifest recorded.
    pub layer_tokens: Vec<u64>,
}

struct SessionState {
    kv: KvCache,
    /// Tokens per layer whose blocks are durable on NVMe (blocks at or past
    /// `persisted / block_tokens` are dirty and never evicted).
    persisted: Vec<u64>,
    /// The NVMe manifest holds a record of this session.
    stored: bool,
    /// Removed by CLOSE/EVICT; a request that looked it up before must not write it back.
    closed: bool,
}

fn nvme_error(e: NvmeError) -> ServiceError {
    let code = match &e {
        NvmeError::Full { .. } | NvmeError::NoSpace { .. } => ErrorCode::ResourceExhausted,
        e if e.is_data_loss() => ErrorCode::DataLoss,
        _ => ErrorCode::Internal,
    };
    ServiceError::new(code, format!("NVMe tier: {e}"))
}

impl From<NvmeError> for ServiceError {
    fn from(e: NvmeError) -> Self {
        nvme_error(e)
    }
}

/// Monotonic counters reported by STATS (relaxed atomics: read at scrape time).
#[derive(Debug, Default)]
pub struct Counters {
    pub decode_requests: AtomicU64,
    pub decode_entries: AtomicU64,
    pub append_tokens: AtomicU64,
    pub errors: AtomicU64,
    pub rejected: AtomicU64,
    pub bytes_touched: AtomicU64,
    pub demotions: AtomicU64,
    pub blocks_demoted: AtomicU64,
    pub blocks_promoted: AtomicU64,
    pub selected_tiles: AtomicU64,
    pub append_ns: AtomicU64,
    pub select_ns: AtomicU64,
    pub fetch_ns: AtomicU64,
    pub attend_ns: AtomicU64,
    /// Decode entries the CUDA device answered.
    pub gpu_entries: AtomicU64,
    /// GPU decode calls answered on the CPU after the appends (a device failure, or a device
    /// keep-set naming a block still on NVMe).
    pub gpu_cpu_fallbacks: AtomicU64,
    /// Entries whose device keep-set named a block still on NVMe (should stay 0).
    pub gpu_cold_divergences: AtomicU64,
}

/// One DECODE request as the GPU path sees it (the engine's per-entry views of it).
struct GpuBatch<'a> {
    layer: u32,
    want_stats: bool,
    sessions: &'a [Arc<Session>],
    entries: &'a [DecodeEntryRef<'a>],
    queries: &'a [Vec<f32>],
    sources: &'a [Option<TierSource<'a>>],
}

/// The most bytes a DECODE reply body for these entries can take (docs/protocol.md §5.3):
/// the output count, then per entry its outputs and, with stats, the counters and every kv
/// head's keep-set (at most the policy's budget of the blocks the layer will have).
fn reply_bound(sessions: &[Arc<Session>], entries: &[DecodeEntryRef<'_>], stats: bool) -> u64 {
    let per_entry = |(s, e): (&Arc<Session>, &DecodeEntryRef<'_>)| -> u64 {
        let g = &s.geometry;
        let out = 4 + 4 * g.q_heads as u64 * g.head_dim as u64 + 1;
        if !stats {
            return out;
        }
        let kept = s
            .policy
            .budget()
            .min(g.blocks_for(e.position.saturating_add(1)));
        let heads = g.kv_heads as u64;
        out + DecodeStats::MIN_WIRE_LEN as u64 + heads * (4 + 4 * kept)
    };
    4 + sessions.iter().zip(entries).map(per_entry).sum::<u64>()
}

/// Frames a decode step may need at most, for making room when the host tier is full: every
/// entry's keep-set (distinct blocks over its kv-heads) and a new block.
fn step_frames(sessions: &[Arc<Session>], entries: &[DecodeEntryRef<'_>]) -> usize {
    sessions
        .iter()
        .zip(entries)
        .map(|(s, e)| {
            let keep = s.policy.budget() as usize * s.geometry.kv_heads as usize;
            let blocks = s.geometry.blocks_for(e.position + 1) as usize;
            keep.min(blocks) + 1
        })
        .sum()
}

/// The NVMe tier's metric series.
struct NvmeSeries {
    usage: crate::metrics::TierGauges,
    read: metrics::Counter,
    written: metrics::Counter,
    counters: crate::metrics::NvmeMetrics,
}

/// The engine's state at one instant: what STATS and a metrics scrape report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub ready: bool,
    pub uptime: Duration,
    pub started_unix_ms: u64,
    pub sessions: u64,
    pub host_bytes_used: u64,
    pub host_bytes_capacity: u64,
    pub host_frames_used: u64,
    pub host_frames_capacity: u64,
    pub decode_requests: u64,
    pub decode_entries: u64,
    pub append_tokens: u64,
    pub errors: u64,
    pub rejected: u64,
    pub bytes_touched: u64,
    pub selected_tiles: u64,
    pub append_ns: u64,
    pub select_ns: u64,
    pub fetch_ns: u64,
    pub attend_ns: u64,
}

pub struct Engine {
    limits: EngineLimits,
    arena: HostArena,
    tier: Option<(Arc<NvmeTier>, TierSettings)>,
    /// The CUDA decode path, for the sessions it supports (cold blocks a step needs are
    /// promoted first); everything else (and any GPU failure, which happens before the step
    /// changes anything) runs on the CPU backend.
    gpu: Option<Mutex<GpuDecoder>>,
    prefetcher: Option<crate::prefetch::Prefetcher>,
    sessions: RwLock<HashMap<u64, Arc<Session>>>,
    /// Each uid's share of the host tier (`host_share_per_uid`), shared by its sessions.
    host_quotas: Mutex<HashMap<u32, Arc<FrameQuota>>>,
    next_id: AtomicU64,
    pub counters: Counters,
    metrics: Metrics,
    /// The fetch-stage histogram, registered only when a colder tier exists to fetch from.
    fetch_seconds: Option<metrics::Histogram>,
    /// NVMe tier series, registered only when the tier exists; refreshed at scrape time.
    nvme_metrics: Option<NvmeSeries>,
    ready: AtomicBool,
    started: Instant,
    started_unix_ms: u64,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn to_geometry(g: &kvtier_protocol::Geometry) -> Geometry {
    Geometry {
        layers: g.layers,
        q_heads: g.q_heads,
        kv_heads: g.kv_heads,
        head_dim: g.head_dim,
        dtype: DType::from_code(g.dtype.as_u8()).expect("protocol dtypes are storage dtypes"),
        block_tokens: g.block_tokens,
    }
}

/// The geometry a manifest record stores.
fn geometry_of(g: &GeometryRecord) -> ServiceResult<Geometry> {
    Ok(Geometry {
        layers: g.layers,
        q_heads: g.q_heads,
        kv_heads: g.kv_heads,
        head_dim: g.head_dim,
        dtype: DType::from_code(g.dtype)
            .ok_or_else(|| ServiceError::internal(format!("unknown dtype {}", g.dtype)))?,
        block_tokens: g.block_tokens,
    })
}

fn policy_of(p: &PolicyRecord) -> Policy {
    Policy {
        sink_blocks: p.sink_blocks,
        local_blocks: p.local_blocks,
        top_k: p.top_k,
    }
}

fn to_wire_geometry(g: &Geometry) -> kvtier_protocol::Geometry {
    kvtier_protocol::Geometry {
        layers: g.layers,
        q_heads: g.q_heads,
        kv_heads: g.kv_heads,
        head_dim: g.head_dim,
        dtype: kvtier_protocol::Dtype::from_u8(g.dtype.code()).expect("same codes"),
        block_tokens: g.block_tokens,
    }
}

impl Engine {
    pub fn new(arena: HostArena, limits: EngineLimits) -> Self {
        Self::with_tier(arena, limits, None, None)
    }

    /// An engine whose sessions tier to `tier`.
    pub fn with_tier(
        arena: HostArena,
        limits: EngineLimits,
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
        Engine {
            limits,
            arena,
            tier,
            gpu: gpu.map(Mutex::new),
            prefetcher,
            sessions: RwLock::new(HashMap::new()),
            host_quotas: Mutex::new(HashMap::new()),
            // Ids never repeat across restarts: they start from the clock (4096 per ms), and
            // recovery moves past every restored id.
            next_id: AtomicU64::new(now_ms() << 12),
            counters: Counters::default(),
            metrics: Metrics::disabled(),
            fetch_seconds: None,
            nvme_metrics: None,
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
            read: metrics.register_lane("nvme_to_host"),
            written: metrics.register_lane("host_to_nvme"),
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
    fn arena_for(&self, uid: u32) -> HostArena {
        let share = self.limits.host_share_per_uid;
        if share >= 1.0 || self.limits.admin_uids.contains(&uid) {
            return self.arena.clone();
        }
        let limit = (self.arena.usage().frames_total as f64 * share).floor() as usize;
        let q = self
            .host_quotas
            .lock()
            .entry(uid)
            .or_insert_with(|| FrameQuota::new(limit.max(1)))
            .clone();
        self.arena.with_quota(q)
    }

    /// Refuses a write that would take `s`'s owner past its share of the NVMe tier.
    fn check_nvme_quota(
        &self,
        tier: &NvmeTier,
        s: &Session,
        runs: &[BlockRun<'_>],
    ) -> ServiceResult<()> {
        let share = self.limits.nvme_share_per_uid;
        if share >= 1.0 || self.limits.admin_uids.contains(&s.owner_uid) {
            return Ok(());
        }
        let total: u64 = tier
            .store()
            .usage()
            .devices
            .iter()
            .map(|d| d.pages_total)
            .sum();
        let limit = (total as f64 * share).floor() as u64;
        let after = tier.owner_pages_after(s.owner_uid, s.id, runs);
        if after > limit {
            return Err(ServiceError::exhausted(format!(
                "uid {} would reference {after} NVMe pages, more than its quota of {limit} (quota.nvme_share_per_uid)",
                s.owner_uid
            )));
        }
        Ok(())
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
        s.last_access_unix_ms.store(now_ms(), Ordering::Relaxed);
        Ok(s)
    }

    /// [`Engine::lookup`] for an operation on the session's data: DATA_LOSS for a session
    /// whose stored data failed verification at startup.
    fn lookup_live(&self, peer: &Peer, id: u64) -> ServiceResult<Arc<Session>> {
        let s = self.lookup(peer, id, false)?;
        if let Some(d) = &s.damaged {
            return Err(ServiceError::new(
                ErrorCode::DataLoss,
                format!(
                    "session {id} is damaged ({}); CLOSE it to delete what remains",
                    d.reason
                ),
            ));
        }
        Ok(s)
    }

    /// A fresh session id: random (ids say nothing about other sessions), never 0, never one
    /// in use or on NVMe.
    fn fresh_id(&self, table: &HashMap<u64, Arc<Session>>) -> u64 {
        loop {
            let mut b = [0u8; 8];
            // SAFETY: getrandom writes at most b.len() bytes into the buffer it is given.
            let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
            let id = if n == 8 {
                u64::from_le_bytes(b) >> 1
            } else {
                // No getrandom (very old kernels): unique, if predictable.
                self.next_id.fetch_add(1, Ordering::Relaxed)
            };
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
        let geometry = to_geometry(&req.geometry);
        let policy = Policy {
            sink_blocks: req.policy.sink_blocks,
            local_blocks: req.policy.local_blocks,
            top_k: req.policy.top_k,
        };
        policy.validate()?;
        let kv = KvCache::new(geometry, self.arena_for(peer.uid))?;
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
            self.persist_locked(&session, &mut st)?;
        }
        sessions.insert(id, session);
        self.gpu_open(id, &geometry, &policy);
        tracing::info!(session = id, uid = peer.uid, label = %req.label, ?geometry, ?policy, "session created");
        Ok(id)
    }

    /// Appends `n_tokens` to every layer of a session; returns its new length. With
    /// write-through the new blocks are durable on NVMe before this returns; if they cannot be
    /// made durable the append is rolled back.
    pub fn append(
        &self,
        peer: &Peer,
        id: u64,
        start: u64,
        n_tokens: u32,
        payload: &[u8],
    ) -> ServiceResult<u64> {
        let s = self.lookup_live(peer, id)?;
        let mut st = s.state.lock();
        let need = st.kv.geometry().blocks_for(start + n_tokens as u64) as usize
            * st.kv.geometry().layers as usize;
        let tails = st.kv.cold_tails();
        let attempt = |st: &mut SessionState| -> ServiceResult<()> {
            self.promote_tails(&s, st, &tails)?;
            st.kv.append(start, n_tokens as u64, payload)?;
            Ok(())
        };
        if let Err(e) = attempt(&mut st) {
            if e.code != ErrorCode::ResourceExhausted || !self.make_room(&[id], need) {
                if e.code == ErrorCode::ResourceExhausted {
                    self.record_rejection(Rejection::HostFull);
                }
                return Err(e);
            }
            attempt(&mut st)?;
        }
        if self.tier.as_ref().is_some_and(|(_, t)| t.write_through) {
            if let Err(e) = self.persist_locked(&s, &mut st) {
                st.kv.truncate(start);
                if let Some(gpu) = &self.gpu {
                    let _ = gpu.lock().invalidate(id);
                }
                return Err(ServiceError::new(
                    e.code,
                    format!("append rolled back, not durable: {}", e.message),
                ));
            }
        }
        self.counters
            .append_tokens
            .fetch_add(n_tokens as u64, Ordering::Relaxed);
        let tokens = st.kv.min_tokens();
        drop(st);
        self.make_room(&[id], 0);
        Ok(tokens)
    }

    /// One decode step of `layer` for every entry (a batch when several). All-or-nothing.
    pub fn decode(
        &self,
        peer: &Peer,
        layer: u32,
        want_stats: bool,
        entries: &[DecodeEntryRef<'_>],
    ) -> ServiceResult<DecodeReply> {
        if entries.is_empty() {
            return Err(ServiceError::invalid("DECODE with no entries"));
        }
        let mut sessions = Vec::with_capacity(entries.len());
        for (i, e) in entries.iter().enumerate() {
            let s = self.lookup_live(peer, e.session).map_err(|err| {
                ServiceError::new(err.code, format!("batch entry {i}: {}", err.message))
            })?;
            sessions.push(s);
        }
        // Refused now if the reply could not be sent, before anything is appended
        // (protocol.md §5.3: nothing is appended on error).
        let bound = reply_bound(&sessions, entries, want_stats);
        if bound > self.limits.max_reply_bytes as u64 {
            return Err(ServiceError::exhausted(format!(
                "the reply could take {bound} bytes, more than max_frame_bytes {}: split the batch{}",
                self.limits.max_reply_bytes,
                if want_stats { " or ask for no stats" } else { "" }
            )));
        }
        // Lock in ascending id order (deadlock freedom); a duplicate would self-deadlock.
        let mut order: Vec<usize> = (0..entries.len()).collect();
        order.sort_by_key(|&i| sessions[i].id);
        if let Some(w) = order
            .windows(2)
            .find(|w| sessions[w[0]].id == sessions[w[1]].id)
        {
            return Err(ServiceError::invalid(format!(
                "session {} appears twice in one DECODE (entries {} and {})",
                sessions[w[0]].id,
                w[0].min(w[1]),
                w[0].max(w[1])
            )));
        }
        let mut guards: Vec<Option<MutexGuard<'_, SessionState>>> =
            (0..entries.len()).map(|_| None).collect();
        for &i in &order {
            guards[i] = Some(sessions[i].state.lock());
        }
        let queries: Vec<Vec<f32>> = entries
            .iter()
            .map(|e| kvtier_protocol::f32s_le(e.q).collect())
            .collect();
        let ids: Vec<u64> = sessions.iter().map(|s| s.id).collect();
        let sources: Vec<Option<TierSource<'_>>> = ids
            .iter()
            .map(|&session| {
                self.tier.as_ref().map(|(tier, _)| TierSource {
                    tier: tier.as_ref(),
                    session,
                })
            })
            .collect();
        let out_len: usize = sessions
            .iter()
            .map(|s| (s.geometry.q_heads * s.geometry.head_dim) as usize)
            .sum();
        let mut out = vec![0f32; out_len];
        let gpu = GpuBatch {
            layer,
            want_stats,
            sessions: &sessions,
            entries,
            queries: &queries,
            sources: &sources,
        };
        if let Some(stats) = self.decode_gpu(&gpu, &mut guards, &mut out)? {
            self.offer_prefetch(layer, &guards, &sessions, &queries);
            drop(guards);
            return Ok(self.decode_reply(&sessions, &ids, out, stats, want_stats));
        }
        let t0 = Instant::now();
        let mut timings = StageTimings::default();
        let mut run = |guards: &mut Vec<Option<MutexGuard<'_, SessionState>>>| {
            for (i, g) in guards.iter_mut().enumerate() {
                let st = g.as_mut().expect("locked above");
                // The tail block takes the new token: bring it back if it was demoted.
                let tails: Vec<(u32, u32)> = st
                    .kv
                    .cold_tails()
                    .into_iter()
                    .filter(|t| t.0 == layer)
                    .collect();
                self.promote_tails(&sessions[i], st, &tails)
                    .map_err(|err| {
                        ServiceError::new(err.code, format!("batch entry {i}: {}", err.message))
                    })?;
            }
            let mut batch: Vec<DecodeEntry<'_>> = guards
                .iter_mut()
                .zip(entries)
                .zip(&queries)
                .zip(&sessions)
                .zip(&sources)
                .map(|((((g, e), q), s), src)| DecodeEntry {
                    kv: &mut g.as_mut().expect("locked above").kv,
                    policy: s.policy,
                    position: e.position,
                    q,
                    k: e.k,
                    v: e.v,
                    cold: src.as_ref().map(|c| c as &dyn ColdSource),
                })
                .collect();
            decode_layer_timed(layer, &mut batch, &mut out, &mut timings)
                .map_err(ServiceError::from)
        };
        let stats = match run(&mut guards) {
            Err(e) if e.code == ErrorCode::ResourceExhausted => {
                // Make room by demoting other sessions, then try once more.
                if !self.make_room(&ids, step_frames(&sessions, entries)) {
                    self.record_rejection(Rejection::HostFull);
                    return Err(e);
                }
                run(&mut guards)?
            }
            other => other?,
        };
        self.offer_prefetch(layer, &guards, &sessions, &queries);
        drop(guards);
        let c = &self.counters;
        c.append_ns.fetch_add(timings.append_ns, Ordering::Relaxed);
        c.select_ns.fetch_add(timings.select_ns, Ordering::Relaxed);
        c.fetch_ns.fetch_add(timings.fetch_ns, Ordering::Relaxed);
        c.attend_ns.fetch_add(timings.attend_ns, Ordering::Relaxed);
        self.metrics.decode_timings(&timings, t0.elapsed());
        if let Some(h) = &self.fetch_seconds {
            h.record(timings.fetch_ns as f64 * 1e-9);
        }
        let promoted: u64 = stats.iter().map(|s| s.blocks_promoted as u64).sum();
        self.counters
            .blocks_promoted
            .fetch_add(promoted, Ordering::Relaxed);
        let wire = sessions
            .iter()
            .zip(stats)
            .map(|(s, st)| {
                let nvme_tiles = st.blocks_promoted * s.geometry.kv_heads;
                DecodeStats {
                    blocks_total: st.blocks_total,
                    blocks_selected: st.tiles_selected,
                    bytes_touched: st.bytes_touched,
                    // The CPU backend attends in place; only NVMe reads move bytes.
                    bytes_moved: st.bytes_promoted,
                    cache_hits: 0,
                    blocks_ram: st.tiles_selected.saturating_sub(nvme_tiles),
                    blocks_nvme: nvme_tiles.min(st.tiles_selected),
                    selected: (0..st.keep.heads())
                        .map(|h| st.keep.head(h).to_vec())
                        .collect(),
                }
            })
            .collect();
        Ok(self.decode_reply(&sessions, &ids, out, wire, want_stats))
    }

    /// Counts a finished step and splits its output per entry.
    fn decode_reply(
        &self,
        sessions: &[Arc<Session>],
        ids: &[u64],
        out: Vec<f32>,
        stats: Vec<DecodeStats>,
        want_stats: bool,
    ) -> DecodeReply {
        self.counters
            .decode_requests
            .fetch_add(1, Ordering::Relaxed);
        self.counters
            .decode_entries
            .fetch_add(sessions.len() as u64, Ordering::Relaxed);
        let touched: u64 = stats.iter().map(|s| s.bytes_touched).sum();
        self.counters
            .bytes_touched
            .fetch_add(touched, Ordering::Relaxed);
        let tiles: u64 = stats.iter().map(|s| s.blocks_selected as u64).sum();
        self.counters
            .selected_tiles
            .fetch_add(tiles, Ordering::Relaxed);
        for st in &stats {
            if let Some(head) = st.selected.first() {
                self.metrics.keep_set(head.len());
            }
        }
        let mut at = 0;
        let entries = sessions
            .iter()
            .zip(stats)
            .map(|(s, st)| {
                let n = (s.geometry.q_heads * s.geometry.head_dim) as usize;
                let o = out[at..at + n].to_vec();
                at += n;
                DecodeOutput {
                    out: o,
                    stats: want_stats.then_some(st),
                }
            })
            .collect();
        self.make_room(ids, 0);
        DecodeReply { entries }
    }

    /// Opens a session on the GPU when the CUDA path supports it (else it stays on the CPU).
    fn gpu_open(&self, id: u64, geometry: &Geometry, policy: &Policy) {
        if let Some(gpu) = &self.gpu {
            let mut g = gpu.lock();
            if g.supports(geometry, policy) {
                if let Err(e) = g.open(id, geometry, policy) {
                    tracing::info!(session = id, error = %e, "session stays on the CPU backend");
                }
            }
        }
    }

    /// Sessions still partly on NVMe: read the runners-up of this layer in the background.
    fn offer_prefetch(
        &self,
        layer: u32,
        guards: &[Option<MutexGuard<'_, SessionState>>],
        sessions: &[Arc<Session>],
        queries: &[Vec<f32>],
    ) {
        let Some(p) = &self.prefetcher else {
            return;
        };
        for ((g, s), q) in guards.iter().zip(sessions).zip(queries) {
            let st = g.as_ref().expect("locked");
            if st.kv.frames() < st.kv.blocks() {
                p.offer(crate::prefetch::Job {
                    session: s.clone(),
                    layer,
                    q: q.clone(),
                });
            }
        }
    }

    /// The GPU step for a batch whose sessions are all open on the GPU; the decoder promotes
    /// the cold blocks the step needs through the NVMe tier first. `Ok(None)`: the CPU path
    /// answers (a session not open on the GPU, a request error the CPU path reports with its
    /// proper code, a device error; all happen before the step changes anything). A full host
    /// tier gets the CPU path's treatment (demote other sessions, try once more) and a failed
    /// NVMe read is the request's error, as on the CPU path (reading it again would not help).
    fn decode_gpu(
        &self,
        b: &GpuBatch<'_>,
        guards: &mut [Option<MutexGuard<'_, SessionState>>],
        out: &mut [f32],
    ) -> ServiceResult<Option<Vec<DecodeStats>>> {
        let Some(gpu) = &self.gpu else {
            return Ok(None);
        };
        let mut made_room = false;
        let r = loop {
            let mut g = gpu.lock();
            if !b.entries.iter().all(|e| g.is_open(e.session)) {
                return Ok(None);
            }
            let mut batch: Vec<GpuEntry<'_>> = guards
                .iter_mut()
                .zip(b.entries)
                .zip(b.queries)
                .zip(b.sources)
                .map(|(((st, e), q), src)| GpuEntry {
                    session: e.session,
                    kv: &mut st.as_mut().expect("locked").kv,
                    position: e.position,
                    q,
                    k: e.k,
                    v: e.v,
                    cold: src.as_ref().map(|c| c as &dyn ColdSource),
                })
                .collect();
            let e = match g.decode(b.layer, &mut batch, out, b.want_stats) {
                Ok(r) => break r,
                Err(e) => e,
            };
            drop(batch);
            // make_room writes other sessions to NVMe: not under the device lock.
            drop(g);
            match e.storage() {
                Some(s @ StorageError::ArenaFull { .. }) if !made_room => {
                    made_room = true;
                    let ids: Vec<u64> = b.sessions.iter().map(|s| s.id).collect();
                    if !self.make_room(&ids, step_frames(b.sessions, b.entries)) {
                        self.record_rejection(Rejection::HostFull);
                        return Err(ServiceError::new(storage_code(s), e.to_string()));
                    }
                }
                Some(s @ (StorageError::ArenaFull { .. } | StorageError::ColdRead { .. })) => {
                    return Err(ServiceError::new(storage_code(s), e.to_string()));
                }
                _ => {
                    match e.root() {
                        GpuError::Cuda(_) => {
                            tracing::warn!(error = %e, "GPU decode failed; answering on the CPU")
                        }
                        _ => tracing::debug!(error = %e, "GPU cannot take this step; CPU path"),
                    }
                    return Ok(None);
                }
            }
        };
        let c = &self.counters;
        if r.cpu_fallback {
            c.gpu_cpu_fallbacks.fetch_add(1, Ordering::Relaxed);
        } else {
            c.gpu_entries
                .fetch_add(b.entries.len() as u64, Ordering::Relaxed);
        }
        c.gpu_cold_divergences
            .fetch_add(r.cold_divergences as u64, Ordering::Relaxed);
        let promoted: u64 = r.entries.iter().map(|s| s.blocks_promoted as u64).sum();
        c.blocks_promoted.fetch_add(promoted, Ordering::Relaxed);
        Ok(Some(
            r.entries
                .into_iter()
                .zip(b.sessions)
                .enumerate()
                .map(|(i, (st, s))| {
                    let geo = s.geometry;
                    let blocks = st.blocks_total as u64;
                    let summaries = blocks * geo.summary_floats_per_block() as u64 * 4;
                    // Device counters are per call: a batch reports them on its first entry.
                    let (hits, moved) = if i == 0 {
                        (r.cache_hits as u32, r.bytes_moved)
                    } else {
                        (0, 0)
                    };
                    // Blocks promoted for this step, counted as tiles of every kv-head like
                    // the CPU path does.
                    let nvme_tiles = (st.blocks_promoted * geo.kv_heads).min(st.tiles_selected);
                    DecodeStats {
                        blocks_total: st.blocks_total,
                        blocks_selected: st.tiles_selected,
                        bytes_touched: summaries
                            + st.tiles_selected as u64 * geo.tile_bytes() as u64,
                        bytes_moved: moved + st.bytes_promoted,
                        cache_hits: hits,
                        blocks_ram: st.tiles_selected.saturating_sub(hits + nvme_tiles),
                        blocks_nvme: nvme_tiles,
                        selected: st
                            .keep
                            .map(|k| (0..k.heads()).map(|h| k.head(h).to_vec()).collect())
                            .unwrap_or_default(),
                    }
                })
                .collect(),
        ))
    }

    fn promote_tails(
        &self,
        s: &Session,
        st: &mut SessionState,
        tails: &[(u32, u32)],
    ) -> ServiceResult<()> {
        if tails.is_empty() {
            return Ok(());
        }
        let (tier, _) = self
            .tier
            .as_ref()
            .ok_or_else(|| ServiceError::internal("cold blocks without an NVMe tier"))?;
        let src = TierSource {
            tier,
            session: s.id,
        };
        for &(layer, block) in tails {
            let n = st.kv.promote(layer, &[block], &src)?;
            self.counters
                .blocks_promoted
                .fetch_add(n as u64, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Writes the session's dirty blocks (those at or past the durable watermark) to NVMe and
    /// commits its record; returns the blocks written.
    fn persist_locked(&self, s: &Session, st: &mut SessionState) -> ServiceResult<usize> {
        if st.closed {
            return Err(ServiceError::not_found(s.id));
        }
        let (tier, _) = self.tier.as_ref().ok_or_else(|| {
            ServiceError::new(
                ErrorCode::FailedPrecondition,
                "the NVMe tier is not enabled (nvme.enabled)",
            )
        })?;
        let geo = s.geometry;
        let bt = geo.block_tokens as u64;
        let mut runs = Vec::new();
        for l in 0..geo.layers {
            // Dirty: the blocks holding tokens past the durable watermark. A layer with none
            // has nothing to write, though its partial tail block (durable, and perhaps
            // demoted since) starts at or after `persisted / bt`.
            let persisted = st.persisted[l as usize];
            if st.kv.tokens(l)? == persisted {
                continue;
            }
            let blocks = st.kv.layer(l)?.blocks() as u32;
            for b in (persisted / bt) as u32..blocks {
                // Appends promote a cold tail before writing into it, so a block with
                // undurable tokens is resident; a cold one here is a bookkeeping bug, answered
                // as an error rather than a panic that would lose every session not yet
                // written.
                let bytes = st.kv.run(l, b).ok_or_else(|| {
                    ServiceError::internal(format!(
                        "session {}: layer {l} block {b} has undurable tokens but is not resident",
                        s.id
                    ))
                })?;
                runs.push(BlockRun {
                    layer: l,
                    block: b,
                    bytes,
                });
            }
        }
        let tokens: Vec<u64> = (0..geo.layers)
            .map(|l| st.kv.tokens(l).expect("layer exists"))
            .collect();
        if runs.is_empty() && st.stored {
            return Ok(0);
        }
        let record = SessionRecord {
            id: s.id,
            owner_uid: s.owner_uid,
            label: s.label.clone(),
            geometry: GeometryRecord {
                layers: geo.layers,
                q_heads: geo.q_heads,
                kv_heads: geo.kv_heads,
                head_dim: geo.head_dim,
                dtype: geo.dtype.code(),
                block_tokens: geo.block_tokens,
            },
            policy: PolicyRecord {
                sink_blocks: s.policy.sink_blocks,
                local_blocks: s.policy.local_blocks,
                top_k: s.policy.top_k,
            },
            layer_tokens: tokens.clone(),
            pages: Vec::new(),
            pinned: s.pinned.load(Ordering::Relaxed),
        };
        self.check_nvme_quota(tier, s, &runs)?;
        tier.put_session(&record, &runs).map_err(nvme_error)?;
        st.persisted = tokens;
        st.stored = true;
        Ok(runs.len())
    }

    /// Persists the session and frees every host frame it holds; returns the frames freed.
    fn demote_locked(&self, s: &Session, st: &mut SessionState) -> ServiceResult<usize> {
        self.persist_locked(s, st)?;
        let mut freed = 0;
        for l in 0..s.geometry.layers {
            for b in 0..st.kv.layer(l)?.blocks() as u32 {
                freed += st.kv.evict(l, b) as usize;
            }
        }
        self.counters.demotions.fetch_add(1, Ordering::Relaxed);
        self.counters
            .blocks_demoted
            .fetch_add(freed as u64, Ordering::Relaxed);
        Ok(freed)
    }

    /// DEMOTE: write the session to NVMe and free its host frames.
    pub fn demote(&self, peer: &Peer, id: u64) -> ServiceResult<u64> {
        let s = self.lookup_live(peer, id)?;
        if s.pinned.load(Ordering::Relaxed) {
            return Err(ServiceError::precondition(format!(
                "session {id} is pinned; UNPIN it first"
            )));
        }
        let mut st = s.state.lock();
        let freed = self.demote_locked(&s, &mut st)?;
        tracing::info!(session = id, frames = freed, "session demoted");
        Ok(freed as u64)
    }

    /// PROMOTE: read every cold block of the session back into the host tier.
    pub fn promote(&self, peer: &Peer, id: u64) -> ServiceResult<u64> {
        let s = self.lookup_live(peer, id)?;
        let Some((tier, _)) = &self.tier else {
            return Ok(0);
        };
        let mut st = s.state.lock();
        let src = TierSource { tier, session: id };
        let mut n = 0;
        for l in 0..s.geometry.layers {
            let all: Vec<u32> = (0..st.kv.layer(l)?.blocks() as u32).collect();
            n += st.kv.promote(l, &all, &src)?;
        }
        self.counters
            .blocks_promoted
            .fetch_add(n as u64, Ordering::Relaxed);
        Ok(n as u64)
    }

    /// PIN / UNPIN: a pinned session is never demoted. For a session with a durable copy
    /// the flag is committed to the NVMe manifest before the reply, so it survives a restart
    /// (a session not yet on NVMe records it when it is first written).
    pub fn pin(&self, peer: &Peer, id: u64, pinned: bool) -> ServiceResult<()> {
        let s = self.lookup_live(peer, id)?;
        // Under the session lock, so a concurrent persist writes the same flag.
        let st = s.state.lock();
        if let (Some((tier, _)), true) = (&self.tier, st.stored) {
            tier.set_pinned(id, pinned).map_err(nvme_error)?;
        }
        s.pinned.store(pinned, Ordering::Relaxed);
        Ok(())
    }

    /// Demotes least recently used, unpinned sessions not in `exclude` while the host tier is
    /// above its high-water mark (down to the low-water mark) or fewer than `need` frames are
    /// free. Only `try_lock`s sessions, so it never waits on a busy one. Returns whether the
    /// goal was reached.
    fn make_room(&self, exclude: &[u64], need: usize) -> bool {
        let Some((_, t)) = &self.tier else {
            return false;
        };
        let u = self.arena.usage();
        let total = u.frames_total as f64;
        let goal_used =
            |used: usize| (used as f64) <= total * t.low_water && u.frames_total - used >= need;
        if (u.frames_used as f64) < total * t.high_water && u.frames_total - u.frames_used >= need {
            return true;
        }
        let mut candidates: Vec<Arc<Session>> = self
            .sessions
            .read()
            .values()
            .filter(|s| !exclude.contains(&s.id) && !s.pinned.load(Ordering::Relaxed))
            .cloned()
            .collect();
        candidates.sort_by_key(|s| s.last_access_unix_ms.load(Ordering::Relaxed));
        for s in candidates {
            if goal_used(self.arena.usage().frames_used) {
                break;
            }
            let Some(mut st) = s.state.try_lock() else {
                continue;
            };
            if st.kv.frames() == 0 {
                continue;
            }
            match self.demote_locked(&s, &mut st) {
                Ok(n) => {
                    tracing::info!(session = s.id, frames = n, "demoted under memory pressure")
                }
                Err(e) => tracing::warn!(session = s.id, error = %e, "demotion failed"),
            }
        }
        let used = self.arena.usage().frames_used;
        u.frames_total - used >= need
    }

    /// Writes every session to NVMe (clean shutdown), so a restart finds them all.
    pub fn persist_all(&self) -> (usize, usize) {
        if self.tier.is_none() {
            return (0, 0);
        }
        let all: Vec<Arc<Session>> = self.sessions.read().values().cloned().collect();
        let (mut ok, mut failed) = (0, 0);
        // A damaged session's record stays on NVMe as it was.
        for s in all.into_iter().filter(|s| s.damaged.is_none()) {
            let mut st = s.state.lock();
            match self.persist_locked(&s, &mut st) {
                Ok(_) => ok += 1,
                Err(e) => {
                    failed += 1;
                    tracing::error!(session = s.id, error = %e, "could not persist session at shutdown");
                }
            }
        }
        (ok, failed)
    }

    /// Loads every session the NVMe manifest holds (warm restart): reads and verifies each
    /// page, rebuilds tiles and bounds bit-identically, keeping blocks resident while the host
    /// tier is below its low-water mark and cold after that. A session that cannot be read
    /// back is left on NVMe, not served, and reported.
    pub fn recover(&self) -> (usize, Vec<String>) {
        let Some((tier, t)) = &self.tier else {
            return (0, Vec::new());
        };
        let mut problems = Vec::new();
        let mut loaded = 0;
        // Pinned sessions first: they get host frames while the tier is below low water.
        let mut records: Vec<SessionRecord> = tier
            .session_ids()
            .into_iter()
            .filter_map(|id| tier.session(id))
            .collect();
        records.sort_by_key(|r| (!r.pinned, r.id));
        for rec in records {
            let id = rec.id;
            match self.restore(tier, t, &rec) {
                Ok(session) => {
                    self.gpu_open(id, &session.geometry, &session.policy);
                    self.sessions.write().insert(id, Arc::new(session));
                    self.next_id.fetch_max(id + 1, Ordering::Relaxed);
                    loaded += 1;
                }
                Err(e) => {
                    // Listed as damaged, its record and pages left as they are on NVMe.
                    problems.push(format!("session {id}: {e} (listed as damaged)"));
                    match self.damaged_session(&rec, e.to_string()) {
                        Ok(s) => {
                            self.sessions.write().insert(id, Arc::new(s));
                        }
                        Err(e) => problems.push(format!("session {id}: not listed: {e}")),
                    }
                }
            }
        }
        (loaded, problems)
    }

    /// The table entry of a stored session that could not be restored.
    fn damaged_session(&self, rec: &SessionRecord, reason: String) -> ServiceResult<Session> {
        let kv = KvCache::new(geometry_of(&rec.geometry)?, self.arena.clone())?;
        let mut s = Session::new(
            rec.id,
            rec.owner_uid,
            rec.label.clone(),
            policy_of(&rec.policy),
            kv,
            true,
        );
        s.state.get_mut().persisted = rec.layer_tokens.clone();
        s.pinned.store(rec.pinned, Ordering::Relaxed);
        s.damaged = Some(Damage {
            reason,
            layer_tokens: rec.layer_tokens.clone(),
        });
        Ok(s)
    }

    fn restore(
        &self,
        tier: &NvmeTier,
        t: &TierSettings,
        rec: &SessionRecord,
    ) -> ServiceResult<Session> {
        let geometry = geometry_of(&rec.geometry)?;
        let policy = policy_of(&rec.policy);
        let mut kv = KvCache::new(geometry, self.arena_for(rec.owner_uid))?;
        let bt = geometry.block_tokens as u64;
        let tokens = |l: u32| *rec.layer_tokens.get(l as usize).unwrap_or(&0);
        // Every run in the order the cache is rebuilt (layer by layer, block by block), read
        // in batches sized by the devices' tracked rates; the next batch is read and verified
        // while this one is rebuilt (on the store's workers).
        let wanted: Vec<(u32, u32)> = (0..geometry.layers)
            .flat_map(|l| (0..geometry.blocks_for(tokens(l)) as u32).map(move |b| (l, b)))
            .collect();
        let workers = tier.store().workers();
        tier.read_runs_pipelined(rec.id, &wanted, |r, pages| -> ServiceResult<()> {
            // Block by block, a block stays resident while the host tier is below low water
            // (frames_used < frames_total * low_water) and each kept block takes a frame: so
            // the first `room` blocks of the batch are kept, the same blocks as block by block.
            // Nothing else allocates frames during recovery (it runs before the socket
            // opens); if something did, the tier could pass low water by at most one batch
            // (PIPELINE_BATCH_BYTES of pages, at most BULK_BATCH_MAX_PAGES blocks).
            let u = self.arena.usage();
            let low = (u.frames_total as f64 * t.low_water).ceil() as usize;
            let mut room = low.saturating_sub(u.frames_used);
            // The blocks before the first page that failed are restored first, so the error
            // is the one block-by-block restoring would meet first.
            let ok = pages.iter().position(Result::is_err).unwrap_or(pages.len());
            let blocks: Vec<StoredBlock<'_>> = pages[..ok]
                .iter()
                .zip(&wanted[r.start..r.start + ok])
                .map(|(page, &(l, b))| {
                    let keep = room > 0;
                    room -= keep as usize;
                    StoredBlock {
                        layer: l,
                        run: page.as_ref().expect("before the first failure").payload(),
                        valid: (tokens(l) - b as u64 * bt).min(bt) as usize,
                        keep,
                    }
                })
                .collect();
            kv.restore_blocks(&blocks, workers)?;
            match pages.into_iter().nth(ok) {
                Some(Err(e)) => Err(nvme_error(e)),
                _ => Ok(()),
            }
        })?;
        let persisted = (0..geometry.layers)
            .map(|l| kv.tokens(l).expect("layer"))
            .collect();
        let mut s = Session::new(rec.id, rec.owner_uid, rec.label.clone(), policy, kv, true);
        s.state.get_mut().persisted = persisted;
        s.pinned.store(rec.pinned, Ordering::Relaxed);
        Ok(s)
    }

    fn info_of(&self, s: &Session) -> SessionInfo {
        let st = s.state.lock();
        let page = self
            .tier
            .as_ref()
            .map_or(0, |(t, _)| t.store().page_size() as u64);
        let nvme_pages: u64 = if st.stored {
            st.persisted.iter().map(|&t| s.geometry.blocks_for(t)).sum()
        } else {
            0
        };
        SessionInfo {
            session: s.id,
            owner_uid: s.owner_uid,
            label: s.label.clone(),
            geometry: to_wire_geometry(&s.geometry),
            policy: kvtier_protocol::Policy {
                sink_blocks: s.policy.sink_blocks,
                local_blocks: s.policy.local_blocks,
                top_k: s.policy.top_k,
            },
            tokens_min: s.damaged.as_ref().map_or(st.kv.min_tokens(), |d| {
                d.layer_tokens.iter().copied().min().unwrap_or(0)
            }),
            tokens_max: s.damaged.as_ref().map_or(st.kv.max_tokens_stored(), |d| {
                d.layer_tokens.iter().copied().max().unwrap_or(0)
            }),
            blocks: st.kv.blocks() as u64,
            host_bytes: st.kv.host_bytes() as u64,
            nvme_bytes: nvme_pages * page,
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
        self.lookup(peer, id, false)?;
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

    /// Drops a session and its NVMe copy; its frames return to the arena once in-flight
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
            if let (Some((tier, _)), true) = (&self.tier, st.stored) {
                tier.delete_session(id).map_err(nvme_error)?;
                st.stored = false;
            }
            st.closed = true;
            self.sessions.write().remove(&id);
        }
        if let Some(gpu) = &self.gpu {
            let mut g = gpu.lock();
            if g.is_open(id) {
                let _ = g.close(id);
            }
        }
        Ok(())
    }

    /// Copies the NVMe tier's usage and traffic into its metric series (scrape time).
    pub fn refresh_tier_metrics(&self) {
        let (Some(m), Some((tier, _))) = (&self.nvme_metrics, &self.tier) else {
            return;
        };
        let su = tier.store().usage();
        let sum = |f: fn(&kvtier_storage::nvme::store::DeviceUsage) -> u64| -> f64 {
            su.devices.iter().map(f).sum::<u64>() as f64
        };
        m.usage.used_bytes.set(sum(|d| d.bytes_used));
        m.usage.capacity_bytes.set(sum(|d| d.bytes_total));
        m.usage.used_blocks.set(sum(|d| d.pages_used));
        m.usage.capacity_blocks.set(sum(|d| d.pages_total));
        m.read.absolute(su.bytes_read);
        m.written.absolute(su.bytes_written);
        m.counters.checksum_errors.absolute(su.corrupt_pages);
        m.counters.io_errors.absolute(su.io_errors);
    }

    /// The counters and usage STATS and metrics report.
    pub fn snapshot(&self) -> Snapshot {
        let u = self.arena.usage();
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Snapshot {
            ready: self.ready.load(Ordering::Relaxed),
            uptime: self.started.elapsed(),
            started_unix_ms: self.started_unix_ms,
            sessions: self.session_count() as u64,
            host_bytes_used: u.bytes_used() as u64,
            host_bytes_capacity: u.bytes_total() as u64,
            host_frames_used: u.frames_used as u64,
            host_frames_capacity: u.frames_total as u64,
            decode_requests: get(&c.decode_requests),
            decode_entries: get(&c.decode_entries),
            append_tokens: get(&c.append_tokens),
            errors: get(&c.errors),
            rejected: get(&c.rejected),
            bytes_touched: get(&c.bytes_touched),
            selected_tiles: get(&c.selected_tiles),
            append_ns: get(&c.append_ns),
            select_ns: get(&c.select_ns),
            fetch_ns: get(&c.fetch_ns),
            attend_ns: get(&c.attend_ns),
        }
    }

    pub fn stats(&self) -> StatsReply {
        let s = self.snapshot();
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        use extra_stats_keys as x;
        let mut entries = vec![
            (stats_keys::UPTIME_MS, s.uptime.as_millis() as u64),
            (stats_keys::SESSIONS, s.sessions),
            (stats_keys::HOST_BYTES_USED, s.host_bytes_used),
            (stats_keys::HOST_BYTES_CAPACITY, s.host_bytes_capacity),
            (stats_keys::HOST_FRAMES_USED, s.host_frames_used),
            (stats_keys::HOST_FRAMES_CAPACITY, s.host_frames_capacity),
            (stats_keys::DECODE_REQUESTS_TOTAL, s.decode_requests),
            (stats_keys::DECODE_ENTRIES_TOTAL, s.decode_entries),
            (stats_keys::APPEND_TOKENS_TOTAL, s.append_tokens),
            (stats_keys::ERRORS_TOTAL, s.errors),
            (stats_keys::REJECTED_TOTAL, s.rejected),
            (stats_keys::BYTES_TOUCHED_TOTAL, s.bytes_touched),
            (x::READY, s.ready as u64),
            (x::STARTED_UNIX_MS, s.started_unix_ms),
            (x::SELECTED_TILES_TOTAL, s.selected_tiles),
            (x::DECODE_APPEND_NS_TOTAL, s.append_ns),
            (x::DECODE_SELECT_NS_TOTAL, s.select_ns),
            (x::DECODE_FETCH_NS_TOTAL, s.fetch_ns),
            (x::DECODE_ATTEND_NS_TOTAL, s.attend_ns),
        ];
        let mut lanes = Vec::new();
        if let Some((tier, _)) = &self.tier {
            let su = tier.store().usage();
            let used: u64 = su.devices.iter().map(|d| d.bytes_used).sum();
            let total: u64 = su.devices.iter().map(|d| d.bytes_total).sum();
            for (i, d) in su.devices.iter().enumerate() {
                lanes.extend(nvme_lane_stats(i, "read", d.read_lane));
                lanes.extend(nvme_lane_stats(i, "write", d.write_lane));
            }
            entries.extend([
                ("nvme_bytes_used", used),
                ("nvme_bytes_capacity", total),
                ("nvme_devices", su.devices.len() as u64),
                ("nvme_sessions", tier.session_ids().len() as u64),
                ("nvme_read_bytes_total", su.bytes_read),
                ("nvme_written_bytes_total", su.bytes_written),
                ("nvme_checksum_errors_total", su.corrupt_pages),
                ("nvme_io_errors_total", su.io_errors),
                ("demotions_total", get(&c.demotions)),
                ("blocks_demoted_total", get(&c.blocks_demoted)),
                ("blocks_promoted_total", get(&c.blocks_promoted)),
                (
                    "blocks_prefetched_total",
                    self.prefetcher.as_ref().map_or(0, |p| get(&p.promoted)),
                ),
            ]);
        }
        if self.gpu.is_some() {
            entries.extend([
                ("gpu_decode_entries_total", get(&c.gpu_entries)),
                ("gpu_cpu_fallbacks_total", get(&c.gpu_cpu_fallbacks)),
                ("gpu_cold_divergences_total", get(&c.gpu_cold_divergences)),
            ]);
        }
        StatsReply {
            entries: entries
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .chain(lanes)
                .collect(),
        }
    }
}

/// STATS entries of one NVMe device lane's online estimate: `nvme_dev<i>_<op>_bytes_per_s`
/// and `nvme_dev<i>_<op>_latency_ns`, 0 until the device has a timed transfer of that kind.
fn nvme_lane_stats(
    device: usize,
    op: &str,
    lane: Option<kvtier_storage::nvme::plan::Lane>,
) -> [(String, u64); 2] {
    let (bw, lat) = lane.map_or((0, 0), |l| {
        (
            l.bandwidth_bytes_per_s.round() as u64,
            (l.latency_s * 1e9).round() as u64,
        )
    });
    [
        (format!("nvme_dev{device}_{op}_bytes_per_s"), bw),
        (format!("nvme_dev{device}_{op}_latency_ns"), lat),
    ]
}

impl Session {
    /// Runs `f` on the session's KV cache under its lock.
    pub(crate) fn with_kv<R>(&self, f: impl FnOnce(&mut KvCache) -> R) -> R {
        f(&mut self.state.lock().kv)
    }

    fn new(
        id: u64,
        owner_uid: u32,
        label: String,
        policy: Policy,
        kv: KvCache,
        stored: bool,
    ) -> Self {
        let now = now_ms();
        let layers = kv.geometry().layers as usize;
        Session {
            id,
            owner_uid,
            label,
            geometry: *kv.geometry(),
            policy,
            created_unix_ms: now,
            last_access_unix_ms: AtomicU64::new(now),
            pinned: std::sync::atomic::AtomicBool::new(false),
            damaged: None,
            state: Mutex::new(SessionState {
                kv,
                persisted: vec![0; layers],
                stored,
                closed: false,
            }),
        }
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_storage::ArenaOptions;

    fn engine() -> Engine {
        let arena = HostArena::new(&ArenaOptions::new(1 << 20, 4096)).unwrap();
        Engine::new(
            arena,
            EngineLimits {
                max_sessions: 4,
                max_sessions_per_uid: 0,
                host_share_per_uid: 1.0,
                nvme_share_per_uid: 1.0,
                max_reply_bytes: 1 << 20,
                admin_uids: vec![],
                admin_gids: vec![],
            },
        )
    }

    #[test]
    fn a_stuck_session_table_is_not_responsive() {
        let e = engine();
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
        let e = engine();
        let get = |k| e.stats().get(k).unwrap();
        assert_eq!(get(extra_stats_keys::READY), 0, "not ready before serving");
        e.set_ready(true);
        assert_eq!(get(extra_stats_keys::READY), 1);
        e.record_error(ErrorCode::NotFound);
        e.record_rejection(Rejection::QueueFull);
        assert_eq!(get(stats_keys::ERRORS_TOTAL), 1);
        assert_eq!(get(stats_keys::REJECTED_TOTAL), 1);
        assert!(get(extra_stats_keys::STARTED_UNIX_MS) > 1_700_000_000_000);
        for k in extra_stats_keys::ALL.iter().chain(&stats_keys::ALL) {
            assert!(e.stats().get(k).is_some(), "STATS lacks {k}");
        }
    }
}
