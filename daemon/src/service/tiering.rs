//! The NVMe tier's policy: what is written when (write-through, DEMOTE, memory pressure,
//! shutdown), PROMOTE and PIN, the per-uid NVMe share, and the wire codes of its failures.

use std::collections::HashSet;

use super::*;

pub(super) fn nvme_error(e: NvmeError) -> ServiceError {
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

/// The blocks a write of the session would put in a tier whose copy holds `persisted` tokens
/// per layer (its durable watermark): those holding tokens past it. A layer with none has
/// nothing to write, though its partial tail block (durable, and perhaps demoted since)
/// starts at or after `persisted / block_tokens`.
pub(super) fn dirty_blocks(
    geo: &Geometry,
    kv: &KvCache,
    persisted: &[u64],
) -> ServiceResult<Vec<(u32, u32)>> {
    let bt = geo.block_tokens as u64;
    let mut out = Vec::new();
    for l in 0..geo.layers {
        let persisted = persisted[l as usize];
        if kv.tokens(l)? == persisted {
            continue;
        }
        let blocks = kv.layer(l)?.blocks() as u32;
        out.extend(((persisted / bt) as u32..blocks).map(|b| (l, b)));
    }
    Ok(out)
}

/// The manifest record of a session as it stands (pages left to the tier that stores it).
pub(super) fn record_of(s: &Session, kv: &KvCache) -> SessionRecord {
    let geo = s.geometry;
    SessionRecord {
        id: s.id,
        owner_uid: s.owner_uid,
        label: s.label.clone(),
        geometry: (&geo).into(),
        policy: (&s.policy).into(),
        layer_tokens: (0..geo.layers)
            .map(|l| kv.tokens(l).expect("layer exists"))
            .collect(),
        pages: Vec::new(),
        pinned: s.pinned.load(Ordering::Relaxed),
        created_unix_ms: s.created_unix_ms,
    }
}

/// Blocks per NVMe write of a session still arriving from the remote tier (64 MiB of
/// Qwen2.5-7B's 256 KiB runs read from the cluster at a time).
const ARRIVING_BATCH: usize = 256;

/// Whether a write to NVMe may take the room other uids' sessions need at shutdown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Write {
    /// A write while serving (write-through, DEMOTE, memory pressure): see
    /// [`Service::check_nvme_room`].
    Serving,
    /// The clean shutdown's: every session is written, in [`Service::persist_all`]'s order.
    Shutdown,
}

impl Service {
    /// Refuses a write that would take `s`'s owner past its share of the NVMe tier
    /// (`quota.nvme_share_per_uid`), or, while serving, one by an owner holding more than an
    /// equal split of the tier (among the uids with sessions) that would leave less free than
    /// other uids' unwritten blocks need at a clean shutdown: one user cannot fill the disk
    /// the others' sessions are written to. Admins are exempt.
    pub(super) fn check_nvme_room(
        &self,
        tier: &NvmeTier,
        s: &Session,
        runs: &[BlockRun<'_>],
        write: Write,
    ) -> ServiceResult<()> {
        if runs.is_empty() || self.limits.admin_uids.contains(&s.owner_uid) {
            return Ok(());
        }
        let store = tier.store();
        let total: u64 = store.usage().devices.iter().map(|d| d.bytes_total).sum();
        // What the owner's pages would come to: a scan of the manifest, done at most once.
        let after = std::cell::OnceCell::new();
        let after = || *after.get_or_init(|| tier.owner_bytes_after(s.owner_uid, s.id, runs));
        let share = self.limits.nvme_share_per_uid;
        let limit = (total as f64 * share).floor() as u64;
        if share < 1.0 && after() > limit {
            return Err(ServiceError::exhausted(format!(
                "uid {} would reference {} bytes of NVMe pages, more than its quota of {limit} (quota.nvme_share_per_uid)",
                s.owner_uid,
                after()
            )));
        }
        if write == Write::Shutdown {
            return Ok(());
        }
        let adding: u64 = runs.iter().map(|r| store.page_bytes(r.bytes.len())).sum();
        let free_after = store.free_bytes().saturating_sub(adding);
        // Unwritten blocks are resident, so a page for every resident run bounds what any
        // shutdown needs: with that much left free (the usual case), no scan of the sessions.
        let u = self.arena.usage();
        let per_run = store.page_bytes(0) + store.unit() as u64;
        if free_after >= u.bytes_used as u64 + u.extents_used as u64 * per_run {
            return Ok(());
        }
        // Other uids' sessions (a busy one is skipped: it is being written or decoded now).
        let (holders, others) = {
            let table = self.sessions.read();
            let holders: HashSet<u32> = table.values().map(|o| o.owner_uid).collect();
            let others: u64 = table
                .values()
                .filter(|o| o.owner_uid != s.owner_uid && o.damaged.is_none())
                .filter_map(|o| {
                    let st = o.state.try_lock()?;
                    let blocks =
                        dirty_blocks(&o.geometry, &st.kv, &st.persisted).ok()?.len() as u64;
                    Some(blocks * store.page_bytes(o.geometry.block_bytes()))
                })
                .sum();
            (holders.len().max(1) as u64, others)
        };
        if after() > total / holders && free_after < others {
            return Err(ServiceError::exhausted(format!(
                "uid {} holds more than an equal split of the NVMe tier ({} of {total} bytes among {holders} uids); writing {adding} more bytes would leave {free_after} free, less than the {others} other users' sessions need at shutdown",
                s.owner_uid,
                after()
            )));
        }
        Ok(())
    }

    pub(super) fn promote_tails(
        &self,
        s: &Session,
        st: &mut SessionState,
        tails: &[(u32, u32)],
    ) -> ServiceResult<()> {
        if tails.is_empty() {
            return Ok(());
        }
        let src = self
            .cold_source(s.id, st)
            .ok_or_else(|| ServiceError::internal("cold blocks without a colder tier"))?;
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
    pub(super) fn persist_locked(
        &self,
        s: &Session,
        st: &mut SessionState,
        write: Write,
    ) -> ServiceResult<usize> {
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
        let dirty = dirty_blocks(&geo, &st.kv, &st.persisted)?;
        if dirty.is_empty() && st.stored {
            return Ok(0);
        }
        // A session still arriving from the remote tier has blocks only there: they are read
        // a batch at a time, each batch committed with the tokens it completes, so memory holds
        // one batch of the session, never all of it.
        let batch = match &st.arriving {
            Some(a) if dirty.iter().any(|&(l, b)| a.contains(l, b)) => ARRIVING_BATCH,
            _ => dirty.len().max(1),
        };
        let chunks: Vec<&[(u32, u32)]> = match dirty.is_empty() {
            true => vec![&[]],
            false => dirty.chunks(batch).collect(),
        };
        let last = chunks.len() - 1;
        for (i, chunk) in chunks.into_iter().enumerate() {
            let arrived = self.arriving_runs(st, chunk)?.unwrap_or_default();
            let mut runs = Vec::with_capacity(chunk.len());
            for &(l, b) in chunk {
                // Appends promote a cold tail before writing into it, so a block with
                // undurable tokens is resident (or still arriving); a cold one here is a
                // bookkeeping bug, answered as an error rather than a panic that would lose
                // every session not yet written.
                let bytes = st.kv.run(l, b).or(arrived.get(l, b)).ok_or_else(|| {
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
            let mut record = record_of(s, &st.kv);
            if let (Some(&(ll, lb)), false) = (chunk.last(), i == last) {
                // Layers past `ll` keep what NVMe held; `ll` holds its blocks up to `lb`.
                let through = (lb as u64 + 1) * geo.block_tokens as u64;
                record.layer_tokens[ll as usize] = record.layer_tokens[ll as usize].min(through);
                for l in ll as usize + 1..record.layer_tokens.len() {
                    record.layer_tokens[l] = st.persisted[l];
                }
            }
            self.put_nvme(tier, s, &record, &runs, write)?;
            drop(runs);
            st.persisted = record.layer_tokens;
            st.stored = true;
        }
        Ok(dirty.len())
    }

    /// Writes `runs` of `s` and its `record` to NVMe, within the owner's share; a page store
    /// found full moves idle sessions to the remote tier (if any) and is tried once more.
    fn put_nvme(
        &self,
        tier: &NvmeTier,
        s: &Session,
        record: &SessionRecord,
        runs: &[BlockRun<'_>],
        write: Write,
    ) -> ServiceResult<()> {
        self.check_nvme_room(tier, s, runs, write)?;
        match tier.put_session(record, runs) {
            Err(NvmeError::Full { .. } | NvmeError::NoSpace { .. })
                if write == Write::Serving
                    && self.demote_to_remote(
                        s.id,
                        runs.iter()
                            .map(|r| tier.store().page_bytes(r.bytes.len()))
                            .sum(),
                    ) =>
            {
                tier.put_session(record, runs).map_err(nvme_error)?
            }
            r => r.map_err(nvme_error)?,
        };
        Ok(())
    }

    /// Persists the session and frees every host extent it holds; returns the extents freed.
    pub(super) fn demote_locked(&self, s: &Session, st: &mut SessionState) -> ServiceResult<usize> {
        s.check_unleased("demoting it")?;
        self.persist_locked(s, st, Write::Serving)?;
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

    /// DEMOTE: write the session to NVMe and free its host extents.
    pub fn demote(&self, peer: &Peer, id: u64) -> ServiceResult<u64> {
        let s = self.lookup_live(peer, id)?;
        if s.pinned.load(Ordering::Relaxed) {
            return Err(ServiceError::precondition(format!(
                "session {id} is pinned; UNPIN it first"
            )));
        }
        let mut st = s.state.lock();
        let freed = self.demote_locked(&s, &mut st)?;
        tracing::info!(session = id, extents = freed, "session demoted");
        Ok(freed as u64)
    }

    /// PROMOTE: read every cold block of the session back into the host tier.
    pub fn promote(&self, peer: &Peer, id: u64) -> ServiceResult<u64> {
        let s = self.lookup_live(peer, id)?;
        let mut st = s.state.lock();
        let Some(src) = self.cold_source(id, &st) else {
            return Ok(0);
        };
        // Every block not resident is read back into an extent of its own.
        let need = (st.kv.blocks() - st.kv.extents()) * st.kv.run_extent_bytes();
        // What an attempt promoted stays promoted: a retry reads only what is still cold.
        let n = std::cell::Cell::new(0);
        self.with_room(&s, need, &mut st, |st| {
            for l in 0..s.geometry.layers {
                let all: Vec<u32> = (0..st.kv.layer(l)?.blocks() as u32).collect();
                n.set(n.get() + st.kv.promote(l, &all, &src)?);
            }
            Ok(())
        })?;
        let n = n.get();
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

    /// Makes room in the host tier for a request of `exclude`'s owner (the requester) that
    /// needs `need` more bytes, or, with `need` 0, brings the tier back under its low-water
    /// mark once it is above the high-water mark. Demotes least recently used, unpinned,
    /// unleased sessions not in `exclude`, but only those it may: the requester's own, and
    /// (unless the requester is itself over its fair share) those of uids over their fair
    /// share, which go first. A uid within its share never loses residency to another uid.
    /// For a request, it frees until `want` bytes (an estimate, at least `need`) fit with the
    /// tier at its low-water mark, and nothing at all when even every session it may demote
    /// would not free `need`. Returns whether `need` bytes are free (perhaps in pieces:
    /// `compact_host` places runs there).
    ///
    /// It only `try_lock`s sessions (the requester holds its own lock: waiting on another's
    /// could deadlock), so a session being decoded or prefetched is passed over. A request
    /// that only such sessions could satisfy tries again for up to [`BUSY_WAIT`]: they are
    /// free again within one read.
    pub(super) fn make_room(&self, exclude: &[u64], need: usize, want: usize) -> bool {
        let deadline = Instant::now() + BUSY_WAIT;
        loop {
            match self.make_room_once(exclude, need, want) {
                Room::Fits => return true,
                Room::Busy if need > 0 && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(1))
                }
                Room::Busy | Room::Short => return false,
            }
        }
    }

    /// One pass of [`Self::make_room`].
    fn make_room_once(&self, exclude: &[u64], need: usize, want: usize) -> Room {
        let want = want.max(need);
        let u = self.arena.usage();
        let Some((_, t)) = &self.tier else {
            // Nothing can be demoted; the free bytes may still hold it (in pieces: compaction).
            return match u.bytes_total - u.bytes_used >= need {
                true => Room::Fits,
                false => Room::Short,
            };
        };
        let total = u.bytes_total;
        let free = |used: usize| total - used;
        let above_high = u.bytes_used as f64 >= total as f64 * t.high_water;
        if free(u.bytes_used) >= want && (want > 0 || !above_high) {
            return Room::Fits;
        }
        if need > total {
            return Room::Short;
        }
        let over = self.over_fair_share();
        let candidates: Vec<Arc<Session>> = {
            let table = self.sessions.read();
            let requester = exclude
                .first()
                .and_then(|id| table.get(id))
                .map(|s| s.owner_uid);
            let requester_over = requester.is_some_and(|r| over.contains(&r));
            table
                .values()
                .filter(|s| {
                    !exclude.contains(&s.id) && !s.pinned.load(Ordering::Relaxed) && s.leases() == 0
                })
                .filter(|s| {
                    Some(s.owner_uid) == requester
                        || (!requester_over && over.contains(&s.owner_uid))
                })
                .cloned()
                .collect()
        };
        // What demoting all of them would free: a request they cannot satisfy demotes nothing.
        // A busy one (being decoded, prefetched) may free anything once it is not.
        let mut busy = false;
        let mut resident: Vec<(Arc<Session>, usize)> = candidates
            .into_iter()
            .filter_map(|s| {
                let Some(st) = s.state.try_lock() else {
                    busy = true;
                    return None;
                };
                let bytes = st.kv.extents() * st.kv.run_extent_bytes();
                drop(st);
                (bytes > 0).then_some((s, bytes))
            })
            .collect();
        let demotable: usize = resident.iter().map(|(_, b)| b).sum();
        if need > 0 && !busy && free(u.bytes_used) + demotable < need {
            return Room::Short;
        }
        resident.sort_by_key(|(s, _)| {
            (
                !over.contains(&s.owner_uid),
                s.last_access_unix_ms.load(Ordering::Relaxed),
            )
        });
        // A request is done once it fits and leaves the tier at its low-water mark, as the
        // pressure pass after it would (the slack keeps the prefetcher's promotions from
        // taking the room back before the retry).
        let low = |used: usize| used as f64 <= total as f64 * t.low_water;
        let done = |used: usize| {
            if want > 0 {
                free(used) >= want && low(used + want)
            } else {
                low(used)
            }
        };
        for (s, _) in resident {
            if done(self.arena.usage().bytes_used) {
                break;
            }
            let Some(mut st) = s.state.try_lock() else {
                busy = true;
                continue;
            };
            if st.kv.extents() == 0 {
                continue;
            }
            match self.demote_locked(&s, &mut st) {
                Ok(n) => {
                    tracing::info!(session = s.id, extents = n, "demoted under memory pressure")
                }
                Err(e) => tracing::warn!(session = s.id, error = %e, "demotion failed"),
            }
        }
        match free(self.arena.usage().bytes_used) >= need {
            true => Room::Fits,
            false if busy => Room::Busy,
            false => Room::Short,
        }
    }

    /// Writes every session to NVMe (clean shutdown), so a restart finds them all.
    pub fn persist_all(&self) -> (usize, usize) {
        if self.tier.is_none() {
            return (0, 0);
        }
        let mut all: Vec<Arc<Session>> = self.sessions.read().values().cloned().collect();
        // The uids holding least of the tier are written first, so one that filled it cannot
        // take the others' room at shutdown.
        if let Some((tier, _)) = &self.tier {
            let held = tier.bytes_by_owner();
            all.sort_by_key(|s| (held.get(&s.owner_uid).copied().unwrap_or(0), s.owner_uid));
        }
        let (mut ok, mut failed) = (0, 0);
        // A damaged session's record stays on NVMe as it was.
        for s in all.into_iter().filter(|s| s.damaged.is_none()) {
            let mut st = s.state.lock();
            match self.persist_locked(&s, &mut st, Write::Shutdown) {
                Ok(_) => ok += 1,
                Err(e) => {
                    failed += 1;
                    tracing::error!(session = s.id, error = %e, "could not persist session at shutdown");
                }
            }
        }
        (ok, failed)
    }
}

/// How long a request waits for sessions [`Service::make_room`] had to pass over (being
/// decoded or prefetched) before it is refused.
pub(super) const BUSY_WAIT: Duration = Duration::from_millis(500);

/// What one pass of making room ended with.
enum Room {
    /// `need` bytes are free.
    Fits,
    /// Not free, and sessions that might have freed them were busy.
    Busy,
    /// Not free, and nothing it may demote would free them.
    Short,
}

#[cfg(test)]
mod tests;
