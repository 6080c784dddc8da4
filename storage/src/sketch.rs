//! Per-block sketches for the sketch selector (`Selector::Sketch`): every stored key quantized
//! to int4 with one absmax scale per channel of the block, and the key bounds of each quarter
//! of the block.
//!
//! **Key codes.** For each (block, kv head), channel `d` has the scale `s_d = max_t |k_t[d]| /
//! 7` over the block's valid keys `k_t` (the stored keys, after dtype rounding, in f32), and
//! key `t` the codes `c_t[d] = clamp(round_ties_even(k_t[d] / s_d), -7, 7)` (0 where `s_d` is
//! 0), in IEEE single precision with round-to-nearest, so the same keys give the same codes on
//! every machine. One scale per channel, not per key: a model's keys have outlier channels
//! (in Gemma 3's global layers one channel's absmax is ~25x the median channel's), and a
//! per-key scale set by the outlier rounds most of a key's other elements to 0 or +-1
//! (docs/fidelity.md). A key's codes take [`code_bytes`] bytes: `W = padded(D) / 4`
//! little-endian u16 words (`padded(D)` is D rounded up to a multiple of 32, the padding codes
//! 0), element `e` in word `e % W` at bits `4 * (e / W)`, as 4-bit two's complement. So
//! shifting eight consecutive words by the same amount yields eight consecutive elements (one
//! SIMD or GPU word operation per eight codes). A block's codes and its D f32 scales are a
//! quarter of its bf16 keys when D <= B.
//!
//! A key that raises a channel's scale re-quantizes that channel of the block's earlier keys,
//! read back from the stored run: a channel's scale rises about ln(B) times while a block
//! fills, so appending costs about one key's quantization per key.
//!
//! **Quarter bounds.** A block of B tokens is cut into [`quarters`] `n` runs of consecutive
//! tokens of at least 32 tokens each (`n` is 4 from B = 128, 2 from 64, else 1, so the first
//! stage reads as many records per token in 64-token blocks as in 128-token ones), quarter `j`
//! holding tokens `floor(j B / n)..floor((j + 1) B / n)`; each keeps the element-wise max and
//! min of its keys like a block summary, rounded outward to bf16
//! ([`crate::dtype::bf16_outward`]). A quarter without tokens yet holds `(-inf, +inf)`.
//! What selection reads are their **quarter codes**: per (block, kv head) one scale
//! `s = max |bound| / 127` over its quarters with tokens, and per quarter the max rounded up and
//! the min rounded down to multiples of it, `ceil(max / s)` and `floor(min / s)` clamped to
//! `-127..=127` (all 0 when `s` is 0; a quarter without tokens `-127` and `127`), int8: a
//! quarter's key bound against an int8 query is then two integer dot products, exact on every
//! machine. They are recomputed from the bounds whenever a block takes keys.
//!
//! A layer keeps, per block: codes `[kv_head][B][code bytes]`, channel scales `[kv_head][D]`
//! (codes of rows past the block's valid tokens zero), quarter bounds
//! `[kv_head][quarter][max|min][D]`, quarter codes `[kv_head][quarter][max|min][D]` and their
//! scales `[kv_head]`. Every path that adds keys (appends, in-place commits, restores,
//! truncation) produces the same bits as appending the keys one by one.

use crate::dtype::bf16_outward;
use crate::geometry::{Geometry, MAX_HEAD_DIM};
use wide::f32x8;

// Codes are built in a stack buffer of the largest padded key.
const _: () = assert!((MAX_HEAD_DIM as usize).is_multiple_of(32));

/// Largest code magnitude: codes are in `-KEY_LEVELS..=KEY_LEVELS`.
pub const KEY_LEVELS: i32 = 7;

/// bf16 bits of -inf and +inf: the bounds of a quarter without keys.
const BF16_NEG_INF: u16 = 0xff80;
const BF16_POS_INF: u16 = 0x7f80;

/// Dims of a key's codes: `head_dim` rounded up to a multiple of 32.
pub fn padded_dims(head_dim: usize) -> usize {
    head_dim.next_multiple_of(32)
}

/// Bytes of one key's packed codes.
pub fn code_bytes(head_dim: usize) -> usize {
    padded_dims(head_dim) / 2
}

/// Quarters a block of `block_tokens` tokens is cut into: runs of at least 32 tokens, four
/// from 128 tokens, two (halves) from 64, else one.
pub fn quarters(block_tokens: usize) -> usize {
    match block_tokens {
        128.. => 4,
        64..128 => 2,
        _ => 1,
    }
}

/// The quarter token `slot` of a block of `block_tokens` falls in.
pub fn quarter_of(slot: usize, block_tokens: usize) -> usize {
    let n = quarters(block_tokens);
    ((slot + 1) * n).div_ceil(block_tokens) - 1
}

/// `x` rounded to the nearest integer, ties to even, for `|x| <= 2^22`: adding and removing
/// 1.5 * 2^23 leaves no fraction bits (IEEE round-to-nearest-even does the rounding), which
/// compiles to two vector adds where `round_ties_even` is a libm call on baseline x86-64.
#[inline(always)]
pub fn round_half_even(x: f32) -> f32 {
    (x + ROUNDING_MAGIC) - ROUNDING_MAGIC
}

/// 1.5 * 2^23: [`round_half_even`]'s constant (for SIMD ports of it).
pub const ROUNDING_MAGIC: f32 = 12_582_912.0;

/// A channel's scale from the largest |element| of the channel over the block's keys.
#[inline(always)]
pub fn channel_scale(amax: f32) -> f32 {
    amax / KEY_LEVELS as f32
}

/// The symmetric code of `x` under `scale`: `clamp(round_half_even(x / scale), -levels,
/// levels)`, 0 where the scale is 0. Keys (int4) and queries (int8) are quantized by it.
#[inline(always)]
pub fn code(x: f32, scale: f32, levels: i32) -> i16 {
    if scale == 0.0 {
        return 0;
    }
    let lim = levels as f32;
    round_half_even(x / scale).clamp(-lim, lim) as i16
}

/// The code of a key element `x` whose channel's scale is `scale`.
#[inline(always)]
pub fn key_code(x: f32, scale: f32) -> i16 {
    code(x, scale, KEY_LEVELS)
}

/// Packs the codes of `key` under its block's channel scales `scales` (one per element) into
/// `codes` (exactly [`code_bytes`] long; the padding codes 0).
pub fn quantize_key(key: &[f32], scales: &[f32], codes: &mut [u8]) {
    debug_assert_eq!(codes.len(), code_bytes(key.len()));
    debug_assert_eq!(scales.len(), key.len());
    let mut c = [0u16; MAX_HEAD_DIM as usize];
    // `key_code` eight elements at a time: the same IEEE division, rounding and clamp (no NaN
    // reaches the clamp but 0 / 0, whose code a zero scale sets to 0 anyway), so the codes
    // are bit for bit the scalar rule's; the tail, if any, by the scalar rule.
    let (lim, magic) = (
        f32x8::splat(KEY_LEVELS as f32),
        f32x8::splat(ROUNDING_MAGIC),
    );
    let lanes = key.len() / 8 * 8;
    for ((o, x), s) in c[..lanes]
        .chunks_exact_mut(8)
        .zip(key.chunks_exact(8))
        .zip(scales.chunks_exact(8))
    {
        let (x, s) = (
            f32x8::new(x.try_into().unwrap()),
            f32x8::new(s.try_into().unwrap()),
        );
        let r = ((x / s + magic) - magic).fast_max(-lim).fast_min(lim);
        let r = s.simd_eq(f32x8::ZERO).select(f32x8::ZERO, r);
        for (o, v) in o.iter_mut().zip(r.fast_trunc_int().to_array()) {
            *o = (v as u16) & 0xf;
        }
    }
    for ((o, &x), &s) in c[lanes..key.len()]
        .iter_mut()
        .zip(&key[lanes..])
        .zip(&scales[lanes..])
    {
        *o = (key_code(x, s) as u16) & 0xf;
    }
    let w = codes.len() / 2;
    for (word, out) in codes.chunks_exact_mut(2).enumerate() {
        let v = c[word] | c[w + word] << 4 | c[2 * w + word] << 8 | c[3 * w + word] << 12;
        out.copy_from_slice(&v.to_le_bytes());
    }
}

/// Replaces the code of element `e` of one packed key.
fn set_code(codes: &mut [u8], e: usize, code: i16) {
    let w = codes.len() / 2;
    let (at, shift) = (2 * (e % w), 4 * (e / w));
    let v = u16::from_le_bytes([codes[at], codes[at + 1]]);
    let v = (v & !(0xf << shift)) | ((code as u16) & 0xf) << shift;
    codes[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

/// The signed codes of one packed key, into `out` ([`padded_dims`] long): element `e` at
/// `out[e]`.
#[inline(always)]
pub fn unpack(codes: &[u8], out: &mut [i16]) {
    let w = codes.len() / 2;
    for (word, b) in codes.chunks_exact(2).enumerate() {
        let v = u16::from_le_bytes([b[0], b[1]]);
        for j in 0..4 {
            // Shift the nibble to the top, then arithmetic right: sign extension.
            out[j * w + word] = ((v << (12 - 4 * j)) as i16) >> 12;
        }
    }
}

/// Folds one key into a quarter's `[max|min][D]` bf16 bounds, rounded outward. Compares in
/// f32 (a widened bf16 is exact).
fn fold_quarter(bounds: &mut [u16], key: &[f32]) {
    let d = key.len();
    let (mx, mn) = bounds.split_at_mut(d);
    let f = |b: u16| f32::from_bits(u32::from(b) << 16);
    for ((m, n), &x) in mx.iter_mut().zip(mn.iter_mut()).zip(key) {
        let (up, down) = (bf16_outward(x, true), bf16_outward(x, false));
        *m = if f(up) > f(*m) { up } else { *m };
        *n = if f(down) < f(*n) { down } else { *n };
    }
}

/// Empty quarter bounds: every fold replaces them.
fn reset_quarters(bounds: &mut [u16], d: usize) {
    for q in bounds.chunks_exact_mut(2 * d) {
        q[..d].fill(BF16_NEG_INF);
        q[d..].fill(BF16_POS_INF);
    }
}

/// Largest quarter code magnitude: quarter codes are in `-BOUND_LEVELS..=BOUND_LEVELS`.
pub const BOUND_LEVELS: i32 = 127;

/// Recomputes one (block, kv head)'s quarter codes from its quarter bounds
/// (`[quarter][max|min][D]` bf16 bits); returns their scale.
fn quantize_quarters(quarters: &[u16], codes: &mut [i8], d: usize) -> f32 {
    let f = |b: u16| f32::from_bits(u32::from(b) << 16);
    let amax = quarters
        .chunks_exact(2 * d)
        .filter(|q| q[..d].iter().all(|&b| f(b).is_finite()))
        .flat_map(|q| q.iter())
        .fold(0f32, |m, &b| m.max(f(b).abs()));
    let scale = amax / BOUND_LEVELS as f32;
    let lim = BOUND_LEVELS as f32;
    for (q, c) in quarters
        .chunks_exact(2 * d)
        .zip(codes.chunks_exact_mut(2 * d))
    {
        if !f(q[0]).is_finite() {
            // No tokens yet: an empty box (never scored: only full blocks are).
            c[..d].fill(-(BOUND_LEVELS as i8));
            c[d..].fill(BOUND_LEVELS as i8);
        } else if scale == 0.0 {
            c.fill(0);
        } else {
            for (o, &b) in c[..d].iter_mut().zip(&q[..d]) {
                *o = (f(b) / scale).ceil().clamp(-lim, lim) as i8;
            }
            for (o, &b) in c[d..].iter_mut().zip(&q[d..]) {
                *o = (f(b) / scale).floor().clamp(-lim, lim) as i8;
            }
        }
    }
    scale
}

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
    out.codes.fill(0);
    reset_quarters(out.quarters, d);
    let mut key = [0f32; MAX_HEAD_DIM as usize];
    let key = &mut key[..d];
    for h in 0..geo.kv_heads as usize {
        // The channels' scales over every valid key, then each key's codes under them.
        let scales = &mut out.channel_scales[h * d..(h + 1) * d];
        let mut amax = [0f32; MAX_HEAD_DIM as usize];
        for t in 0..valid {
            let o = geo.k_row_offset(h, t);
            geo.dtype.decode(&run[o..o + row], key);
            for (m, x) in amax.iter_mut().zip(key.iter()) {
                *m = m.max(x.abs());
            }
            let q = h * qb + quarter_of(t, bt) * 2 * d;
            fold_quarter(&mut out.quarters[q..q + 2 * d], key);
        }
        for (s, &m) in scales.iter_mut().zip(&amax) {
            *s = channel_scale(m);
        }
        for t in 0..valid {
            let o = geo.k_row_offset(h, t);
            geo.dtype.decode(&run[o..o + row], key);
            let r = h * bt + t;
            quantize_key(key, scales, &mut out.codes[r * cb..(r + 1) * cb]);
        }
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
        self.0.extend(&BlockSketches::new(geo, 1));
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
    pub(crate) fn replace_from(&mut self, geo: &Geometry, block: usize, staged: &LayerSketches) {
        self.truncate(geo, block);
        self.0.extend(&staged.0);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_under_their_channel_scales() {
        let key = [0.7f32, -0.35, 0.0, 0.1, -0.7];
        let scales = [0.1f32, 0.1, 0.1, 0.1, 0.0];
        let mut codes = [0u8; 16];
        quantize_key(&key, &scales, &mut codes);
        let mut out = [0i16; 32];
        unpack(&codes, &mut out);
        // -0.35 / 0.1 = -3.5 rounds to even: -4; a channel of scale 0 codes 0; the padding is
        // zero.
        assert_eq!(out[..5], [7, -4, 0, 1, 0]);
        assert!(out[5..].iter().all(|&c| c == 0));
        assert_eq!(channel_scale(0.7), 0.7 / 7.0);
        assert_eq!(key_code(100.0, 1.0), 7);
    }

    /// The eight-lane quantizer gives every element the scalar rule's code: ties, the clamp,
    /// zero and tiny scales, signed zeros and subnormals, at head dims with and without a tail.
    #[test]
    fn quantize_key_is_the_scalar_rule_element_by_element() {
        let mut rng = crate::testing::Rng::new(0x2545_f491);
        let mut next = || rng.next_u64() as u32;
        let special = [
            0.0f32, -0.0, 0.5, -0.5, 1.5, -2.5, 7.5, -7.5, 7.0, 1e-40, -1e-40, 1e30,
        ];
        for d in [3usize, 8, 20, 40, 128, 256] {
            for round in 0..400 {
                let mut scales = vec![0f32; d];
                let mut key = vec![0f32; d];
                for (s, k) in scales.iter_mut().zip(key.iter_mut()) {
                    let r = next();
                    *s = match r % 7 {
                        0 => 0.0,
                        1 => 1e-38,
                        2 => 1.0,
                        _ => f32::from_bits(0x3c00_0000 + (next() >> 9)),
                    };
                    *k = match (r >> 3) % 4 {
                        0 => special[(next() % special.len() as u32) as usize] * s.max(1.0),
                        1 => special[(next() % special.len() as u32) as usize],
                        _ => {
                            f32::from_bits(next() & 0xbfff_ffff)
                                * if round % 2 == 0 { 1.0 } else { *s }
                        }
                    };
                }
                let mut codes = vec![0u8; code_bytes(d)];
                quantize_key(&key, &scales, &mut codes);
                let mut out = vec![0i16; padded_dims(d)];
                unpack(&codes, &mut out);
                for e in 0..d {
                    assert_eq!(
                        out[e],
                        key_code(key[e], scales[e]),
                        "d {d} e {e}: {} / {}",
                        key[e],
                        scales[e]
                    );
                }
                assert!(out[d..].iter().all(|&c| c == 0));
            }
        }
    }

    #[test]
    fn every_code_of_every_element_unpacks_to_itself() {
        for d in [2usize, 20, 32, 128, 256] {
            let scales = vec![1f32; d];
            for e in 0..d {
                for c in -KEY_LEVELS..=KEY_LEVELS {
                    let mut key = vec![0f32; d];
                    key[e] = c as f32;
                    key[(e + 1) % d] = 7.0;
                    let mut codes = vec![0u8; code_bytes(d)];
                    quantize_key(&key, &scales, &mut codes);
                    let mut out = vec![0i16; padded_dims(d)];
                    unpack(&codes, &mut out);
                    let want: Vec<i16> = key.iter().map(|&x| x as i16).collect();
                    assert_eq!(out[..d], want[..], "d {d} e {e} c {c}");
                    // Rewriting one element's code changes that element only.
                    let other = (c + 3).rem_euclid(15) - 7;
                    set_code(&mut codes, e, other as i16);
                    unpack(&codes, &mut out);
                    let mut want = want;
                    want[e] = other as i16;
                    assert_eq!(out[..d], want[..], "set: d {d} e {e} c {c}");
                }
            }
        }
    }

    /// Keys appended one by one, each raising some channels' scales (so earlier keys are
    /// re-quantized), sketch to the same bits as the block sketched whole, at every length.
    #[test]
    fn appending_keys_one_by_one_equals_sketching_the_block() {
        use crate::dtype::DType;
        for (dtype, bt, d) in [(DType::Bf16, 64u32, 40u32), (DType::F32, 16, 128)] {
            let geo = Geometry {
                layers: 1,
                q_heads: 4,
                kv_heads: 2,
                head_dim: d,
                dtype,
                block_tokens: bt,
            };
            let (bt, d) = (bt as usize, d as usize);
            let mut run = vec![0u8; geo.block_bytes()];
            let mut x = 0x9e37_79b9_u32;
            let mut layer = LayerSketches::default();
            layer.open_block(&geo);
            let mut key = vec![0f32; d];
            for t in 0..bt {
                for h in 0..geo.kv_heads as usize {
                    // Magnitudes growing with t in some channels, shrinking in others.
                    let vals: Vec<f32> = (0..d)
                        .map(|c| {
                            x ^= x << 13;
                            x ^= x >> 17;
                            x ^= x << 5;
                            let u = (x >> 8) as f32 / (1u32 << 24) as f32 - 0.5;
                            u * if c % 3 == 0 {
                                1.0 + t as f32
                            } else {
                                40.0 / (1.0 + t as f32)
                            }
                        })
                        .collect();
                    let o = geo.k_row_offset(h, t);
                    dtype.encode(&vals, &mut run[o..o + geo.row_bytes()]);
                    dtype.decode(&run[o..o + geo.row_bytes()], &mut key);
                    layer.add(&geo, 0, h, t, &key, &run);
                }
                layer.seal(&geo, 0);
                let mut whole = BlockSketches::new(&geo, 1);
                sketch_block(&geo, &run, t + 1, whole.blocks_mut(&geo).next().unwrap());
                assert_eq!(layer.range(&geo, 0..1).codes, &whole.codes[..], "t {t}");
                assert_eq!(
                    layer.range(&geo, 0..1).channel_scales,
                    &whole.channel_scales[..],
                    "t {t}"
                );
                assert_eq!(
                    layer.range(&geo, 0..1).quarters,
                    &whole.quarters[..],
                    "t {t}"
                );
            }
        }
    }

    #[test]
    fn quarters_partition_the_block() {
        let counts: Vec<usize> = [1, 31, 32, 63, 64, 127, 128, 1024].map(quarters).into();
        assert_eq!(counts, [1, 1, 1, 1, 2, 2, 4, 4]);
        for bt in 1..300usize {
            let n = quarters(bt);
            let mut last = 0;
            for t in 0..bt {
                let q = quarter_of(t, bt);
                assert!(q >= last && q < n, "bt {bt} t {t}");
                assert!((q * bt / n..(q + 1) * bt / n).contains(&t), "bt {bt} t {t}");
                last = q;
            }
            assert_eq!(last, n - 1);
        }
    }
}
