//! Per-block sketches for the sketch selector (`Selector::Sketch`): every stored key quantized
//! to int4 with one absmax scale, and the key bounds of each quarter of the block.
//!
//! **Key codes.** A key `k` (the stored key, after dtype rounding, in f32) becomes
//! `scale = max_d |k_d| / 7` and codes `c_d = clamp(round_ties_even(k_d / scale), -7, 7)` (all
//! zero when `scale` is 0), in IEEE single precision with round-to-nearest, so the same key
//! gives the same codes on every machine. A key's codes take [`code_bytes`] bytes: `W =
//! padded(D) / 4` little-endian u16 words (`padded(D)` is D rounded up to a multiple of 32,
//! the padding codes 0), element `e` in word `e % W` at bits `4 * (e / W)`, as 4-bit two's
//! complement. So shifting eight consecutive words by the same amount yields eight
//! consecutive elements (one SIMD or GPU word operation per eight codes). With its f32 scale a
//! key's sketch is a quarter of a bf16 key.
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
//! A layer keeps, per block: codes `[kv_head][B][code bytes]`, scales `[kv_head][B]` (rows
//! past the block's valid tokens zero), quarter bounds `[kv_head][quarter][max|min][D]`,
//! quarter codes `[kv_head][quarter][max|min][D]` and their scales `[kv_head]`. Every path
//! that adds keys (appends, in-place commits, restores, truncation) produces the same bits as
//! appending the keys one by one.

use crate::dtype::bf16_outward;
use crate::geometry::{Geometry, MAX_HEAD_DIM};

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
    const MAGIC: f32 = 12_582_912.0;
    (x + MAGIC) - MAGIC
}

/// Sketches `key` into `codes` (exactly [`code_bytes`] long); returns its scale.
pub fn sketch_key(key: &[f32], codes: &mut [u8]) -> f32 {
    debug_assert_eq!(codes.len(), code_bytes(key.len()));
    let amax = key.iter().fold(0f32, |m, x| m.max(x.abs()));
    let scale = amax / KEY_LEVELS as f32;
    codes.fill(0);
    if scale == 0.0 {
        return 0.0;
    }
    let lim = KEY_LEVELS as f32;
    let mut c = [0u16; MAX_HEAD_DIM as usize];
    for (o, x) in c.iter_mut().zip(key) {
        *o = (round_half_even(x / scale).clamp(-lim, lim) as i16 as u16) & 0xf;
    }
    let w = codes.len() / 2;
    for (word, out) in codes.chunks_exact_mut(2).enumerate() {
        let v = c[word] | c[w + word] << 4 | c[2 * w + word] << 8 | c[3 * w + word] << 12;
        out.copy_from_slice(&v.to_le_bytes());
    }
    scale
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
    pub scales: Vec<f32>,
    pub quarters: Vec<u16>,
    pub quarter_codes: Vec<i8>,
    pub quarter_scales: Vec<f32>,
}

/// Element counts of one block's sketch: (codes, scales, quarters / quarter codes, quarter
/// scales).
fn per_block(geo: &Geometry) -> (usize, usize, usize, usize) {
    let (hkv, bt, d) = (
        geo.kv_heads as usize,
        geo.block_tokens as usize,
        geo.head_dim as usize,
    );
    (
        hkv * bt * code_bytes(d),
        hkv * bt,
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
            scales: vec![0.0; n * s],
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
            .zip(self.scales.chunks_exact_mut(s))
            .zip(self.quarters.chunks_exact_mut(q))
            .zip(self.quarter_codes.chunks_exact_mut(q))
            .zip(self.quarter_scales.chunks_exact_mut(qs))
            .map(
                |((((codes, scales), quarters), quarter_codes), quarter_scales)| BlockSketch {
                    codes,
                    scales,
                    quarters,
                    quarter_codes,
                    quarter_scales,
                },
            )
    }

    /// The sketches borrowed.
    pub fn as_ref(&self) -> BlockSketchesRef<'_> {
        BlockSketchesRef {
            codes: &self.codes,
            scales: &self.scales,
            quarters: &self.quarters,
            quarter_codes: &self.quarter_codes,
            quarter_scales: &self.quarter_scales,
        }
    }

    /// Appends another run of blocks.
    pub fn extend(&mut self, other: &BlockSketches) {
        self.codes.extend_from_slice(&other.codes);
        self.scales.extend_from_slice(&other.scales);
        self.quarters.extend_from_slice(&other.quarters);
        self.quarter_codes.extend_from_slice(&other.quarter_codes);
        self.quarter_scales.extend_from_slice(&other.quarter_scales);
    }
}

/// Sketches of consecutive blocks, borrowed (a layer's, or [`BlockSketches`]').
#[derive(Debug, Clone, Copy)]
pub struct BlockSketchesRef<'a> {
    pub codes: &'a [u8],
    pub scales: &'a [f32],
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
            scales: &self.scales[r * bt..(r + 1) * bt],
            quarters: &self.quarters[r * qv..(r + 1) * qv],
            quarter_codes: &self.quarter_codes[r * qv..(r + 1) * qv],
            quarter_scale: self.quarter_scales[r],
        }
    }
}

/// The sketches of one block, borrowed whole.
pub struct BlockSketch<'a> {
    pub codes: &'a mut [u8],
    pub scales: &'a mut [f32],
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

/// One (block, kv head)'s sketch, read-only: key codes `[B][code bytes]` and scales `[B]`,
/// quarter bounds `[quarter][max|min][D]` (bf16 bits), quarter codes (same shape, int8) and
/// their scale.
#[derive(Clone, Copy, Debug)]
pub struct HeadSketch<'a> {
    pub codes: &'a [u8],
    pub scales: &'a [f32],
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
    out.scales.fill(0.0);
    reset_quarters(out.quarters, d);
    let mut key = [0f32; MAX_HEAD_DIM as usize];
    let key = &mut key[..d];
    for h in 0..geo.kv_heads as usize {
        for t in 0..valid {
            let o = geo.k_row_offset(h, t);
            geo.dtype.decode(&run[o..o + row], key);
            let r = h * bt + t;
            out.scales[r] = sketch_key(key, &mut out.codes[r * cb..(r + 1) * cb]);
            let q = h * qb + quarter_of(t, bt) * 2 * d;
            fold_quarter(&mut out.quarters[q..q + 2 * d], key);
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
        b.scales.truncate(blocks * s);
        b.quarters.truncate(blocks * q);
        b.quarter_codes.truncate(blocks * q);
        b.quarter_scales.truncate(blocks * qs);
    }

    /// Adds one key (already decoded to f32) of token `slot` of a block: its codes and its
    /// quarter's bounds. The block's quarter codes follow at [`Self::seal`].
    pub(crate) fn add(
        &mut self,
        geo: &Geometry,
        block: usize,
        kv_head: usize,
        slot: usize,
        key: &[f32],
    ) {
        let (bt, d) = (geo.block_tokens as usize, geo.head_dim as usize);
        let cb = code_bytes(d);
        let b = &mut self.0;
        let r = (block * geo.kv_heads as usize + kv_head) * bt + slot;
        b.scales[r] = sketch_key(key, &mut b.codes[r * cb..(r + 1) * cb]);
        let q = ((block * geo.kv_heads as usize + kv_head) * quarters(bt) + quarter_of(slot, bt))
            * 2
            * d;
        fold_quarter(&mut b.quarters[q..q + 2 * d], key);
    }

    /// Recomputes a block's quarter codes after keys were added to it.
    pub(crate) fn seal(&mut self, geo: &Geometry, block: usize) {
        self.blocks_mut(geo, block)
            .next()
            .expect("the block exists")
            .quantize(geo);
    }

    /// Adds rows `rows` of a block from its stored run (every kv head), then seals it.
    pub(crate) fn add_run(
        &mut self,
        geo: &Geometry,
        block: usize,
        run: &[u8],
        rows: std::ops::Range<usize>,
    ) {
        let (d, row) = (geo.head_dim as usize, geo.row_bytes());
        let mut key = [0f32; MAX_HEAD_DIM as usize];
        let key = &mut key[..d];
        for h in 0..geo.kv_heads as usize {
            for t in rows.clone() {
                let o = geo.k_row_offset(h, t);
                geo.dtype.decode(&run[o..o + row], key);
                self.add(geo, block, h, t, key);
            }
        }
        self.seal(geo, block);
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
            scales: &b.scales[blocks.start * s..blocks.end * s],
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
            + 4 * b.scales.len()
            + 2 * b.quarters.len()
            + b.quarter_codes.len()
            + 4 * b.quarter_scales.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_scale_is_absmax_over_7() {
        let key = [0.7f32, -0.35, 0.0, 0.1, -0.7];
        let mut codes = [0u8; 16];
        let s = sketch_key(&key, &mut codes);
        assert_eq!(s, 0.7 / 7.0);
        let mut out = [0i16; 32];
        unpack(&codes, &mut out);
        // -0.35 / 0.1 = -3.5 rounds to even: -4; the padding is zero.
        assert_eq!(out[..5], [7, -4, 0, 1, -7]);
        assert!(out[5..].iter().all(|&c| c == 0));
        assert_eq!(sketch_key(&[0.0; 5], &mut codes), 0.0);
        assert_eq!(codes, [0; 16]);
    }

    #[test]
    fn every_code_of_every_element_unpacks_to_itself() {
        for d in [2usize, 20, 32, 128, 256] {
            for e in 0..d {
                for c in -KEY_LEVELS..=KEY_LEVELS {
                    // Another element at 7 makes the scale 1: codes are the values.
                    let mut key = vec![0f32; d];
                    key[e] = c as f32;
                    key[(e + 1) % d] = 7.0;
                    let mut codes = vec![0u8; code_bytes(d)];
                    sketch_key(&key, &mut codes);
                    let mut out = vec![0i16; padded_dims(d)];
                    unpack(&codes, &mut out);
                    let want: Vec<i16> = key.iter().map(|&x| x as i16).collect();
                    assert_eq!(out[..d], want[..], "d {d} e {e} c {c}");
                }
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
