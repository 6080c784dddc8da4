//! The data path: appends and decode steps, with the reply bound and the retry after making
//! room. A DECODE is: look up and lock the sessions, run the one decode step
//! (`kvtier_kernels::decode_step`) on the CUDA decoder when every session of the batch is open
//! on it (else, or when it cannot take the batch, on the CPU), reply.

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

/// Frames a decode step may need at most, for making room when the host tier is full: every
/// entry's keep-set (distinct blocks over its kv-heads) and a new block.
pub(super) fn step_frames(sessions: &[Arc<Session>], entries: &[DecodeEntryRef<'_>]) -> usize {
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

impl Engine {
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
        let t0 = Instant::now();
        let mut timings = StageTimings::default();
        let mut on_gpu = self.gpu.is_some();
        let mut made_room = false;
        let report = loop {
            let mut batch: Vec<DecodeEntry<'_>> = guards
                .iter_mut()
                .zip(entries)
                .zip(&queries)
                .zip(&sessions)
                .zip(&sources)
                .map(|((((g, e), q), s), src)| DecodeEntry {
                    session: s.id,
                    kv: &mut g.as_mut().expect("locked above").kv,
                    policy: s.policy,
                    position: e.position,
                    q,
                    k: e.k,
                    v: e.v,
                    cold: src.as_ref().map(|c| c as &dyn ColdSource),
                })
                .collect();
            let r = match (&self.gpu, on_gpu) {
                (Some(gpu), true) => decode_step(
                    &mut *gpu.lock(),
                    layer,
                    &mut batch,
                    &mut out,
                    want_stats,
                    &mut timings,
                ),
                _ => decode_step(&mut Cpu, layer, &mut batch, &mut out, false, &mut timings),
            };
            drop(batch);
            let e = match r {
                Ok(report) => break report,
                Err(KernelError::Unavailable { reason }) => {
                    tracing::debug!(%reason, "the GPU cannot take this step; CPU path");
                    on_gpu = false;
                    continue;
                }
                Err(e) => ServiceError::from(e),
            };
            // Make room by demoting other sessions (not under the device lock), then try once
            // more.
            if e.code != ErrorCode::ResourceExhausted || made_room {
                return Err(e);
            }
            made_room = true;
            if !self.make_room(&ids, step_frames(&sessions, entries)) {
                self.record_rejection(Rejection::HostFull);
                return Err(e);
            }
        };
        self.offer_prefetch(layer, &guards, &sessions, &queries);
        drop(guards);
        self.count_step(&report, on_gpu, &timings, t0.elapsed());
        let hits = report.cache_hits;
        let moved = report.bytes_moved;
        let wire = sessions
            .iter()
            .zip(report.entries)
            .enumerate()
            .map(|(i, (s, st))| {
                // Device counters are per call: a batch reports them on its first entry.
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
            })
            .collect();
        Ok(self.decode_reply(&sessions, &ids, out, wire, want_stats))
    }

    /// Counts a step in the engine's counters and latency metrics.
    fn count_step(&self, r: &StepReport, on_gpu: bool, t: &StageTimings, total: Duration) {
        let c = &self.counters;
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
        self.make_room(ids, 0);
        DecodeReply { entries }
    }

    /// Opens a session on the GPU when the CUDA path supports it (else it stays on the CPU).
    pub(super) fn gpu_open(&self, id: u64, geometry: &Geometry, policy: &Policy) {
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
    pub(super) fn offer_prefetch(
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
                let session = s.clone();
                p.offer(
                    crate::prefetch::Job {
                        session: s.id,
                        policy: s.policy,
                        layer,
                        q: q.clone(),
                    },
                    Box::new(move |f| session.with_kv(|kv| f(kv))),
                );
            }
        }
    }
}
