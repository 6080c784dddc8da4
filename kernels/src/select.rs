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

use kvtier_storage::sketch::{padded_dims, quarters, round_half_even, HeadSketch};
use kvtier_storage::{Geometry, LayerView, Policy, Selector};
use wide::{i16x16, i16x8, i32x4, i32x8, i8x16};

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
    let lim = QUERY_LEVELS as f32;
    for (c, x) in codes.iter_mut().zip(q) {
        *c = round_half_even(x / scale).clamp(-lim, lim) as i16;
    }
    scale
}

/// A kv head's query group quantized for sketch scoring ([`quantize_query`] per head), laid
/// out for [`QuerySketch::score`]. Reused across calls without allocating once warm.
#[derive(Debug, Default, Clone)]
pub struct QuerySketch {
    /// `[G][padded D / 8]`: each head's codes, the padding zero.
    vecs: Vec<i16x8>,
    /// `[G][D]`: each head's codes where positive (else 0), and where negative (else 0): the
    /// quarter bounds' maxima pair with the first, their minima with the second.
    pos: Vec<i16>,
    neg: Vec<i16>,
    scales: Vec<f32>,
}

impl QuerySketch {
    /// The group `q_group` (`G x d` f32) quantized.
    pub fn new(q_group: &[f32], d: usize) -> Self {
        let mut s = QuerySketch::default();
        s.set(q_group, d);
        s
    }

    /// Quantizes `q_group` (`G x d` f32) in place of the previous group.
    pub fn set(&mut self, q_group: &[f32], d: usize) {
        let pv = padded_dims(d) / 8;
        self.vecs.clear();
        self.pos.clear();
        self.neg.clear();
        self.scales.clear();
        let mut codes = [0i16; MAX_PADDED_DIMS];
        for qh in q_group.chunks_exact(d) {
            codes.fill(0);
            self.scales.push(quantize_query(qh, &mut codes[..d]));
            self.vecs.extend(
                codes[..pv * 8]
                    .chunks_exact(8)
                    .map(|c| i16x8::new(c.try_into().expect("8 codes"))),
            );
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
    /// tokens and the group's query heads. Per head and token the integer dot product of the
    /// codes is exact; it becomes `f32(dot) * key_scale` (rounded), the max over tokens is
    /// taken, then `* q_scale` (rounded) and the max over heads: each product rounds
    /// monotonically, so this is the max of the sketched logits, whatever order a port takes
    /// the maxima in. `-0.0` is returned as `0.0`.
    pub fn score(&self, sketch: &HeadSketch<'_>) -> f32 {
        // Fixed vector counts unroll the dot products (D = 32, 64, 128, 256).
        match self.vecs.len() / self.scales.len() {
            4 => self.score_with::<4>(sketch),
            8 => self.score_with::<8>(sketch),
            16 => self.score_with::<16>(sketch),
            32 => self.score_with::<32>(sketch),
            _ => self.score_with::<0>(sketch),
        }
    }

    /// [`Self::score`] with `PV` vectors of codes per key (0: any count).
    #[inline(always)]
    fn score_with<const PV: usize>(&self, sketch: &HeadSketch<'_>) -> f32 {
        let g = self.scales.len();
        let pv = if PV == 0 { self.vecs.len() / g } else { PV };
        let cb = pv * 4; // 8 codes of 4 bits per vector
        let mut key = [i16x8::ZERO; MAX_PADDED_DIMS / 8];
        let key = &mut key[..pv];
        let mut best = [f32::NEG_INFINITY; kvtier_storage::geometry::MAX_HEADS as usize];
        let best = &mut best[..g];
        for (t, &ks) in sketch.scales.iter().enumerate() {
            unpack_words(&sketch.codes[t * cb..(t + 1) * cb], key);
            for (b, qh) in best.iter_mut().zip(self.vecs.chunks_exact(pv)) {
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
                *b = b.max((a0 + a1).reduce_add() as f32 * ks);
            }
        }
        let score = best
            .iter()
            .zip(&self.scales)
            .fold(f32::NEG_INFINITY, |s, (b, qs)| s.max(b * qs));
        score + 0.0
    }
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

/// Distant units up to which the sketch selector skips its first stage and ranks every
/// distant block by its sketch: twice [`candidate_units`] (at most [`MAX_SCAN_BLOCKS`] blocks,
/// and never fewer than the candidates). Where a layer is that short, scoring every block
/// costs at most twice the rerank of a long one, and the first stage's bound, which tracks
/// relevance on prose poorly, loses nothing (docs/decisions/0020).
pub fn scan_units(candidates: u32, top_k: u32, block_tokens: u32) -> usize {
    let want = candidate_units(candidates, top_k, block_tokens);
    want.max((2 * want).min(MAX_SCAN_BLOCKS / unit_blocks(block_tokens)))
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
