//! The NVMe tier as the daemon uses it: a [`PageStore`] plus its manifest, with the write
//! ordering that makes an acknowledged write survive a crash.
//!
//! A write (`put_session`) is copy-on-write: new pages at a new generation, fdatasync of the
//! devices, then a manifest commit; only then does it return. Pages the commit stops
//! referencing are freed one commit later (the previous manifest is the fallback if the newest
//! file is damaged, and its pages must still be there). Reads verify every page against the
//! identity and checksum the manifest recorded.
//!
//! When the free space is enough for a write but in pieces too small for its pages, pages are
//! moved out of the way (compaction, [`NvmeTier::put_session`]): copied to free extents,
//! a commit that references the copies, and a second commit after which the originals are
//! free. Reads hold the relocation lock shared, so no page moves under one.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use super::link;
use super::manifest::{Manifest, ManifestStore, PageRecord, SessionRecord};
use super::store::{cut_by_bytes, Evacuation, PageAddr, PageData, PageRead, PageStore, PageWrite};
use super::{NvmeError, PageId};

mod read;
pub use read::TierSource;

/// One (layer, block) run to store.
#[derive(Debug, Clone, Copy)]
pub struct BlockRun<'a> {
    pub layer: u32,
    pub block: u32,
    pub bytes: &'a [u8],
}

/// Why (layer, block) `runs` cannot be stored as runs of session `id` of `layers` layers: a
/// layer out of range, or a (layer, block) given twice.
pub fn refuse_runs(
    id: u64,
    layers: u32,
    runs: impl ExactSizeIterator<Item = (u32, u32)>,
) -> Option<String> {
    let mut seen = std::collections::HashSet::with_capacity(runs.len());
    for (layer, block) in runs {
        if layer >= layers {
            return Some(format!(
                "session {id}: layer {layer} out of range ({layers} layers)"
            ));
        }
        if !seen.insert((layer, block)) {
            return Some(format!(
                "session {id}: (layer {layer}, block {block}) given twice"
            ));
        }
    }
    None
}

/// Predicted wall time of one batch of a bulk read at the devices' tracked read rates: long
/// enough that the per-batch latency is a few percent, short enough to bound the buffers a
/// batch holds (about 16 MB at 2 GB/s).
pub const BULK_BATCH_SECONDS: f64 = 0.008;
/// Most pages one batch of a bulk read holds, whatever the rates.
pub const BULK_BATCH_MAX_PAGES: usize = 256;
/// Pages per batch before every device has a tracked read rate.
pub const BULK_BATCH_UNMEASURED_PAGES: usize = 64;
/// Fewest pages a promotion copies per thread: fewer are copied on the calling thread (a
/// spawn costs about what copying a few block runs does).
const COPY_MIN_PAGES_PER_THREAD: usize = 4;

/// Most page bytes one batch of [`NvmeTier::read_runs_pipelined`] holds: with the batch
/// being consumed and the one read ahead, a pipelined read holds at most twice this (well
/// inside the page store's buffer pool, so its buffers are recycled, not allocated).
pub const PIPELINE_BATCH_BYTES: usize = 32 << 20;

/// What recovery found at open.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Epoch of the manifest in use (0: none, a fresh tier).
    pub epoch: u64,
    pub sessions: usize,
    pub pages: usize,
    /// Manifest files that failed verification and were skipped (newest first).
    pub skipped_manifests: Vec<String>,
}

struct State {
    manifests: ManifestStore,
    manifest: Manifest,
    /// Retired by the last commit; freed after the next one.
    deferred: Vec<PageAddr>,
}

/// The NVMe tier: sessions stored as checksummed pages, indexed by a crash-safe manifest.
pub struct NvmeTier {
    store: Arc<PageStore>,
    state: Mutex<State>,
    /// Held shared by every read from its plan to its last page, exclusively while pages
    /// move (compaction): a read never plans a page that moves and is overwritten under it.
    /// Taken before `state`, never while holding it.
    relocation: RwLock<()>,
    /// Pages moved by compaction since open.
    moved: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for NvmeTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmeTier")
            .field("store", &self.store)
            .finish()
    }
}

impl NvmeTier {
    /// Opens the tier: loads the newest valid manifest from `manifest_dir` (falling back to
    /// the previous one if the newest is damaged; one of fixed pages, format versions 1 to 3,
    /// is converted to the store's units), checks it matches the store, and marks its pages
    /// (and the fallback's) allocated.
    pub fn open(
        store: PageStore,
        manifest_dir: &Path,
    ) -> Result<(Self, RecoveryReport), NvmeError> {
        let (manifests, loaded) = ManifestStore::open(manifest_dir)?;
        let (manifest, deferred, skipped) = match loaded {
            Some(mut l) => {
                let deferred = l.recover_into(&store)?;
                let skipped = l
                    .skipped
                    .iter()
                    .map(|(p, e)| format!("{}: {e}", p.display()))
                    .collect();
                (l.current, deferred, skipped)
            }
            None => (Manifest::for_store(&store), Vec::new(), Vec::new()),
        };
        let report = RecoveryReport {
            epoch: manifest.epoch,
            sessions: manifest.sessions.len(),
            pages: manifest.page_addrs().count(),
            skipped_manifests: skipped,
        };
        Ok((
            Self {
                store: Arc::new(store),
                state: Mutex::new(State {
                    manifests,
                    manifest,
                    deferred,
                }),
                relocation: RwLock::new(()),
                moved: std::sync::atomic::AtomicU64::new(0),
            },
            report,
        ))
    }

    pub fn store(&self) -> &Arc<PageStore> {
        &self.store
    }

    /// Pages compaction moved to place writes since the tier was opened.
    pub fn pages_moved(&self) -> u64 {
        self.moved.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The current manifest's epoch.
    pub fn epoch(&self) -> u64 {
        self.state.lock().manifest.epoch
    }

    /// The generation the next `put_session` stamps on its pages (its commit's epoch).
    pub fn next_generation(&self) -> u64 {
        self.state.lock().manifests.next_epoch()
    }

    /// Metadata and page records of a session.
    pub fn session(&self, id: u64) -> Option<SessionRecord> {
        self.state.lock().manifest.session(id).cloned()
    }

    pub fn session_ids(&self) -> Vec<u64> {
        self.state
            .lock()
            .manifest
            .sessions
            .iter()
            .map(|s| s.id)
            .collect()
    }

    /// Stores runs of a session durably and updates its metadata (`meta.pages` is ignored:
    /// runs not given keep their current pages). Returns the committed epoch; when it returns
    /// `Ok`, the data survives a crash. On error nothing changes (new pages are freed; pages
    /// moved to make room stay moved, every copy verified and committed). Where the free
    /// bytes would hold the runs' pages but no free extent is long enough, other pages are
    /// moved out of the way first (see the module docs).
    pub fn put_session(
        &self,
        meta: &SessionRecord,
        runs: &[BlockRun<'_>],
    ) -> Result<u64, NvmeError> {
        let listed = runs.iter().map(|r| (r.layer, r.block));
        if let Some(why) = refuse_runs(meta.id, meta.geometry.layers, listed) {
            return Err(NvmeError::invalid(why));
        }
        for r in runs {
            if r.bytes.len() > self.store.max_payload() {
                return Err(NvmeError::invalid(format!(
                    "session {}: run of {} bytes exceeds the page payload {}",
                    meta.id,
                    r.bytes.len(),
                    self.store.max_payload()
                )));
            }
        }
        let mut st = self.state.lock();
        let addrs = match self.alloc_runs(meta.id, runs) {
            Err(NvmeError::Full { .. }) if self.fits_in_free_bytes(runs) => {
                // Reads finish before pages move: the relocation lock, then the state again.
                drop(st);
                let _moving = self.relocation.write();
                st = self.state.lock();
                self.alloc_compacting(&mut st, meta.id, runs)?
            }
            r => r?,
        };
        let generation = st.manifests.next_epoch();
        let ids: Vec<PageId> = runs
            .iter()
            .map(|r| PageId {
                session: meta.id,
                layer: r.layer,
                block: r.block,
                generation,
            })
            .collect();
        let writes: Vec<PageWrite> = runs
            .iter()
            .zip(&addrs)
            .zip(&ids)
            .map(|((r, &addr), &id)| PageWrite {
                addr,
                id,
                payload: r.bytes,
            })
            .collect();
        let undo = |e: NvmeError| {
            if let Err(fe) = self.store.free(&addrs) {
                tracing::error!(error = %fe, "freeing pages of a failed write");
            }
            e
        };
        let crcs = self
            .store
            .write_pages(&writes)
            .and_then(|c| self.store.sync().map(|()| c))
            .map_err(undo)?;

        let mut next = st.manifest.clone();
        let idx = match next.sessions.iter().position(|s| s.id == meta.id) {
            Some(i) => i,
            None => {
                next.sessions.push(SessionRecord {
                    pages: Vec::new(),
                    ..meta.clone()
                });
                next.sessions.len() - 1
            }
        };
        let sess = &mut next.sessions[idx];
        let pages = std::mem::take(&mut sess.pages);
        *sess = SessionRecord {
            pages: Vec::new(),
            ..meta.clone()
        };
        let mut by_key: HashMap<(u32, u32), PageRecord> =
            pages.into_iter().map(|p| ((p.layer, p.block), p)).collect();
        let mut retired = Vec::new();
        let unit = self.store.unit() as u64;
        for ((r, a), crc) in runs.iter().zip(&addrs).zip(crcs) {
            let rec = PageRecord {
                layer: r.layer,
                block: r.block,
                device: a.device,
                page: a.page,
                generation,
                crc,
                payload_len: r.bytes.len() as u32,
            };
            if let Some(old) = by_key.insert((r.layer, r.block), rec) {
                retired.push(old.addr(unit));
            }
        }
        let mut pages: Vec<PageRecord> = by_key.into_values().collect();
        pages.sort_by_key(|p| (p.layer, p.block));
        sess.pages = pages;
        let epoch = st.manifests.commit(&mut next).map_err(undo)?;
        self.after_commit(&mut st, next, retired);
        Ok(epoch)
    }

    /// One page per run, each the extent its payload needs. All runs of a session have one
    /// size (its geometry's block run), so this is one allocation; runs of several sizes take
    /// one per size, all freed again if any fails (all or nothing, like one).
    fn alloc_runs(&self, session: u64, runs: &[BlockRun<'_>]) -> Result<Vec<PageAddr>, NvmeError> {
        let mut lens: Vec<usize> = runs.iter().map(|r| r.bytes.len()).collect();
        lens.sort_unstable();
        lens.dedup();
        let mut addrs: Vec<Option<PageAddr>> = vec![None; runs.len()];
        let mut taken = Vec::with_capacity(runs.len());
        for len in lens {
            let of_len: Vec<usize> = (0..runs.len())
                .filter(|&i| runs[i].bytes.len() == len)
                .collect();
            match self.store.alloc(session, of_len.len(), len) {
                Ok(got) => {
                    for (&i, &a) in of_len.iter().zip(&got) {
                        addrs[i] = Some(a);
                    }
                    taken.extend(got);
                }
                Err(e) => {
                    if let Err(fe) = self.store.free(&taken) {
                        tracing::error!(error = %fe, "freeing pages of a failed allocation");
                    }
                    return Err(e);
                }
            }
        }
        Ok(addrs
            .into_iter()
            .map(|a| a.expect("every run's length was allocated"))
            .collect())
    }

    /// Whether the free bytes hold a page for every run (a failed allocation then means the
    /// free space is in pieces, and compaction can place them).
    fn fits_in_free_bytes(&self, runs: &[BlockRun<'_>]) -> bool {
        let need: u64 = runs
            .iter()
            .map(|r| self.store.page_bytes(r.bytes.len()))
            .sum();
        need <= self.store.free_bytes()
    }

    /// [`NvmeTier::alloc_runs`] page by page, emptying a window ([`NvmeTier::evacuate`]) for
    /// each page no free extent holds; under the relocation lock. All or nothing: on error
    /// the pages allocated so far are freed (pages moved stay moved, committed).
    fn alloc_compacting(
        &self,
        st: &mut State,
        session: u64,
        runs: &[BlockRun<'_>],
    ) -> Result<Vec<PageAddr>, NvmeError> {
        let mut got: Vec<PageAddr> = Vec::with_capacity(runs.len());
        let undo = |got: &[PageAddr], e: NvmeError| {
            if let Err(fe) = self.store.free(got) {
                tracing::error!(error = %fe, "freeing pages of a failed allocation");
            }
            e
        };
        for r in runs {
            let units = self.store.page_units(r.bytes.len());
            // An evacuation empties a window of the page's length; a few more tries cover a
            // commit that failed after the pages moved.
            let mut tries = 0;
            let addr = loop {
                match self.store.alloc(session, 1, r.bytes.len()) {
                    Ok(a) => break a[0],
                    Err(e @ NvmeError::Full { .. }) => {
                        tries += 1;
                        let moved = self.evacuate(st, units, &got).map_err(|x| undo(&got, x))?;
                        if !moved || tries > 4 {
                            return Err(undo(&got, e));
                        }
                    }
                    Err(e) => return Err(undo(&got, e)),
                }
            };
            got.push(addr);
        }
        Ok(got)
    }

    /// Moves the pages out of one window of `units` units ([`PageStore::plan_evacuation`]):
    /// each is read and verified, written to its new extent with the same identity, the
    /// devices synced, a manifest committed that references the copies, then a second commit
    /// after which the originals (the first commit's retired pages) are free. `fixed` pages
    /// (allocated for the write in progress, in no manifest yet) never move. False when no
    /// window can be emptied. On error the copies are freed and every page stays where the
    /// manifest says it is.
    fn evacuate(&self, st: &mut State, units: u32, fixed: &[PageAddr]) -> Result<bool, NvmeError> {
        let unit = self.store.unit() as u64;
        let freed_soon: std::collections::HashSet<PageAddr> = st.deferred.iter().copied().collect();
        let Some(Evacuation { moves }) = self.store.plan_evacuation(units, &freed_soon, fixed)
        else {
            return Ok(false);
        };
        let copies: Vec<PageAddr> = moves.iter().map(|m| m.1).collect();
        let undo = |e: NvmeError| {
            if let Err(fe) = self.store.free(&copies) {
                tracing::error!(error = %fe, "freeing the copies of a failed compaction");
            }
            e
        };
        // Where each moving page is in the manifest (one pass over its records).
        let moving: std::collections::HashSet<PageAddr> = moves.iter().map(|m| m.0).collect();
        let mut at: HashMap<PageAddr, (usize, usize)> = HashMap::with_capacity(moves.len());
        for (i, s) in st.manifest.sessions.iter().enumerate() {
            for (j, p) in s.pages.iter().enumerate() {
                let addr = p.addr(unit);
                if moving.contains(&addr) {
                    at.insert(addr, (i, j));
                }
            }
        }
        let mut reads = Vec::with_capacity(moves.len());
        for (from, _) in &moves {
            let Some(&(i, j)) = at.get(from) else {
                return Err(undo(NvmeError::invalid(format!(
                    "compaction: {from:?} is allocated but no session references it"
                ))));
            };
            let (s, p) = (&st.manifest.sessions[i], &st.manifest.sessions[i].pages[j]);
            reads.push(PageRead {
                addr: *from,
                id: PageId {
                    session: s.id,
                    layer: p.layer,
                    block: p.block,
                    generation: p.generation,
                },
                expected_crc: Some(p.crc),
            });
        }
        let data = self
            .store
            .read_pages(&reads)
            .map_err(undo)?
            .into_iter()
            .collect::<Result<Vec<PageData>, NvmeError>>()
            .map_err(undo)?;
        let writes: Vec<PageWrite> = reads
            .iter()
            .zip(&data)
            .zip(&copies)
            .map(|((r, d), &addr)| PageWrite {
                addr,
                id: r.id,
                payload: d.payload(),
            })
            .collect();
        self.store
            .write_pages(&writes)
            .and_then(|_| self.store.sync())
            .map_err(undo)?;
        let mut next = st.manifest.clone();
        for (from, to) in &moves {
            let (i, j) = at[from];
            let p = &mut next.sessions[i].pages[j];
            p.device = to.device;
            p.page = to.page;
        }
        st.manifests.commit(&mut next).map_err(undo)?;
        self.after_commit(st, next, moving.into_iter().collect());
        // The originals are the fallback manifest's until one more commit.
        let mut again = st.manifest.clone();
        st.manifests.commit(&mut again)?;
        self.after_commit(st, again, Vec::new());
        self.moved
            .fetch_add(moves.len() as u64, std::sync::atomic::Ordering::Relaxed);
        let bytes: u64 = copies.iter().map(|&a| self.store.addr_bytes(a)).sum();
        tracing::info!(
            pages = moves.len(),
            bytes,
            "NVMe compaction moved pages to place a write"
        );
        Ok(true)
    }

    /// NVMe page bytes each owner's sessions reference now.
    pub fn bytes_by_owner(&self) -> HashMap<u32, u64> {
        let st = self.state.lock();
        let mut out = HashMap::new();
        for s in &st.manifest.sessions {
            *out.entry(s.owner_uid).or_insert(0) +=
                s.pages.iter().map(|p| self.page_bytes(p)).sum::<u64>();
        }
        out
    }

    /// Bytes of the pages the sessions of `owner` would reference once `runs` of `session`
    /// are written: what they reference now, with each run's page replaced by (or, for a new
    /// run, added as) a page of its size. For per-owner quotas.
    pub fn owner_bytes_after(&self, owner: u32, session: u64, runs: &[BlockRun<'_>]) -> u64 {
        let now = self.bytes_by_owner().get(&owner).copied().unwrap_or(0);
        let st = self.state.lock();
        let rec = st
            .manifest
            .session(session)
            .filter(|s| s.owner_uid == owner);
        let (added, replaced) = runs.iter().fold((0u64, 0u64), |(add, rep), r| {
            let old = rec
                .and_then(|s| s.page(r.layer, r.block))
                .map_or(0, |p| self.page_bytes(p));
            (add + self.store.page_bytes(r.bytes.len()), rep + old)
        });
        (now + added).saturating_sub(replaced)
    }

    /// Records PIN/UNPIN of a stored session durably (a manifest commit; no page changes).
    /// Returns the committed epoch, or None when the record already says so.
    pub fn set_pinned(&self, id: u64, pinned: bool) -> Result<Option<u64>, NvmeError> {
        let mut st = self.state.lock();
        let Some(i) = st.manifest.sessions.iter().position(|s| s.id == id) else {
            return Err(NvmeError::invalid(format!("no session {id} on NVMe")));
        };
        if st.manifest.sessions[i].pinned == pinned {
            return Ok(None);
        }
        let mut next = st.manifest.clone();
        next.sessions[i].pinned = pinned;
        let epoch = st.manifests.commit(&mut next)?;
        self.after_commit(&mut st, next, Vec::new());
        Ok(Some(epoch))
    }

    /// Bytes of a recorded page (its extent in the store).
    fn page_bytes(&self, p: &PageRecord) -> u64 {
        self.store.addr_bytes(p.addr(self.store.unit() as u64))
    }

    /// Removes a session durably; its pages are reused after the next commit.
    pub fn delete_session(&self, id: u64) -> Result<u64, NvmeError> {
        let mut st = self.state.lock();
        let mut next = st.manifest.clone();
        let Some(i) = next.sessions.iter().position(|s| s.id == id) else {
            return Err(NvmeError::invalid(format!("no session {id} on NVMe")));
        };
        let gone = next.sessions.remove(i);
        let epoch = st.manifests.commit(&mut next)?;
        let unit = self.store.unit() as u64;
        self.after_commit(
            &mut st,
            next,
            gone.pages.iter().map(|p| p.addr(unit)).collect(),
        );
        self.store.forget_session(id);
        Ok(epoch)
    }

    /// Frees now the pages the last commit retired (kept until the next commit, so that a
    /// torn commit can fall back to the manifest before it) by committing the manifest
    /// unchanged: for a caller that deleted sessions to make room for a write at once.
    pub fn free_retired(&self) -> Result<(), NvmeError> {
        let mut st = self.state.lock();
        if st.deferred.is_empty() {
            return Ok(());
        }
        let mut next = st.manifest.clone();
        st.manifests.commit(&mut next)?;
        self.after_commit(&mut st, next, Vec::new());
        Ok(())
    }

    fn after_commit(&self, st: &mut State, next: Manifest, retired: Vec<PageAddr>) {
        st.manifest = next;
        let free = std::mem::replace(&mut st.deferred, retired);
        if let Err(e) = self.store.free(&free) {
            // Only possible if the bookkeeping is wrong; leaking pages is the safe side.
            tracing::error!(error = %e, "freeing retired pages");
        }
    }
}
