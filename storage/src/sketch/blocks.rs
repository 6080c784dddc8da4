//! The sketches of whole blocks: the host layout a device takes ([`BlockSketches`]), a block's
//! sketch from its run ([`sketch_block`]), and a layer's sketches kept as keys arrive.

use super::*;

/// Owned sketches of consecutive blocks in the host layout (what a device takes).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct BlockSketches {
    pub codes: Vec<u8>,
    pub channel_scales: Vec<f32>,
    pub quarters: Vec<u16>,
    pub quarter_codes: Vec<i8>,
    pub quarter_scales: Vec<f32>,
}

/// Element counts of one block's sketch: (codes, channel scales, quarters / quarter codes,
/// quarter scales).
fn per_block(geo: &Geometry) -> (usize, usize, usize, usize) {
    let (hkv, bt, d) = (
        geo.kv_heads as usize,
        geo.block_tokens as usize,
        geo.head_dim as usize,
    );
    (
        hkv * bt * code_bytes(d),
        hkv * d,
        hkv * quarters(bt) * 2 * d,
        hkv,
    )
}

impl BlockSketches {
    /// `n` empty blocks.
    pub fn new(geo: &Geometry, n: usize) -> Self {
        let (c, s, q, qs) = per_block(geo);
        let mut b = BlockSketches {
            codes: vec![0; n * c],
            channel_scales: vec![0.0; n * s],
            quarters: vec![0; n * q],
            quarter_codes: vec![0; n * q],
            quarter_scales: vec![0.0; n * qs],
        };
        reset_quarters(&mut b.quarters, geo.head_dim as usize);
        for mut block in b.blocks_mut(geo) {
            block.quantize(geo);
        }
        b
    }

    /// Every block, mutably, in order.
    pub fn blocks_mut(&mut self, geo: &Geometry) -> impl Iterator<Item = BlockSketch<'_>> {
        let (c, s, q, qs) = per_block(geo);
        self.codes
            .chunks_exact_mut(c)
            .zip(self.channel_scales.chunks_exact_mut(s))
            .zip(self.quarters.chunks_exact_mut(q))
            .zip(self.quarter_codes.chunks_exact_mut(q))
            .zip(self.quarter_scales.chunks_exact_mut(qs))
            .map(
                |((((codes, channel_scales), quarters), quarter_codes), quarter_scales)| {
                    BlockSketch {
                        codes,
                        channel_scales,
                        quarters,
                        quarter_codes,
                        quarter_scales,
                    }
                },
            )
    }

    /// The sketches borrowed.
    pub fn as_ref(&self) -> BlockSketchesRef<'_> {
        BlockSketchesRef {
            codes: &self.codes,
            channel_scales: &self.channel_scales,
            quarters: &self.quarters,
            quarter_codes: &self.quarter_codes,
            quarter_scales: &self.quarter_scales,
        }
    }

    /// Appends another run of blocks.
    pub fn extend(&mut self, other: &BlockSketches) {
        self.codes.extend_from_slice(&other.codes);
        self.channel_scales.extend_from_slice(&other.channel_scales);
        self.quarters.extend_from_slice(&other.quarters);
        self.quarter_codes.extend_from_slice(&other.quarter_codes);
        self.quarter_scales.extend_from_slice(&other.quarter_scales);
    }
}

/// Sketches of consecutive blocks, borrowed (a layer's, or [`BlockSketches`]').
#[derive(Debug, Clone, Copy)]
pub struct BlockSketchesRef<'a> {
    pub codes: &'a [u8],
    pub channel_scales: &'a [f32],
    pub quarters: &'a [u16],
    pub quarter_codes: &'a [i8],
    pub quarter_scales: &'a [f32],
}

impl<'a> BlockSketchesRef<'a> {
    /// Blocks held.
    pub fn blocks(&self, geo: &Geometry) -> usize {
        self.quarter_scales.len() / per_block(geo).3
    }

    /// One (block, kv head)'s sketch.
    pub fn head(&self, geo: &Geometry, block: usize, kv_head: usize) -> HeadSketch<'a> {
        let (bt, d) = (geo.block_tokens as usize, geo.head_dim as usize);
        let (cb, qv) = (code_bytes(d), quarters(bt) * 2 * d);
        let r = block * geo.kv_heads as usize + kv_head;
        HeadSketch {
            codes: &self.codes[r * bt * cb..(r + 1) * bt * cb],
            channel_scales: &self.channel_scales[r * d..(r + 1) * d],
            quarters: &self.quarters[r * qv..(r + 1) * qv],
            quarter_codes: &self.quarter_codes[r * qv..(r + 1) * qv],
            quarter_scale: self.quarter_scales[r],
        }
    }
}

/// The sketches of one block, borrowed whole.
pub struct BlockSketch<'a> {
    pub codes: &'a mut [u8],
    pub channel_scales: &'a mut [f32],
    pub quarters: &'a mut [u16],
    pub quarter_codes: &'a mut [i8],
    pub quarter_scales: &'a mut [f32],
}

impl BlockSketch<'_> {
    /// Recomputes the quarter codes of every kv head from its quarter bounds.
    pub(crate) fn quantize(&mut self, geo: &Geometry) {
        let d = geo.head_dim as usize;
        let qv = quarters(geo.block_tokens as usize) * 2 * d;
        for ((q, c), s) in self
            .quarters
            .chunks_exact(qv)
            .zip(self.quarter_codes.chunks_exact_mut(qv))
            .zip(self.quarter_scales.iter_mut())
        {
            *s = quantize_quarters(q, c, d);
        }
    }
}

/// One (block, kv head)'s sketch, read-only: key codes `[B][code bytes]`, channel scales
/// `[D]`, quarter bounds `[quarter][max|min][D]` (bf16 bits), quarter codes (same shape, int8) and
/// their scale.
#[derive(Clone, Copy, Debug)]
pub struct HeadSketch<'a> {
    pub codes: &'a [u8],
    pub channel_scales: &'a [f32],
    pub quarters: &'a [u16],
    pub quarter_codes: &'a [i8],
    pub quarter_scale: f32,
}

/// Sketches the first `valid` stored keys of a block run into one block's sketch, resetting
/// the rest: what appending them one by one produces. The engine's sketches of a leased block
/// come from here.
pub fn sketch_block(geo: &Geometry, run: &[u8], valid: usize, mut out: BlockSketch<'_>) {
    let (d, row, bt) = (
        geo.head_dim as usize,
        geo.row_bytes(),
        geo.block_tokens as usize,
    );
    let (cb, qb) = (code_bytes(d), self::quarters(bt) * 2 * d);
    reset_quarters(out.quarters, d);
    // Each head's keys decoded once, for both passes.
    let mut keys = vec![0f32; valid * d];
    let mut amax = vec![0f32; d];
    for h in 0..geo.kv_heads as usize {
        for (t, key) in keys.chunks_exact_mut(d).enumerate() {
            let o = geo.k_row_offset(h, t);
            geo.dtype.decode(&run[o..o + row], key);
        }
        // The channels' scales over every valid key, then each key's codes under them.
        amax.fill(0.0);
        for (t, key) in keys.chunks_exact(d).enumerate() {
            for (m, x) in amax.iter_mut().zip(key) {
                // f32::max for a non-negative (or NaN) `x.abs()`, but branch-free.
                let a = x.abs();
                *m = if a > *m { a } else { *m };
            }
            let q = h * qb + quarter_of(t, bt) * 2 * d;
            fold_quarter(&mut out.quarters[q..q + 2 * d], key);
        }
        let scales = &mut out.channel_scales[h * d..(h + 1) * d];
        for (s, &m) in scales.iter_mut().zip(&amax) {
            *s = channel_scale(m);
        }
        let codes = &mut out.codes[h * bt * cb..(h + 1) * bt * cb];
        let (kept, past) = codes.split_at_mut(valid * cb);
        for (key, c) in keys.chunks_exact(d).zip(kept.chunks_exact_mut(cb)) {
            quantize_key(key, scales, c);
        }
        past.fill(0);
    }
    out.quantize(geo);
}

/// The sketches of one layer's blocks.
#[derive(Debug, Default)]
pub(crate) struct LayerSketches(BlockSketches);

impl LayerSketches {
    /// Blocks sketched.
    pub(crate) fn blocks(&self, geo: &Geometry) -> usize {
        self.0.as_ref().blocks(geo)
    }

    /// Appends an empty block.
    pub(crate) fn open_block(&mut self, geo: &Geometry) {
        self.open_blocks(geo, 1);
    }

    /// Appends `n` empty blocks (a prefill's layer opens hundreds at once).
    pub(crate) fn open_blocks(&mut self, geo: &Geometry, n: usize) {
        self.append(BlockSketches::new(geo, n));
    }

    /// Appends `blocks`: moved into an empty layer (a prefill's, hundreds of MB at 128K
    /// tokens), copied after blocks it holds.
    fn append(&mut self, blocks: BlockSketches) {
        if self.0.quarter_scales.is_empty() {
            self.0 = blocks;
        } else {
            self.0.extend(&blocks);
        }
    }

    /// Keeps the first `blocks` blocks.
    pub(crate) fn truncate(&mut self, geo: &Geometry, blocks: usize) {
        let (c, s, q, qs) = per_block(geo);
        let b = &mut self.0;
        b.codes.truncate(blocks * c);
        b.channel_scales.truncate(blocks * s);
        b.quarters.truncate(blocks * q);
        b.quarter_codes.truncate(blocks * q);
        b.quarter_scales.truncate(blocks * qs);
    }

    /// Adds one key (already decoded to f32) of token `slot` of a block whose stored run
    /// `run` holds it and the block's earlier keys: its codes, the channel scales it raises
    /// (re-quantizing those channels of the earlier keys) and its quarter's bounds. The
    /// block's quarter codes follow at [`Self::seal`].
    pub(crate) fn add(
        &mut self,
        geo: &Geometry,
        block: usize,
        kv_head: usize,
        slot: usize,
        key: &[f32],
        run: &[u8],
    ) {
        let (bt, d) = (geo.block_tokens as usize, geo.head_dim as usize);
        let (cb, es) = (code_bytes(d), geo.dtype.size());
        let b = &mut self.0;
        let r = block * geo.kv_heads as usize + kv_head;
        let scales = &mut b.channel_scales[r * d..(r + 1) * d];
        let codes = &mut b.codes[r * bt * cb..(r + 1) * bt * cb];
        for (c, (s, &x)) in scales.iter_mut().zip(key).enumerate() {
            // The scale of the max is the max of the scales: division rounds monotonically.
            let new = channel_scale(x.abs());
            if new > *s {
                *s = new;
                let mut v = [0f32];
                for (t, codes) in codes.chunks_exact_mut(cb).take(slot).enumerate() {
                    let o = geo.k_row_offset(kv_head, t) + c * es;
                    geo.dtype.decode(&run[o..o + es], &mut v);
                    set_code(codes, c, key_code(v[0], new));
                }
            }
        }
        quantize_key(key, scales, &mut codes[slot * cb..(slot + 1) * cb]);
        let q = (r * quarters(bt) + quarter_of(slot, bt)) * 2 * d;
        fold_quarter(&mut b.quarters[q..q + 2 * d], key);
    }

    /// Recomputes a block's quarter codes after keys were added to it.
    pub(crate) fn seal(&mut self, geo: &Geometry, block: usize) {
        self.blocks_mut(geo, block)
            .next()
            .expect("the block exists")
            .quantize(geo);
    }

    /// Adds rows `rows` of a block from its stored run (every kv head), then seals it. Rows
    /// that are a large share of the block's (a prefill's whole blocks) sketch the block anew,
    /// which equals adding them one by one without re-quantizing earlier keys each time a
    /// channel's scale grows.
    pub(crate) fn add_run(
        &mut self,
        geo: &Geometry,
        block: usize,
        run: &[u8],
        rows: std::ops::Range<usize>,
    ) {
        if rows.len() * 4 >= rows.end {
            self.rebuild(geo, block, run, rows.end);
            return;
        }
        let (d, row) = (geo.head_dim as usize, geo.row_bytes());
        let mut key = [0f32; MAX_HEAD_DIM as usize];
        let key = &mut key[..d];
        for h in 0..geo.kv_heads as usize {
            for t in rows.clone() {
                let o = geo.k_row_offset(h, t);
                geo.dtype.decode(&run[o..o + row], key);
                self.add(geo, block, h, t, key, run);
            }
        }
        self.seal(geo, block);
    }

    /// A copy of block `block` alone: what a staged append adds keys to before it adopts them
    /// ([`Self::replace_from`]).
    pub(crate) fn copy_block(&self, geo: &Geometry, block: usize) -> LayerSketches {
        let r = self.range(geo, block..block + 1);
        LayerSketches(BlockSketches {
            codes: r.codes.to_vec(),
            channel_scales: r.channel_scales.to_vec(),
            quarters: r.quarters.to_vec(),
            quarter_codes: r.quarter_codes.to_vec(),
            quarter_scales: r.quarter_scales.to_vec(),
        })
    }

    /// Blocks `block..` become `staged`'s blocks.
    pub(crate) fn replace_from(&mut self, geo: &Geometry, block: usize, staged: LayerSketches) {
        self.truncate(geo, block);
        self.append(staged.0);
    }

    /// Rebuilds one block from the first `valid` keys of its run (truncation).
    pub(crate) fn rebuild(&mut self, geo: &Geometry, block: usize, run: &[u8], valid: usize) {
        let b = self
            .blocks_mut(geo, block)
            .next()
            .expect("the block exists");
        sketch_block(geo, run, valid, b);
    }

    /// Blocks `blocks` whole.
    pub(crate) fn range(
        &self,
        geo: &Geometry,
        blocks: std::ops::Range<usize>,
    ) -> BlockSketchesRef<'_> {
        let (c, s, q, qs) = per_block(geo);
        let b = &self.0;
        BlockSketchesRef {
            codes: &b.codes[blocks.start * c..blocks.end * c],
            channel_scales: &b.channel_scales[blocks.start * s..blocks.end * s],
            quarters: &b.quarters[blocks.start * q..blocks.end * q],
            quarter_codes: &b.quarter_codes[blocks.start * q..blocks.end * q],
            quarter_scales: &b.quarter_scales[blocks.start * qs..blocks.end * qs],
        }
    }

    /// One (block, kv head)'s sketch.
    pub(crate) fn get(&self, geo: &Geometry, block: usize, kv_head: usize) -> HeadSketch<'_> {
        self.0.as_ref().head(geo, block, kv_head)
    }

    /// Whole blocks `first..`, for a parallel rebuild.
    pub(crate) fn blocks_mut(
        &mut self,
        geo: &Geometry,
        first: usize,
    ) -> impl Iterator<Item = BlockSketch<'_>> {
        self.0.blocks_mut(geo).skip(first)
    }

    /// Host bytes held.
    pub(crate) fn bytes(&self) -> usize {
        let b = &self.0;
        b.codes.len()
            + 4 * b.channel_scales.len()
            + 2 * b.quarters.len()
            + b.quarter_codes.len()
            + 4 * b.quarter_scales.len()
    }
}
