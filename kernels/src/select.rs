//! The block selector: Quest-style key-bound scoring and the per-kv-head keep-set.
//!
//! For each distant block the score is an upper bound on any of its keys' dot product with any
//! query head of the kv-head's group (`bound_dot`, then the max over the group). The keep-set of
//! a kv-head is the sink blocks, the local window (including the partial tail block) and the
//! top-k distant blocks by score, lower block index first on ties. Sink and local blocks are
//! taken out of the candidates before the top-k, so the set has no duplicates by construction.

use std::cmp::Ordering;

use kvtier_storage::{Geometry, LayerView, Policy};

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
    let gd = geo.group() * geo.head_dim as usize;
    let q_group = &q[kv_head * gd..(kv_head + 1) * gd];
    let k = policy.top_k as usize;
    let n = local_start - sink_end;
    scratch.scores.clear();
    scratch.scores.extend((sink_end..local_start).map(|b| {
        let (hi, lo) = layer.bounds(b, kv_head);
        block_score(q_group, hi, lo)
    }));
    scratch.order.clear();
    scratch.order.extend(0..n as u32);
    // Higher score first; on equal scores the lower block index. A total order, so the result
    // does not depend on the selection algorithm's internal order.
    let scores = &scratch.scores;
    let better = |a: &u32, b: &u32| -> Ordering {
        scores[*b as usize]
            .total_cmp(&scores[*a as usize])
            .then(a.cmp(b))
    };
    // `partition` returned ranges, so there are more distant candidates than k.
    debug_assert!(k < n);
    if k > 0 {
        scratch.order.select_nth_unstable_by(k - 1, better);
    }
    scratch.order.truncate(k);
    scratch.order.sort_unstable();
    out.extend(0..sink_end as u32);
    out.extend(
        scratch
            .order
            .iter()
            .map(|&i| (sink_end + i as usize) as u32),
    );
    out.extend(local_start as u32..blocks as u32);
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
    out.clear();
    let mut head = Vec::new();
    for h in 0..layer.geometry().kv_heads as usize {
        select_head(q, layer, layer.blocks(), policy, h, scratch, &mut head);
        out.push_head(head.iter().copied());
    }
    Ok(())
}
