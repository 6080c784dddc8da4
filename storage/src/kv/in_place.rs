//! Appends whose rows another process writes in place, through its own mapping of the shared
//! arena (RESERVE / COMMIT, the in-engine data path): the extents of the blocks they open are
//! held by an [`InPlaceAppend`] until it is committed (checked and adopted, bit-identical to
//! [`KvCache::append`] of the same rows) or aborted.

use super::{fold_bounds, reset_bounds, zero_rows, KvCache, LayerKv, Slot, PARALLEL_APPEND_BYTES};
use crate::arena::Extent;
use crate::error::{Result, StorageError};
use crate::geometry::Geometry;
use crate::par;
use crate::sketch::{sketch_block, BlockSketch, LayerSketches};

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
        Ok(InPlaceAppend {
            start,
            n,
            fresh,
            staged: (0..self.layers.len()).map(|_| None).collect(),
            rows: None,
        })
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
    /// stages the layers [`KvCache::stage_in_place`] has not (checks them: a NaN or infinity
    /// is refused like an append's; zeroes any row written past them; folds the keys into
    /// the bounds and sketches), then adopts every layer's blocks at once. The result is
    /// bit-identical to [`KvCache::append`] of the same rows. On error, or with `n == 0`,
    /// nothing is appended and the append is aborted ([`KvCache::abort_in_place`]).
    pub fn commit_in_place(&mut self, mut p: InPlaceAppend, n: u64) -> Result<()> {
        if n == 0 {
            self.abort_in_place(p);
            return Ok(());
        }
        let rest: Vec<usize> = (0..self.layers.len())
            .filter(|&l| p.staged[l].is_none())
            .collect();
        if let Err(e) = self.stage(&mut p, n, &rest) {
            self.abort_in_place(p);
            return Err(e);
        }
        let (start, end) = (p.start, p.start + n);
        let geo = self.geo;
        for ((l, fresh), staged) in self.layers.iter_mut().zip(p.fresh).zip(p.staged) {
            adopt_layer(
                &geo,
                l,
                fresh,
                staged.expect("every layer staged"),
                start,
                end,
            );
        }
        Ok(())
    }

    /// Checks and summarizes the first `n` rows of layers `layers` written in place, without
    /// adopting them: a partial COMMIT, while the writer still writes the other layers. The
    /// layers read nothing of it until [`KvCache::commit_in_place`] adopts every layer at
    /// once. Each layer is staged once, every stage of one append stages the same `n`, and
    /// `layers` is not empty. On error the append is unchanged (the caller aborts it).
    pub fn stage_in_place(
        &mut self,
        p: &mut InPlaceAppend,
        n: u64,
        layers: std::ops::Range<usize>,
    ) -> Result<()> {
        if layers.is_empty() {
            return Err(StorageError::PayloadSize {
                what: "layers committed",
                expected: 1,
                got: 0,
            });
        }
        let count = self.layers.len() as u32;
        if let Some(l) = layers.clone().find(|&l| l >= self.layers.len()) {
            return Err(StorageError::LayerOutOfRange {
                layer: l as u32,
                layers: count,
            });
        }
        if let Some(l) = layers.clone().find(|&l| p.staged[l].is_some()) {
            return Err(StorageError::LayerCommitted { layer: l as u32 });
        }
        self.stage(p, n, &layers.collect::<Vec<_>>())
    }

    /// Stages `layers` (none staged yet) with `n` rows, on several threads when they are a
    /// prefill's size.
    fn stage(&mut self, p: &mut InPlaceAppend, n: u64, layers: &[usize]) -> Result<()> {
        if n > p.n {
            return Err(StorageError::PayloadSize {
                what: "committed tokens (at most the reserved count)",
                expected: p.n as usize,
                got: n as usize,
            });
        }
        match p.rows {
            Some(rows) if rows != n => {
                return Err(StorageError::CommitTokens {
                    expected: rows,
                    got: n,
                })
            }
            _ => {}
        }
        let geo = self.geo;
        let bytes = (n as usize).saturating_mul(2 * geo.token_bytes() * layers.len());
        let threads = if bytes < PARALLEL_APPEND_BYTES {
            1
        } else {
            par::default_workers()
        };
        // Layers on `threads` threads, and each layer's rows (or blocks) on its share of them:
        // a COMMIT of one layer of a prefill checks tens of MB.
        let inner = (threads / layers.len().max(1)).max(1);
        let checked = par::map_indexed(layers.len(), threads, "kvtier-commit", |i| {
            let l = layers[i];
            check_in_place(&geo, &self.layers[l], &p.fresh[l], p.start, n, inner)
        });
        if let Some(e) = checked.into_iter().flatten().next() {
            return Err(e);
        }
        let (start, end) = (p.start, p.start + n);
        let mut work: Vec<(&mut LayerKv, &mut Vec<Extent>, Option<Staged>)> = self
            .layers
            .iter_mut()
            .zip(p.fresh.iter_mut())
            .enumerate()
            .filter(|(l, _)| layers.contains(l))
            .map(|(_, (l, f))| (l, f, None))
            .collect();
        par::each_mut(&mut work, threads, "kvtier-commit", |(l, fresh, out)| {
            *out = Some(stage_layer(&geo, l, fresh, start, end, inner));
        });
        let staged: Vec<Staged> = work
            .into_iter()
            .map(|(_, _, s)| s.expect("staged"))
            .collect();
        for (&l, s) in layers.iter().zip(staged) {
            p.staged[l] = Some(s);
        }
        p.rows = Some(n);
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
    /// Per layer, its rows checked and summarized ([`KvCache::stage_in_place`]), not adopted.
    staged: Vec<Option<Staged>>,
    /// The rows every stage so far staged.
    rows: Option<u64>,
}

/// One layer's rows checked and summarized, waiting to be adopted: the bounds and sketches of
/// its blocks from the first the rows go to (the partial tail block, when they start in one).
#[derive(Debug)]
struct Staged {
    summaries: Vec<f32>,
    sketches: Option<LayerSketches>,
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

    /// Layers not yet staged ([`KvCache::stage_in_place`]).
    pub fn layers_left(&self) -> usize {
        self.staged.iter().filter(|s| s.is_none()).count()
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
    threads: usize,
) -> Option<StorageError> {
    // Rows in `threads` consecutive chunks; the first error of the first chunk that has one
    // is the first in row order, as a scan of all rows would find it.
    let chunk = n.div_ceil(threads.max(1) as u64).max(1);
    let chunks = n.div_ceil(chunk) as usize;
    par::map_indexed(chunks, threads, "kvtier-check", |c| {
        let rows = c as u64 * chunk..((c as u64 + 1) * chunk).min(n);
        check_rows(geo, l, fresh, start, rows)
    })
    .into_iter()
    .flatten()
    .next()
}

/// The first non-finite element of rows `rows` (counted from `start`) of one layer's append,
/// as [`StorageError::NonFinite`] indexes it: `(row * kv_heads + head) * head_dim + element`.
fn check_rows(
    geo: &Geometry,
    l: &LayerKv,
    fresh: &[Extent],
    start: u64,
    rows: std::ops::Range<u64>,
) -> Option<StorageError> {
    let (bt, hkv, row) = (
        geo.block_tokens as u64,
        geo.kv_heads as usize,
        geo.row_bytes(),
    );
    for i in rows {
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

/// Rows `start..end` written in place into one layer, checked, made ready to join it: rows past
/// `end` are zeroed (written or not: the extents were not zeroed when reserved), as is each new
/// extent's padding past its run; the keys are folded into copies of the bounds and sketches
/// of the blocks they go to, which [`adopt_layer`] puts in place. The blocks the rows open are
/// summarized on up to `threads` threads (a prefill's layer alone is hundreds of blocks).
fn stage_layer(
    geo: &Geometry,
    l: &mut LayerKv,
    fresh: &mut [Extent],
    start: u64,
    end: u64,
    threads: usize,
) -> Staged {
    let bt = geo.block_tokens as u64;
    let spb = geo.summary_floats_per_block();
    let (first, held) = ((start / bt) as usize, l.slots.len());
    let blocks = geo.blocks_for(end) as usize - first;
    // 1 when the rows start inside the resident tail block (block `first`).
    let tail = usize::from(first < held);
    let mut summaries = vec![0f32; blocks * spb];
    let mut sketches = l.sketches.as_ref().map(|sk| {
        let mut staged = match tail {
            1 => sk.copy_block(geo, first),
            _ => LayerSketches::default(),
        };
        staged.open_blocks(geo, blocks - tail);
        staged
    });
    if tail == 1 {
        let Some(Slot::Hot(extent)) = l.slots.get_mut(first) else {
            unreachable!("begin_in_place checked the tail is resident")
        };
        let run = extent.as_mut_slice();
        let base = first as u64 * bt;
        let (from, to) = (
            (start - base) as usize,
            (end.min(base + bt) - base) as usize,
        );
        zero_rows(geo, run, to, bt as usize);
        summaries[..spb].copy_from_slice(&l.summaries[first * spb..(first + 1) * spb]);
        fold_bounds(geo, run, from..to, &mut summaries[..spb]);
        if let Some(sk) = &mut sketches {
            sk.add_run(geo, 0, run, from..to);
        }
    }
    // The blocks the rows open start at row 0: each is summarized whole, on its own.
    let sketch_blocks: Vec<Option<BlockSketch<'_>>> = match &mut sketches {
        Some(sk) => sk.blocks_mut(geo, tail).map(Some).collect(),
        None => (tail..blocks).map(|_| None).collect(),
    };
    let mut work: Vec<_> = (tail..blocks)
        .zip(summaries[tail * spb..].chunks_mut(spb))
        .zip(sketch_blocks)
        .zip(fresh.iter_mut())
        .map(|(((i, sum), sketch), f)| {
            let base = (first + i) as u64 * bt;
            let to = (end.min(base + bt) - base) as usize;
            (sum, sketch, f.as_mut_slice(), to)
        })
        .collect();
    par::each_mut(
        &mut work,
        threads,
        "kvtier-commit",
        |(sum, sketch, run, to)| {
            run[geo.block_bytes()..].fill(0);
            zero_rows(geo, run, *to, bt as usize);
            reset_bounds(geo, sum);
            fold_bounds(geo, run, 0..*to, sum);
            if let Some(out) = sketch.take() {
                sketch_block(geo, run, *to, out);
            }
        },
    );
    Staged {
        summaries,
        sketches,
    }
}

/// A staged layer joins: the blocks its rows open take `fresh`'s extents (the rest go back),
/// and its bounds and sketches replace those of the blocks from the first its rows go to.
fn adopt_layer(
    geo: &Geometry,
    l: &mut LayerKv,
    mut fresh: Vec<Extent>,
    s: Staged,
    start: u64,
    end: u64,
) {
    let first = (start / geo.block_tokens as u64) as usize;
    fresh.truncate((geo.blocks_for(end) - geo.blocks_for(start)) as usize);
    l.slots.extend(fresh.into_iter().map(Slot::Hot));
    l.summaries.truncate(first * geo.summary_floats_per_block());
    if l.summaries.is_empty() {
        l.summaries = s.summaries; // a prefill into an empty layer: moved, not copied
    } else {
        l.summaries.extend_from_slice(&s.summaries);
    }
    if let (Some(sk), Some(staged)) = (&mut l.sketches, s.sketches) {
        sk.replace_from(geo, first, staged);
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
