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
#[inline]
pub fn quantize_key(key: &[f32], scales: &[f32], codes: &mut [u8]) {
    debug_assert_eq!(codes.len(), code_bytes(key.len()));
    debug_assert_eq!(scales.len(), key.len());
    codes.fill(0);
    let w = codes.len() / 2;
    // `key_code` eight elements at a time: the same IEEE division, rounding and clamp (no NaN
    // reaches the clamp but 0 / 0, whose code a zero scale sets to 0 anyway), so the codes
    // are bit for bit the scalar rule's; the tail, if any, by the scalar rule. Eight
    // consecutive elements share a nibble of eight consecutive words (`w` is a multiple of 8).
    let (lim, magic) = (
        f32x8::splat(KEY_LEVELS as f32),
        f32x8::splat(ROUNDING_MAGIC),
    );
    let lanes = key.len() / 8 * 8;
    for (e, (x, s)) in key[..lanes]
        .chunks_exact(8)
        .zip(scales.chunks_exact(8))
        .enumerate()
    {
        let (x, s) = (
            f32x8::new(x.try_into().unwrap()),
            f32x8::new(s.try_into().unwrap()),
        );
        let r = ((x / s + magic) - magic).fast_max(-lim).fast_min(lim);
        let r = s.simd_eq(f32x8::ZERO).select(f32x8::ZERO, r);
        let (word, shift) = ((8 * e) % w, 4 * (8 * e / w));
        for (out, v) in codes[2 * word..2 * word + 16]
            .chunks_exact_mut(2)
            .zip(r.fast_trunc_int().to_array())
        {
            let v = u16::from_le_bytes([out[0], out[1]]) | ((v as u16) & 0xf) << shift;
            out.copy_from_slice(&v.to_le_bytes());
        }
    }
    for (e, (&x, &s)) in key.iter().zip(scales).enumerate().skip(lanes) {
        set_code(codes, e, key_code(x, s));
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
/// f32 (a widened bf16 is exact). Branch-free, so it compiles to vector code.
#[inline]
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
            // ceil and floor from the nearest integer, exact for |x| <= 2^22 (here |x| <=
            // 127): libm calls on baseline x86-64, vector code this way.
            let ceil = |x: f32| {
                let r = round_half_even(x);
                if r < x {
                    r + 1.0
                } else {
                    r
                }
            };
            let floor = |x: f32| {
                let r = round_half_even(x);
                if r > x {
                    r - 1.0
                } else {
                    r
                }
            };
            for (o, &b) in c[..d].iter_mut().zip(&q[..d]) {
                *o = ceil(f(b) / scale).clamp(-lim, lim) as i8;
            }
            for (o, &b) in c[d..].iter_mut().zip(&q[d..]) {
                *o = floor(f(b) / scale).clamp(-lim, lim) as i8;
            }
        }
    }
    scale
}

mod blocks;

pub use blocks::*;

#[cfg(test)]
mod tests;
