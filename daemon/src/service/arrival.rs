//! Sessions whose blocks are in the remote tier and not here: resumed before their runs
//! arrive, or moved there from NVMe under pressure.
//!
//! A resume reads the session's record and every block's summary (its bounds and sketches,
//! 1.6% of the runs' bytes, 18% with sketches) and serves the session at once: selection runs
//! over the summaries as it always does, and the keep-set's blocks that are still only in the
//! cluster are read from it on demand, as cold blocks are from NVMe (the selector as
//! prefetcher). The rest streams in from the cluster in the background
//! ([`Service::stream_arrivals`]) while the host tier has room; what does not fit stays in
//! the cluster, read when a step keeps it.
//!
//! Under NVMe pressure (a write that finds the page store full), the least recently used
//! idle sessions move from NVMe to the cluster ([`Service::demote_to_remote`]): what the
//! cluster lacks is written, the NVMe copy deleted, and the session stays here, its cold
//! blocks read from the cluster when a step keeps them (not streamed back: it was idle).
//!
//! Invariant: a block in [`Arriving::blocks`] is cold here and its run is in the cluster at
//! the generation [`Arriving::record`] names. It leaves the set when its run is read (it is
//! then resident) and when this node writes it to the cluster again (it was resident or on
//! NVMe to be written); nothing else replaces a page of a session this node claims.

use std::collections::BTreeSet;

use kvtier_remote::{RemoteRecord, RemoteStore};
use kvtier_storage::{Extent, SavedRuns};

use super::*;

/// The blocks of a session still only in the remote tier, and the record naming their pages.
pub(super) struct Arriving {
    record: RemoteRecord,
    blocks: Mutex<BTreeSet<(u32, u32)>>,
    /// Stream the blocks in ahead of need (a resume); else read only on demand (a session
    /// demoted to the cluster).
    stream: bool,
    /// When streaming last failed: the session is left alone for a second after.
    failed: Mutex<Option<Instant>>,
}

impl Arriving {
    pub(super) fn new(record: RemoteRecord, blocks: BTreeSet<(u32, u32)>, stream: bool) -> Self {
        Arriving {
            record,
            blocks: Mutex::new(blocks),
            stream,
            failed: Mutex::new(None),
        }
    }

    /// Whether every block has arrived.
    pub(super) fn is_empty(&self) -> bool {
        self.blocks.lock().is_empty()
    }

    /// Takes `written` off the set: this node has written them to the cluster again.
    pub(super) fn written(&self, written: &[(u32, u32)]) {
        let mut b = self.blocks.lock();
        for w in written {
            b.remove(w);
        }
    }

    pub(super) fn contains(&self, layer: u32, block: u32) -> bool {
        self.blocks.lock().contains(&(layer, block))
    }
}

/// Where a session's cold blocks are read from: the NVMe tier, and for a session still
/// arriving, the remote tier for the blocks only there.
pub(super) struct SessionSource<'a> {
    pub(super) nvme: Option<TierSource<'a>>,
    pub(super) remote: Option<(&'a dyn RemoteStore, Arc<Arriving>)>,
    /// Counts the blocks (and bytes) read from the remote tier on demand.
    pub(super) counters: &'a Counters,
}

impl ColdSource for SessionSource<'_> {
    fn read_runs(
        &self,
        layer: u32,
        blocks: &[u32],
        extents: &mut [Extent],
    ) -> kvtier_storage::Result<()> {
        let nvme_read = |blocks: &[u32], extents: &mut [Extent]| match &self.nvme {
            Some(t) => t.read_runs(layer, blocks, extents),
            None => Err(StorageError::NotResident {
                layer,
                blocks: blocks.len(),
            }),
        };
        let Some((store, arriving)) = &self.remote else {
            return nvme_read(blocks, extents);
        };
        let (far, near): (Vec<usize>, Vec<usize>) = {
            let only_remote = arriving.blocks.lock();
            (0..blocks.len()).partition(|&i| only_remote.contains(&(layer, blocks[i])))
        };
        if far.is_empty() {
            return nvme_read(blocks, extents);
        }
        // Blocks on NVMe one at a time: a block both promoted and evicted again since the
        // resume is rare.
        for &i in &near {
            nvme_read(&blocks[i..i + 1], &mut extents[i..i + 1])?;
        }
        let wanted: Vec<(u32, u32)> = far.iter().map(|&i| (layer, blocks[i])).collect();
        let failed = |block, reason: &dyn std::fmt::Display, corrupt| {
            StorageError::cold_read("the remote tier", layer, block, reason, corrupt)
        };
        let runs = store
            .read_runs(&arriving.record, &wanted)
            .map_err(|e| failed(wanted[0].1, &e, e.is_data_loss()))?;
        for (&i, run) in far.iter().zip(&runs) {
            if run.len() > extents[i].len() {
                let why = format!("a {}-byte run, longer than a block's", run.len());
                return Err(failed(blocks[i], &why, true));
            }
            extents[i].put_run(run);
        }
        // Read: they are resident once the promotion that asked for them returns.
        arriving.written(&wanted);
        self.counters
            .remote_blocks_fetched
            .fetch_add(wanted.len() as u64, Ordering::Relaxed);
        self.counters.read_from_remote(&runs);
        Ok(())
    }
}

impl Service {
    /// Where `st`'s cold blocks are read from (None: nowhere, every block is resident).
    pub(super) fn cold_source(&self, id: u64, st: &SessionState) -> Option<SessionSource<'_>> {
        let nvme = self.tier.as_ref().map(|(tier, _)| TierSource {
            tier: tier.as_ref(),
            session: id,
        });
        let remote = self
            .remote
            .as_ref()
            .zip(st.arriving.clone())
            .map(|(r, a)| (&*r.store as &dyn RemoteStore, a));
        (nvme.is_some() || remote.is_some()).then_some(SessionSource {
            nvme,
            remote,
            counters: &self.counters,
        })
    }

    /// The runs of `blocks` of an arriving session read from the cluster (for an NVMe write
    /// of blocks that have not arrived); None when none of them is still arriving.
    pub(super) fn arriving_runs(
        &self,
        st: &SessionState,
        blocks: &[(u32, u32)],
    ) -> ServiceResult<Option<SavedRuns>> {
        let (Some(r), Some(a)) = (&self.remote, &st.arriving) else {
            return Ok(None);
        };
        let far: Vec<(u32, u32)> = blocks
            .iter()
            .copied()
            .filter(|&(l, b)| a.contains(l, b))
            .collect();
        if far.is_empty() {
            return Ok(None);
        }
        let runs = r
            .store
            .read_runs(&a.record, &far)
            .map_err(remote::remote_error)?;
        self.counters.read_from_remote(&runs);
        Ok(Some(SavedRuns(far.into_iter().zip(runs).collect())))
    }

    /// Rebuilds session `rec` from its summaries alone: every block cold, its runs left in
    /// the cluster (module docs). The caller has checked [`RemoteRecord::has_summaries`].
    pub(super) fn restore_summaries(
        &self,
        r: &Remote,
        rec: RemoteRecord,
    ) -> ServiceResult<Session> {
        let meta = rec.session.clone();
        let (rb, mut kv) = self.rebuild(&meta)?;
        for chunk in rb.wanted.chunks(SUMMARY_BATCH) {
            let summaries = r
                .store
                .read_summaries(&rec, chunk)
                .map_err(remote::remote_error)?;
            self.counters.read_from_remote(&summaries);
            for (&(l, b), s) in chunk.iter().zip(&summaries) {
                kv.restore_summary(l, s, rb.valid(l, b))?;
            }
        }
        let blocks: BTreeSet<(u32, u32)> = rb.wanted.iter().copied().collect();
        let mut s = Session::restored(&meta, rb.policy, kv, Durable::Remote);
        if !blocks.is_empty() {
            s.state.get_mut().arriving =
                Some(Arc::new(Arriving::new(rec, blocks, r.stream_resumed)));
        }
        Ok(s)
    }

    /// Moves one batch of every arriving session's blocks from the cluster into the host
    /// tier, while the tier stays below its low-water mark (a session that does not fit is
    /// left to be read on demand). Called in a loop from a thread of its own; returns the
    /// blocks moved (0: nothing to do now).
    pub fn stream_arrivals(&self) -> usize {
        let Some(r) = &self.remote else {
            return 0;
        };
        let arriving: Vec<(Arc<Session>, Arc<Arriving>)> = self
            .sessions
            .read()
            .values()
            .filter_map(|s| {
                let a = s.state.try_lock()?.arriving.clone()?;
                a.stream.then(|| (s.clone(), a))
            })
            .collect();
        let mut moved = 0;
        for (s, a) in arriving {
            let batch: Vec<(u32, u32)> =
                a.blocks.lock().iter().take(STREAM_BATCH).copied().collect();
            if batch.is_empty() {
                // Every block read on demand (or by PROMOTE) meanwhile.
                self.install_streamed(&s, &a, &SavedRuns::default());
                continue;
            }
            let resting = a
                .failed
                .lock()
                .is_some_and(|t| t.elapsed() < Duration::from_secs(1));
            if resting || !self.host_has_room(batch.len() * s.geometry.block_bytes()) {
                continue;
            }
            // Read without the session lock: steps go on meanwhile.
            let runs = match r.store.read_runs(&a.record, &batch) {
                Ok(runs) => runs,
                Err(e) => {
                    *a.failed.lock() = Some(Instant::now());
                    tracing::warn!(session = s.id, error = %e, "remote: streaming a resumed session's blocks failed; they are read when a step keeps them");
                    continue;
                }
            };
            self.counters.read_from_remote(&runs);
            let runs = SavedRuns(batch.iter().copied().zip(runs).collect());
            moved += self.install_streamed(&s, &a, &runs);
        }
        moved
    }

    /// Installs streamed runs into a session still arriving from `a` (not one closed, taken
    /// by another node, or resumed anew since); returns the blocks installed.
    fn install_streamed(&self, s: &Session, a: &Arc<Arriving>, runs: &SavedRuns) -> usize {
        let mut st = s.state.lock();
        if st.closed || !st.arriving.as_ref().is_some_and(|x| Arc::ptr_eq(x, a)) {
            return 0;
        }
        let mut by_layer: HashMap<u32, Vec<u32>> = HashMap::new();
        for &(l, b) in runs.0.keys() {
            if a.contains(l, b) {
                by_layer.entry(l).or_default().push(b);
            }
        }
        let mut installed = 0;
        for (l, mut blocks) in by_layer {
            blocks.sort_unstable();
            match st.kv.promote(l, &blocks, runs) {
                Ok(n) => {
                    installed += n;
                    a.written(&blocks.iter().map(|&b| (l, b)).collect::<Vec<_>>());
                }
                // The host tier filled meanwhile: the rest waits (or is read on demand).
                Err(_) => break,
            }
        }
        self.counters
            .remote_blocks_streamed
            .fetch_add(installed as u64, Ordering::Relaxed);
        if a.is_empty() {
            st.arriving = None;
            tracing::info!(
                session = s.id,
                "remote: every block of the resumed session has arrived"
            );
        }
        installed
    }

    /// Moves least recently used idle sessions (unpinned, unleased, with an NVMe copy, not
    /// `exclude`) from NVMe to the cluster until `need` bytes of the page store are free
    /// (module docs). Only `try_lock`s sessions. Returns whether `need` bytes are free.
    pub(super) fn demote_to_remote(&self, exclude: u64, need: u64) -> bool {
        let (Some(r), Some((tier, _))) = (&self.remote, &self.tier) else {
            return false;
        };
        let free = || tier.store().free_bytes();
        let mut idle: Vec<Arc<Session>> = self
            .sessions
            .read()
            .values()
            .filter(|s| {
                s.id != exclude
                    && s.damaged.is_none()
                    && !s.pinned.load(Ordering::Relaxed)
                    && s.leases() == 0
            })
            .cloned()
            .collect();
        idle.sort_by_key(|s| s.last_access_unix_ms.load(Ordering::Relaxed));
        for s in idle {
            if free() >= need {
                break;
            }
            let Some(mut st) = s.state.try_lock() else {
                continue;
            };
            if st.closed || !st.stored || st.reserved.is_some() {
                continue;
            }
            match self.demote_to_remote_locked(r, tier, &s, &mut st) {
                Ok(blocks) => {
                    self.counters
                        .remote_demotions
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::info!(
                        session = s.id,
                        blocks,
                        "session moved from NVMe to the remote tier (NVMe full)"
                    );
                    // A deleted session's pages are free after the next manifest commit: one
                    // now.
                    if let Err(e) = tier.free_retired() {
                        tracing::warn!(error = %e, "NVMe: committing the manifest to free a moved session's pages failed");
                    }
                }
                Err(e) => {
                    tracing::warn!(session = s.id, error = %e, "remote: could not move the session from NVMe to the cluster")
                }
            }
        }
        free() >= need
    }

    /// Writes what the cluster lacks of `s`, then drops its NVMe copy: its cold blocks are
    /// read from the cluster from now on. Returns the session's blocks now only there.
    fn demote_to_remote_locked(
        &self,
        r: &Remote,
        tier: &NvmeTier,
        s: &Session,
        st: &mut SessionState,
    ) -> ServiceResult<usize> {
        self.put_remote_locked(r, s, st)?;
        let record = r
            .store
            .record(s.id)
            .map_err(remote::remote_error)?
            .ok_or_else(|| {
                ServiceError::internal("the session's record vanished after its write")
            })?;
        let mut cold = BTreeSet::new();
        for l in 0..s.geometry.layers {
            let blocks = st.kv.layer(l)?.blocks() as u32;
            cold.extend(
                (0..blocks)
                    .filter(|&b| !st.kv.is_resident(l, b))
                    .map(|b| (l, b)),
            );
        }
        let n = cold.len();
        // Every cold block is in the cluster at `record`'s generation (just written or
        // written before and not replaced since), so the NVMe copy can go.
        st.arriving = Some(Arc::new(Arriving::new(record, cold, false)));
        tier.delete_session(s.id).map_err(tiering::nvme_error)?;
        st.stored = false;
        st.persisted.iter_mut().for_each(|p| *p = 0);
        Ok(n)
    }

    /// Whether `bytes` more fit in the host tier below its low-water mark (without an NVMe
    /// tier, below nine tenths of it): streaming never pushes other sessions out.
    fn host_has_room(&self, bytes: usize) -> bool {
        let u = self.arena.usage();
        let low = self.tier.as_ref().map_or(0.9, |(_, t)| t.low_water);
        (u.bytes_used + bytes) as f64 <= low * u.bytes_total as f64
    }
}

/// Summaries per read of a resume (a few MiB with sketches).
const SUMMARY_BATCH: usize = 1024;

/// Runs per streamed batch (64 MiB of Qwen2.5-7B's 256 KiB runs: a pipeline on each of four
/// connections).
const STREAM_BATCH: usize = 256;
