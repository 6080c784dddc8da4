//! Appends whose rows another process writes in place, through its own mapping of the shared
//! arena (RESERVE / COMMIT, the in-engine data path): the extents of the blocks they open are
//! held by an [`InPlaceAppend`] until it is committed (checked and adopted, bit-identical to
//! [`KvCache::append`] of the same rows) or aborted.

use super::{fold_bounds, reset_bounds, zero_rows, KvCache, LayerKv, Slot, PARALLEL_APPEND_BYTES};
use crate::arena::Extent;
use crate::error::{Result, StorageError};
use crate::geometry::Geometry;
use crate::par;

impl KvCache {
    /// Opens an append of `n` tokens to every layer whose rows another process writes in
    /// place, through its own mapping of the shared arena (RESERVE / COMMIT, the in-engine
    /// data path): the extents of the blocks it opens are taken now and held by the returned
    /// [`InPlaceAppend`], not by the layers, until [`KvCache::commit_in_place`]. They are not
    /// zeroed here (at prefill sizes that memset was half of an in-place append's time): the
    /// writer fills the rows it commits and the commit zeroes every other byte of the extents
    /// it adopts. Every layer must hold the same count and its partial tail block must be
    /// resident. Nothing readers see changes: rows past the stored tokens are never read.
    pub fn begin_in_place(&self, n: u64) -> Result<InPlaceAppend> {
        let (start, max) = (self.min_tokens(), self.max_tokens_stored());
        if start != max {
            return Err(StorageError::UnevenLayers { min: start, max });
        }
        if n == 0 {
            return Err(StorageError::PayloadSize {
                what: "in-place append tokens",
                expected: 1,
                got: 0,
            });
        }
        if start.checked_add(n).is_none_or(|end| end > self.max_tokens) {
            return Err(StorageError::TooManyTokens {
                max: self.max_tokens,
            });
        }
        if let Some(&(layer, _)) = self.cold_tails().first() {
            return Err(StorageError::NotResident { layer, blocks: 1 });
        }
        let per_layer = self.extents_needed(start, n);
        let mut all = self
            .arena
            .alloc_many_unzeroed(per_layer * self.layers.len(), self.geo.block_bytes())?;
        let fresh = (0..self.layers.len())
            .map(|_| all.split_off(all.len() - per_layer))
            .collect();
        Ok(InPlaceAppend { start, n, fresh })
    }

    /// Arena byte offsets of the block runs `p`'s rows go to, per layer: the partial tail
    /// block (if the append starts inside one), then the blocks it opens.
    pub fn in_place_offsets(&self, p: &InPlaceAppend) -> Vec<Vec<u64>> {
        let bt = self.geo.block_tokens as u64;
        self.layers
            .iter()
            .zip(&p.fresh)
            .map(|(l, fresh)| {
                let tail = (!p.start.is_multiple_of(bt)).then(|| match l.slots.last() {
                    Some(Slot::Hot(f)) => f.offset() as u64,
                    _ => unreachable!("begin_in_place checked the tail is resident"),
                });
                tail.into_iter()
                    .chain(fresh.iter().map(|f| f.offset() as u64))
                    .collect()
            })
            .collect()
    }

    /// Adopts the first `n` (at most `p.tokens()`) rows written in place into every layer:
    /// checks them (a NaN or infinity is refused like an append's), zeroes any row written
    /// past them, folds the keys into the bounds and takes the blocks' extents. The result is
    /// bit-identical to [`KvCache::append`] of the same rows. On error, or with `n == 0`,
    /// nothing is appended and the append is aborted ([`KvCache::abort_in_place`]).
    pub fn commit_in_place(&mut self, p: InPlaceAppend, n: u64) -> Result<()> {
        if n > p.n {
            let err = StorageError::PayloadSize {
                what: "committed tokens (at most the reserved count)",
                expected: p.n as usize,
                got: n as usize,
            };
            self.abort_in_place(p);
            return Err(err);
        }
        let geo = self.geo;
        let layers = self.layers.len();
        // A prefill-sized commit checks and folds its layers on several threads, as a large
        // append does.
        let bytes = (n as usize).saturating_mul(2 * geo.token_bytes() * layers);
        let threads = if bytes < PARALLEL_APPEND_BYTES {
            1
        } else {
            par::default_workers()
        };
        let checked = par::map_indexed(layers, threads, "kvtier-commit", |i| {
            check_in_place(&geo, &self.layers[i], &p.fresh[i], p.start, n)
        });
        if let Some(e) = checked.into_iter().flatten().next() {
            self.abort_in_place(p);
            return Err(e);
        }
        let (start, end) = (p.start, p.start + n);
        let mut work: Vec<(&mut LayerKv, Vec<Extent>)> =
            self.layers.iter_mut().zip(p.fresh).collect();
        par::zip_mut(
            &mut work,
            &vec![(); layers],
            threads,
            "kvtier-commit",
            |(l, fresh), _| commit_layer(&geo, l, std::mem::take(fresh), start, end),
        );
        Ok(())
    }

    /// Drops an in-place append: the rows written into the tail block are zeroed again and the
    /// opened extents go back to the arena. The cache is as before [`KvCache::begin_in_place`].
    pub fn abort_in_place(&mut self, p: InPlaceAppend) {
        let geo = self.geo;
        let bt = geo.block_tokens as u64;
        if p.start.is_multiple_of(bt) {
            return;
        }
        for l in &mut self.layers {
            if let Some(Slot::Hot(extent)) = l.slots.last_mut() {
                zero_rows(
                    &geo,
                    extent.as_mut_slice(),
                    (p.start % bt) as usize,
                    bt as usize,
                );
            }
        }
    }
}

/// An append whose rows another process writes in place ([`KvCache::begin_in_place`]): the
/// extents of the blocks it opens, held until it is committed or aborted (dropping it unused
/// frees them, but leaves any rows written into the tail block: abort it instead).
#[derive(Debug)]
pub struct InPlaceAppend {
    start: u64,
    n: u64,
    /// Per layer, the extents of the blocks the append opens, in block order.
    fresh: Vec<Vec<Extent>>,
}

impl InPlaceAppend {
    /// The position of its first row: every layer's length when it was opened.
    pub fn start(&self) -> u64 {
        self.start
    }

    /// Rows reserved.
    pub fn tokens(&self) -> u64 {
        self.n
    }
}

/// The first NaN or infinity in rows `start..start + n` written in place into one layer (its
/// resident tail block, then `fresh`), as an append of them reports it: the element index
/// within that layer's K or V payload, `[n][kv_heads][head_dim]`.
fn check_in_place(
    geo: &Geometry,
    l: &LayerKv,
    fresh: &[Extent],
    start: u64,
    n: u64,
) -> Option<StorageError> {
    let (bt, hkv, row) = (
        geo.block_tokens as u64,
        geo.kv_heads as usize,
        geo.row_bytes(),
    );
    for i in 0..n {
        let pos = start + i;
        let (b, t) = (pos / bt, (pos % bt) as usize);
        let run = match l.slots.get(b as usize) {
            Some(Slot::Hot(f)) => f.as_slice(),
            _ => fresh[(b - l.slots.len() as u64) as usize].as_slice(),
        };
        for h in 0..hkv {
            for (what, o) in [("k", geo.k_row_offset(h, t)), ("v", geo.v_row_offset(h, t))] {
                if let Some(e) = geo.dtype.first_non_finite(&run[o..o + row]) {
                    let index = (i as usize * hkv + h) * geo.head_dim as usize + e;
                    return Some(StorageError::NonFinite { what, index });
                }
            }
        }
    }
    None
}

/// Rows `start..end` written in place join one layer: the blocks they open take `fresh`'s
/// extents (the rest go back), rows past `end` are zeroed (written or not: the extents were not
/// zeroed when reserved), as is each new extent's padding past its run; the keys are folded
/// into the bounds.
fn commit_layer(geo: &Geometry, l: &mut LayerKv, mut fresh: Vec<Extent>, start: u64, end: u64) {
    let bt = geo.block_tokens as u64;
    let spb = geo.summary_floats_per_block();
    fresh.truncate((geo.blocks_for(end) - geo.blocks_for(start)) as usize);
    for mut f in fresh {
        // A new block starts at row 0 (`start` is a block boundary or in the tail block), so
        // its rows are `start..end`'s or zeroed below; only the padding is left.
        f.as_mut_slice()[geo.block_bytes()..].fill(0);
        l.slots.push(Slot::Hot(f));
        l.summaries.extend(std::iter::repeat_n(0.0, spb));
        if let Some(sk) = &mut l.sketches {
            sk.open_block(geo);
        }
    }
    for b in start / bt..end.div_ceil(bt) {
        let Slot::Hot(extent) = &mut l.slots[b as usize] else {
            unreachable!("the tail is resident and the rest is new")
        };
        let base = b * bt;
        let from = (start.max(base) - base) as usize;
        let to = (end.min(base + bt) - base) as usize;
        let run = extent.as_mut_slice();
        zero_rows(geo, run, to, bt as usize);
        let summ = &mut l.summaries[b as usize * spb..(b as usize + 1) * spb];
        if from == 0 {
            reset_bounds(geo, summ);
        }
        fold_bounds(geo, run, from..to, summ);
        if let Some(sk) = &mut l.sketches {
            sk.add_run(geo, b as usize, run, from..to);
        }
    }
    l.tokens = end;
}

/// Arena byte offsets of the K and V rows of kv head `h` of the append's row `i` (position
/// `start + i`), given one layer's run offsets from [`KvCache::in_place_offsets`] (or a
/// RESERVE reply): where an engine writes them.
pub fn in_place_row(geo: &Geometry, offsets: &[u64], start: u64, i: u64, h: usize) -> (u64, u64) {
    let bt = geo.block_tokens as u64;
    let pos = start + i;
    let run = offsets[(pos / bt - start / bt) as usize];
    let t = (pos % bt) as usize;
    (
        run + geo.k_row_offset(h, t) as u64,
        run + geo.v_row_offset(h, t) as u64,
    )
}
