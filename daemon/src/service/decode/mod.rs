//! The data path: appends and decode steps, with the reply bound and the retry after making
//! room. A DECODE is: look up and lock the sessions, run the one decode step
//! (`kvtier_kernels::decode_step`) on the CUDA decoder when every session of the batch is open
//! on it (else, or when it cannot take the batch, on the CPU), reply.

use std::borrow::Cow;

use kvtier_storage::arena::extent_bytes;

use super::*;

/// The most bytes a DECODE reply body for these entries can take (docs/protocol.md §5.3):
/// the output count, then per entry its outputs and, with stats, the counters and every kv
/// head's keep-set (at most the policy's budget of the blocks the layer will have).
pub(super) fn reply_bound(
    sessions: &[Arc<Session>],
    entries: &[DecodeEntryRef<'_>],
    stats: bool,
) -> u64 {
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

/// Host bytes (whole extents) a decode step may need at most, for making room when the host tier is full: every
/// entry's keep-set (distinct blocks over its kv-heads) and a new block.
pub(super) fn step_bytes(sessions: &[Arc<Session>], positions: &[u64]) -> usize {
    sessions
        .iter()
        .zip(positions)
        .map(|(s, &position)| {
            let keep = s.policy.budget() as usize * s.geometry.kv_heads as usize;
            let blocks = s.geometry.blocks_for(position + 1) as usize;
            (keep.min(blocks) + 1) * extent_bytes(s.geometry.block_bytes())
        })
        .sum()
}

/// How often a decode step makes room and tries again before it answers RESOURCE_EXHAUSTED.
const ROOM_ATTEMPTS: usize = 3;

/// One validated DECODE request. Its K/V rows are borrowed from the request body, and owned
/// ([`Job::into_owned`]) only when the request joins a batch run by another request's thread
/// (see [`super::coalesce`]).
pub(super) struct Job<'a> {
    layer: u32,
    sessions: Vec<Arc<Session>>,
    positions: Vec<u64>,
    queries: Vec<Vec<f32>>,
    ks: Vec<Cow<'a, [u8]>>,
    vs: Vec<Cow<'a, [u8]>>,
    want_stats: bool,
}

impl Job<'_> {
    pub(super) fn into_owned(self) -> Job<'static> {
        let own = |rows: Vec<Cow<'_, [u8]>>| -> Vec<Cow<'static, [u8]>> {
            rows.into_iter()
                .map(|r| Cow::Owned(r.into_owned()))
                .collect()
        };
        Job {
            layer: self.layer,
            sessions: self.sessions,
            positions: self.positions,
            queries: self.queries,
            ks: own(self.ks),
            vs: own(self.vs),
            want_stats: self.want_stats,
        }
    }
}

impl Service {
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
        s.used_now();
        let mut st = s.state.lock();
        lease::check_unreserved(&s, &st)?;
        let need = Self::append_need(&st, start + n_tokens as u64);
        let tails = st.kv.cold_tails();
        self.with_room(&s, need, &mut st, |st| {
            self.promote_tails(&s, st, &tails)?;
            Ok(st.kv.append(start, n_tokens as u64, payload)?)
        })?;
        self.appended(&s, st, start)
    }

    /// Runs `attempt` on a locked session that needs `need` more host bytes (see
    /// [`Self::append_need`]); if the host tier is full, makes room (`make_room`, then
    /// `compact_host` where the free bytes are in pieces) and tries once more. A refusal by
    /// the owner's own share of the tier makes no room: demoting others frees nothing it may
    /// take.
    pub(super) fn with_room<T>(
        &self,
        s: &Session,
        need: usize,
        st: &mut SessionState,
        attempt: impl Fn(&mut SessionState) -> ServiceResult<T>,
    ) -> ServiceResult<T> {
        match attempt(st) {
            Err(e) if e.code == ErrorCode::ResourceExhausted => {
                if self.share_refuses(s.owner_uid, need) {
                    self.record_rejection(Rejection::HostShare);
                    return Err(e);
                }
                let run = st.kv.run_extent_bytes();
                if !self.make_room(&[s.id], need, need)
                    || !self.compact_host(need.div_ceil(run), run)
                {
                    self.record_rejection(Rejection::HostFull);
                    return Err(e);
                }
                attempt(st)
            }
            r => r,
        }
    }

    /// Host bytes an append of the tokens before `end` newly takes: the blocks it opens in
    /// every layer, and the partial tail blocks on NVMe it brings back to write into.
    pub(super) fn append_need(st: &SessionState, end: u64) -> usize {
        let g = st.kv.geometry();
        let blocks =
            (g.blocks_for(end) as usize * g.layers as usize).saturating_sub(st.kv.blocks());
        (blocks + st.kv.cold_tails().len()) * st.kv.run_extent_bytes()
    }

    /// The end of an append (APPEND_KV or COMMIT) of the tokens past `start`: with
    /// write-through they are made durable on NVMe, or the session is cut back to `start` and
    /// the append refused; then they are counted, the lock dropped and room made. Returns the
    /// session's stored tokens.
    pub(super) fn appended(
        &self,
        s: &Session,
        mut st: MutexGuard<'_, SessionState>,
        start: u64,
    ) -> ServiceResult<u64> {
        let nvme = self.tier.as_ref().is_some_and(|(_, t)| t.write_through);
        let written = match nvme {
            true => self
                .persist_locked(s, &mut st, tiering::Write::Serving)
                .map(|_| ())
                .map_err(|e| (e, "not durable")),
            false => Ok(()),
        }
        .and_then(|()| {
            self.append_through_remote(s, &mut st)
                .map_err(|e| (e, "not in the remote tier"))
        });
        if let Err((e, why)) = written {
            st.roll_back(None, start);
            if let Some(gpu) = &self.gpu {
                let _ = gpu.invalidate(s.id);
            }
            return Err(e.context(format_args!("append rolled back, {why}")));
        }
        let tokens = st.kv.min_tokens();
        self.counters
            .append_tokens
            .fetch_add(tokens - start, Ordering::Relaxed);
        drop(st);
        self.make_room(&[s.id], 0, 0);
        Ok(tokens)
    }

    /// One decode step of `layer` for every entry (a batch when several). All-or-nothing.
    /// With `backend.coalesce` (on with a GPU), concurrent requests of one decoder lane run as
    /// one step, one device call, whatever their layers.
    pub fn decode(
        &self,
        peer: &Peer,
        layer: u32,
        want_stats: bool,
        entries: &[DecodeEntryRef<'_>],
    ) -> ServiceResult<DecodeReply> {
        let job = self.prepare(peer, layer, want_stats, entries)?;
        if !self.limits.coalesce {
            return self.run_jobs(&[&job]).map(|mut r| r.remove(0));
        }
        // Any request can join any batch (a batch's step locks the lanes of its sessions);
        // by lane they run at once.
        let lane = self
            .gpu
            .as_ref()
            .and_then(|g| g.lane_of(job.sessions[0].id))
            .unwrap_or(0);
        self.coalescers[lane].submit(job.into_owned(), &|jobs| self.run_coalesced(jobs), &|| {
            Err(ServiceError::internal("the coalesced decode call failed"))
        })
    }

    /// Checks a request (sessions, reply bound, duplicates) and takes its data.
    fn prepare<'a>(
        &self,
        peer: &Peer,
        layer: u32,
        want_stats: bool,
        entries: &[DecodeEntryRef<'a>],
    ) -> ServiceResult<Job<'a>> {
        if entries.is_empty() {
            return Err(ServiceError::invalid("DECODE with no entries"));
        }
        let mut sessions = Vec::with_capacity(entries.len());
        for (i, e) in entries.iter().enumerate() {
            let s = self
                .lookup_live(peer, e.session)
                .map_err(|err| err.context(format_args!("batch entry {i}")))?;
            s.used_now();
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
        Ok(Job {
            layer,
            sessions,
            positions: entries.iter().map(|e| e.position).collect(),
            queries: entries
                .iter()
                .map(|e| kvtier_protocol::f32s_le(e.q).collect())
                .collect(),
            ks: entries.iter().map(|e| Cow::Borrowed(e.k)).collect(),
            vs: entries.iter().map(|e| Cow::Borrowed(e.v)).collect(),
            want_stats,
        })
    }

    /// Answers coalesced requests (of any layers): as one step where their sessions are
    /// distinct (a session in two requests waits for the next group), and each on its own
    /// when the joint step fails, so that one request's error is its own.
    fn run_coalesced(&self, jobs: Vec<Job<'_>>) -> Vec<ServiceResult<DecodeReply>> {
        let mut results: Vec<Option<ServiceResult<DecodeReply>>> =
            (0..jobs.len()).map(|_| None).collect();
        let mut pending: Vec<usize> = (0..jobs.len()).collect();
        while !pending.is_empty() {
            let mut seen = std::collections::HashSet::new();
            let (group, rest): (Vec<usize>, Vec<usize>) = pending.into_iter().partition(|&i| {
                let ids: Vec<u64> = jobs[i].sessions.iter().map(|s| s.id).collect();
                ids.iter().all(|id| !seen.contains(id)) && {
                    seen.extend(ids);
                    true
                }
            });
            let refs: Vec<&Job<'_>> = group.iter().map(|&i| &jobs[i]).collect();
            match self.run_jobs(&refs) {
                Ok(replies) => {
                    if group.len() > 1 {
                        self.counters
                            .decode_coalesced
                            .fetch_add(group.len() as u64, Ordering::Relaxed);
                    }
                    for (&i, r) in group.iter().zip(replies) {
                        results[i] = Some(Ok(r));
                    }
                }
                Err(e) if group.len() == 1 => results[group[0]] = Some(Err(e)),
                // Nothing changed (the step is all-or-nothing): each on its own.
                Err(_) => {
                    for &i in &group {
                        results[i] = Some(self.run_jobs(&[&jobs[i]]).map(|mut r| r.remove(0)));
                    }
                }
            }
            pending = rest;
        }
        results
            .into_iter()
            .map(|r| r.expect("every request answered"))
            .collect()
    }

    /// One decode step over every entry of `jobs` (each at its request's layer, their sessions
    /// distinct): lock the sessions, step on the CUDA decoder when it takes the batch (else on
    /// the CPU), reply to each request.
    fn run_jobs(&self, jobs: &[&Job<'_>]) -> ServiceResult<Vec<DecodeReply>> {
        let layers: Vec<u32> = jobs
            .iter()
            .flat_map(|j| j.sessions.iter().map(|_| j.layer))
            .collect();
        let sessions: Vec<Arc<Session>> = jobs
            .iter()
            .flat_map(|j| j.sessions.iter().cloned())
            .collect();
        let positions: Vec<u64> = jobs
            .iter()
            .flat_map(|j| j.positions.iter().copied())
            .collect();
        let queries: Vec<&Vec<f32>> = jobs.iter().flat_map(|j| &j.queries).collect();
        let ks: Vec<&[u8]> = jobs
            .iter()
            .flat_map(|j| j.ks.iter().map(|k| &**k))
            .collect();
        let vs: Vec<&[u8]> = jobs
            .iter()
            .flat_map(|j| j.vs.iter().map(|v| &**v))
            .collect();
        let want_stats = jobs.iter().any(|j| j.want_stats);
        // Lock in ascending id order (deadlock freedom).
        let mut order: Vec<usize> = (0..sessions.len()).collect();
        order.sort_by_key(|&i| sessions[i].id);
        let mut guards: Vec<Option<MutexGuard<'_, SessionState>>> =
            (0..sessions.len()).map(|_| None).collect();
        for &i in &order {
            let g = sessions[i].state.lock();
            lease::check_unreserved(&sessions[i], &g)?;
            guards[i] = Some(g);
        }
        let ids: Vec<u64> = sessions.iter().map(|s| s.id).collect();
        let sources: Vec<_> = ids
            .iter()
            .zip(&guards)
            .map(|(&id, g)| self.cold_source(id, g.as_ref().expect("locked above")))
            .collect();
        let out_len: usize = sessions
            .iter()
            .map(|s| (s.geometry.q_heads * s.geometry.head_dim) as usize)
            .sum();
        let mut out = vec![0f32; out_len];
        let t0 = Instant::now();
        let mut timings = StageTimings::default();
        let mut on_gpu = self.gpu.is_some();
        // Rooms made so far: the prefetcher may take freed extents before the retry.
        let mut rooms_made = 0;
        let report = loop {
            let mut batch: Vec<DecodeEntry<'_>> = guards
                .iter_mut()
                .zip(&sessions)
                .zip(&sources)
                .enumerate()
                .map(|(i, ((g, s), src))| DecodeEntry {
                    session: s.id,
                    layer: layers[i],
                    kv: &mut g.as_mut().expect("locked above").kv,
                    policy: s.policy,
                    position: positions[i],
                    q: queries[i],
                    k: ks[i],
                    v: vs[i],
                    cold: src.as_ref().map(|c| c as &dyn ColdSource),
                })
                .collect();
            let r = match (self.gpu.as_ref(), on_gpu) {
                (Some(mut gpu), true) => {
                    decode_step(&mut gpu, &mut batch, &mut out, want_stats, &mut timings)
                }
                _ => decode_step(&mut Cpu, &mut batch, &mut out, false, &mut timings),
            };
            drop(batch);
            let e = match r {
                Ok(report) => break report,
                Err(KernelError::Unavailable { reason }) => {
                    tracing::debug!(%reason, "the GPU cannot take this step; CPU path");
                    on_gpu = false;
                    continue;
                }
                Err(e) => e,
            };
            // What the step could not place (a run promoted or opened); step_bytes bounds what
            // the whole step may take.
            let (runs, run_bytes) = match e.root() {
                KernelError::Storage(StorageError::ArenaFull {
                    wanted, run_bytes, ..
                }) => (*wanted, *run_bytes),
                _ => (0, 0),
            };
            let short = runs * run_bytes;
            let e = ServiceError::from(e);
            // Make room by demoting other sessions (not under the device lock), then try again.
            if e.code != ErrorCode::ResourceExhausted || rooms_made == ROOM_ATTEMPTS {
                return Err(e);
            }
            rooms_made += 1;
            let want = step_bytes(&sessions, &positions);
            if !self.make_room(&ids, if short > 0 { short } else { want }, want)
                || (runs > 0 && !self.compact_host(runs, run_bytes))
            {
                self.record_rejection(Rejection::HostFull);
                return Err(e);
            }
        };
        // With remote.write_through, each session's new token goes to the cluster before the
        // reply; one that cannot be written is rolled back (its layer cut back to where the
        // step found it) and the whole request refused, as if no entry had been appended.
        let mut unwritten = None;
        for (i, s) in sessions.iter().enumerate() {
            let st = guards[i].as_mut().expect("locked above");
            if let Err(e) = self.append_through_remote(s, st) {
                unwritten = Some(e);
                break;
            }
        }
        if let Some(e) = unwritten {
            for (i, s) in sessions.iter().enumerate() {
                let st = guards[i].as_mut().expect("locked above");
                st.roll_back(Some(layers[i] as usize), positions[i]);
                if let Some(gpu) = &self.gpu {
                    let _ = gpu.invalidate(s.id);
                }
            }
            return Err(e.context("decode rolled back, not in the remote tier"));
        }
        self.offer_prefetch(&layers, &guards, &sessions, &queries);
        drop(guards);
        self.count_step(&report, on_gpu, &timings, t0.elapsed());
        // Device counters are per call: they go to the call's first entry.
        let hits = report.cache_hits;
        let moved = report.bytes_moved;
        let mut wire = sessions
            .iter()
            .zip(report.entries)
            .enumerate()
            .map(|(i, (s, st))| {
                let (hits, moved) = if i == 0 { (hits as u32, moved) } else { (0, 0) };
                // Blocks promoted for this step, counted as tiles of every kv-head.
                let nvme_tiles = (st.blocks_promoted * s.geometry.kv_heads).min(st.tiles_selected);
                DecodeStats {
                    blocks_total: st.blocks_total,
                    blocks_selected: st.tiles_selected,
                    bytes_touched: st.bytes_touched,
                    bytes_moved: moved + st.bytes_promoted,
                    cache_hits: hits,
                    blocks_ram: st.tiles_selected.saturating_sub(hits + nvme_tiles),
                    blocks_nvme: nvme_tiles,
                    selected: st
                        .keep
                        .map(|k| (0..k.heads()).map(|h| k.head(h).to_vec()).collect())
                        .unwrap_or_default(),
                }
            });
        // Each request its own outputs and stats, in order.
        let mut at = 0;
        let mut replies = Vec::with_capacity(jobs.len());
        for j in jobs {
            let n = j.sessions.len();
            let len: usize = j
                .sessions
                .iter()
                .map(|s| (s.geometry.q_heads * s.geometry.head_dim) as usize)
                .sum();
            let stats: Vec<DecodeStats> = wire.by_ref().take(n).collect();
            let o: Vec<f32> = out.drain(..len).collect();
            replies.push(self.decode_reply(&j.sessions, &ids[at..at + n], o, stats, j.want_stats));
            at += n;
        }
        Ok(replies)
    }

    /// Counts a step in the service's counters and latency metrics.
    fn count_step(&self, r: &StepReport, on_gpu: bool, t: &StageTimings, total: Duration) {
        let c = &self.counters;
        c.decode_steps.fetch_add(1, Ordering::Relaxed);
        c.append_ns.fetch_add(t.append_ns, Ordering::Relaxed);
        c.select_ns.fetch_add(t.select_ns, Ordering::Relaxed);
        c.fetch_ns.fetch_add(t.fetch_ns, Ordering::Relaxed);
        c.attend_ns.fetch_add(t.attend_ns, Ordering::Relaxed);
        self.metrics.decode_timings(t, total);
        if let Some(h) = &self.fetch_seconds {
            h.record(t.fetch_ns as f64 * 1e-9);
        }
        let promoted: u64 = r.entries.iter().map(|s| s.blocks_promoted as u64).sum();
        c.blocks_promoted.fetch_add(promoted, Ordering::Relaxed);
        if on_gpu {
            if r.cpu_fallback {
                c.gpu_cpu_fallbacks.fetch_add(1, Ordering::Relaxed);
            } else {
                c.gpu_entries
                    .fetch_add(r.entries.len() as u64, Ordering::Relaxed);
            }
            c.gpu_cold_divergences
                .fetch_add(r.cold_divergences as u64, Ordering::Relaxed);
        }
    }

    /// Counts a finished step and splits its output per entry.
    pub(super) fn decode_reply(
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
        self.make_room(ids, 0, 0);
        DecodeReply { entries }
    }

    /// Opens a session on the GPU when the CUDA path supports it (else it stays on the CPU).
    pub(super) fn gpu_open(&self, id: u64, geometry: &Geometry, policy: &Policy) {
        if let Some(gpu) = &self.gpu {
            if gpu.supports(geometry, policy) {
                if let Err(e) = gpu.open(id, geometry, policy) {
                    tracing::info!(session = id, error = %e, "session stays on the CPU backend");
                }
            }
        }
    }

    /// Drops the session's device state, if the CUDA decoder holds any.
    pub(super) fn gpu_close(&self, id: u64) {
        if let Some(gpu) = &self.gpu {
            if gpu.is_open(id) {
                let _ = gpu.close(id);
            }
        }
    }

    /// Sessions still partly on NVMe: read the runners-up of each entry's layer in the
    /// background.
    pub(super) fn offer_prefetch(
        &self,
        layers: &[u32],
        guards: &[Option<MutexGuard<'_, SessionState>>],
        sessions: &[Arc<Session>],
        queries: &[&Vec<f32>],
    ) {
        let Some(p) = &self.prefetcher else {
            return;
        };
        for (((g, s), q), &layer) in guards.iter().zip(sessions).zip(queries).zip(layers) {
            let st = g.as_ref().expect("locked");
            if st.kv.extents() < st.kv.blocks() {
                let session = s.clone();
                p.offer(
                    crate::prefetch::Job {
                        session: s.id,
                        policy: s.policy,
                        layer,
                        q: q.to_vec(),
                    },
                    Box::new(move |f| session.with_kv(|kv| f(kv))),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests;
