//! Warm restart: stored block runs appended back whole, block by block or in bulk over
//! threads, with tiles, bounds and sketches bit-identical to the session before it was stored.

use parking_lot::Mutex;

use super::{refold_bounds, KvCache, Slot};
use crate::arena::Extent;
use crate::error::{Result, StorageError};
use crate::geometry::Geometry;
use crate::par;
use crate::sketch::{sketch_block, BlockSketch};

/// Fewest blocks per thread before [`KvCache::restore_blocks`] fans out (a block's bound
/// rebuild is tens of microseconds, about what a thread spawn costs).
pub const RESTORE_MIN_BLOCKS_PER_THREAD: usize = 4;

/// One stored block for [`KvCache::restore_blocks`]: the arguments of one
/// [`KvCache::restore_block`] call.
#[derive(Debug, Clone, Copy)]
pub struct StoredBlock<'a> {
    pub layer: u32,
    /// The block run as stored (exactly `block_bytes`).
    pub run: &'a [u8],
    /// Tokens of the block that are present (B except for a layer's tail block).
    pub valid: usize,
    /// Keep the run resident in a fresh extent (else the block is restored cold).
    pub keep: bool,
}

impl KvCache {
    /// Appends a whole stored block to `layer` (warm restart): `run` is the block run with
    /// `valid` tokens; the layer's length must be a multiple of the block size. Folds the
    /// block's bounds from its stored keys, so tiles, bounds and every later selection are
    /// bit-identical to the session before it was stored. With `keep` the run stays resident
    /// in a fresh extent; without, the block is restored cold (summary only).
    pub fn restore_block(
        &mut self,
        layer: u32,
        run: &[u8],
        valid: usize,
        keep: bool,
    ) -> Result<()> {
        let geo = self.geo;
        self.check_block_start(layer, valid)?;
        if run.len() != geo.block_bytes() {
            return Err(StorageError::PayloadSize {
                what: "stored block run",
                expected: geo.block_bytes(),
                got: run.len(),
            });
        }
        if let Some(index) = geo.dtype.first_non_finite(run) {
            return Err(StorageError::NonFinite {
                what: "stored block run",
                index,
            });
        }
        let slot = if keep {
            let mut f = self.arena.alloc(self.geo.block_bytes())?;
            f.as_mut_slice()[..run.len()].copy_from_slice(run);
            Slot::Hot(f)
        } else {
            Slot::Cold
        };
        let l = &mut self.layers[layer as usize];
        let at = l.summaries.len();
        l.summaries.resize(at + geo.summary_floats_per_block(), 0.0);
        refold_bounds(&geo, run, valid, &mut l.summaries[at..]);
        if let Some(sk) = &mut l.sketches {
            sk.open_block(&geo);
            sk.add_run(&geo, l.slots.len(), run, 0..valid);
        }
        l.slots.push(slot);
        l.tokens += valid as u64;
        Ok(())
    }

    /// Refuses a block of `valid` tokens appended whole to `layer` unless the layer ends at a
    /// block boundary and `valid` is 1 to B.
    pub(super) fn check_block_start(&self, layer: u32, valid: usize) -> Result<()> {
        let bt = self.geo.block_tokens as u64;
        let l = self.layer_kv(layer)?;
        if l.tokens % bt != 0 || valid == 0 || valid as u64 > bt {
            return Err(StorageError::PositionMismatch {
                layer,
                expected: l.tokens.next_multiple_of(bt),
                got: l.tokens,
            });
        }
        Ok(())
    }

    /// [`KvCache::restore_block`] for many blocks at once, in order, on up to `threads`
    /// threads (the caller's included; small batches stay on the caller). All-or-nothing: on
    /// error the cache is unchanged, and the error is the one the first failing block would
    /// have given restoring block by block. On success tiles, bounds and lengths are
    /// bit-identical to restoring block by block.
    pub fn restore_blocks(&mut self, blocks: &[StoredBlock<'_>], threads: usize) -> Result<()> {
        let geo = self.geo;
        let bt = geo.block_tokens as u64;
        let threads = threads
            .min(blocks.len() / RESTORE_MIN_BLOCKS_PER_THREAD)
            .max(1);
        // The cheap checks, in order, against the layer lengths the blocks before each one
        // leave behind; `limit` is the first block that fails one.
        let mut tokens: Vec<u64> = self.layers.iter().map(|l| l.tokens).collect();
        let mut bad = None;
        for (i, b) in blocks.iter().enumerate() {
            let Some(t) = tokens.get_mut(b.layer as usize) else {
                bad = Some((
                    i,
                    StorageError::LayerOutOfRange {
                        layer: b.layer,
                        layers: geo.layers,
                    },
                ));
                break;
            };
            if *t % bt != 0 || b.valid == 0 || b.valid as u64 > bt {
                bad = Some((
                    i,
                    StorageError::PositionMismatch {
                        layer: b.layer,
                        expected: t.next_multiple_of(bt),
                        got: *t,
                    },
                ));
                break;
            }
            if b.run.len() != geo.block_bytes() {
                bad = Some((
                    i,
                    StorageError::PayloadSize {
                        what: "stored block run",
                        expected: geo.block_bytes(),
                        got: b.run.len(),
                    },
                ));
                break;
            }
            *t += b.valid as u64;
        }
        if let Some((limit, err)) = bad {
            return Err(self.fails_before(blocks, limit, threads).unwrap_or(err));
        }
        let kept = blocks.iter().filter(|b| b.keep).count();
        let mut extents = match self.arena.alloc_many_unzeroed(kept, self.geo.block_bytes()) {
            Ok(f) => f,
            Err(full) => {
                return Err(self
                    .fails_before(blocks, blocks.len(), threads)
                    .unwrap_or(full))
            }
        };

        // Summaries go where block-by-block appends would put them: after the layer's
        // current ones, in block order.
        let spb = geo.summary_floats_per_block();
        let old_lens: Vec<usize> = self.layers.iter().map(|l| l.summaries.len()).collect();
        let mut added = vec![0usize; self.layers.len()];
        for b in blocks {
            added[b.layer as usize] += 1;
        }
        let old_blocks: Vec<usize> = self.layers.iter().map(|l| l.slots.len()).collect();
        let non_finite = {
            let mut tails: Vec<_> = self
                .layers
                .iter_mut()
                .zip(&added)
                .map(|(l, &n)| {
                    let at = l.summaries.len();
                    l.summaries.resize(at + n * spb, 0.0);
                    let sketches = l.sketches.as_mut().map(|sk| {
                        let first = sk.blocks(&geo);
                        for _ in 0..n {
                            sk.open_block(&geo);
                        }
                        sk.blocks_mut(&geo, first)
                    });
                    (l.summaries[at..].chunks_exact_mut(spb), sketches)
                })
                .collect();
            let mut free_extents = extents.iter_mut();
            let work: Vec<Mutex<RestoreWork<'_, '_>>> = blocks
                .iter()
                .map(|b| {
                    let (summaries, sketches) = &mut tails[b.layer as usize];
                    Mutex::new(RestoreWork {
                        block: b,
                        summary: summaries.next().expect("sized above"),
                        sketch: sketches.as_mut().map(|s| s.next().expect("sized above")),
                        extent: if b.keep { free_extents.next() } else { None },
                    })
                })
                .collect();
            par::map_indexed(work.len(), threads, "kvtier-restore", |i| {
                let mut w = work[i].lock();
                let w = &mut *w;
                let run = w.block.run;
                if let Some(index) = geo.dtype.first_non_finite(run) {
                    return Some((i, index));
                }
                if let Some(f) = w.extent.as_mut() {
                    let f = f.as_mut_slice();
                    f[..run.len()].copy_from_slice(run);
                    f[run.len()..].fill(0);
                }
                refold_bounds(&geo, run, w.block.valid, w.summary);
                if let Some(s) = w.sketch.take() {
                    sketch_block(&geo, run, w.block.valid, s);
                }
                None
            })
            .into_iter()
            .flatten()
            .next()
        };
        if let Some((_, index)) = non_finite {
            for ((l, len), blocks) in self.layers.iter_mut().zip(old_lens).zip(old_blocks) {
                l.summaries.truncate(len);
                if let Some(sk) = &mut l.sketches {
                    sk.truncate(&geo, blocks);
                }
            }
            return Err(StorageError::NonFinite {
                what: "stored block run",
                index,
            });
        }
        let mut extents = extents.drain(..);
        for b in blocks {
            let l = &mut self.layers[b.layer as usize];
            l.slots.push(if b.keep {
                Slot::Hot(extents.next().expect("one extent per kept block"))
            } else {
                Slot::Cold
            });
            l.tokens += b.valid as u64;
        }
        Ok(())
    }

    /// The error restoring `blocks[..limit]` block by block would stop at, if any, beyond the
    /// position and size checks (which pass there): a non-finite run, or a kept block that
    /// finds the arena full.
    fn fails_before(
        &self,
        blocks: &[StoredBlock<'_>],
        limit: usize,
        threads: usize,
    ) -> Option<StorageError> {
        let free = self.arena.fits(self.geo.block_bytes(), limit);
        let upto = blocks[..limit]
            .iter()
            .enumerate()
            .filter(|(_, b)| b.keep)
            .nth(free)
            .map_or(limit, |(i, _)| i);
        first_non_finite_block(&self.geo, &blocks[..upto], threads).or_else(|| {
            // Described as block by block meets it: with the blocks before it holding their
            // extents.
            (upto < limit).then(|| self.arena.full_after(free, self.geo.block_bytes()))
        })
    }
}

/// One block's share of a bulk restore: where its bounds and (if kept) its tiles go.
struct RestoreWork<'b, 'k> {
    block: &'b StoredBlock<'b>,
    summary: &'k mut [f32],
    /// The block's sketch, when the cache keeps sketches.
    sketch: Option<BlockSketch<'k>>,
    extent: Option<&'k mut Extent>,
}

/// The first of `blocks` (in order) holding a NaN or infinity, as the error restoring it
/// gives.
fn first_non_finite_block(
    geo: &Geometry,
    blocks: &[StoredBlock<'_>],
    threads: usize,
) -> Option<StorageError> {
    par::map_indexed(blocks.len(), threads, "kvtier-restore", |i| {
        geo.dtype.first_non_finite(blocks[i].run)
    })
    .into_iter()
    .flatten()
    .next()
    .map(|index| StorageError::NonFinite {
        what: "stored block run",
        index,
    })
}
