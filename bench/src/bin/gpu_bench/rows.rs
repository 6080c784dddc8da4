//! A measured row, the queries a run draws, and what the rows are computed from.

use super::*;

#[derive(Default, Clone)]
pub(super) struct Row {
    pub(super) ctx: u32,
    pub(super) k: u32,
    pub(super) batch: u32,
    pub(super) mode: &'static str,
    pub(super) step_ms: f64,
    /// The same mode with split launches (main measures both).
    pub(super) split_ms: f64,
    pub(super) wall_ms: f64,
    pub(super) bytes: f64,
    pub(super) keep_bytes: f64,
    pub(super) hit_rate: f64,
    pub(super) sel_us: f64,
    /// Per step: sum over layers of the fetch + attend phase (ms).
    pub(super) fetch_ms: f64,
    pub(super) att_us: f64,
    pub(super) overlap: f64,
    pub(super) chance: f64,
}

impl Row {
    pub(super) fn floor_ms(&self) -> f64 {
        self.bytes / (PCIE_GBPS * 1e9) * 1e3
    }
    pub(super) fn gbps(&self) -> f64 {
        self.bytes / (self.step_ms * 1e-3) / 1e9
    }
}

/// Queries for every (session, layer): AR(1) with correlation rho between steps.
pub(super) struct Queries {
    pub(super) q: Vec<Vec<f32>>, // [session] -> [layers * Hq * D]
    pub(super) rho: f64,
    pub(super) rng: Rng,
}

impl Queries {
    pub(super) fn new(batch: u32, rho: f64, seed: u64) -> Self {
        let mut rng = Rng(seed);
        let n = (LAYERS * HQ * D) as usize;
        let q = (0..batch)
            .map(|_| (0..n).map(|_| normal(&mut rng) as f32).collect())
            .collect();
        Queries { q, rho, rng }
    }
    pub(super) fn advance(&mut self) {
        let s = (1.0 - self.rho * self.rho).sqrt();
        for qs in &mut self.q {
            for x in qs.iter_mut() {
                *x = (self.rho * *x as f64 + s * normal(&mut self.rng)) as f32;
            }
        }
    }
}

pub(super) fn overlap(
    prev: &[Vec<Vec<u32>>],
    cur: &[Vec<Vec<u32>>],
    sink: u32,
    n_blocks: u32,
    local: u32,
) -> (f64, usize) {
    // Distant blocks only (sink and local always overlap).
    let mut inter = 0usize;
    let mut total = 0usize;
    for (p, c) in prev.iter().flatten().zip(cur.iter().flatten()) {
        let d = |v: &Vec<u32>| {
            v.iter()
                .copied()
                .filter(|&b| b >= sink && b < n_blocks - local)
                .collect::<Vec<u32>>()
        };
        let (pd, cd) = (d(p), d(c));
        inter += cd.iter().filter(|b| pd.binary_search(b).is_ok()).count();
        total += cd.len();
    }
    (inter as f64 / total.max(1) as f64, total)
}

/// One select_score launch's phases from its trace (select.cu, SEL_TRACE), in ns:
/// [span, start spread, q staged, scored, block top-32, list published, counted (median
/// over thread blocks), last arrival, merge, plan (median over the kv heads' last blocks)].
pub(super) fn trace_phases(t: &[u64]) -> Option<[f64; 16]> {
    let recs: Vec<&[u64]> = t.chunks_exact(16).filter(|r| r[0] != 0).collect();
    if recs.is_empty() {
        return None;
    }
    let t0 = recs.iter().map(|r| r[0]).min()? as f64;
    let ph = |a: usize, b: usize, last: bool| {
        let mut v: Vec<f64> = recs
            .iter()
            .filter(|r| !last || r[7] != 0)
            .map(|r| r[b] as f64 - r[a] as f64)
            .collect();
        median(&mut v)
    };
    let mut out = [0f64; 16];
    out[1] = recs.iter().map(|r| r[0]).max()? as f64 - t0;
    for k in 0..5 {
        out[2 + k] = ph(k, k + 1, false);
    }
    let mut arrive: Vec<f64> = recs
        .iter()
        .filter(|r| r[7] != 0)
        .map(|r| r[5] as f64 - t0)
        .collect();
    out[7] = median(&mut arrive);
    out[8] = ph(5, 6, true);
    out[9] = ph(6, 7, true);
    out[0] = recs.iter().map(|r| r[5].max(r[7])).max()? as f64 - t0;
    // The same intra-block phases from the SM clock (cycles), against a coarse global timer.
    for k in 0..5 {
        out[10 + k] = ph(8 + k, 9 + k, false);
    }
    out[15] = ph(13, 15, true);
    Some(out)
}
