//! Sessions on a real daemon, checked against the dense oracle: the geometry and policy the
//! daemon tests use, and [`Shadow`], the model side of a session.

use kvtier_kernels::dense::{max_rel_err, reference_attention};
use kvtier_protocol::client::Client;
use kvtier_protocol::{DType, DecodeEntryRef, DecodeOutput, Geometry, Policy};
use kvtier_storage::testing::Rng;

use crate::kv::{f32_bytes, query, rows};

/// A small GQA geometry whose (layer, block) run exactly fills a 4 KiB frame: 2 KV heads x
/// (K, V) x 16 tokens x 32 dims x 2 bytes.
pub const SMALL_GEOMETRY: Geometry = Geometry::new(2, 4, 2, 32, DType::Bf16, 16);

/// [`SMALL_GEOMETRY`].
pub fn small_geometry() -> Geometry {
    SMALL_GEOMETRY
}

/// Sink 1, local 1, top-k 2 by the sketch selector with 2 candidates per kv head: a
/// keep-set of 4 blocks once past 4 blocks, its candidates narrowed by the bounds once past 6.
pub fn policy() -> Policy {
    Policy::sketch(1, 1, 2, 2)
}

pub fn entry<'a>(
    session: u64,
    position: u64,
    q: &'a [u8],
    k: &'a [u8],
    v: &'a [u8],
) -> DecodeEntryRef<'a> {
    DecodeEntryRef {
        session,
        position,
        q,
        k,
        v,
    }
}

/// The model side of a session: every layer's stored K/V (as f32 after dtype rounding), so
/// outputs can be checked against the dense oracle. Its sessions use [`policy`].
#[derive(Clone)]
pub struct Shadow {
    pub g: Geometry,
    pub k: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
    pub rng: Rng,
}

impl Shadow {
    pub fn new(g: Geometry, seed: u64) -> Self {
        Shadow {
            g,
            k: vec![Vec::new(); g.layers as usize],
            v: vec![Vec::new(); g.layers as usize],
            rng: Rng::new(seed),
        }
    }

    fn row_elems(&self) -> usize {
        (self.g.kv_heads * self.g.head_dim) as usize
    }

    /// A random APPEND_KV payload of `n` tokens (recorded in the shadow).
    pub fn payload(&mut self, n: usize) -> Vec<u8> {
        let g = self.g;
        let mut out = Vec::new();
        for l in 0..self.g.layers as usize {
            for kv in 0..2 {
                let bytes = rows(&g, n, &mut self.rng);
                let stored = g.dtype.decode_vec(&bytes);
                if kv == 0 {
                    self.k[l].extend(stored)
                } else {
                    self.v[l].extend(stored)
                }
                out.extend(bytes);
            }
        }
        out
    }

    /// A random decode input for `layer` (recorded): (q, k, v).
    pub fn step_input(&mut self, layer: usize) -> (Vec<f32>, Vec<u8>, Vec<u8>) {
        let g = self.g;
        let q = query(&g, &mut self.rng);
        let k = rows(&g, 1, &mut self.rng);
        let v = rows(&g, 1, &mut self.rng);
        self.k[layer].extend(g.dtype.decode_vec(&k));
        self.v[layer].extend(g.dtype.decode_vec(&v));
        (q, k, v)
    }

    /// Forgets every token past `n` in every layer (what a server that lost them holds).
    pub fn truncate(&mut self, n: u64) {
        let keep = n as usize * self.row_elems();
        for l in 0..self.g.layers as usize {
            self.k[l].truncate(keep);
            self.v[l].truncate(keep);
        }
    }

    pub fn tokens(&self, layer: usize) -> u64 {
        (self.k[layer].len() / self.row_elems()) as u64
    }

    /// Checks a decode output against dense attention over exactly the reported keep-set.
    pub fn check(&self, layer: usize, q: &[f32], out: &DecodeOutput) {
        let stats = out.stats.as_ref().expect("stats requested");
        let g = self.g;
        let bt = self.g.block_tokens;
        let want = reference_attention(&g, q, &self.k[layer], &self.v[layer], |h, t| {
            stats.selected[h].binary_search(&(t as u32 / bt)).is_ok()
        });
        let err = max_rel_err(&out.out, &want);
        assert!(
            err <= 2e-3,
            "decode output differs from the dense oracle: rel err {err}"
        );
        let blocks = g.blocks_for(self.tokens(layer)) as u32;
        assert_eq!(stats.blocks_total, blocks);
        let p = policy();
        let budget = (p.sink_blocks + p.local_blocks + p.top_k).min(blocks);
        assert!(
            stats.selected.iter().all(|s| s.len() as u32 == budget),
            "keep-set size"
        );
    }

    /// One decode step of session `id` at `layer` (a random input at the next position, stats
    /// requested), its output checked against the oracle and returned.
    pub fn decode(&mut self, c: &mut Client, id: u64, layer: usize) -> DecodeOutput {
        let pos = self.tokens(layer);
        let (q, k, v) = self.step_input(layer);
        let out = c
            .decode(layer as u32, entry(id, pos, &f32_bytes(&q), &k, &v), true)
            .unwrap_or_else(|e| panic!("session {id} layer {layer} at {pos}: {e}"));
        self.check(layer, &q, &out);
        out
    }

    /// One decode step of session `id` over every layer, each output checked.
    pub fn step(&mut self, c: &mut Client, id: u64) {
        for layer in 0..self.g.layers as usize {
            self.decode(c, id, layer);
        }
    }
}

/// A new, empty session of [`small_geometry`] and [`policy`] labelled `label`, and its shadow
/// (seeded with `seed`).
pub fn create(c: &mut Client, label: &str, seed: u64) -> (u64, Shadow) {
    let g = small_geometry();
    let id = c.create_session(g, policy(), label).unwrap();
    (id, Shadow::new(g, seed))
}

/// [`create`], then `n` tokens drawn by the shadow appended.
pub fn open(c: &mut Client, label: &str, n: u32, seed: u64) -> (u64, Shadow) {
    let (id, mut sh) = create(c, label, seed);
    c.append_kv(id, 0, n, &sh.payload(n as usize)).unwrap();
    (id, sh)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shadow_draws_the_payload_kv_payload_draws_and_records_it() {
        let g = small_geometry();
        let mut sh = Shadow::new(g, 9);
        let p = sh.payload(20);
        assert_eq!(p, crate::kv::payload(&g, 20, 9));
        assert_eq!((sh.tokens(0), sh.tokens(1)), (20, 20));
        sh.step_input(1);
        assert_eq!((sh.tokens(0), sh.tokens(1)), (20, 21));
        sh.truncate(20);
        assert_eq!(sh.tokens(1), 20);
    }
}
