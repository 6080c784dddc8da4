//! CPU gather-decode attention over a keep-set.
//!
//! Work is split into units of (entry, kv-head, run of up to `SPLIT` selected tiles). Each unit
//! streams its tiles with an fp32 online softmax — a K/V tile is decoded once and serves all G
//! query heads of its group — and leaves a partial `(m, l, acc)` per query head. Partials are then
//! merged per (entry, kv-head) by log-sum-exp in unit order, so the result does not depend on how
//! units were spread over threads.

use rayon::prelude::*;

use kvtier_storage::LayerView;

use crate::select::KeepSet;
use crate::simd::{axpy, dots, exp_nonpos, weighted_rows};

/// Tiles per work unit: large enough to amortise the merge, small enough to spread a batch-1
/// step over both cores.
pub const SPLIT: usize = 8;

/// Below this many selected tiles in a request the work stays on the calling thread.
const PARALLEL_MIN_TILES: usize = 32;

/// One attention problem: a query over the selected tiles of one layer.
#[derive(Clone, Copy)]
pub struct AttendItem<'a> {
    /// `[q_heads][head_dim]` f32.
    pub q: &'a [f32],
    pub layer: LayerView<'a>,
    pub keep: &'a KeepSet,
}

/// A unit of work: `tiles` of `item`'s `kv_head`.
struct Unit {
    item: usize,
    kv_head: usize,
    first: usize,
    count: usize,
}

/// Per query head of a unit: running max `m`, normaliser `l`, and unnormalised output `acc`.
struct Partial {
    m: Vec<f32>,
    l: Vec<f32>,
    acc: Vec<f32>,
}

/// [`attend`] over parallel lists: entry i is query `qs[i]` over `keeps[i]` of `views[i]`.
pub fn attend_keep_sets<'a>(
    qs: impl IntoIterator<Item = &'a [f32]>,
    views: &[LayerView<'a>],
    keeps: impl IntoIterator<Item = &'a KeepSet>,
    out: &mut [f32],
) {
    let items: Vec<AttendItem<'_>> = qs
        .into_iter()
        .zip(views)
        .zip(keeps)
        .map(|((q, layer), keep)| AttendItem {
            q,
            layer: *layer,
            keep,
        })
        .collect();
    debug_assert_eq!(items.len(), views.len());
    attend(&items, out);
}

/// Attention for every item; `out` receives `[item][q_heads][head_dim]` f32. Items must have
/// been checked (query sizes, keep-sets within the layer).
pub fn attend(items: &[AttendItem<'_>], out: &mut [f32]) {
    let mut units = Vec::new();
    // Per (item, kv-head) in output order: the range of its units.
    let mut heads = Vec::new();
    for (i, it) in items.iter().enumerate() {
        for h in 0..it.keep.heads() {
            let n = it.keep.head(h).len();
            let start = units.len();
            for first in (0..n).step_by(SPLIT) {
                units.push(Unit {
                    item: i,
                    kv_head: h,
                    first,
                    count: SPLIT.min(n - first),
                });
            }
            heads.push(start..units.len());
        }
    }
    let tiles: usize = items.iter().map(|it| it.keep.tiles()).sum();
    let run = |u: &Unit| run_unit(&items[u.item], u);
    let partials: Vec<Partial> = if tiles >= PARALLEL_MIN_TILES {
        units.par_iter().map(run).collect()
    } else {
        units.iter().map(run).collect()
    };
    let mut heads = heads.into_iter();
    let mut off = 0;
    for it in items {
        let geo = it.layer.geometry();
        let (g, d) = (geo.group(), geo.head_dim as usize);
        let item_out = &mut out[off..off + geo.q_heads as usize * d];
        off += item_out.len();
        for (h, head_out) in item_out.chunks_exact_mut(g * d).enumerate() {
            let range = heads.next().expect("one range per (item, kv-head)");
            debug_assert!(units[range.clone()].iter().all(|u| u.kv_head == h));
            merge(&partials[range], g, d, head_out);
        }
    }
}

fn run_unit(it: &AttendItem<'_>, u: &Unit) -> Partial {
    let geo = it.layer.geometry();
    let (g, d, bt) = (
        geo.group(),
        geo.head_dim as usize,
        geo.block_tokens as usize,
    );
    let scale = 1.0 / (d as f32).sqrt();
    let q: Vec<f32> = it.q[u.kv_head * g * d..(u.kv_head + 1) * g * d]
        .iter()
        .map(|x| x * scale)
        .collect();
    let mut p = Partial {
        m: vec![f32::NEG_INFINITY; g],
        l: vec![0.0; g],
        acc: vec![0.0; g * d],
    };
    let mut rows = vec![0f32; bt * d];
    let mut s = vec![0f32; g * bt];
    for &block in &it.keep.head(u.kv_head)[u.first..u.first + u.count] {
        let block = block as usize;
        let n = it.layer.valid_tokens(block);
        let (kt, vt) = it.layer.tile(block, u.kv_head);
        let rows = &mut rows[..n * d];
        geo.dtype.decode(&kt[..n * geo.row_bytes()], rows);
        scores(&q, g, d, rows, bt, &mut s);
        for gi in 0..g {
            let sg = &mut s[gi * bt..gi * bt + n];
            let tile_max = sg.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let m_new = p.m[gi].max(tile_max);
            // The first tile has m = -inf: alpha = 0 rescales the empty accumulator to zero.
            let alpha = (p.m[gi] - m_new).exp();
            p.m[gi] = m_new;
            sg.iter_mut().for_each(|st| *st = exp_nonpos(*st - m_new));
            p.l[gi] = p.l[gi] * alpha + sg.iter().sum::<f32>();
            for a in &mut p.acc[gi * d..(gi + 1) * d] {
                *a *= alpha;
            }
        }
        geo.dtype.decode(&vt[..n * geo.row_bytes()], rows);
        for gi in 0..g {
            weighted_rows(
                &s[gi * bt..gi * bt + n],
                rows,
                &mut p.acc[gi * d..(gi + 1) * d],
            );
        }
    }
    p
}

/// `s[g][t] = q[g] . rows[t]` for the `n = rows.len() / d` rows, up to four query heads per
/// pass so each key row is read once per four heads.
fn scores(q: &[f32], g: usize, d: usize, rows: &[f32], bt: usize, s: &mut [f32]) {
    let mut gi = 0;
    while gi < g {
        match g - gi {
            1 => scores_n::<1>(q, gi, d, rows, bt, s),
            2 => scores_n::<2>(q, gi, d, rows, bt, s),
            3 => scores_n::<3>(q, gi, d, rows, bt, s),
            _ => scores_n::<4>(q, gi, d, rows, bt, s),
        }
        gi += (g - gi).min(4);
    }
}

fn scores_n<const N: usize>(
    q: &[f32],
    g0: usize,
    d: usize,
    rows: &[f32],
    bt: usize,
    s: &mut [f32],
) {
    let qs: [&[f32]; N] = std::array::from_fn(|j| &q[(g0 + j) * d..(g0 + j + 1) * d]);
    for (t, key) in rows.chunks_exact(d).enumerate() {
        for (j, v) in dots(qs, key).into_iter().enumerate() {
            s[(g0 + j) * bt + t] = v;
        }
    }
}

/// Log-sum-exp merge of one kv-head's partials, in unit order, into its `G x D` output rows.
fn merge(partials: &[Partial], g: usize, d: usize, out: &mut [f32]) {
    out.fill(0.0);
    for (gi, o) in out.chunks_exact_mut(d).enumerate().take(g) {
        let m = partials
            .iter()
            .map(|p| p.m[gi])
            .fold(f32::NEG_INFINITY, f32::max);
        let mut l = 0.0;
        for p in partials {
            let w = (p.m[gi] - m).exp();
            l += p.l[gi] * w;
            axpy(o, w, &p.acc[gi * d..(gi + 1) * d]);
        }
        if l > 0.0 {
            let inv = 1.0 / l;
            o.iter_mut().for_each(|x| *x *= inv);
        }
    }
}
