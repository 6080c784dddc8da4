//! Reading a session back: bulk reads cut into batches by the devices' tracked read rates,
//! verified page by page, pipelined into the caller's sink; and the tier as a cold-block
//! source for decode steps.

use std::ops::Range;

use super::*;

impl NvmeTier {
    /// Cuts a bulk read of `wanted` runs (in delivery order) into consecutive batches by the
    /// devices' tracked read rates ([`link::split_batches`], [`BULK_BATCH_SECONDS`]); by count
    /// ([`BULK_BATCH_UNMEASURED_PAGES`]) until every device has a tracked rate. Each run counts
    /// its page's bytes; runs the session does not have count nothing (their read fails on its
    /// own, without I/O).
    pub fn plan_batches(
        &self,
        session: u64,
        wanted: &[(u32, u32)],
    ) -> Result<Vec<Range<usize>>, NvmeError> {
        if self.store.read_links().is_none() {
            return Ok(unmeasured_batches(wanted.len()));
        }
        self.batches_of(&self.run_reads(session, wanted)?)
    }

    /// Each wanted run's (device, page bytes); (0, 0) for a run the session does not have.
    fn run_reads(
        &self,
        session: u64,
        wanted: &[(u32, u32)],
    ) -> Result<Vec<(usize, u64)>, NvmeError> {
        self.per_run(session, wanted, |p| {
            p.map_or((0, 0), |p| (p.device as usize, self.page_bytes(p)))
        })
    }

    /// [`NvmeTier::plan_batches`] of runs with these reads.
    fn batches_of(&self, reads: &[(usize, u64)]) -> Result<Vec<Range<usize>>, NvmeError> {
        match self.store.read_links() {
            None => Ok(unmeasured_batches(reads.len())),
            Some(links) => {
                link::split_batches(&links, reads, BULK_BATCH_SECONDS, BULK_BATCH_MAX_PAGES)
            }
        }
    }

    /// `f` of each wanted (layer, block) run's page record (None: the session does not have it),
    /// under the lock; an error for a session not on NVMe. Binary search per run: building an
    /// index of the whole session for every batch made a bulk read quadratic in its size.
    fn per_run<T>(
        &self,
        session: u64,
        wanted: &[(u32, u32)],
        f: impl Fn(Option<&PageRecord>) -> T,
    ) -> Result<Vec<T>, NvmeError> {
        let st = self.state.lock();
        let s = st
            .manifest
            .session(session)
            .ok_or_else(|| NvmeError::invalid(format!("no session {session} on NVMe")))?;
        Ok(wanted.iter().map(|&(l, b)| f(s.page(l, b))).collect())
    }

    /// Reads and verifies runs of a session. The outer error is for an unknown session or a
    /// dead driver; each run has its own result (`InvalidArgument` for a run that is not
    /// stored, `Corrupt`/`ShortRead`/`Io` for one that cannot be read back correctly).
    pub fn read_runs(
        &self,
        session: u64,
        wanted: &[(u32, u32)],
    ) -> Result<Vec<Result<PageData, NvmeError>>, NvmeError> {
        let unit = self.store.unit() as u64;
        let _placed = self.relocation.read();
        let plan: Vec<Option<PageRead>> = self.per_run(session, wanted, |p| {
            p.map(|p| PageRead {
                addr: p.addr(unit),
                id: PageId {
                    session,
                    layer: p.layer,
                    block: p.block,
                    generation: p.generation,
                },
                expected_crc: Some(p.crc),
            })
        })?;
        let reads: Vec<PageRead> = plan.iter().flatten().copied().collect();
        let mut done = self.store.read_pages(&reads)?.into_iter();
        Ok(plan
            .iter()
            .zip(wanted)
            .map(|(p, &(layer, block))| match p {
                Some(_) => done.next().expect("one result per read"),
                None => Err(NvmeError::invalid(format!(
                    "session {session} has no (layer {layer}, block {block}) on NVMe"
                ))),
            })
            .collect())
    }

    /// Reads `wanted` runs of a session (a bulk read: warm restart, PROMOTE) in consecutive
    /// batches ([`NvmeTier::plan_batches`], cut to at most [`PIPELINE_BATCH_BYTES`]) and hands
    /// each batch to `consume`, in order, with its range in `wanted` and one result per run
    /// (as [`NvmeTier::read_runs`] gives them: verified pages or typed errors). A reader
    /// thread reads the next batch while `consume` works on the current one, so reading and
    /// verifying overlap what the caller does with the pages; at most two batches of pages
    /// are alive at once. Stops at the first error `consume` returns, or an error of a whole
    /// batch (unknown session, dead driver), and returns it; no batch after it is consumed.
    pub fn read_runs_pipelined<E: From<NvmeError>>(
        &self,
        session: u64,
        wanted: &[(u32, u32)],
        mut consume: impl FnMut(Range<usize>, Vec<Result<PageData, NvmeError>>) -> Result<(), E>,
    ) -> Result<(), E> {
        let reads = self.run_reads(session, wanted)?;
        let batches: Vec<Range<usize>> = self
            .batches_of(&reads)?
            .into_iter()
            .flat_map(|r| split_by_bytes(r, &reads, PIPELINE_BATCH_BYTES as u64))
            .collect();
        let sequential = |batches: &[Range<usize>],
                          consume: &mut dyn FnMut(_, _) -> Result<(), E>| {
            for r in batches {
                let pages = self.read_runs(session, &wanted[r.clone()])?;
                consume(r.clone(), pages)?;
            }
            Ok(())
        };
        if batches.len() <= 1 {
            return sequential(&batches, &mut consume);
        }
        std::thread::scope(|s| {
            // Rendezvous: the reader holds the batch it read until the consumer takes it, so
            // it is never more than one batch ahead.
            let (tx, rx) = std::sync::mpsc::sync_channel(0);
            let reader = std::thread::Builder::new()
                .name("kvtier-readahead".into())
                .spawn_scoped(s, {
                    let batches = &batches;
                    move || {
                        for r in batches {
                            let pages = self.read_runs(session, &wanted[r.clone()]);
                            let failed = pages.is_err();
                            // A consumer that stopped drops the receiver: stop too.
                            if tx.send((r.clone(), pages)).is_err() || failed {
                                return;
                            }
                        }
                    }
                });
            if reader.is_err() {
                // No thread to spare: the same reads, one after another.
                return sequential(&batches, &mut consume);
            }
            for (r, pages) in rx {
                consume(r, pages?)?;
            }
            Ok(())
        })
    }
}

/// Consecutive batches of [`BULK_BATCH_UNMEASURED_PAGES`] runs, while no device has a rate.
fn unmeasured_batches(n: usize) -> Vec<Range<usize>> {
    (0..n)
        .step_by(BULK_BATCH_UNMEASURED_PAGES)
        .map(|a| a..(a + BULK_BATCH_UNMEASURED_PAGES).min(n))
        .collect()
}

/// Cuts `r` into consecutive ranges whose page bytes (`reads[i].1`) sum to at most `most` (a
/// run larger than that is a range of its own).
fn split_by_bytes(r: Range<usize>, reads: &[(usize, u64)], most: u64) -> Vec<Range<usize>> {
    let bytes = reads[r.clone()].iter().map(|&(_, b)| b);
    cut_by_bytes(bytes, most, usize::MAX)
        .into_iter()
        .map(|c| c.start + r.start..c.end + r.start)
        .collect()
}

/// Reads one session's cold blocks back from the tier into host extents (the KV cache's
/// [`crate::ColdSource`]): every page is verified against the identity and checksum the
/// manifest recorded; a page that fails is an error (`corrupt` for data loss), never data.
pub struct TierSource<'a> {
    pub tier: &'a NvmeTier,
    pub session: u64,
}

impl crate::ColdSource for TierSource<'_> {
    fn read_runs(
        &self,
        layer: u32,
        blocks: &[u32],
        extents: &mut [crate::Extent],
    ) -> crate::Result<()> {
        let fail = |block: u32, e: &NvmeError| {
            crate::StorageError::cold_read("the NVMe tier", layer, block, e, e.is_data_loss())
        };
        if blocks.is_empty() {
            return Ok(());
        }
        let wanted: Vec<(u32, u32)> = blocks.iter().map(|&b| (layer, b)).collect();
        // A large promotion goes in batches sized by the devices' tracked rates.
        let batches = self
            .tier
            .plan_batches(self.session, &wanted)
            .map_err(|e| fail(blocks[0], &e))?;
        let workers = self.tier.store().workers();
        for r in batches {
            let pages = self
                .tier
                .read_runs(self.session, &wanted[r.clone()])
                .map_err(|e| fail(blocks[r.start], &e))?
                .into_iter()
                .zip(&blocks[r.clone()])
                .map(|(page, &b)| page.map_err(|e| fail(b, &e)))
                .collect::<crate::Result<Vec<_>>>()?;
            // Copied into the extents on the store's workers: 7% less promotion time than on
            // one thread on a 16-core host (nvme_bench --only mixed, docs/benchmarks.md).
            let threads = workers.min(pages.len() / COPY_MIN_PAGES_PER_THREAD).max(1);
            crate::par::zip_mut(
                &mut extents[r],
                &pages,
                threads,
                "kvtier-promote",
                |extent, page| extent.put_run(page.payload()),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::split_by_bytes;

    #[test]
    fn batches_are_cut_by_the_bytes_of_their_pages() {
        let bytes = [3, 3, 3, 1, 1, 1, 5, 2, 0, 9].map(|b| (0usize, b));
        assert_eq!(
            split_by_bytes(0..10, &bytes, 6),
            [0..2, 2..6, 6..7, 7..9, 9..10],
            "a page over the limit is a batch of its own"
        );
        assert_eq!(split_by_bytes(3..7, &bytes, 100), vec![3..7]);
        assert_eq!(
            split_by_bytes(4..4, &bytes, 6),
            Vec::<std::ops::Range<usize>>::new()
        );
    }
}
