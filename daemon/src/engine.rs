//! The daemon's state and the semantics of every operation, independent of the socket: sessions
//! (ownership, admission), appends, batched decode steps, and the counters behind STATS.
//!
//! Locking: the session table is a read-write lock held only to look sessions up; each session's
//! KV cache has its own mutex, held for the duration of one append or decode. A batch decode
//! locks its sessions in ascending id order, so two batches can never deadlock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::{Mutex, MutexGuard, RwLock};

use kvtier_kernels::{decode_layer_timed, DecodeEntry, StageTimings};
use kvtier_protocol::{
    stats_keys, CreateSessionRequest, DecodeEntryRef, DecodeOutput, DecodeReply, DecodeStats,
    ErrorCode, SessionInfo, StatsReply,
};
use kvtier_storage::{DType, Geometry, HostArena, KvCache, Policy};

use crate::error::{ServiceError, ServiceResult};
use crate::metrics::{Metrics, Rejection};

/// STATS keys tierd reports beyond the protocol's initial set (docs/protocol.md §5.7).
pub mod extra_stats_keys {
    /// 1 while the daemon accepts requests, 0 once shutdown has begun (draining).
    pub const READY: &str = "ready";
    /// Wall-clock start time, ms since the Unix epoch.
    pub const STARTED_UNIX_MS: &str = "started_unix_ms";
    /// Selected (block, kv-head) tiles over all decode entries.
    pub const SELECTED_TILES_TOTAL: &str = "selected_tiles_total";
    /// Summed wall time of DECODE requests' stages, ns (divide by decode_requests_total).
    pub const DECODE_APPEND_NS_TOTAL: &str = "decode_append_ns_total";
    pub const DECODE_SELECT_NS_TOTAL: &str = "decode_select_ns_total";
    pub const DECODE_ATTEND_NS_TOTAL: &str = "decode_attend_ns_total";

    pub const ALL: [&str; 6] = [
        READY,
        STARTED_UNIX_MS,
        SELECTED_TILES_TOTAL,
        DECODE_APPEND_NS_TOTAL,
        DECODE_SELECT_NS_TOTAL,
        DECODE_ATTEND_NS_TOTAL,
    ];
}

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
    pub admin_uids: Vec<u32>,
    pub admin_gids: Vec<u32>,
}

/// One session: its identity, policy and KV cache.
pub struct Session {
    pub id: u64,
    pub owner_uid: u32,
    pub label: String,
    pub geometry: Geometry,
    pub policy: Policy,
    pub created_unix_ms: u64,
    last_access_unix_ms: AtomicU64,
    kv: Mutex<KvCache>,
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
    pub selected_tiles: AtomicU64,
    pub append_ns: AtomicU64,
    pub select_ns: AtomicU64,
    pub attend_ns: AtomicU64,
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
    pub attend_ns: u64,
}

pub struct Engine {
    limits: EngineLimits,
    arena: HostArena,
    sessions: RwLock<HashMap<u64, Arc<Session>>>,
    next_id: AtomicU64,
    pub counters: Counters,
    metrics: Metrics,
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
        Engine {
            limits,
            arena,
            sessions: RwLock::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            counters: Counters::default(),
            metrics: Metrics::disabled(),
            ready: AtomicBool::new(false),
            started: Instant::now(),
            started_unix_ms: now_ms(),
        }
    }

    /// Records into `metrics` from now on.
    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
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

    pub fn session_count(&self) -> usize {
        self.sessions.read().len()
    }

    /// Looks a session up for `peer`: NOT_FOUND if absent, PERMISSION_DENIED if another uid's
    /// (admins may read any session, `admin_ok`).
    fn lookup(&self, peer: &Peer, id: u64, admin_ok: bool) -> ServiceResult<Arc<Session>> {
        let s = self
            .sessions
            .read()
            .get(&id)
            .cloned()
            .ok_or_else(|| ServiceError::not_found(id))?;
        if s.owner_uid != peer.uid && !(admin_ok && self.is_admin(peer)) {
            return Err(ServiceError::denied(format!(
                "session {id} belongs to another user"
            )));
        }
        s.last_access_unix_ms.store(now_ms(), Ordering::Relaxed);
        Ok(s)
    }

    pub fn create(&self, peer: &Peer, req: &CreateSessionRequest) -> ServiceResult<u64> {
        let geometry = to_geometry(&req.geometry);
        let policy = Policy {
            sink_blocks: req.policy.sink_blocks,
            local_blocks: req.policy.local_blocks,
            top_k: req.policy.top_k,
        };
        policy.validate()?;
        let kv = KvCache::new(geometry, self.arena.clone())?;
        let mut sessions = self.sessions.write();
        if sessions.len() >= self.limits.max_sessions {
            self.record_rejection(Rejection::SessionLimit);
            return Err(ServiceError::exhausted(format!(
                "session limit reached ({} sessions; admission.max_sessions)",
                self.limits.max_sessions
            )));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let now = now_ms();
        sessions.insert(
            id,
            Arc::new(Session {
                id,
                owner_uid: peer.uid,
                label: req.label.clone(),
                geometry,
                policy,
                created_unix_ms: now,
                last_access_unix_ms: AtomicU64::new(now),
                kv: Mutex::new(kv),
            }),
        );
        tracing::info!(session = id, uid = peer.uid, label = %req.label, ?geometry, ?policy, "session created");
        Ok(id)
    }

    /// Appends `n_tokens` to every layer of a session; returns its new length.
    pub fn append(
        &self,
        peer: &Peer,
        id: u64,
        start: u64,
        n_tokens: u32,
        payload: &[u8],
    ) -> ServiceResult<u64> {
        let s = self.lookup(peer, id, false)?;
        let mut kv = s.kv.lock();
        kv.append(start, n_tokens as u64, payload)
            .inspect_err(|e| {
                if matches!(e, kvtier_storage::StorageError::ArenaFull { .. }) {
                    self.record_rejection(Rejection::HostFull);
                }
            })?;
        self.counters
            .append_tokens
            .fetch_add(n_tokens as u64, Ordering::Relaxed);
        Ok(kv.min_tokens())
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
            let s = self.lookup(peer, e.session, false).map_err(|err| {
                ServiceError::new(err.code, format!("batch entry {i}: {}", err.message))
            })?;
            sessions.push(s);
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
        let mut guards: Vec<Option<MutexGuard<'_, KvCache>>> =
            (0..entries.len()).map(|_| None).collect();
        for &i in &order {
            guards[i] = Some(sessions[i].kv.lock());
        }
        let queries: Vec<Vec<f32>> = entries
            .iter()
            .map(|e| kvtier_protocol::f32s_le(e.q).collect())
            .collect();
        let mut batch: Vec<DecodeEntry<'_>> = guards
            .iter_mut()
            .zip(entries)
            .zip(&queries)
            .zip(&sessions)
            .map(|(((g, e), q), s)| DecodeEntry {
                kv: g.as_mut().expect("locked above"),
                policy: s.policy,
                position: e.position,
                q,
                k: e.k,
                v: e.v,
            })
            .collect();
        let out_len: usize = sessions
            .iter()
            .map(|s| (s.geometry.q_heads * s.geometry.head_dim) as usize)
            .sum();
        let mut out = vec![0f32; out_len];
        let t0 = Instant::now();
        let mut timings = StageTimings::default();
        let stats =
            decode_layer_timed(layer, &mut batch, &mut out, &mut timings).inspect_err(|e| {
                if matches!(
                    e.root(),
                    kvtier_kernels::KernelError::Storage(
                        kvtier_storage::StorageError::ArenaFull { .. }
                    )
                ) {
                    self.record_rejection(Rejection::HostFull);
                }
            })?;
        drop(batch);
        drop(guards);
        let c = &self.counters;
        c.append_ns.fetch_add(timings.append_ns, Ordering::Relaxed);
        c.select_ns.fetch_add(timings.select_ns, Ordering::Relaxed);
        c.attend_ns.fetch_add(timings.attend_ns, Ordering::Relaxed);
        self.metrics.decode_timings(&timings, t0.elapsed());
        let mut tiles = 0u64;
        for st in &stats {
            tiles += st.tiles_selected as u64;
            if st.keep.heads() > 0 {
                self.metrics.keep_set(st.keep.head(0).len());
            }
        }
        c.selected_tiles.fetch_add(tiles, Ordering::Relaxed);
        self.counters
            .decode_requests
            .fetch_add(1, Ordering::Relaxed);
        self.counters
            .decode_entries
            .fetch_add(entries.len() as u64, Ordering::Relaxed);
        let touched: u64 = stats.iter().map(|s| s.bytes_touched).sum();
        self.counters
            .bytes_touched
            .fetch_add(touched, Ordering::Relaxed);
        let mut at = 0;
        let reply = sessions
            .iter()
            .zip(stats)
            .map(|(s, st)| {
                let n = (s.geometry.q_heads * s.geometry.head_dim) as usize;
                let o = out[at..at + n].to_vec();
                at += n;
                DecodeOutput {
                    out: o,
                    stats: want_stats.then(|| DecodeStats {
                        blocks_total: st.blocks_total,
                        blocks_selected: st.tiles_selected,
                        bytes_touched: st.bytes_touched,
                        // The CPU backend attends in place: nothing crosses a tier boundary.
                        bytes_moved: 0,
                        cache_hits: 0,
                        blocks_ram: st.tiles_selected,
                        blocks_nvme: 0,
                        selected: (0..st.keep.heads())
                            .map(|h| st.keep.head(h).to_vec())
                            .collect(),
                    }),
                }
            })
            .collect();
        Ok(DecodeReply { entries: reply })
    }

    fn info_of(&self, s: &Session) -> SessionInfo {
        let kv = s.kv.lock();
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
            tokens_min: kv.min_tokens(),
            tokens_max: kv.max_tokens_stored(),
            blocks: kv.frames() as u64,
            host_bytes: kv.host_bytes() as u64,
            nvme_bytes: 0,
            pinned: false,
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
        self.remove(id);
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
        self.remove(id);
        tracing::info!(session = id, uid = peer.uid, "session evicted");
        Ok(())
    }

    /// Drops a session; its frames return to the arena once in-flight requests release it.
    fn remove(&self, id: u64) {
        self.sessions.write().remove(&id);
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
            attend_ns: get(&c.attend_ns),
        }
    }

    pub fn stats(&self) -> StatsReply {
        let s = self.snapshot();
        use extra_stats_keys as x;
        let entries = vec![
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
            (x::DECODE_ATTEND_NS_TOTAL, s.attend_ns),
        ];
        StatsReply {
            entries: entries
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
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
