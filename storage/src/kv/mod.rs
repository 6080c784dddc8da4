//! The KV cache of one session: per layer, a block table of arena extents and the blocks'
//! key-bound summaries, grown by appends that never reorder or rewrite positions.

use crate::arena::{Extent, HostArena};
use crate::error::{Result, StorageError};
use crate::geometry::{Geometry, MAX_HEAD_DIM};
use crate::par;
use crate::sketch::{BlockSketchesRef, HeadSketch, LayerSketches};

mod in_place;
mod relocate;
mod restore;
mod saved;
mod summary;
pub use in_place::{in_place_row, InPlaceAppend};
pub use restore::{StoredBlock, RESTORE_MIN_BLOCKS_PER_THREAD};
pub use saved::SavedRuns;
pub use summary::summary_bytes;

/// Payload bytes from which [`KvCache::append`] spreads its layers over threads.
const PARALLEL_APPEND_BYTES: usize = 4 << 20;

/// Where a block's bytes are: in an arena extent, or only in a colder tier (its summary always
/// stays in RAM, so selection never waits for a cold tier).
enum Slot {
    Hot(Extent),
    Cold,
}

impl Slot {
    fn extent(&self) -> Option<&Extent> {
        match self {
            Slot::Hot(f) => Some(f),
            Slot::Cold => None,
        }
    }
}

/// Reads stored block runs back from a colder tier (the NVMe page store).
pub trait ColdSource: Send + Sync {
    /// Fills `extents[i]` with the stored run of `(layer, blocks[i])` and zeroes the rest of the
    /// extent ([`Extent::put_run`]): the extents come unzeroed (holding a previous owner's bytes),
    /// because zeroing an extent only to copy over it doubled the memory traffic of a promotion.
    /// Must verify what it returns: wrong bytes must be an error, never data.
    fn read_runs(&self, layer: u32, blocks: &[u32], extents: &mut [Extent]) -> Result<()>;
}

struct LayerKv {
    tokens: u64,
    /// Slot of block `b` at index `b`.
    slots: Vec<Slot>,
    /// `[block][kv_head][max|min][D]` in f32 of the stored (dtype-rounded) keys.
    summaries: Vec<f32>,
    /// Per-token key sketches (`crate::sketch`), for sessions whose selector ranks by them.
    sketches: Option<LayerSketches>,
}

/// One session's full KV cache in the host tier.
pub struct KvCache {
    geo: Geometry,
    arena: HostArena,
    layers: Vec<LayerKv>,
    max_tokens: u64,
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("geometry", &self.geo)
            .field("tokens", &self.min_tokens())
            .finish()
    }
}

impl KvCache {
    /// An empty cache that keeps per-token key sketches (what the default selector needs).
    /// Fails if the geometry is invalid or a block run is larger than the arena's largest
    /// extent.
    pub fn new(geo: Geometry, arena: HostArena) -> Result<Self> {
        Self::new_with(geo, arena, true)
    }

    /// An empty cache, with per-token key sketches or without (a session whose selector does
    /// not read them saves their host memory: a quarter of its keys' bytes).
    pub fn new_with(geo: Geometry, arena: HostArena, sketches: bool) -> Result<Self> {
        geo.validate()?;
        if geo.block_bytes() > arena.max_run_bytes() {
            return Err(StorageError::BlockTooLarge {
                block_bytes: geo.block_bytes(),
                max_run_bytes: arena.max_run_bytes(),
            });
        }
        let layers = (0..geo.layers)
            .map(|_| LayerKv {
                tokens: 0,
                slots: Vec::new(),
                summaries: Vec::new(),
                sketches: sketches.then(LayerSketches::default),
            })
            .collect();
        Ok(KvCache {
            geo,
            arena,
            layers,
            // Block indices are u32 everywhere (selections, page tables, the wire).
            max_tokens: u32::MAX as u64 * geo.block_tokens as u64,
        })
    }

    pub fn geometry(&self) -> &Geometry {
        &self.geo
    }

    pub fn arena(&self) -> &HostArena {
        &self.arena
    }

    /// Whether the cache keeps per-token key sketches.
    pub fn has_sketches(&self) -> bool {
        self.layers.first().is_some_and(|l| l.sketches.is_some())
    }

    /// Host bytes of the key sketches (outside the arena, like the summaries).
    pub fn sketch_bytes(&self) -> usize {
        self.layers
            .iter()
            .filter_map(|l| l.sketches.as_ref())
            .map(LayerSketches::bytes)
            .sum()
    }

    /// Tokens stored at `layer`.
    pub fn tokens(&self, layer: u32) -> Result<u64> {
        Ok(self.layer_kv(layer)?.tokens)
    }

    /// Fewest tokens of any layer: the length of the prefix present in every layer.
    pub fn min_tokens(&self) -> u64 {
        self.layers.iter().map(|l| l.tokens).min().unwrap_or(0)
    }

    pub fn max_tokens_stored(&self) -> u64 {
        self.layers.iter().map(|l| l.tokens).max().unwrap_or(0)
    }

    /// Blocks resident in the host tier over all layers (each is one arena extent).
    pub fn extents(&self) -> usize {
        self.layers
            .iter()
            .map(|l| l.slots.iter().filter(|s| s.extent().is_some()).count())
            .sum()
    }

    /// Blocks over all layers, resident or not.
    pub fn blocks(&self) -> usize {
        self.layers.iter().map(|l| l.slots.len()).sum()
    }

    /// Whether `(layer, block)` is in the host tier. Panics on a block that does not exist.
    pub fn is_resident(&self, layer: u32, block: u32) -> bool {
        self.layers[layer as usize].slots[block as usize]
            .extent()
            .is_some()
    }

    /// The stored run of a resident block (for writing it to a colder tier).
    pub fn run(&self, layer: u32, block: u32) -> Option<&[u8]> {
        let bb = self.geo.block_bytes();
        self.layers
            .get(layer as usize)?
            .slots
            .get(block as usize)?
            .extent()
            .map(|f| &f.as_slice()[..bb])
    }

    /// Drops the extent of a resident block, keeping its summary: the block is now cold. The
    /// caller must hold a durable copy (the NVMe tier). Returns whether an extent was freed.
    pub fn evict(&mut self, layer: u32, block: u32) -> bool {
        let slot = &mut self.layers[layer as usize].slots[block as usize];
        matches!(std::mem::replace(slot, Slot::Cold), Slot::Hot(_))
    }

    /// The blocks of `blocks` at `layer` that are cold.
    pub fn cold_among(&self, layer: u32, blocks: &[u32]) -> Vec<u32> {
        let slots = &self.layers[layer as usize].slots;
        blocks
            .iter()
            .copied()
            .filter(|&b| matches!(slots.get(b as usize), Some(Slot::Cold)))
            .collect()
    }

    /// Brings cold `blocks` of `layer` back into extents from `source`. All-or-nothing: on
    /// error (arena full, a read or verification failure) no block changed. Returns how many
    /// blocks were read.
    pub fn promote(
        &mut self,
        layer: u32,
        blocks: &[u32],
        source: &dyn ColdSource,
    ) -> Result<usize> {
        let cold = self.cold_among(layer, blocks);
        if cold.is_empty() {
            return Ok(0);
        }
        // Unzeroed: the source writes every byte (`ColdSource::read_runs`).
        let mut extents = self
            .arena
            .alloc_many_unzeroed(cold.len(), self.geo.block_bytes())?;
        source.read_runs(layer, &cold, &mut extents)?;
        let slots = &mut self.layers[layer as usize].slots;
        for (b, f) in cold.iter().zip(extents) {
            slots[*b as usize] = Slot::Hot(f);
        }
        Ok(cold.len())
    }

    /// The partially filled tail blocks that are cold, as `(layer, block)`: what must be
    /// promoted before an append.
    pub fn cold_tails(&self) -> Vec<(u32, u32)> {
        let bt = self.geo.block_tokens as u64;
        self.layers
            .iter()
            .enumerate()
            .filter(|(_, l)| l.tokens % bt != 0 && matches!(l.slots.last(), Some(Slot::Cold)))
            .map(|(i, l)| (i as u32, l.slots.len() as u32 - 1))
            .collect()
    }

    /// Cuts every layer back to at most `tokens` tokens: later blocks are dropped, the rows past
    /// the new tail are zeroed and the tail's bounds refolded, so the cache is bit-identical to
    /// one that never held the removed tokens (an append rolled back when a tier could not
    /// take it). Panics if a tail block it must rewrite is cold.
    pub fn truncate(&mut self, tokens: u64) {
        for l in 0..self.layers.len() {
            self.truncate_layer(l, tokens);
        }
    }

    /// [`KvCache::truncate`] of one layer (a DECODE's token, appended to its layer alone).
    pub fn truncate_layer(&mut self, layer: usize, tokens: u64) {
        let geo = self.geo;
        let bt = geo.block_tokens as u64;
        let spb = geo.summary_floats_per_block();
        let Some(l) = self.layers.get_mut(layer) else {
            return;
        };
        if l.tokens <= tokens {
            return;
        }
        let blocks = geo.blocks_for(tokens) as usize;
        l.slots.truncate(blocks);
        l.summaries.truncate(blocks * spb);
        l.tokens = tokens;
        let valid = (tokens % bt) as usize;
        if let Some(sk) = &mut l.sketches {
            sk.truncate(&geo, blocks);
        }
        if valid == 0 {
            return;
        }
        let Some(Slot::Hot(extent)) = l.slots.last_mut() else {
            panic!("truncate: the tail block must be resident");
        };
        let run = extent.as_mut_slice();
        zero_rows(&geo, run, valid, bt as usize);
        refold_bounds(&geo, run, valid, &mut l.summaries[(blocks - 1) * spb..]);
        if let Some(sk) = &mut l.sketches {
            sk.rebuild(&geo, blocks - 1, run, valid);
        }
    }

    /// Host bytes held (whole extents).
    pub fn host_bytes(&self) -> usize {
        self.extents() * self.run_extent_bytes()
    }

    /// Bytes of the arena extent one block run of this session takes.
    pub fn run_extent_bytes(&self) -> usize {
        crate::arena::extent_bytes(self.geo.block_bytes())
    }

    fn layer_kv(&self, layer: u32) -> Result<&LayerKv> {
        self.layers
            .get(layer as usize)
            .ok_or(StorageError::LayerOutOfRange {
                layer,
                layers: self.geo.layers,
            })
    }

    /// A read-only view of one layer for selection and attention.
    pub fn layer(&self, layer: u32) -> Result<LayerView<'_>> {
        let l = self.layer_kv(layer)?;
        Ok(LayerView {
            geo: &self.geo,
            tokens: l.tokens,
            slots: &l.slots,
            summaries: &l.summaries,
            sketches: l.sketches.as_ref(),
        })
    }

    /// Appends `n` tokens to one layer starting at `start`, which must equal the layer's length.
    /// `k` and `v` are `[n][kv_heads][head_dim]` in the session dtype (the engine's layout).
    /// All-or-nothing: on error nothing changed.
    pub fn append_layer(&mut self, layer: u32, start: u64, k: &[u8], v: &[u8]) -> Result<()> {
        let need = self.check_layer_append(layer, start, k, v)?;
        let mut fresh = self
            .arena
            .alloc_many_unzeroed(need, self.geo.block_bytes())?;
        self.append_layer_reserved(layer, start, k, v, &mut fresh)
    }

    /// Validates a one-layer append without changing anything; returns how many new extents it
    /// needs. Lets a batch of appends over many sessions reserve all extents before touching any.
    pub fn check_layer_append(&self, layer: u32, start: u64, k: &[u8], v: &[u8]) -> Result<usize> {
        let n = self.check_rows(layer, start, k, v)?;
        Ok(self.extents_needed(start, n))
    }

    /// [`KvCache::append_layer`] taking its new extents from `reserved` (at least
    /// [`KvCache::check_layer_append`]'s count).
    pub fn append_layer_reserved(
        &mut self,
        layer: u32,
        start: u64,
        k: &[u8],
        v: &[u8],
        reserved: &mut Vec<Extent>,
    ) -> Result<()> {
        let n = self.check_rows(layer, start, k, v)?;
        let need = self.extents_needed(start, n);
        let bytes = self.run_extent_bytes();
        if reserved.len() < need || reserved.iter().any(|f| f.len() != bytes) {
            return Err(self.arena.full(need, bytes));
        }
        self.write_layer(layer, k, v, n, reserved);
        Ok(())
    }

    /// Appends `n` tokens to every layer. `payload` is, for each layer in order, K then V, each
    /// `[n][kv_heads][head_dim]`: `2 * layers * n * token_bytes` bytes. All layers must have the
    /// same length `start`. All-or-nothing.
    pub fn append(&mut self, start: u64, n: u64, payload: &[u8]) -> Result<()> {
        let tb = self.geo.token_bytes() as u64;
        let expected = n
            .checked_mul(tb)
            .and_then(|x| x.checked_mul(2 * self.geo.layers as u64))
            .filter(|&x| x <= usize::MAX as u64)
            .ok_or(StorageError::TooManyTokens {
                max: self.max_tokens,
            })? as usize;
        if payload.len() != expected {
            return Err(StorageError::PayloadSize {
                what: "append payload",
                expected,
                got: payload.len(),
            });
        }
        let half = (n * tb) as usize;
        let rows = |layer: usize| {
            let at = 2 * half * layer;
            (&payload[at..at + half], &payload[at + half..at + 2 * half])
        };
        let layers = self.geo.layers as usize;
        if payload.len() < PARALLEL_APPEND_BYTES {
            let mut need = 0;
            for layer in 0..layers {
                let (k, v) = rows(layer);
                need += self.check_layer_append(layer as u32, start, k, v)?;
            }
            let mut fresh = self
                .arena
                .alloc_many_unzeroed(need, self.geo.block_bytes())?;
            for layer in 0..layers {
                let (k, v) = rows(layer);
                self.write_layer(layer as u32, k, v, n, &mut fresh);
            }
            debug_assert!(fresh.is_empty());
            return Ok(());
        }
        // A large append (a prefill, an engine's hand-off) checks and writes its layers on
        // several threads: each layer's rows, extents and bounds are its own.
        let threads = par::default_workers();
        let checked = par::map_indexed(layers, threads, "kvtier-append", |layer| {
            let (k, v) = rows(layer);
            self.check_layer_append(layer as u32, start, k, v)
        });
        let need = checked.into_iter().collect::<Result<Vec<usize>>>()?;
        let mut fresh = self
            .arena
            .alloc_many_unzeroed(need.iter().sum(), self.geo.block_bytes())?;
        // Layer 0 takes the last extents, layer 1 the ones before: what the serial path's pops
        // give each layer.
        let mut work: Vec<(&mut LayerKv, Vec<Extent>)> = Vec::with_capacity(layers);
        for (l, &count) in self.layers.iter_mut().zip(&need) {
            work.push((l, fresh.split_off(fresh.len() - count)));
        }
        debug_assert!(fresh.is_empty());
        let geo = self.geo;
        let src: Vec<(&[u8], &[u8])> = (0..layers).map(rows).collect();
        par::zip_mut(
            &mut work,
            &src,
            threads,
            "kvtier-append",
            |(l, own), &(k, v)| {
                write_rows(&geo, l, k, v, n, own);
            },
        );
        Ok(())
    }

    /// Validates one layer's rows; returns the token count.
    fn check_rows(&self, layer: u32, start: u64, k: &[u8], v: &[u8]) -> Result<u64> {
        let l = self.layer_kv(layer)?;
        if start != l.tokens {
            return Err(StorageError::PositionMismatch {
                layer,
                expected: l.tokens,
                got: start,
            });
        }
        let tb = self.geo.token_bytes();
        if !k.len().is_multiple_of(tb) {
            return Err(StorageError::PayloadSize {
                what: "k",
                expected: (k.len() / tb + 1) * tb,
                got: k.len(),
            });
        }
        if v.len() != k.len() {
            return Err(StorageError::PayloadSize {
                what: "v",
                expected: k.len(),
                got: v.len(),
            });
        }
        let n = (k.len() / tb) as u64;
        let bt = self.geo.block_tokens as u64;
        if n > 0 && l.tokens % bt != 0 {
            if let Some(Slot::Cold) = l.slots.last() {
                // The partial tail block must be in RAM to take more rows.
                return Err(StorageError::NotResident { layer, blocks: 1 });
            }
        }
        if l.tokens + n > self.max_tokens {
            return Err(StorageError::TooManyTokens {
                max: self.max_tokens,
            });
        }
        // A NaN key would poison every bound and score of its block; a NaN value every output.
        for (what, bytes) in [("k", k), ("v", v)] {
            if let Some(index) = self.geo.dtype.first_non_finite(bytes) {
                return Err(StorageError::NonFinite { what, index });
            }
        }
        Ok(n)
    }

    fn extents_needed(&self, tokens: u64, n: u64) -> usize {
        (self.geo.blocks_for(tokens + n) - self.geo.blocks_for(tokens)) as usize
    }

    /// Copies validated rows into the tail extents (opening blocks from `fresh`) and folds the
    /// keys into the blocks' bounds. Cannot fail.
    fn write_layer(&mut self, layer: u32, k: &[u8], v: &[u8], n: u64, fresh: &mut Vec<Extent>) {
        let geo = self.geo;
        write_rows(&geo, &mut self.layers[layer as usize], k, v, n, fresh);
    }
}

/// [`KvCache::write_layer`] on one layer: rows copied into its tail extents (each new extent's
/// other bytes zeroed), keys folded into its bounds.
fn write_rows(
    geo: &Geometry,
    l: &mut LayerKv,
    k: &[u8],
    v: &[u8],
    n: u64,
    fresh: &mut Vec<Extent>,
) {
    let (bt, hkv, d) = (
        geo.block_tokens as u64,
        geo.kv_heads as usize,
        geo.head_dim as usize,
    );
    let row = geo.row_bytes();
    let spb = geo.summary_floats_per_block();
    let mut key = [0f32; MAX_HEAD_DIM as usize];
    let key = &mut key[..d];
    let start = l.tokens;
    for i in 0..n as usize {
        let pos = l.tokens;
        let (block, slot) = ((pos / bt) as usize, (pos % bt) as usize);
        if block == l.slots.len() {
            let mut f = fresh.pop().expect("extents were reserved");
            // The extent may hold a former owner's bytes (the extents are not zeroed when
            // taken: the rows below overwrite most of them): zero the rows this append leaves
            // empty and the padding past the run.
            let filled = (n as usize - i).min(bt as usize);
            let run = f.as_mut_slice();
            zero_rows(geo, run, filled, bt as usize);
            run[geo.block_bytes()..].fill(0);
            l.slots.push(Slot::Hot(f));
            if let Some(sk) = &mut l.sketches {
                sk.open_block(geo);
            }
            // Empty bounds: every fold replaces them.
            for h in 0..hkv {
                let at = l.summaries.len();
                l.summaries.resize(at + d, f32::NEG_INFINITY);
                l.summaries.resize(at + 2 * d, f32::INFINITY);
                debug_assert_eq!(at, (block * hkv + h) * 2 * d);
            }
        }
        let Slot::Hot(extent) = &mut l.slots[block] else {
            unreachable!("the tail block is never evicted while it is being filled")
        };
        let extent = extent.as_mut_slice();
        let summ = &mut l.summaries[block * spb..(block + 1) * spb];
        for h in 0..hkv {
            let src = (i * hkv + h) * row;
            let (ks, vs) = (&k[src..src + row], &v[src..src + row]);
            let ko = geo.k_row_offset(h, slot);
            let vo = geo.v_row_offset(h, slot);
            extent[ko..ko + row].copy_from_slice(ks);
            extent[vo..vo + row].copy_from_slice(vs);
            // Bounds of the stored (rounded) key, so scores bound what attention will see.
            geo.dtype.decode(ks, key);
            let s = &mut summ[h * 2 * d..(h + 1) * 2 * d];
            let (mx, mn) = s.split_at_mut(d);
            for ((m, x), kv) in mx.iter_mut().zip(mn.iter_mut()).zip(key.iter()) {
                *m = m.max(*kv);
                *x = x.min(*kv);
            }
        }
        l.tokens += 1;
    }
    // The keys' sketches once their blocks hold them, block by block.
    if let Some(sk) = &mut l.sketches {
        let end = l.tokens;
        for b in start / bt..end.div_ceil(bt) {
            let Slot::Hot(extent) = &l.slots[b as usize] else {
                unreachable!("the blocks just written are resident")
            };
            let base = b * bt;
            let rows = (start.max(base) - base) as usize..(end.min(base + bt) - base) as usize;
            sk.add_run(geo, b as usize, extent.as_slice(), rows);
        }
    }
}

/// Zeroes rows `from..to` of every kv head's K and V tiles of a run.
fn zero_rows(geo: &Geometry, run: &mut [u8], from: usize, to: usize) {
    if from >= to {
        return;
    }
    let row = geo.row_bytes();
    for h in 0..geo.kv_heads as usize {
        for o in [geo.k_row_offset(h, from), geo.v_row_offset(h, from)] {
            run[o..o + (to - from) * row].fill(0);
        }
    }
}

/// Empty `[kv_head][max|min][D]` bounds: every fold replaces them.
fn reset_bounds(geo: &Geometry, summ: &mut [f32]) {
    let d = geo.head_dim as usize;
    for h in 0..geo.kv_heads as usize {
        let (mx, mn) = summ[h * 2 * d..(h + 1) * 2 * d].split_at_mut(d);
        mx.fill(f32::NEG_INFINITY);
        mn.fill(f32::INFINITY);
    }
}

/// Folds the stored keys of rows `rows` of a run into its block's bounds, in row order (what
/// appending them one by one does).
fn fold_bounds(geo: &Geometry, run: &[u8], rows: std::ops::Range<usize>, summ: &mut [f32]) {
    let (d, row) = (geo.head_dim as usize, geo.row_bytes());
    let mut key = [0f32; MAX_HEAD_DIM as usize];
    let key = &mut key[..d];
    for h in 0..geo.kv_heads as usize {
        let (mx, mn) = summ[h * 2 * d..(h + 1) * 2 * d].split_at_mut(d);
        for t in rows.clone() {
            let o = geo.k_row_offset(h, t);
            geo.dtype.decode(&run[o..o + row], key);
            for ((m, x), kv) in mx.iter_mut().zip(mn.iter_mut()).zip(key.iter()) {
                *m = m.max(*kv);
                *x = x.min(*kv);
            }
        }
    }
}

/// Recomputes one block's `[kv_head][max|min][D]` bounds from the first `valid` stored keys of
/// its run (exactly what folding them in one by one on append produces): the summary of
/// [`LayerView::summaries`], for an engine that reads runs in place (LEASE).
pub fn refold_bounds(geo: &Geometry, run: &[u8], valid: usize, summ: &mut [f32]) {
    reset_bounds(geo, summ);
    fold_bounds(geo, run, 0..valid, summ);
}

/// Read-only view of one layer of a session's cache.
#[derive(Clone, Copy)]
pub struct LayerView<'a> {
    geo: &'a Geometry,
    tokens: u64,
    slots: &'a [Slot],
    summaries: &'a [f32],
    sketches: Option<&'a LayerSketches>,
}

impl<'a> LayerView<'a> {
    pub fn geometry(&self) -> &'a Geometry {
        self.geo
    }

    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    pub fn blocks(&self) -> usize {
        self.slots.len()
    }

    /// All summaries of the layer: `[block][kv_head][max|min][D]` f32.
    pub fn summaries(&self) -> &'a [f32] {
        self.summaries
    }

    /// `(k_max, k_min)` of one (block, kv-head).
    pub fn bounds(&self, block: usize, kv_head: usize) -> (&'a [f32], &'a [f32]) {
        let d = self.geo.head_dim as usize;
        let at = (block * self.geo.kv_heads as usize + kv_head) * 2 * d;
        let s = &self.summaries[at..at + 2 * d];
        s.split_at(d)
    }

    /// Whether the layer keeps per-token key sketches.
    pub fn has_sketches(&self) -> bool {
        self.sketches.is_some()
    }

    /// One (block, kv-head)'s sketch ([`crate::sketch`]); None when the cache keeps none.
    pub fn sketch(&self, block: usize, kv_head: usize) -> Option<HeadSketch<'a>> {
        self.sketches.map(|s| s.get(self.geo, block, kv_head))
    }

    /// The sketches of blocks `blocks` whole, in [`crate::sketch`]'s host layout (what a
    /// device uploads); None when the cache keeps none.
    pub fn sketch_blocks(&self, blocks: std::ops::Range<usize>) -> Option<BlockSketchesRef<'a>> {
        self.sketches.map(|s| s.range(self.geo, blocks))
    }

    /// Tokens present in `block`: B except for the tail block.
    pub fn valid_tokens(&self, block: usize) -> usize {
        let bt = self.geo.block_tokens as u64;
        (self.tokens - block as u64 * bt).min(bt) as usize
    }

    /// The arena extent holding `block`, or None while the block is cold.
    pub fn extent(&self, block: usize) -> Option<&'a Extent> {
        self.slots[block].extent()
    }

    /// The (layer, block) run: every KV head's K tile then V tile. Panics if the block is
    /// cold: callers bring a keep-set in ([`KvCache::promote`]) before attending to it.
    pub fn block_run(&self, block: usize) -> &'a [u8] {
        let extent = self.slots[block]
            .extent()
            .unwrap_or_else(|| panic!("block {block} is not resident; promote it before reading"));
        &extent.as_slice()[..self.geo.block_bytes()]
    }

    /// `(K tile, V tile)` of one (block, kv-head); rows past `valid_tokens` are zero.
    pub fn tile(&self, block: usize, kv_head: usize) -> (&'a [u8], &'a [u8]) {
        let at = self.geo.tile_offset(kv_head);
        let half = self.geo.half_tile_bytes();
        let run = self.block_run(block);
        (&run[at..at + half], &run[at + half..at + 2 * half])
    }
}
