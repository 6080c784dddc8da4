//! CUDA backend against the CPU selector (`kvtier_kernels::select::{block_score, partition}`,
//! bit for bit) and an f64 attention reference.
//! Every test is `#[ignore]`d with the reason, so a machine without a GPU reports it as ignored;
//! bench/gpu/run.sh runs them with `--include-ignored`. Run anyway without a device, each prints
//! "skipped: no CUDA device" and passes.
#![cfg(feature = "cuda")]

use half::{bf16, f16};
use kvtier_kernels::cuda::{
    bf16_outward, device_available, AnonMapping, AttentionMath, CudaBackend, CudaConfig, CudaError,
    DecodeItem, DenseKv, LaunchMode, LayerStats, PinnedRegion, StepItem, SummaryDtype, Timing,
};
use kvtier_kernels::select::{block_score, partition};
use kvtier_storage::testing::XorShift64 as Rng;
use kvtier_storage::{DType, Geometry, Policy};

fn gpu() -> bool {
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
struct SessionKv {
    n_tokens: u32,
    k: Vec<Vec<Vec<f32>>>, // [layer][kvh][t*D + d]
    v: Vec<Vec<Vec<f32>>>,
    frames: Vec<Vec<u64>>, // [layer][block] -> frame index
}

struct Harness {
    cfg: CudaConfig,
    be: CudaBackend,
    sessions: Vec<SessionKv>,
    next_frame: u64,
    n_frames: u64,
    rng: Rng,
}

fn geom(hq: u32, hkv: u32, d: u32, b: u32, dtype: DType) -> Geometry {
    Geometry::new(2, hq, hkv, d, dtype, b)
}

/// How keys are drawn: `templates` > 0 makes block b reuse the keys of block b % templates
/// (identical summaries, hence exactly tied scores).
#[derive(Clone, Copy)]
struct KeyGen {
    templates: u32,
}

impl Harness {
    fn new(cfg: CudaConfig, seed: u64) -> Harness {
        let mut be = CudaBackend::new(0, cfg).expect("backend");
        be.set_poison_outputs(true);
        let g = cfg.geometry;
        let n_frames = cfg.max_sessions as u64 * g.layers as u64 * cfg.max_blocks as u64;
        let map = AnonMapping::new((n_frames * g.block_bytes() as u64) as usize).expect("mmap");
        let region = PinnedRegion::register_owned(be.context(), map).expect("pin");
        be.attach_host(region).expect("attach");
        Harness {
            cfg,
            be,
            sessions: Vec::new(),
            next_frame: 0,
            n_frames,
            rng: Rng(seed | 1),
        }
    }

    fn frame_offset(&self, frame: u64) -> u64 {
        frame * self.cfg.geometry.block_bytes() as u64
    }

    /// Writes token t (all kv heads) of a session layer into its host frame.
    fn write_token(&mut self, s: usize, l: usize, t: u32) {
        let g = self.cfg.geometry;
        let (b, d, bt) = (g.block_tokens, g.head_dim as usize, g.block_tokens as usize);
        let es = g.dtype.size();
        let frame = self.sessions[s].frames[l][(t / b) as usize];
        let base = self.frame_offset(frame) as usize;
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
    fn add_session(&mut self, n_tokens: u32, keys: KeyGen) -> u32 {
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
        let mut frames = vec![vec![0u64; nb]; g.layers as usize];
        for fl in frames.iter_mut() {
            for f in fl.iter_mut() {
                *f = (self.next_frame * 7919) % self.n_frames;
                self.next_frame += 1;
            }
        }
        self.sessions.push(SessionKv {
            n_tokens: 0,
            k,
            v,
            frames,
        });
        self.append(slot, n_tokens);
        slot
    }

    /// Appends tokens to every layer: host frames, tail summaries, mappings, token counts.
    fn append(&mut self, slot: u32, n_new: u32) {
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
            let sums = self.summaries(s, l, first, last - first);
            self.be
                .upload_summaries(slot, l as u32, first, &sums)
                .unwrap();
            let offs: Vec<u64> = (first..last)
                .map(|b| self.frame_offset(self.sessions[s].frames[l][b as usize]))
                .collect();
            self.be.map_blocks(slot, l as u32, first, &offs).unwrap();
            self.be.set_tokens(slot, l as u32, new).unwrap();
        }
    }

    /// Sessions of these token counts (independent random keys), their slots in order.
    fn add_sessions(&mut self, n_tokens: &[u32]) -> Vec<u32> {
        n_tokens
            .iter()
            .map(|&n| self.add_session(n, KeyGen { templates: 0 }))
            .collect()
    }

    fn query(&mut self) -> Vec<f32> {
        let g = self.cfg.geometry;
        (0..g.q_heads * g.head_dim)
            .map(|_| uniform_pm1(&mut self.rng) * 2.0)
            .collect()
    }

    /// The CPU selector's own scoring ([`block_score`]) and partition ([`partition`]) over the
    /// same (optionally bf16-rounded) summaries; top-k by score, ties to the lower block, as
    /// `select_head` orders them (`total_cmp`, then index).
    fn cpu_select(&self, s: usize, l: usize, q: &[f32]) -> Vec<Vec<u32>> {
        let g = self.cfg.geometry;
        let p = self.cfg.policy;
        let policy = Policy {
            sink_blocks: p.sink_blocks,
            local_blocks: p.local_blocks,
            top_k: p.top_k,
        };
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

    /// f64 softmax attention over the given blocks per kv head: [Hq][D].
    fn cpu_attend(&self, s: usize, l: usize, q: &[f32], keep: &[Vec<u32>]) -> Vec<f64> {
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

fn rel_err(got: &[f32], want: &[f64]) -> f64 {
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
fn check_layer(h: &mut Harness, layer: u32, slots: &[u32]) -> Vec<f32> {
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
fn step_items<'a>(slots: &[u32], qs: &'a [Vec<f32>]) -> Vec<StepItem<'a>> {
    slots
        .iter()
        .zip(qs)
        .map(|(&slot, q)| StepItem { slot, q })
        .collect()
}

/// Checks a decode_step's outputs and keep-sets (`keeps[layer]`, as `last_keep_sets` gives them)
/// against the CPU selector and the f64 reference, for the first `layers` layers of `slots` with
/// queries `qs` (each [step layers x Hq x D]).
fn check_step(
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

const POLICY: Policy = Policy {
    sink_blocks: 1,
    local_blocks: 4,
    top_k: 8,
};

/// Qwen2.5-7B attention (28/4 heads, D=128, B=128, bf16), sink 1, local 4, top-k 32.
fn qwen_config(max_blocks: u32, sessions: u32) -> CudaConfig {
    let policy = Policy {
        sink_blocks: 1,
        local_blocks: 4,
        top_k: 32,
    };
    let g = geom(28, 4, 128, 128, DType::Bf16);
    CudaConfig::new(g, policy, max_blocks, sessions, SummaryDtype::F32)
}

#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn smoke_device_and_one_layer() {
    if !gpu() {
        return;
    }
    let cfg = CudaConfig::new(
        geom(28, 4, 128, 128, DType::Bf16),
        POLICY,
        24,
        1,
        SummaryDtype::F32,
    );
    let mut h = Harness::new(cfg, 1);
    println!("device: {}", h.be.device_name().unwrap());
    let s = h.add_session(20 * 128 + 77, KeyGen { templates: 0 });
    check_layer(&mut h, 0, &[s]);
}

/// Qwen2.5-7B geometry (B=128, bf16), batch 1 and 8, sessions of different lengths, both
/// the top-k path and the all-blocks path.
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn qwen_geometry_batch_1_and_8() {
    if !gpu() {
        return;
    }
    let cfg = qwen_config(64, 8);
    let mut h = Harness::new(cfg, 2);
    let lens = [
        64 * 128,
        50 * 128 + 3,
        37 * 128,
        38 * 128 + 1,
        10 * 128 + 127,
        1,
        129,
        63 * 128 + 64,
    ];
    let slots = h.add_sessions(&lens);
    check_layer(&mut h, 0, &slots[..1]);
    check_layer(&mut h, 1, &slots[..1]);
    check_layer(&mut h, 1, &slots);
    check_layer(&mut h, 0, &slots);
}

#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn other_geometries_and_dtypes() {
    if !gpu() {
        return;
    }
    let cases = [
        (
            geom(8, 8, 64, 16, DType::F16),
            Policy {
                sink_blocks: 2,
                local_blocks: 3,
                top_k: 4,
            },
            SummaryDtype::F32,
        ),
        (geom(16, 2, 128, 32, DType::F32), POLICY, SummaryDtype::F32),
        (
            geom(16, 4, 256, 64, DType::Bf16),
            POLICY,
            SummaryDtype::Bf16Outward,
        ),
        (
            geom(32, 8, 32, 16, DType::F32),
            Policy {
                sink_blocks: 0,
                local_blocks: 1,
                top_k: 3,
            },
            SummaryDtype::Bf16Outward,
        ),
        (
            geom(12, 4, 64, 128, DType::Bf16),
            POLICY,
            SummaryDtype::Bf16Outward,
        ),
    ];
    for (ci, (g, p, sd)) in cases.into_iter().enumerate() {
        let cfg = CudaConfig::new(g, p, 40, 8, sd);
        let mut h = Harness::new(cfg, 10 + ci as u64);
        let b = g.block_tokens;
        let lens = [
            40 * b,
            33 * b + 1,
            20 * b - 1,
            3,
            17 * b + b / 2,
            39 * b + 2,
            25 * b,
            12 * b,
        ];
        let slots = h.add_sessions(&lens);
        check_layer(&mut h, 1, &slots[..1]);
        check_layer(&mut h, 0, &slots);
    }
}

/// Tensor-core tiles against fp32 ones on the same inputs: both within 2e-3 of the f64
/// reference (check_layer), and within 2e-5 of each other, which bf16-rounded factors would
/// not be (q and the softmax weights are split into bf16 high and low parts).
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn tensor_core_attention_matches_fp32() {
    if !gpu() {
        return;
    }
    for g in [
        geom(28, 4, 128, 128, DType::Bf16),
        geom(8, 2, 64, 16, DType::Bf16),
        geom(12, 4, 64, 128, DType::Bf16),
    ] {
        let b = g.block_tokens;
        let run = |attention: AttentionMath| {
            let cfg = CudaConfig {
                attention,
                ..CudaConfig::new(g, POLICY, 40, 3, SummaryDtype::F32)
            };
            assert_eq!(
                cfg.validate().unwrap().att_mma,
                attention == AttentionMath::TensorCores
            );
            let mut h = Harness::new(cfg, 31);
            let slots = h.add_sessions(&[40 * b, 17 * b + b / 2, 3]);
            // Cold, then the same sessions again (cache hits) with fresh queries.
            let mut outs = check_layer(&mut h, 0, &slots);
            outs.extend(check_layer(&mut h, 0, &slots));
            outs
        };
        let mma = run(AttentionMath::TensorCores);
        let simt: Vec<f64> = run(AttentionMath::Simt).iter().map(|&x| x as f64).collect();
        let e = rel_err(&mma, &simt);
        println!("{g:?}: tensor cores vs fp32 rel diff {e:.3e}");
        assert!(e < 2e-5, "{g:?}: tensor cores vs fp32 rel diff {e}");
    }
}

/// Many exactly equal scores: the lower block index must win, as on the CPU.
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn selector_ties_break_to_lower_block() {
    if !gpu() {
        return;
    }
    for (templates, sd) in [
        (3, SummaryDtype::F32),
        (1, SummaryDtype::F32),
        (5, SummaryDtype::Bf16Outward),
    ] {
        let cfg = CudaConfig::new(geom(8, 2, 64, 16, DType::Bf16), POLICY, 60, 2, sd);
        let mut h = Harness::new(cfg, 20 + templates as u64);
        let a = h.add_session(60 * 16, KeyGen { templates });
        let b = h.add_session(45 * 16 + 5, KeyGen { templates });
        check_layer(&mut h, 0, &[a, b]);
        check_layer(&mut h, 1, &[b]);
    }
}

/// Dense mode (top_k covers every block) equals plain softmax attention over all tokens.
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn dense_mode_is_plain_attention() {
    if !gpu() {
        return;
    }
    let p = Policy {
        sink_blocks: 1,
        local_blocks: 2,
        top_k: 40,
    };
    let cfg = CudaConfig::new(
        geom(28, 4, 128, 32, DType::Bf16),
        p,
        43,
        2,
        SummaryDtype::F32,
    );
    let mut h = Harness::new(cfg, 30);
    let s = h.add_session(43 * 32, KeyGen { templates: 0 });
    let q = h.query();
    let out =
        h.be.decode_layer(0, &[DecodeItem { slot: s, q: &q }])
            .unwrap();
    let all: Vec<Vec<u32>> = (0..4).map(|_| (0..43).collect()).collect();
    assert_eq!(h.be.last_keep_sets(0).unwrap()[0], all);
    let r = h.cpu_attend(s as usize, 0, &q, &all);
    let e = rel_err(&out.out, &r);
    assert!(e < 2e-3, "rel err {e}");
}

/// On a flushed layer-0 cache, `items` (two sessions, 4 kv heads, the first with a partial
/// tail) run twice: the first call misses everything, the second refetches only the 4 partial
/// tail tiles and gives the same output. Returns the first call's statistics.
fn repeat_refetches_only_partial_tails(h: &mut Harness, items: &[DecodeItem<'_>]) -> LayerStats {
    let first = h.be.decode_layer(0, items).unwrap();
    assert_eq!(first.stats.hits, 0, "cold cache");
    let second = h.be.decode_layer(0, items).unwrap();
    assert_eq!(
        second.stats.misses, 4,
        "only the first session's partial tail tiles (4 kv heads) refetched"
    );
    assert_eq!(first.out, second.out);
    first.stats
}

/// Second identical call hits the cache except partial tail tiles, with identical output;
/// appended tokens (tail refetched, new blocks) are attended correctly.
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn block_cache_hits_and_appends() {
    if !gpu() {
        return;
    }
    let cfg = CudaConfig::new(
        geom(28, 4, 128, 32, DType::Bf16),
        POLICY,
        40,
        2,
        SummaryDtype::F32,
    );
    let mut h = Harness::new(cfg, 40);
    let a = h.add_session(30 * 32 + 5, KeyGen { templates: 0 }); // partial tail
    let b = h.add_session(30 * 32, KeyGen { templates: 0 }); // full tail
    let (qa, qb) = (h.query(), h.query());
    let items = [
        DecodeItem { slot: a, q: &qa },
        DecodeItem { slot: b, q: &qb },
    ];
    repeat_refetches_only_partial_tails(&mut h, &items);
    // Other layer has its own cache: cold.
    let other = h.be.decode_layer(1, &items).unwrap();
    assert_eq!(other.stats.hits, 0);
    // Append: complete a's tail and start two more blocks; b gets one token.
    h.append(a, 27 + 40);
    h.append(b, 1);
    for _ in 0..3 {
        check_layer(&mut h, 0, &[a, b]);
    }
    // flush -> cold again
    h.be.flush_cache().unwrap();
    let qa = h.query();
    let cold =
        h.be.decode_layer(0, &[DecodeItem { slot: a, q: &qa }])
            .unwrap();
    assert_eq!(cold.stats.hits, 0);
}

/// Long layers are planned in two parts (plan_fixed: sink + local, fetched while the selector
/// runs; select_topk: the distant blocks). With a cache of exactly KSEL slots, a repeated query
/// must still hit every full tile, a changed query must never evict a tile the same call uses,
/// and every output stays exact against the CPU.
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn split_plan_keeps_cache_exact_at_ksel_slots() {
    if !gpu() {
        return;
    }
    let mut cfg = CudaConfig::new(
        geom(28, 4, 128, 32, DType::Bf16),
        POLICY,
        200,
        2,
        SummaryDtype::F32,
    );
    cfg.cache_slots = POLICY.budget() as u32;
    let mut h = Harness::new(cfg, 41);
    let a = h.add_session(150 * 32 + 7, KeyGen { templates: 0 }); // partial tail
    let b = h.add_session(120 * 32, KeyGen { templates: 0 }); // full tail
    let (qa, qb) = (h.query(), h.query());
    let items = [
        DecodeItem { slot: a, q: &qa },
        DecodeItem { slot: b, q: &qb },
    ];
    let first = repeat_refetches_only_partial_tails(&mut h, &items);
    assert_eq!(first.tiles, 2 * 4 * POLICY.budget());
    // Changing queries: the keep-sets move, the cache turns over, results stay exact.
    for _ in 0..6 {
        check_layer(&mut h, 0, &[a, b]);
    }
    h.append(a, 40);
    h.append(b, 33);
    for _ in 0..3 {
        check_layer(&mut h, 0, &[a, b]);
        check_layer(&mut h, 1, &[b, a]);
    }
}

/// Long layers (radix top-k over up to 1,095 distant blocks, plans split between plan_fixed and
/// select_topk) equal the CPU selector for several top_k, ties included (templates make many
/// scores exactly equal).
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn selector_long_layers_match_cpu() {
    if !gpu() {
        return;
    }
    for (top_k, templates) in [(32, 0), (32, 7), (31, 3), (33, 0), (48, 5)] {
        let policy = Policy {
            sink_blocks: 2,
            local_blocks: 3,
            top_k,
        };
        let cfg = CudaConfig::new(
            geom(28, 4, 128, 16, DType::Bf16),
            policy,
            1100,
            2,
            SummaryDtype::F32,
        );
        check_two_sessions(cfg, 60 + top_k as u64, 1100 * 16, 70 * 16 + 3, templates);
    }
}

/// A session of `long` tokens and one of `short` tokens, batched both ways round on two layers.
fn check_two_sessions(cfg: CudaConfig, seed: u64, long: u32, short: u32, templates: u32) {
    let mut h = Harness::new(cfg, seed);
    let a = h.add_session(long, KeyGen { templates });
    let b = h.add_session(short, KeyGen { templates });
    check_layer(&mut h, 0, &[a, b]);
    check_layer(&mut h, 1, &[b, a]);
}

/// decode_step (all layers, one sync) equals per-layer calls.
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn decode_step_matches_layers() {
    if !gpu() {
        return;
    }
    let cfg = CudaConfig::new(
        geom(28, 4, 128, 32, DType::Bf16),
        POLICY,
        40,
        3,
        SummaryDtype::F32,
    );
    let mut h = Harness::new(cfg, 50);
    let slots = h.add_sessions(&[40 * 32, 25 * 32 + 9, 7]);
    let hqd = 28 * 128;
    let qs: Vec<Vec<f32>> = slots
        .iter()
        .map(|_| [h.query(), h.query()].concat())
        .collect();
    h.be.set_timing(Timing::Layers).unwrap();
    let items = step_items(&slots, &qs);
    let step = h.be.decode_step(&items).unwrap();
    assert!(step.step_ms.unwrap() > 0.0);
    assert_eq!(step.timing.as_ref().unwrap().len(), 2);
    for (i, &slot) in slots.iter().enumerate() {
        for l in 0..2 {
            let q = &qs[i][l * hqd..(l + 1) * hqd];
            let want = h.cpu_select(slot as usize, l, q);
            let r = h.cpu_attend(slot as usize, l, q, &want);
            let got = &step.out[(i * 2 + l) * hqd..(i * 2 + l + 1) * hqd];
            let e = rel_err(got, &r);
            assert!(e < 2e-3, "slot {slot} layer {l}: {e}");
        }
    }
    // Step timing: the step's time only, the same outputs; then none.
    h.be.set_timing(Timing::Step).unwrap();
    let coarse = h.be.decode_step(&items).unwrap();
    assert!(coarse.step_ms.unwrap() > 0.0 && coarse.timing.is_none());
    assert_eq!(coarse.out, step.out);
    h.be.set_timing(Timing::Off).unwrap();
    let untimed = h.be.decode_step(&items).unwrap();
    assert!(untimed.step_ms.is_none() && untimed.timing.is_none());
    assert_eq!(untimed.out, step.out);
}

/// layer_fused (a layer but its merge in one launch, available for the Qwen geometry) against
/// split launches (plan_fixed and the fixed tiles beside select_score, then the distant tiles):
/// the same keep-sets, cache decisions and bit-identical outputs, cold and warm, at batch 1 and
/// 3 (with a short layer), over several steps (the ticket count carries across launches), and
/// exact against the CPU.
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn fused_launch_matches_split_launches() {
    if !gpu() {
        return;
    }
    let cfg = qwen_config(300, 3);
    let mut h = Harness::new(cfg, 90);

    let slots = h.add_sessions(&[300 * 128, 211 * 128 + 17, 20 * 128]);
    h.be.set_timing(Timing::Layers).unwrap();
    for batch in [1, 3] {
        let qs: Vec<Vec<f32>> = slots[..batch]
            .iter()
            .map(|_| [h.query(), h.query()].concat())
            .collect();
        let items = step_items(&slots[..batch], &qs);
        for warm in [false, true] {
            let mut runs = Vec::new();
            for fused in [true, false, true] {
                h.be.set_launch_mode(if fused {
                    LaunchMode::Fused
                } else {
                    LaunchMode::Split
                });
                if !warm {
                    h.be.flush_cache().unwrap();
                }
                let step = h.be.decode_step(&items).unwrap();
                let t = &step.timing.as_ref().unwrap()[0];
                assert_eq!(
                    t.select_ms.is_none(),
                    fused,
                    "per-kernel times only when split"
                );
                assert!(t.layer_ms > 0.0);
                let keeps: Vec<_> = (0..2).map(|l| h.be.last_keep_sets(l).unwrap()).collect();
                runs.push((step.out, step.stats, keeps));
            }
            for r in &runs[1..] {
                assert_eq!(r.0, runs[0].0, "outputs (batch {batch}, warm {warm})");
                assert_eq!(r.2, runs[0].2, "keep-sets (batch {batch}, warm {warm})");
                if !warm {
                    assert_eq!(r.1, runs[0].1, "cold cache statistics");
                }
            }
            if warm {
                // The repeated query hits every full tile it fetched before.
                let last = &runs[2].1;
                assert!(last.iter().all(|s| s.hits + s.misses == s.tiles));
                assert!(last.iter().all(|s| s.misses <= 4 * batch as u64));
            }
            check_step(&h, &slots[..batch], &qs, 2, &runs[0].0, &runs[0].2);
        }
        // Auto decides from each layer's previous call: after a flush the call runs fused, and
        // so does its repeat (the call before it missed); once a call has hit (all tiles but
        // partial tails), the next runs split. The output never changes.
        h.be.set_launch_mode(LaunchMode::Auto);
        h.be.flush_cache().unwrap();
        let mut outs = Vec::new();
        for want_split in [false, false, true, true] {
            let step = h.be.decode_step(&items).unwrap();
            let t = step.timing.as_ref().unwrap();
            assert!(
                t.iter().all(|t| t.select_ms.is_some() == want_split),
                "split {want_split}"
            );
            outs.push(step.out);
        }
        assert!(outs.iter().all(|o| *o == outs[0]));
    }
}

/// Dependent launch (a layer's layer_fused starting while the previous layer's merge runs,
/// its reads of host frames overlapping it) changes nothing but timing: over 4 layers, with
/// fused, Auto and split launches, cold and warm, batch 1 and 3 (with a short layer), the
/// outputs, keep-sets and cold cache statistics are bit-identical with it off, exact against
/// the CPU, and per-layer calls give the same outputs.
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn dependent_launch_changes_only_timing() {
    if !gpu() {
        return;
    }
    let mut cfg = qwen_config(120, 3);
    cfg.geometry.layers = 4;
    let mut h = Harness::new(cfg, 91);
    let (major, _) = h.be.context().compute_capability().unwrap();
    let slots = h.add_sessions(&[120 * 128, 90 * 128 + 5, 20 * 128]);
    let hqd = 28 * 128;
    // Per-layer events would sit between the kernels and turn it off.
    h.be.set_timing(Timing::Layers).unwrap();
    assert!(!h.be.dependent_launch());
    h.be.set_timing(Timing::Step).unwrap();
    assert_eq!(
        h.be.dependent_launch(),
        major >= 9,
        "on where the device has it"
    );
    for batch in [1, 3] {
        let qs: Vec<Vec<f32>> = slots[..batch]
            .iter()
            .map(|_| (0..4).flat_map(|_| h.query()).collect())
            .collect();
        let items = step_items(&slots[..batch], &qs);
        for mode in [LaunchMode::Fused, LaunchMode::Auto, LaunchMode::Split] {
            h.be.set_launch_mode(mode);
            for warm in [false, true] {
                let mut runs = Vec::new();
                for pdl in [true, false, true] {
                    h.be.set_dependent_launch(pdl);
                    if !warm {
                        h.be.flush_cache().unwrap();
                    }
                    let step = h.be.decode_step(&items).unwrap();
                    assert!(
                        step.out.iter().all(|x| x.is_finite()),
                        "every output written"
                    );
                    let keeps: Vec<_> = (0..4).map(|l| h.be.last_keep_sets(l).unwrap()).collect();
                    runs.push((step.out, step.stats, keeps));
                }
                for r in &runs[1..] {
                    let what = format!("batch {batch}, {mode:?}, warm {warm}");
                    assert_eq!(r.0, runs[0].0, "outputs ({what})");
                    assert_eq!(r.2, runs[0].2, "keep-sets ({what})");
                    if !warm {
                        assert_eq!(r.1, runs[0].1, "cold cache statistics ({what})");
                    }
                }
                check_step(&h, &slots[..batch], &qs, 4, &runs[0].0, &runs[0].2);
            }
        }
        // Per-layer calls (the daemon's path: each call's first launch follows uploads, not a
        // kernel) give the step's outputs.
        h.be.set_dependent_launch(true);
        h.be.set_launch_mode(LaunchMode::Auto);
        h.be.flush_cache().unwrap();
        let step = h.be.decode_step(&items).unwrap();
        h.be.flush_cache().unwrap();
        for l in 0..4u32 {
            let layer_items: Vec<DecodeItem> = slots[..batch]
                .iter()
                .zip(&qs)
                .map(|(&slot, q)| DecodeItem {
                    slot,
                    q: &q[l as usize * hqd..(l as usize + 1) * hqd],
                })
                .collect();
            let out = h.be.decode_layer(l, &layer_items).unwrap().out;
            for i in 0..batch {
                let l = l as usize;
                assert_eq!(
                    &out[i * hqd..(i + 1) * hqd],
                    &step.out[(i * 4 + l) * hqd..(i * 4 + l + 1) * hqd],
                    "layer {l} item {i}"
                );
            }
        }
    }
}

/// Dense attention (the benchmark's baseline): every block, from host frames and from a copy in
/// GPU memory, equals the f64 reference over all blocks (batch 2, one session with a partial
/// tail, one short); both sources give bit-identical outputs; the statistics count every tile;
/// the sparse path gives the same output before and after; a session whose copy is missing or
/// stale is refused with a typed error.
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn dense_attention_matches_reference() {
    if !gpu() {
        return;
    }
    let cfg = qwen_config(60, 3);
    let mut h = Harness::new(cfg, 92);
    let slots = h.add_sessions(&[60 * 128 - 37, 9 * 128]);
    let other = h.add_session(128, KeyGen { templates: 0 });
    let hqd = 28 * 128;
    let qs: Vec<Vec<f32>> = slots
        .iter()
        .map(|_| [h.query(), h.query()].concat())
        .collect();
    let items = step_items(&slots, &qs);
    let sparse = h.be.decode_step(&items).unwrap().out;
    let host = h.be.dense_step(&items, DenseKv::Host).unwrap();
    let kv = h.be.copy_kv_to_device(&slots).unwrap();
    assert_eq!(kv.bytes(), (60 + 9) * 2 * cfg.geometry.block_bytes() as u64);
    let dev = h.be.dense_step(&items, DenseKv::Device(&kv)).unwrap();
    assert_eq!(host.out, dev.out, "same tiles, same arithmetic");
    for (i, &slot) in slots.iter().enumerate() {
        let nb = h.sessions[slot as usize].n_tokens.div_ceil(128);
        let all: Vec<Vec<u32>> = (0..4).map(|_| (0..nb).collect()).collect();
        for l in 0..2 {
            let q = &qs[i][l * hqd..(l + 1) * hqd];
            let r = h.cpu_attend(slot as usize, l, q, &all);
            let e = rel_err(&host.out[(i * 2 + l) * hqd..(i * 2 + l + 1) * hqd], &r);
            assert!(e < 2e-3, "slot {slot} layer {l}: rel err {e}");
        }
    }
    let tiles = (60 + 9) * 4;
    for (hs, ds) in host.stats.iter().zip(&dev.stats) {
        assert_eq!((hs.tiles, hs.misses, hs.hits), (tiles, tiles, 0));
        assert_eq!(hs.bytes_moved, tiles * cfg.geometry.tile_bytes() as u64);
        assert_eq!((ds.tiles, ds.hits, ds.bytes_moved), (tiles, tiles, 0));
    }
    // The sparse path gives the same output after the dense calls.
    assert_eq!(h.be.decode_step(&items).unwrap().out, sparse);
    // A session not copied, then one grown since its copy.
    let q2 = [h.query(), h.query()].concat();
    let err =
        h.be.dense_step(
            &[StepItem {
                slot: other,
                q: &q2,
            }],
            DenseKv::Device(&kv),
        )
        .unwrap_err();
    assert!(
        matches!(err, CudaError::KvNotOnDevice { copied: 0, .. }),
        "{err}"
    );
    h.append(slots[1], 1);
    let err = h.be.dense_step(&items, DenseKv::Device(&kv)).unwrap_err();
    assert!(
        matches!(
            err,
            CudaError::KvNotOnDevice {
                n_blocks: 10,
                copied: 9,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn bad_inputs_get_typed_errors() {
    if !gpu() {
        return;
    }
    let cfg = CudaConfig::new(
        geom(8, 2, 64, 16, DType::Bf16),
        POLICY,
        20,
        2,
        SummaryDtype::F32,
    );
    let mut h = Harness::new(cfg, 60);
    let s = h.add_session(100, KeyGen { templates: 0 });
    let q = h.query();
    let be = &mut h.be;
    let one = |slot| [DecodeItem { slot, q: &q }];
    assert!(matches!(
        be.decode_layer(2, &one(s)),
        Err(CudaError::LayerOutOfRange { .. })
    ));
    assert!(matches!(
        be.decode_layer(0, &one(1)),
        Err(CudaError::SessionNotOpen { slot: 1 })
    ));
    assert!(matches!(
        be.decode_layer(0, &one(7)),
        Err(CudaError::SlotOutOfRange { .. })
    ));
    assert!(matches!(
        be.decode_layer(0, &[]),
        Err(CudaError::EmptyBatch)
    ));
    let dup = [DecodeItem { slot: s, q: &q }, DecodeItem { slot: s, q: &q }];
    assert!(matches!(
        be.decode_layer(0, &dup),
        Err(CudaError::DuplicateSession { .. })
    ));
    let three = [
        DecodeItem { slot: s, q: &q },
        DecodeItem { slot: 1, q: &q },
        DecodeItem { slot: 0, q: &q },
    ];
    assert!(matches!(
        be.decode_layer(0, &three),
        Err(CudaError::BatchTooLarge { .. })
    ));
    assert!(matches!(
        be.decode_layer(
            0,
            &[DecodeItem {
                slot: s,
                q: &q[1..]
            }]
        ),
        Err(CudaError::BadLength { .. })
    ));
    let mut qn = q.clone();
    qn[5] = f32::NAN;
    assert!(matches!(
        be.decode_layer(0, &[DecodeItem { slot: s, q: &qn }]),
        Err(CudaError::NonFinite { index: 5, .. })
    ));
    // Tokens beyond the mapped/summarised blocks: refused, never attended.
    be.set_tokens(s, 0, 200).unwrap();
    assert!(matches!(
        be.decode_layer(0, &one(s)),
        Err(CudaError::NotReady { .. })
    ));
    assert!(matches!(
        be.set_tokens(s, 0, 150),
        Err(CudaError::BadTokenCount { .. })
    ));
    assert!(matches!(
        be.set_tokens(s, 0, 20 * 16 + 1),
        Err(CudaError::BadTokenCount { .. })
    ));
    be.open_session(1).unwrap();
    assert!(matches!(
        be.decode_layer(0, &one(1)),
        Err(CudaError::EmptySession { .. })
    ));
    assert!(matches!(
        be.open_session(1),
        Err(CudaError::SessionAlreadyOpen { .. })
    ));
    assert!(matches!(
        be.upload_summaries(s, 0, 0, &[0.0; 7]),
        Err(CudaError::BadLength { .. })
    ));
    let per = 2 * 2 * 64;
    assert!(matches!(
        be.upload_summaries(s, 0, 19, &vec![0.0; 2 * per]),
        Err(CudaError::BlockOutOfRange { .. })
    ));
    let mut bad = vec![0.0; per];
    bad[3] = f32::INFINITY;
    assert!(matches!(
        be.upload_summaries(s, 0, 0, &bad),
        Err(CudaError::NonFinite { .. })
    ));
    let region_len = be.host_mut().unwrap().len() as u64;
    assert!(matches!(
        be.map_blocks(s, 0, 0, &[region_len]),
        Err(CudaError::HostRange { .. })
    ));
    assert!(matches!(
        be.map_blocks(s, 0, 0, &[u64::MAX - 3]),
        Err(CudaError::HostRange { .. })
    ));
    let map = AnonMapping::new(1 << 20).unwrap();
    let other = PinnedRegion::register_owned(be.context(), map).unwrap();
    assert!(matches!(
        be.attach_host(other),
        Err(CudaError::HostRegionAttached)
    ));
    be.close_session(1).unwrap();
    assert!(matches!(
        be.close_session(1),
        Err(CudaError::SessionNotOpen { .. })
    ));
    assert!(matches!(
        be.detach_host(),
        Err(CudaError::SessionsOpen { open: 1 })
    ));
    be.close_session(s).unwrap();
    let region = be.detach_host().unwrap();
    assert!(matches!(be.detach_host(), Err(CudaError::NoHostRegion)));
    be.attach_host(region).unwrap();

    let mut fresh = CudaBackend::new(0, cfg).unwrap();
    fresh.open_session(0).unwrap();
    assert!(matches!(
        fresh.map_blocks(0, 0, 0, &[0]),
        Err(CudaError::NoHostRegion)
    ));
    assert!(matches!(
        CudaBackend::new(4096, cfg),
        Err(CudaError::NoDevice { .. })
    ));
}

#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn pinned_region_chunks_and_cleanup() {
    if !gpu() {
        return;
    }
    let cfg = CudaConfig::new(
        geom(8, 2, 64, 16, DType::Bf16),
        POLICY,
        20,
        1,
        SummaryDtype::F32,
    );
    let be = CudaBackend::new(0, cfg).unwrap();
    let ctx = be.context();
    let mut map = AnonMapping::new(1 << 20).unwrap();
    let base = map.as_mut_slice().as_mut_ptr();
    {
        // SAFETY: `map` outlives the region (dropped at the end of this block).
        let r = unsafe { PinnedRegion::register_chunked(ctx, base, 1 << 20, 64 << 10) }.unwrap();
        assert_eq!(r.chunk_count(), 16);
        assert!(r.device_addr(0, 64 << 10).is_ok());
        assert!(
            r.device_addr((64 << 10) - 16, 32).is_err(),
            "range crossing a chunk"
        );
        assert!(r.device_addr(1 << 20, 1).is_err());
        // The second half is registered already: a registration overlapping it fails after
        // registering its own first chunks, and must hand those back.
        // SAFETY: same live mapping.
        let e = unsafe { PinnedRegion::register_chunked(ctx, base, 1 << 20, 64 << 10) };
        assert!(matches!(e, Err(CudaError::Pin { offset: 0, .. })));
    }
    let mut map2 = AnonMapping::new(1 << 20).unwrap();
    let base2 = map2.as_mut_slice().as_mut_ptr();
    // SAFETY: map2 outlives r2 within this scope.
    let r2 = unsafe {
        PinnedRegion::register_chunked(ctx, base2.wrapping_add(512 << 10), 512 << 10, 64 << 10)
    }
    .unwrap();
    // SAFETY: as above; overlaps r2 from offset 512 KiB, so it fails at that chunk.
    let e = unsafe { PinnedRegion::register_chunked(ctx, base2, 1 << 20, 64 << 10) };
    assert!(
        matches!(e, Err(CudaError::Pin { offset, .. }) if offset == 512 << 10),
        "{e:?}"
    );
    // Its first 8 chunks were unregistered on failure: registering them again works.
    // SAFETY: as above.
    let again = unsafe { PinnedRegion::register_chunked(ctx, base2, 512 << 10, 64 << 10) };
    assert!(again.is_ok(), "{:?}", again.err());
    drop(again);
    drop(r2);
    drop(map2);
    drop(map);
    assert!(matches!(AnonMapping::new(0), Err(CudaError::EmptyRegion)));
    // SAFETY: misaligned base is rejected before any driver call.
    let e = unsafe { PinnedRegion::register(ctx, 0x1001 as *mut u8, 4096) };
    assert!(matches!(e, Err(CudaError::Misaligned { .. })));
}

/// Thousands of blocks: several candidates per top-k thread, full radix passes, exact match.
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn selector_large_context_exact() {
    if !gpu() {
        return;
    }
    let p = Policy {
        sink_blocks: 1,
        local_blocks: 4,
        top_k: 32,
    };
    for (templates, sd) in [
        (0, SummaryDtype::F32),
        (7, SummaryDtype::F32),
        (0, SummaryDtype::Bf16Outward),
    ] {
        let cfg = CudaConfig::new(geom(8, 2, 32, 16, DType::F32), p, 3000, 2, sd);
        let mut h = Harness::new(cfg, 70 + templates as u64);
        let a = h.add_session(3000 * 16, KeyGen { templates });
        let b = h.add_session(2111 * 16 + 9, KeyGen { templates });
        check_layer(&mut h, 0, &[a, b]);
        check_layer(&mut h, 1, &[b, a]);
    }
}

/// The largest supported context (32,768 blocks: 256 candidate lists per kv head, 8 merged per
/// select_topk warp before the tree) and a mid-size one, ties included: exactly the CPU's.
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn selector_max_blocks_list_merge_exact() {
    if !gpu() {
        return;
    }
    for (top_k, templates) in [(32, 0), (32, 5), (8, 3)] {
        let p = Policy {
            sink_blocks: 1,
            local_blocks: 4,
            top_k,
        };
        let cfg = CudaConfig::new(
            geom(4, 1, 32, 16, DType::Bf16),
            p,
            32_768,
            2,
            SummaryDtype::F32,
        );
        check_two_sessions(
            cfg,
            80 + templates as u64,
            32_768 * 16,
            9_000 * 16 + 7,
            templates,
        );
    }
}
