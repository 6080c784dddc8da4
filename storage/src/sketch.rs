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
//! **Quarter bounds.** A block of B tokens is cut into [`quarters`] `n = min(4, B)` runs of
//! consecutive tokens, quarter `j` holding tokens `floor(j B / n)..floor((j + 1) B / n)`; each
//! keeps the element-wise max and min of its keys like a block summary, rounded outward to
//! bf16 ([`crate::dtype::bf16_outward`]) so that every backend reads the same values in half
//! the bytes. A quarter without tokens yet holds `(-inf, +inf)`.
//!
//! A layer keeps, per block: codes `[kv_head][B][code bytes]`, scales `[kv_head][B]` (rows
//! past the block's valid tokens zero) and quarter bounds `[kv_head][quarter][max|min][D]`.
//! Every path that adds keys (appends, in-place commits, restores, truncation) produces the
//! same bits as appending the keys one by one.

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

/// Quarters a block of `block_tokens` tokens is cut into.
pub fn quarters(block_tokens: usize) -> usize {
    block_tokens.min(4)
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

/// The sketches of one block, borrowed whole: what a parallel rebuild fills.
pub(crate) struct BlockSketch<'a> {
    pub codes: &'a mut [u8],
    pub scales: &'a mut [f32],
    pub quarters: &'a mut [u16],
}

/// One (block, kv head)'s sketch, read-only: codes `[B][code bytes]`, scales `[B]`, quarter
/// bounds `[quarter][max|min][D]` (bf16 bits).
#[derive(Clone, Copy, Debug)]
pub struct HeadSketch<'a> {
    pub codes: &'a [u8],
    pub scales: &'a [f32],
    pub quarters: &'a [u16],
}

/// Sketches the first `valid` stored keys of a block run into one block's sketch, resetting
/// the rest: what appending them one by one produces. The engine's sketches of a leased block
/// come from here.
pub fn sketch_block(
    geo: &Geometry,
    run: &[u8],
    valid: usize,
    codes: &mut [u8],
    scales: &mut [f32],
    quarters: &mut [u16],
) {
    let (d, row, bt) = (
        geo.head_dim as usize,
        geo.row_bytes(),
        geo.block_tokens as usize,
    );
    let (cb, qb) = (code_bytes(d), self::quarters(bt) * 2 * d);
    codes.fill(0);
    scales.fill(0.0);
    reset_quarters(quarters, d);
    let mut key = [0f32; MAX_HEAD_DIM as usize];
    let key = &mut key[..d];
    for h in 0..geo.kv_heads as usize {
        for t in 0..valid {
            let o = geo.k_row_offset(h, t);
            geo.dtype.decode(&run[o..o + row], key);
            let r = h * bt + t;
            scales[r] = sketch_key(key, &mut codes[r * cb..(r + 1) * cb]);
            let q = h * qb + quarter_of(t, bt) * 2 * d;
            fold_quarter(&mut quarters[q..q + 2 * d], key);
        }
    }
}

/// The sketches of one layer's blocks.
#[derive(Debug, Default)]
pub(crate) struct LayerSketches {
    codes: Vec<u8>,
    scales: Vec<f32>,
    quarters: Vec<u16>,
}

impl LayerSketches {
    /// (code bytes, scales, quarter values) of one block.
    fn per_block(geo: &Geometry) -> (usize, usize, usize) {
        let (hkv, bt, d) = (
            geo.kv_heads as usize,
            geo.block_tokens as usize,
            geo.head_dim as usize,
        );
        (
            hkv * bt * code_bytes(d),
            hkv * bt,
            hkv * quarters(bt) * 2 * d,
        )
    }

    /// Blocks sketched.
    pub(crate) fn blocks(&self, geo: &Geometry) -> usize {
        self.scales.len() / Self::per_block(geo).1
    }

    /// Appends an empty block.
    pub(crate) fn open_block(&mut self, geo: &Geometry) {
        let (c, s, q) = Self::per_block(geo);
        self.codes.resize(self.codes.len() + c, 0);
        self.scales.resize(self.scales.len() + s, 0.0);
        let at = self.quarters.len();
        self.quarters.resize(at + q, 0);
        reset_quarters(&mut self.quarters[at..], geo.head_dim as usize);
    }

    /// Keeps the first `blocks` blocks.
    pub(crate) fn truncate(&mut self, geo: &Geometry, blocks: usize) {
        let (c, s, q) = Self::per_block(geo);
        self.codes.truncate(blocks * c);
        self.scales.truncate(blocks * s);
        self.quarters.truncate(blocks * q);
    }

    /// Adds one key (already decoded to f32) of token `slot` of a block.
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
        let r = (block * geo.kv_heads as usize + kv_head) * bt + slot;
        self.scales[r] = sketch_key(key, &mut self.codes[r * cb..(r + 1) * cb]);
        let q = ((block * geo.kv_heads as usize + kv_head) * quarters(bt) + quarter_of(slot, bt))
            * 2
            * d;
        fold_quarter(&mut self.quarters[q..q + 2 * d], key);
    }

    /// Adds rows `rows` of a block from its stored run (every kv head).
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
    }

    /// Rebuilds one block from the first `valid` keys of its run (truncation).
    pub(crate) fn rebuild(&mut self, geo: &Geometry, block: usize, run: &[u8], valid: usize) {
        let b = self
            .blocks_mut(geo, block)
            .next()
            .expect("the block exists");
        sketch_block(geo, run, valid, b.codes, b.scales, b.quarters);
    }

    /// One (block, kv head)'s sketch.
    pub(crate) fn get(&self, geo: &Geometry, block: usize, kv_head: usize) -> HeadSketch<'_> {
        let (bt, d) = (geo.block_tokens as usize, geo.head_dim as usize);
        let (cb, qv) = (code_bytes(d), quarters(bt) * 2 * d);
        let r = block * geo.kv_heads as usize + kv_head;
        HeadSketch {
            codes: &self.codes[r * bt * cb..(r + 1) * bt * cb],
            scales: &self.scales[r * bt..(r + 1) * bt],
            quarters: &self.quarters[r * qv..(r + 1) * qv],
        }
    }

    /// Whole blocks `first..`, for a parallel rebuild.
    pub(crate) fn blocks_mut(
        &mut self,
        geo: &Geometry,
        first: usize,
    ) -> impl Iterator<Item = BlockSketch<'_>> {
        let (c, s, q) = Self::per_block(geo);
        self.codes[first * c..]
            .chunks_exact_mut(c)
            .zip(self.scales[first * s..].chunks_exact_mut(s))
            .zip(self.quarters[first * q..].chunks_exact_mut(q))
            .map(|((codes, scales), quarters)| BlockSketch {
                codes,
                scales,
                quarters,
            })
    }

    /// Host bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.codes.len() + 4 * self.scales.len() + 2 * self.quarters.len()
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
