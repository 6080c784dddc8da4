//! The block selector: the per-kv-head keep-set, its distant blocks ranked by the policy's
//! [`Selector`].
//!
//! The keep-set of a kv-head is the sink blocks, the local window (including the partial tail
//! block) and the top-k distant blocks by score, lower block index first on ties. Sink and
//! local blocks are taken out of the candidates before the top-k, so the set has no duplicates
//! by construction. The scores:
//!
//! - [`Selector::Bound`]: an upper bound on any of the block's keys' dot product with any
//!   query head of the kv-head's group (`bound_dot`, then the max over the group).
//! - [`Selector::Sketch`]: two stages. The first ranks *units* of four quarter records
//!   ([`unit_blocks`]: a block of 128 tokens or more, two of 64, four of 32 or fewer; unit `u`
//!   is blocks `u G .. (u + 1) G`) by the best [`QuerySketch::quarter_score`] of their distant
//!   blocks (the key bound of each quarter in int8, max over quarters and the group; ties to
//!   the lower unit), and the distant blocks of the best [`candidate_units`] are the
//!   candidates; they are ranked by their key sketches ([`QuerySketch::score`]) and the top-k
//!   kept. Small blocks so cost the first stage what 128-token blocks cost while the keep-set
//!   is cut finer. When the candidate units cover every distant block, every block is scored
//!   by its sketch.

use std::cmp::Ordering;

use rayon::prelude::*;

use kvtier_storage::sketch::{code, padded_dims, quarters, HeadSketch, ROUNDING_MAGIC};
use kvtier_storage::{Geometry, LayerView, Policy, Selector};
use wide::{f32x8, i16x16, i16x8, i32x4, i32x8, i8x16};

use crate::error::{KernelError, Result};
use crate::simd::bound_dot;

/// Selected block ids per kv-head, ascending: head `h`'s ids are `head(h)`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeepSet {
    offsets: Vec<u32>,
    blocks: Vec<u32>,
}

impl KeepSet {
    pub fn new() -> Self {
        KeepSet {
            offsets: vec![0],
            blocks: Vec::new(),
        }
    }

    /// Every block of every one of `kv_heads` heads (dense attention over `blocks` blocks).
    pub fn all(kv_heads: usize, blocks: usize) -> Self {
        let mut k = KeepSet::new();
        for _ in 0..kv_heads {
            k.push_head(0..blocks as u32);
        }
        k
    }

    pub fn clear(&mut self) {
        self.offsets.clear();
        self.offsets.push(0);
        self.blocks.clear();
    }

    pub fn push_head(&mut self, blocks: impl IntoIterator<Item = u32>) {
        self.blocks.extend(blocks);
        self.offsets.push(self.blocks.len() as u32);
    }

    pub fn heads(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    pub fn head(&self, h: usize) -> &[u32] {
        &self.blocks[self.offsets[h] as usize..self.offsets[h + 1] as usize]
    }

    /// Selected (block, kv-head) tiles over all heads.
    pub fn tiles(&self) -> usize {
        self.blocks.len()
    }

    /// Distinct blocks over all heads, ascending: what must be resident to attend.
    pub fn union(&self) -> Vec<u32> {
        let mut u = self.blocks.clone();
        u.sort_unstable();
        u.dedup();
        u
    }
}

/// Reusable buffers so a decode step allocates nothing once warm.
#[derive(Debug, Default)]
pub struct SelectScratch {
    scores: Vec<f32>,
    order: Vec<u32>,
    /// Sketch selector: the first stage's units, before they become candidate blocks; then
    /// the candidates while the second stage ranks them.
    units: Vec<u32>,
    /// Sketch selector: the kv head's quantized query group.
    query: QuerySketch,
}

/// Largest code magnitude of a quantized query: codes are in `-QUERY_LEVELS..=QUERY_LEVELS`.
pub const QUERY_LEVELS: i32 = 127;

/// Quantizes one query head for sketch scoring: `scale = max_d |q_d| / 127`, codes
/// `clamp(round_ties_even(q_d / scale), -127, 127)` (all zero when `scale` is 0), in IEEE
/// single precision with round-to-nearest (what the CUDA selector computes, bit for bit).
/// Returns the scale.
pub fn quantize_query(q: &[f32], codes: &mut [i16]) -> f32 {
    let amax = q.iter().fold(0f32, |m, x| m.max(x.abs()));
    let scale = amax / QUERY_LEVELS as f32;
    if scale == 0.0 {
        codes.fill(0);
        return 0.0;
    }
    for (c, &x) in codes.iter_mut().zip(q) {
        *c = code(x, scale, QUERY_LEVELS);
    }
    scale
}

/// A kv head's query group quantized for sketch scoring, reused across calls without
/// allocating once warm. The first stage takes each head quantized once ([`quantize_query`]);
/// the second quantizes it per candidate block, times the block's channel scales
/// ([`QuerySketch::score`]).
#[derive(Debug, Default, Clone)]
pub struct QuerySketch {
    /// `[G][D]`: the group as given.
    group: Vec<f32>,
    /// `[G][D]`: each head's codes where positive (else 0), and where negative (else 0): the
    /// quarter bounds' maxima pair with the first, their minima with the second.
    pos: Vec<i16>,
    neg: Vec<i16>,
    scales: Vec<f32>,
}

/// Query heads whose per-block codes the second stage holds at once (on the stack).
const HEAD_CHUNK: usize = 8;

impl QuerySketch {
    /// The group `q_group` (`G x d` f32) quantized.
    pub fn new(q_group: &[f32], d: usize) -> Self {
        let mut s = QuerySketch::default();
        s.set(q_group, d);
        s
    }

    /// Quantizes `q_group` (`G x d` f32) in place of the previous group.
    pub fn set(&mut self, q_group: &[f32], d: usize) {
        self.group.clear();
        self.group.extend_from_slice(q_group);
        self.pos.clear();
        self.neg.clear();
        self.scales.clear();
        let mut codes = [0i16; MAX_PADDED_DIMS];
        for qh in q_group.chunks_exact(d) {
            self.scales.push(quantize_query(qh, &mut codes[..d]));
            self.pos.extend(codes[..d].iter().map(|&c| c.max(0)));
            self.neg.extend(codes[..d].iter().map(|&c| c.min(0)));
        }
    }

    /// Stage-1 score of one (block, kv-head) for the sketch selector: the key bound of each of
    /// the block's quarters from its quarter codes against the query's codes, as the exact
    /// integer `I = sum_d pos_d * max_d + neg_d * min_d` (`pos`, `neg` the code where positive,
    /// negative, else 0), per query head the largest over the quarters, then `f32(I) *
    /// quarter_scale` (rounded), `* q_scale` (rounded) and the largest over the heads. `-0.0`
    /// is returned as `0.0`.
    pub fn quarter_score(&self, sketch: &HeadSketch<'_>) -> f32 {
        let g = self.scales.len();
        let d = self.pos.len() / g;
        let mut best = [i32::MIN; kvtier_storage::geometry::MAX_HEADS as usize];
        let best = &mut best[..g];
        let full = d / 16 * 16;
        for q in sketch.quarter_codes.chunks_exact(2 * d) {
            let (hi, lo) = q.split_at(d);
            for ((b, pos), neg) in best
                .iter_mut()
                .zip(self.pos.chunks_exact(d))
                .zip(self.neg.chunks_exact(d))
            {
                let mut acc = i32x8::ZERO;
                for c in (0..full).step_by(16) {
                    let h = i16x16::from_i8x16(i8x16::new(hi[c..c + 16].try_into().expect("16")));
                    let l = i16x16::from_i8x16(i8x16::new(lo[c..c + 16].try_into().expect("16")));
                    let p = i16x16::new(pos[c..c + 16].try_into().expect("16"));
                    let n = i16x16::new(neg[c..c + 16].try_into().expect("16"));
                    acc += p.dot(h) + n.dot(l);
                }
                let mut sum = acc.reduce_add();
                for c in full..d {
                    sum +=
                        i32::from(pos[c]) * i32::from(hi[c]) + i32::from(neg[c]) * i32::from(lo[c]);
                }
                *b = (*b).max(sum);
            }
        }
        let score = best
            .iter()
            .zip(&self.scales)
            .fold(f32::NEG_INFINITY, |s, (&b, qs)| {
                s.max(b as f32 * sketch.quarter_scale * qs)
            });
        score + 0.0
    }

    /// Sketch score of one (block, kv-head): the largest sketched logit over the block's
    /// tokens and the group's query heads. Each head `q` is quantized for the block
    /// ([`block_query`]: [`quantize_query`] of `q[d] * s[d]`, `s` the block's channel scales,
    /// each product rounded), giving codes `c` and a scale `s_q`; per token the integer dot
    /// product of `c` with the key's codes is exact, the max over tokens is taken, then
    /// `f32(max) * s_q` (rounded) and the max over heads. `-0.0` is returned as `0.0`.
    pub fn score(&self, sketch: &HeadSketch<'_>) -> f32 {
        // Fixed vector counts unroll the dot products (D = 32, 64, 128, 256).
        match padded_dims(self.pos.len() / self.scales.len()) / 8 {
            4 => self.score_with::<4>(sketch),
            8 => self.score_with::<8>(sketch),
            16 => self.score_with::<16>(sketch),
            32 => self.score_with::<32>(sketch),
            _ => self.score_with::<0>(sketch),
        }
    }

    /// [`Self::score`] with `PV` vectors of codes per key (0: any count). Its buffers are
    /// sized by `PV`: zeroing ones sized for the largest head, per candidate, cost more than
    /// its dot products.
    #[inline(always)]
    fn score_with<const PV: usize>(&self, sketch: &HeadSketch<'_>) -> f32 {
        if PV == 0 {
            let pv = padded_dims(self.group.len() / self.scales.len()) / 8;
            let mut key = vec![i16x8::ZERO; pv];
            let mut qv = vec![i16x8::ZERO; HEAD_CHUNK * pv];
            return self.score_in::<0>(sketch, &mut key, &mut qv);
        }
        let mut key = [i16x8::ZERO; PV];
        let mut qv = [[i16x8::ZERO; PV]; HEAD_CHUNK];
        self.score_in::<PV>(sketch, &mut key, qv.as_flattened_mut())
    }

    /// [`Self::score_with`] in buffers for one key's codes and `HEAD_CHUNK` heads' codes.
    #[inline(always)]
    fn score_in<const PV: usize>(
        &self,
        sketch: &HeadSketch<'_>,
        key: &mut [i16x8],
        qv: &mut [i16x8],
    ) -> f32 {
        let g = self.scales.len();
        let d = self.group.len() / g;
        let pv = if PV == 0 { key.len() } else { PV };
        let cb = pv * 4; // 8 codes of 4 bits per vector
        let mut qs = [0f32; HEAD_CHUNK];
        let mut score = f32::NEG_INFINITY;
        for heads in self.group.chunks(HEAD_CHUNK * d) {
            let n = heads.len() / d;
            let qv = &mut qv[..n * pv];
            for ((qh, v), s) in heads
                .chunks_exact(d)
                .zip(qv.chunks_exact_mut(pv))
                .zip(&mut qs)
            {
                *s = block_query(qh, sketch.channel_scales, v);
            }
            let mut best = [i32::MIN; HEAD_CHUNK];
            for codes in sketch.codes.chunks_exact(cb) {
                unpack_words(codes, key);
                for (b, qh) in best.iter_mut().zip(qv.chunks_exact(pv)) {
                    // Two accumulators: integer sums are exact in any order.
                    let (mut a0, mut a1) = (i32x4::ZERO, i32x4::ZERO);
                    let mut pairs = qh.chunks_exact(2).zip(key.chunks_exact(2));
                    for (q, k) in &mut pairs {
                        a0 += q[0].dot(k[0]);
                        a1 += q[1].dot(k[1]);
                    }
                    if pv % 2 == 1 {
                        a0 += qh[pv - 1].dot(key[pv - 1]);
                    }
                    *b = (*b).max((a0 + a1).reduce_add());
                }
            }
            for (&b, &s) in best[..n].iter().zip(&qs) {
                score = score.max(b as f32 * s);
            }
        }
        score + 0.0
    }
}

/// One query head quantized for one block: [`quantize_query`] of `q[d] * channel_scales[d]`
/// (each product rounded to f32), its codes as i16x8 vectors of consecutive elements into `out`
/// (padded D / 8 of them, the padding zero); returns the codes' scale. In f32x8 lanes: the
/// second stage quantizes every candidate's query group, and in scalar steps that was a fifth
/// of the CPU step at 16K. The same IEEE operations as [`quantize_query`], so the same bits.
pub fn block_query(q: &[f32], channel_scales: &[f32], out: &mut [i16x8]) -> f32 {
    let d = q.len();
    // Lane vector v of the products, zero past d (computed twice: a multiply is cheaper than
    // a buffer for the largest head).
    let product = |v: usize| {
        let (lo, hi) = ((8 * v).min(d), (8 * v + 8).min(d));
        if hi - lo == 8 {
            let lanes = |c: &[f32]| f32x8::from(<[f32; 8]>::try_from(c).expect("8 lanes"));
            lanes(&q[lo..hi]) * lanes(&channel_scales[lo..hi])
        } else {
            let mut a = [0f32; 8];
            for ((o, &x), &s) in a.iter_mut().zip(&q[lo..hi]).zip(&channel_scales[lo..hi]) {
                *o = x * s;
            }
            f32x8::from(a)
        }
    };
    let amax = (0..out.len())
        .fold(f32x8::ZERO, |m, v| m.max(product(v).abs()))
        .to_array()
        .into_iter()
        .fold(0f32, f32::max);
    let scale = amax / QUERY_LEVELS as f32;
    if scale == 0.0 {
        out.fill(i16x8::ZERO);
        return 0.0;
    }
    let (sv, lim) = (f32x8::splat(scale), f32x8::splat(QUERY_LEVELS as f32));
    let magic = f32x8::splat(ROUNDING_MAGIC);
    for (v, o) in out.iter_mut().enumerate() {
        // round_half_even, then the clamp: exact integers, so the conversion is exact.
        let r = ((product(v) / sv + magic) - magic).max(-lim).min(lim);
        *o = i16x8::new(r.round_int().to_array().map(|x| x as i16));
    }
    scale
}

/// Largest padded head dim ([`padded_dims`] of `MAX_HEAD_DIM`).
const MAX_PADDED_DIMS: usize = kvtier_storage::geometry::MAX_HEAD_DIM as usize;

/// One key's codes as i16x8 vectors of consecutive elements: the word layout of
/// [`kvtier_storage::sketch`] puts elements `j W + w` (`w` in eight consecutive words) in the
/// same nibble of those words, so one shift pair extracts eight of them.
#[inline(always)]
fn unpack_words(codes: &[u8], out: &mut [i16x8]) {
    let per_nibble = codes.len() / 16; // W / 8 vectors
    for (v, chunk) in codes.chunks_exact(16).enumerate() {
        let words: [i16; 8] =
            std::array::from_fn(|i| i16::from_le_bytes([chunk[2 * i], chunk[2 * i + 1]]));
        let x = i16x8::new(words);
        // Nibble j to the top of each word, then an arithmetic shift: sign extension.
        out[v] = (x << 12) >> 12;
        out[per_nibble + v] = (x << 8) >> 12;
        out[2 * per_nibble + v] = (x << 4) >> 12;
        out[3 * per_nibble + v] = x >> 12;
    }
}

/// Blocks per unit of the sketch selector's first stage: four quarter records
/// ([`kvtier_storage::sketch::quarters`] per block: a block of 128 tokens or more, two of 64 to
/// 127, four smaller ones). One warp's four octets score a unit on the GPU.
pub fn unit_blocks(block_tokens: u32) -> usize {
    4 / quarters(block_tokens as usize)
}

/// Units the sketch selector's first stage passes to the second: enough for `candidates`
/// blocks, and never fewer than `top_k` distant blocks even when the units at both ends of
/// the distant range hold one distant block each.
pub fn candidate_units(candidates: u32, top_k: u32, block_tokens: u32) -> usize {
    let g = unit_blocks(block_tokens);
    let blocks = (candidates as usize).max(top_k as usize + 2 * (g - 1));
    blocks.div_ceil(g)
}

/// Units of the distant blocks `sink_end..local_start` (the units at both ends may hold
/// fewer distant blocks than [`unit_blocks`]).
pub fn distant_units(sink_end: usize, local_start: usize, block_tokens: u32) -> usize {
    let g = unit_blocks(block_tokens);
    (local_start - 1) / g + 1 - sink_end / g
}

/// The most candidate blocks the second stage scores in one layer (one warp's list of 8 keys
/// per lane in the CUDA rerank).
pub const MAX_SCAN_BLOCKS: usize = 256;

/// Distant tokens up to which a layer's keep-set scores every distant block's sketch (at
/// most [`MAX_SCAN_BLOCKS`] blocks): the sketches of 16,384 tokens, whatever the block size.
pub const SCAN_TOKENS: usize = 16 * 1024;

/// Distant units up to which the sketch selector skips its first stage and ranks every
/// distant block by its sketch: [`SCAN_TOKENS`] worth of blocks, at most one rerank list
/// ([`MAX_SCAN_BLOCKS`]), and never fewer than the candidates. The first stage's bound tracks
/// relevance on prose poorly; a layer that short loses nothing to it, and scoring it costs
/// the sketches of 16,384 tokens in any block size (docs/decisions/0024).
pub fn scan_units(candidates: u32, top_k: u32, block_tokens: u32) -> usize {
    let want = candidate_units(candidates, top_k, block_tokens);
    let blocks = MAX_SCAN_BLOCKS.min(SCAN_TOKENS / block_tokens as usize);
    want.max(blocks / unit_blocks(block_tokens))
}

/// Checks a query's length and values against a geometry.
pub fn check_query(geo: &Geometry, q: &[f32]) -> Result<()> {
    let expected = (geo.q_heads * geo.head_dim) as usize;
    if q.len() != expected {
        return Err(KernelError::QuerySize {
            expected,
            got: q.len(),
        });
    }
    if let Some(index) = q.iter().position(|x| !x.is_finite()) {
        return Err(KernelError::NonFiniteQuery { index });
    }
    Ok(())
}

/// The block ranges of a layer of `blocks` blocks under `policy`: `(sink_end, local_start)`.
/// Distant candidates are `sink_end..local_start`; `None` when everything is kept.
pub fn partition(blocks: usize, policy: &Policy) -> Option<(usize, usize)> {
    if blocks as u64 <= policy.budget() {
        return None;
    }
    let sink_end = policy.sink_blocks as usize;
    Some((sink_end, blocks - policy.local_blocks as usize))
}

/// Score of one (block, kv-head): the max over the head's query group of the bound dot product.
/// `q_group` is the group's `G x D` query rows.
#[inline]
pub fn block_score(q_group: &[f32], hi: &[f32], lo: &[f32]) -> f32 {
    q_group
        .chunks_exact(hi.len())
        .map(|qg| bound_dot(qg, hi, lo))
        .fold(f32::NEG_INFINITY, f32::max)
}

/// Selects the keep-set of one kv-head into `out` (ascending block ids) for a layer of
/// `blocks` blocks. `q` is the full `[q_heads][head_dim]` query, already checked with
/// [`check_query`].
///
/// `blocks` may exceed `layer.blocks()` by one: the decode step selects *before* appending the
/// new token (so a cold-tier read failure changes nothing), and the block that token opens is
/// in the local window, which is never scored — only distant blocks, which all exist, are.
pub fn select_head(
    q: &[f32],
    layer: &LayerView<'_>,
    blocks: usize,
    policy: &Policy,
    kv_head: usize,
    scratch: &mut SelectScratch,
    out: &mut Vec<u32>,
) {
    let geo = layer.geometry();
    debug_assert!(blocks <= layer.blocks() + 1);
    out.clear();
    let Some((sink_end, local_start)) = partition(blocks, policy) else {
        out.extend(0..blocks as u32);
        return;
    };
    let d = geo.head_dim as usize;
    let gd = geo.group() * d;
    let q_group = &q[kv_head * gd..(kv_head + 1) * gd];
    let k = policy.top_k as usize;
    let n = local_start - sink_end;
    // `partition` returned ranges, so there are more distant candidates than k.
    debug_assert!(k < n);
    out.extend(0..sink_end as u32);
    match policy.selector {
        Selector::Bound => {
            scratch.scores.clear();
            scratch.scores.extend((sink_end..local_start).map(|b| {
                let (hi, lo) = layer.bounds(b, kv_head);
                block_score(q_group, hi, lo)
            }));
            scratch.order.clear();
            scratch.order.extend(0..n as u32);
            top_k_in_place(&scratch.scores, &mut scratch.order, k);
            out.extend(
                scratch
                    .order
                    .iter()
                    .map(|&i| (sink_end + i as usize) as u32),
            );
        }
        Selector::Sketch { candidates } => {
            let g = unit_blocks(geo.block_tokens);
            let want = candidate_units(candidates, policy.top_k, geo.block_tokens);
            let scan = scan_units(candidates, policy.top_k, geo.block_tokens);
            let SelectScratch {
                scores,
                order,
                units,
                query,
            } = scratch;
            let sketch = |b: usize| {
                layer
                    .sketch(b, kv_head)
                    .expect("the sketch selector runs on caches with sketches (checked per entry)")
            };
            query.set(q_group, d);
            let query = &*query;
            // Stage 1: the distant blocks of the `want` best units by their quarter bounds
            // (every block while the layer has at most `scan` distant units), ascending in
            // `order` (positions from `sink_end`).
            let (u0, u1) = (
                sink_end / g,
                sink_end / g + distant_units(sink_end, local_start, geo.block_tokens),
            );
            let distant = |u: usize| (u * g).max(sink_end)..((u + 1) * g).min(local_start);
            order.clear();
            if scan < u1 - u0 {
                let unit = |u: usize| {
                    distant(u)
                        .map(|b| query.quarter_score(&sketch(b)))
                        .fold(f32::NEG_INFINITY, f32::max)
                };
                if n >= PARALLEL_MIN_QUARTERS {
                    (u0..u1)
                        .into_par_iter()
                        .with_min_len((PARALLEL_MIN_QUARTERS / 2).div_ceil(g))
                        .map(unit)
                        .collect_into_vec(scores);
                } else {
                    scores.clear();
                    scores.extend((u0..u1).map(unit));
                }
                units.clear();
                units.extend(0..(u1 - u0) as u32);
                top_k_in_place(scores, units, want);
                order.extend(
                    units
                        .iter()
                        .flat_map(|&i| distant(u0 + i as usize))
                        .map(|b| (b - sink_end) as u32),
                );
            } else {
                order.extend(0..n as u32);
            }
            // Stage 2: the candidates ranked by their sketches.
            let rank = |&i: &u32| query.score(&sketch(sink_end + i as usize));
            if order.len() >= PARALLEL_MIN_SKETCHES {
                order
                    .par_iter()
                    .with_min_len(PARALLEL_MIN_SKETCHES / 2)
                    .map(rank)
                    .collect_into_vec(scores);
            } else {
                scores.clear();
                scores.extend(order.iter().map(rank));
            }
            // The candidates move to `units` (free now), `order` ranks their positions.
            std::mem::swap(order, units);
            let cands = &*units;
            order.clear();
            order.extend(0..cands.len() as u32);
            top_k_in_place(scores, order, k);
            for j in order.iter_mut() {
                *j = cands[*j as usize];
            }
            out.extend(order.iter().map(|&i| (sink_end + i as usize) as u32));
        }
    }
    out.extend(local_start as u32..blocks as u32);
}

/// From this many distant blocks a head's quarter scores are split across the thread pool,
/// and from this many candidates their sketch scores: at batch 1 a layer has only as many
/// selections as kv heads, and two-stage scoring is most of the layer's serial work (one
/// candidate's sketch is ~115K multiply-adds at D = 128, G = 7). Scores do not depend on the
/// split.
const PARALLEL_MIN_QUARTERS: usize = 64;
const PARALLEL_MIN_SKETCHES: usize = 16;

/// Keeps in `order` (positions into `scores`, ascending) the `k` best by score, ascending:
/// higher score first, on equal scores the lower position. A total order, so the result does
/// not depend on the selection algorithm's internal order.
fn top_k_in_place(scores: &[f32], order: &mut Vec<u32>, k: usize) {
    let better = |a: &u32, b: &u32| -> Ordering {
        scores[*b as usize]
            .total_cmp(&scores[*a as usize])
            .then(a.cmp(b))
    };
    if k == 0 {
        order.clear();
        return;
    }
    if k < order.len() {
        order.select_nth_unstable_by(k - 1, better);
        order.truncate(k);
    }
    order.sort_unstable();
}

/// Selects the keep-set of every kv-head of a layer.
pub fn select(
    q: &[f32],
    layer: &LayerView<'_>,
    policy: &Policy,
    scratch: &mut SelectScratch,
    out: &mut KeepSet,
) -> Result<()> {
    check_query(layer.geometry(), q)?;
    if policy.selector.needs_sketches() && !layer.has_sketches() {
        return Err(KernelError::NoSketches);
    }
    out.clear();
    let mut head = Vec::new();
    for h in 0..layer.geometry().kv_heads as usize {
        select_head(q, layer, layer.blocks(), policy, h, scratch, &mut head);
        out.push_head(head.iter().copied());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The f32x8 port equals the scalar rule ([`quantize_query`] of the rounded products) bit
    /// for bit, padding included, over dims that do and do not fill whole lanes, ties, zero
    /// scales and channels of scale 0.
    #[test]
    fn block_query_is_quantize_query_of_the_products() {
        let mut x = 0x2545_f491_u32;
        let mut rnd = || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        };
        for d in [5usize, 21, 32, 100, 128, 256] {
            for case in 0..50 {
                let q: Vec<f32> = (0..d).map(|_| rnd() * 8.0).collect();
                let mut s: Vec<f32> = (0..d).map(|_| (rnd() + 0.5) * 0.3).collect();
                match case {
                    0 => s.fill(0.0),
                    1 => s.iter_mut().step_by(3).for_each(|x| *x = 0.0),
                    // Products of 0.5 steps against a scale of 1: ties at every element.
                    2 => {
                        s.fill(1.0);
                        let q: Vec<f32> = (0..d).map(|i| (i % 255) as f32 - 127.0 + 0.5).collect();
                        check(&q, &s);
                        continue;
                    }
                    _ => {}
                }
                check(&q, &s);
            }
        }

        fn check(q: &[f32], s: &[f32]) {
            let d = q.len();
            let p: Vec<f32> = q.iter().zip(s).map(|(a, b)| a * b).collect();
            let mut want = vec![0i16; padded_dims(d)];
            let want_scale = quantize_query(&p, &mut want[..d]);
            let mut got = vec![i16x8::splat(99); padded_dims(d) / 8];
            let scale = block_query(q, s, &mut got);
            let got: Vec<i16> = got.iter().flat_map(|v| v.to_array()).collect();
            assert_eq!(
                (scale.to_bits(), got),
                (want_scale.to_bits(), want),
                "d {d}"
            );
        }
    }
}
