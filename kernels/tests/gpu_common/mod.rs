//! Shared harness of the CUDA integration tests (gpu_attention, gpu_selector,
//! gpu_cache_and_launch, gpu_errors): a CUDA backend over a pinned host region, sessions of
//! random keys, and the CPU selector (`kvtier_kernels::select::{block_score, partition}`, bit for
//! bit) and an f64 attention reference to check it against. Each test file includes it with
//! `mod gpu_common;` and uses part of it.
#![allow(dead_code)]

use half::{bf16, f16};
use kvtier_kernels::cuda::{
    bf16_outward, device_available, AnonMapping, CudaBackend, CudaConfig, DecodeItem, PinnedRegion,
    StepItem, SummaryDtype,
};
use kvtier_kernels::select::{block_score, partition, QuerySketch};
use kvtier_storage::sketch::{sketch_block, BlockSketches};
use kvtier_storage::testing::XorShift64 as Rng;
use kvtier_storage::{DType, Geometry, Policy, Selector};

pub fn gpu() -> bool {
    if device_available() {
        true
    } else {
        println!("skipped: no CUDA device");
        false
    }
}

/// Uniform in [-1, 1).
fn uniform_pm1(rng: &mut Rng) -> f32 {
    ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// Rounds to the storage dtype and returns (stored value as f32, little-endian bytes).
fn store(x: f32, dt: DType) -> (f32, Vec<u8>) {
    match dt {
        DType::Bf16 => {
            let h = bf16::from_f32(x);
            (h.to_f32(), h.to_bits().to_le_bytes().to_vec())
        }
        DType::F16 => {
            let h = f16::from_f32(x);
            (h.to_f32(), h.to_bits().to_le_bytes().to_vec())
        }
        DType::F32 => (x, x.to_le_bytes().to_vec()),
    }
}

/// One session's KV as the CPU sees it: per layer, per kv head, K and V [tokens][D] (stored values).
pub struct SessionKv {
    pub n_tokens: u32,
    k: Vec<Vec<Vec<f32>>>, // [layer][kvh][t*D + d]
    v: Vec<Vec<Vec<f32>>>,
    extents: Vec<Vec<u64>>, // [layer][block] -> extent index
}

pub struct Harness {
    pub cfg: CudaConfig,
    pub be: CudaBackend,
    pub sessions: Vec<SessionKv>,
    next_extent: u64,
    n_extents: u64,
    rng: Rng,
}

pub fn geom(hq: u32, hkv: u32, d: u32, b: u32, dtype: DType) -> Geometry {
    Geometry::new(2, hq, hkv, d, dtype, b)
}

/// How keys are drawn: `templates` > 0 makes block b reuse the keys of block b % templates
/// (identical summaries, hence exactly tied scores).
#[derive(Clone, Copy)]
pub struct KeyGen {
    pub templates: u32,
}

impl Harness {
    /// A harness for `cfg` seeded with `seed`, or None (the test passes, saying so) without a
    /// CUDA device.
    pub fn start(cfg: CudaConfig, seed: u64) -> Option<Harness> {
        gpu().then(|| Harness::new(cfg, seed))
    }

    pub fn new(cfg: CudaConfig, seed: u64) -> Harness {
        let mut be = CudaBackend::new(0, cfg).expect("backend");
        be.set_poison_outputs(true);
        let g = cfg.geometry;
        let n_extents = cfg.max_sessions as u64 * g.layers as u64 * cfg.max_blocks as u64;
        let map = AnonMapping::new((n_extents * g.block_bytes() as u64) as usize).expect("mmap");
        let region = PinnedRegion::register_owned(be.context(), map).expect("pin");
        be.attach_host(region).expect("attach");
        Harness {
            cfg,
            be,
            sessions: Vec::new(),
            next_extent: 0,
            n_extents,
            rng: Rng(seed | 1),
        }
    }

    fn extent_offset(&self, extent: u64) -> u64 {
        extent * self.cfg.geometry.block_bytes() as u64
    }

    /// Writes token t (all kv heads) of a session layer into its host extent.
    fn write_token(&mut self, s: usize, l: usize, t: u32) {
        let g = self.cfg.geometry;
        let (b, d, bt) = (g.block_tokens, g.head_dim as usize, g.block_tokens as usize);
        let es = g.dtype.size();
        let extent = self.sessions[s].extents[l][(t / b) as usize];
        let base = self.extent_offset(extent) as usize;
        let tin = (t % b) as usize;
        let host = self.be.host_mut().unwrap().host_mut().unwrap();
        for h in 0..g.kv_heads as usize {
            let tile = base + h * g.tile_bytes();
            for dd in 0..d {
                let kv = &self.sessions[s];
                let kx = kv.k[l][h][t as usize * d + dd];
                let vx = kv.v[l][h][t as usize * d + dd];
                let ko = tile + (tin * d + dd) * es;
                let vo = tile + (bt * d + tin * d + dd) * es;
                host[ko..ko + es].copy_from_slice(&store(kx, g.dtype).1);
                host[vo..vo + es].copy_from_slice(&store(vx, g.dtype).1);
            }
        }
    }

    /// The key sketches of block `b` of a session layer, from its run in the host extent (the
    /// storage crate's own sketching).
    fn block_sketch(&self, s: usize, l: usize, b: u32) -> BlockSketches {
        let g = self.cfg.geometry;
        let kv = &self.sessions[s];
        let valid = (kv.n_tokens - b * g.block_tokens).min(g.block_tokens) as usize;
        let base = self.extent_offset(kv.extents[l][b as usize]) as usize;
        let host = self.be.host().unwrap().host().unwrap();
        let run = &host[base..base + g.block_bytes()];
        let mut out = BlockSketches::new(&g, 1);
        sketch_block(&g, run, valid, out.blocks_mut(&g).next().unwrap());
        out
    }

    /// Summaries [n][kvh][2][D] of blocks first..first+n of a session layer (stored keys).
    fn summaries(&self, s: usize, l: usize, first: u32, n: u32) -> Vec<f32> {
        let g = self.cfg.geometry;
        let (d, bt) = (g.head_dim as usize, g.block_tokens);
        let kv = &self.sessions[s];
        let mut out = Vec::new();
        for b in first..first + n {
            for h in 0..g.kv_heads as usize {
                let mut mx = vec![f32::NEG_INFINITY; d];
                let mut mn = vec![f32::INFINITY; d];
                for t in b * bt..((b + 1) * bt).min(kv.n_tokens) {
                    for dd in 0..d {
                        let x = kv.k[l][h][t as usize * d + dd];
                        mx[dd] = mx[dd].max(x);
                        mn[dd] = mn[dd].min(x);
                    }
                }
                out.extend_from_slice(&mx);
                out.extend_from_slice(&mn);
            }
        }
        out
    }

    /// Opens session slot s with n_tokens tokens in every layer.
    pub fn add_session(&mut self, n_tokens: u32, keys: KeyGen) -> u32 {
        let g = self.cfg.geometry;
        let s = self.sessions.len();
        let slot = s as u32;
        self.be.open_session(slot).unwrap();
        let (d, hkv, bt) = (g.head_dim as usize, g.kv_heads as usize, g.block_tokens);
        let cap = (self.cfg.max_blocks * bt) as usize;
        let mut k = vec![vec![vec![0f32; cap * d]; hkv]; g.layers as usize];
        let mut v = k.clone();
        for l in 0..g.layers as usize {
            for h in 0..hkv {
                for t in 0..cap {
                    for dd in 0..d {
                        let src_t = if keys.templates > 0 {
                            let blk = t as u32 / bt;
                            ((blk % keys.templates) * bt + t as u32 % bt) as usize
                        } else {
                            t
                        };
                        let kx = if src_t < t {
                            k[l][h][src_t * d + dd]
                        } else {
                            store(uniform_pm1(&mut self.rng), g.dtype).0
                        };
                        k[l][h][t * d + dd] = kx;
                        v[l][h][t * d + dd] = store(uniform_pm1(&mut self.rng), g.dtype).0;
                    }
                }
            }
        }
        // Frames in a scrambled order, so the page table really is an indirection.
        let nb = self.cfg.max_blocks as usize;
        let mut extents = vec![vec![0u64; nb]; g.layers as usize];
        for fl in extents.iter_mut() {
            for f in fl.iter_mut() {
                *f = (self.next_extent * 7919) % self.n_extents;
                self.next_extent += 1;
            }
        }
        self.sessions.push(SessionKv {
            n_tokens: 0,
            k,
            v,
            extents,
        });
        self.append(slot, n_tokens);
        slot
    }

    /// Appends tokens to every layer: host extents, tail summaries, mappings, token counts.
    pub fn append(&mut self, slot: u32, n_new: u32) {
        let g = self.cfg.geometry;
        let s = slot as usize;
        let old = self.sessions[s].n_tokens;
        let new = old + n_new;
        self.sessions[s].n_tokens = new;
        let bt = g.block_tokens;
        for l in 0..g.layers as usize {
            for t in old..new {
                self.write_token(s, l, t);
            }
            let first = old / bt;
            let last = new.div_ceil(bt);
            if self.cfg.sketch() {
                let mut all = BlockSketches::default();
                for b in first..last {
                    all.extend(&self.block_sketch(s, l, b));
                }
                self.be
                    .upload_sketches(slot, l as u32, first, &all.as_ref())
                    .unwrap();
            } else {
                let sums = self.summaries(s, l, first, last - first);
                self.be
                    .upload_summaries(slot, l as u32, first, &sums)
                    .unwrap();
            }
            let offs: Vec<u64> = (first..last)
                .map(|b| self.extent_offset(self.sessions[s].extents[l][b as usize]))
                .collect();
            self.be.map_blocks(slot, l as u32, first, &offs).unwrap();
            self.be.set_tokens(slot, l as u32, new).unwrap();
        }
    }

    /// Sessions of these token counts (independent random keys), their slots in order.
    pub fn add_sessions(&mut self, n_tokens: &[u32]) -> Vec<u32> {
        n_tokens
            .iter()
            .map(|&n| self.add_session(n, KeyGen { templates: 0 }))
            .collect()
    }

    pub fn query(&mut self) -> Vec<f32> {
        let g = self.cfg.geometry;
        (0..g.q_heads * g.head_dim)
            .map(|_| uniform_pm1(&mut self.rng) * 2.0)
            .collect()
    }

    /// The CPU selector's own scoring ([`block_score`]) and partition ([`partition`]) over the
    /// same (optionally bf16-rounded) summaries; top-k by score, ties to the lower block, as
    /// `select_head` orders them (`total_cmp`, then index).
    pub fn cpu_select(&self, s: usize, l: usize, q: &[f32]) -> Vec<Vec<u32>> {
        let g = self.cfg.geometry;
        let p = self.cfg.policy;
        if let Selector::Sketch { candidates } = p.selector {
            return self.cpu_select_sketch(s, l, q, candidates as usize);
        }
        let policy = Policy::bound(p.sink_blocks, p.local_blocks, p.top_k);
        let (d, grp) = (g.head_dim as usize, g.group());
        let n = self.sessions[s].n_tokens.div_ceil(g.block_tokens);
        let mut sums = self.summaries(s, l, 0, n);
        if self.cfg.summary_dtype == SummaryDtype::Bf16Outward {
            for (i, x) in sums.iter_mut().enumerate() {
                *x = f32::from_bits((bf16_outward(*x, (i / d) % 2 == 0) as u32) << 16);
            }
        }
        (0..g.kv_heads as usize)
            .map(|h| {
                let Some((sink_end, local_start)) = partition(n as usize, &policy) else {
                    return (0..n).collect();
                };
                let q_group = &q[h * grp * d..(h + 1) * grp * d];
                let mut cand: Vec<(f32, u32)> = (sink_end..local_start)
                    .map(|b| {
                        let row = &sums[(b * g.kv_heads as usize + h) * 2 * d..][..2 * d];
                        (block_score(q_group, &row[..d], &row[d..]), b as u32)
                    })
                    .collect();
                cand.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                let mut keep: Vec<u32> = (0..sink_end as u32).collect();
                keep.extend(cand.iter().take(p.top_k as usize).map(|c| c.1));
                keep.extend(local_start as u32..n);
                keep.sort_unstable();
                keep
            })
            .collect()
    }

    /// The sketch selector on the CPU, from its own scoring ([`QuerySketch::quarter_score`],
    /// [`QuerySketch::score`]) of each block's sketches (from its run): the `c` best distant
    /// blocks by quarter bound (every one in a layer within twice as many units), then the
    /// top-k of those by sketch, ties to the lower block.
    fn cpu_select_sketch(&self, s: usize, l: usize, q: &[f32], c: usize) -> Vec<Vec<u32>> {
        let g = self.cfg.geometry;
        let p = self.cfg.policy;
        let (d, grp) = (g.head_dim as usize, g.group());
        let n = self.sessions[s].n_tokens.div_ceil(g.block_tokens);
        let blocks: Vec<BlockSketches> = (0..n).map(|b| self.block_sketch(s, l, b)).collect();
        let best = |mut c: Vec<(f32, u32)>, k: usize| -> Vec<u32> {
            c.sort_by(|a, b| a.0.total_cmp(&b.0).reverse().then(a.1.cmp(&b.1)));
            c.into_iter().take(k).map(|x| x.1).collect()
        };
        (0..g.kv_heads as usize)
            .map(|h| {
                let Some((sink_end, local_start)) = partition(n as usize, &p) else {
                    return (0..n).collect();
                };
                let qs = QuerySketch::new(&q[h * grp * d..(h + 1) * grp * d], d);
                let head = |b: usize| blocks[b].as_ref().head(&g, 0, h);
                // Units of four quarter records (G blocks): each scored by its best distant
                // block; the distant blocks of the best `ceil(max(c, k + 2 (G - 1)) / G)`, or
                // of every unit where there are at most 16,384 tokens' worth (256 blocks at most;
                // `want` if more).
                let unit = 4 / kvtier_storage::sketch::quarters(g.block_tokens as usize);
                let want = c.max(p.top_k as usize + 2 * (unit - 1)).div_ceil(unit);
                let scan = want.max((16_384 / g.block_tokens as usize).min(256) / unit);
                let (u0, u1) = (sink_end / unit, (local_start - 1) / unit + 1);
                let distant =
                    |u: usize| (u * unit).max(sink_end)..((u + 1) * unit).min(local_start);
                let units: Vec<u32> = if u1 - u0 <= scan {
                    (u0 as u32..u1 as u32).collect()
                } else {
                    best(
                        (u0..u1)
                            .map(|u| {
                                let m = distant(u)
                                    .map(|b| qs.quarter_score(&head(b)))
                                    .fold(f32::NEG_INFINITY, f32::max);
                                (m, u as u32)
                            })
                            .collect(),
                        want,
                    )
                };
                let cands: Vec<u32> = units
                    .iter()
                    .flat_map(|&u| distant(u as usize))
                    .map(|b| b as u32)
                    .collect();
                let mut keep: Vec<u32> = (0..sink_end as u32).collect();
                keep.extend(best(
                    cands
                        .iter()
                        .map(|&b| (qs.score(&head(b as usize)), b))
                        .collect(),
                    p.top_k as usize,
                ));
                keep.extend(local_start as u32..n);
                keep.sort_unstable();
                keep
            })
            .collect()
    }

    /// f64 softmax attention over the given blocks per kv head: [Hq][D].
    pub fn cpu_attend(&self, s: usize, l: usize, q: &[f32], keep: &[Vec<u32>]) -> Vec<f64> {
        let g = self.cfg.geometry;
        let (d, grp, bt) = (g.head_dim as usize, g.group(), g.block_tokens);
        let kv = &self.sessions[s];
        let scale = 1.0 / (d as f64).sqrt();
        let mut out = vec![0f64; g.q_heads as usize * d];
        for hq in 0..g.q_heads as usize {
            let h = hq / grp;
            let toks: Vec<usize> = keep[h]
                .iter()
                .flat_map(|&b| (b * bt..((b + 1) * bt).min(kv.n_tokens)).map(|t| t as usize))
                .collect();
            let qh = &q[hq * d..][..d];
            let sc: Vec<f64> = toks
                .iter()
                .map(|&t| {
                    (0..d)
                        .map(|dd| qh[dd] as f64 * kv.k[l][h][t * d + dd] as f64)
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = w.iter().sum();
            for (wi, &t) in w.iter().zip(&toks) {
                for dd in 0..d {
                    out[hq * d + dd] += wi / z * kv.v[l][h][t * d + dd] as f64;
                }
            }
        }
        out
    }
}

pub fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    assert!(
        got.iter().all(|x| x.is_finite()),
        "unwritten (NaN-poisoned) or non-finite output"
    );
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| (*a as f64 - b).powi(2))
        .sum();
    let den: f64 = want.iter().map(|b| b * b).sum();
    (num / den).sqrt()
}

/// Runs one layer for the given slots and checks selection (exact) and attention (2e-3);
/// returns the outputs.
pub fn check_layer(h: &mut Harness, layer: u32, slots: &[u32]) -> Vec<f32> {
    let qs: Vec<Vec<f32>> = slots.iter().map(|_| h.query()).collect();
    let items: Vec<DecodeItem> = slots
        .iter()
        .zip(&qs)
        .map(|(&slot, q)| DecodeItem { slot, q })
        .collect();
    let out = h.be.decode_layer(layer, &items).expect("decode");
    let keeps = h.be.last_keep_sets(layer).unwrap();
    let hqd = (h.cfg.geometry.q_heads * h.cfg.geometry.head_dim) as usize;
    for (i, &slot) in slots.iter().enumerate() {
        let want = h.cpu_select(slot as usize, layer as usize, &qs[i]);
        assert_eq!(keeps[i], want, "keep-set of slot {slot} layer {layer}");
        let r = h.cpu_attend(slot as usize, layer as usize, &qs[i], &want);
        let e = rel_err(&out.out[i * hqd..(i + 1) * hqd], &r);
        assert!(e < 2e-3, "slot {slot} layer {layer}: rel err {e}");
    }
    let tiles: u64 = keeps.iter().flatten().map(|k| k.len() as u64).sum();
    assert_eq!(out.stats.tiles, tiles);
    assert_eq!(out.stats.hits + out.stats.misses, tiles);
    assert_eq!(
        out.stats.bytes_moved,
        out.stats.misses * h.cfg.geometry.tile_bytes() as u64
    );
    out.out
}

/// decode_step items: slot `slots[i]` with queries `qs[i]`.
pub fn step_items<'a>(slots: &[u32], qs: &'a [Vec<f32>]) -> Vec<StepItem<'a>> {
    slots
        .iter()
        .zip(qs)
        .map(|(&slot, q)| StepItem { slot, q })
        .collect()
}

/// Checks a decode_step's outputs and keep-sets (`keeps[layer]`, as `last_keep_sets` gives them)
/// against the CPU selector and the f64 reference, for the first `layers` layers of `slots` with
/// queries `qs` (each [step layers x Hq x D]).
pub fn check_step(
    h: &Harness,
    slots: &[u32],
    qs: &[Vec<f32>],
    layers: usize,
    out: &[f32],
    keeps: &[Vec<Vec<Vec<u32>>>],
) {
    let hqd = (h.cfg.geometry.q_heads * h.cfg.geometry.head_dim) as usize;
    let n = qs[0].len() / hqd;
    for (i, &slot) in slots.iter().enumerate() {
        for l in 0..layers {
            let q = &qs[i][l * hqd..(l + 1) * hqd];
            let want = h.cpu_select(slot as usize, l, q);
            assert_eq!(keeps[l][i], want, "keep-set of slot {slot} layer {l}");
            let r = h.cpu_attend(slot as usize, l, q, &want);
            let got = &out[(i * n + l) * hqd..(i * n + l + 1) * hqd];
            let e = rel_err(got, &r);
            assert!(e < 2e-3, "slot {slot} layer {l}: rel err {e}");
        }
    }
}

pub const POLICY: Policy = Policy::bound(1, 4, 8);

/// Qwen2.5-7B heads (28/4, D=128, bf16) in blocks of 32 tokens, [`POLICY`], fp32 summaries.
pub fn qwen_b32_config(max_blocks: u32, sessions: u32) -> CudaConfig {
    let g = geom(28, 4, 128, 32, DType::Bf16);
    CudaConfig::new(g, POLICY, max_blocks, sessions, SummaryDtype::F32)
}

/// Qwen2.5-7B attention (28/4 heads, D=128, B=128, bf16), sink 1, local 4, top-k 32.
pub fn qwen_config(max_blocks: u32, sessions: u32) -> CudaConfig {
    let policy = Policy::bound(1, 4, 32);
    let g = geom(28, 4, 128, 128, DType::Bf16);
    CudaConfig::new(g, policy, max_blocks, sessions, SummaryDtype::F32)
}
