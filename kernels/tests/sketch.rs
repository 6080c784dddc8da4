//! The sketch selector against a scalar restatement of its rule, and what it is for: finding
//! the block a query reads where the key bound cannot tell blocks apart.

use kvtier_kernels::decode::sketch_bytes_read;
use kvtier_kernels::select::{select_head, QuerySketch};
use kvtier_kernels::{decode_cpu, select, DecodeEntry, KeepSet, KernelError, SelectScratch};
use kvtier_storage::testing::Rng;
use kvtier_storage::{ArenaOptions, DType, Geometry, HostArena, KvCache, LayerView, Policy};
use kvtier_tests::kv::{payload, query, rows};
use proptest::prelude::*;

fn cache(g: Geometry, n: usize, seed: u64) -> KvCache {
    let frame = g.block_bytes().next_multiple_of(4096);
    let blocks = g.blocks_for(n as u64 + 8) as usize * g.layers as usize;
    let arena = HostArena::new(&ArenaOptions::new((blocks + 4) * frame, frame)).unwrap();
    let mut kv = KvCache::new(g, arena).unwrap();
    kv.append(0, n as u64, &payload(&g, n, seed)).unwrap();
    kv
}

/// The k best of `cands` by `score`, higher first, ties to the lower block; ascending.
fn best(cands: &[usize], score: impl Fn(usize) -> f32, k: usize) -> Vec<usize> {
    let mut c: Vec<(f32, usize)> = cands.iter().map(|&b| (score(b), b)).collect();
    c.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut out: Vec<usize> = c.into_iter().take(k).map(|(_, b)| b).collect();
    out.sort_unstable();
    out
}

/// The code of element `e` of token `t` in a packed block (the layout of
/// kvtier_storage::sketch, restated: `W = padded(D) / 4` u16 words per token, element `e` in
/// word `e % W` at bits `4 (e / W)`).
fn code(codes: &[u8], d: usize, t: usize, e: usize) -> i32 {
    let w = d.next_multiple_of(32) / 4;
    let at = t * 2 * w + 2 * (e % w);
    let word = u16::from_le_bytes([codes[at], codes[at + 1]]);
    let nib = ((word >> (4 * (e / w))) & 0xf) as u8;
    i32::from(((nib << 4) as i8) >> 4)
}

/// The sketch selector's keep-set of one kv head, restated from its documentation with
/// scalar loops: query codes; candidate units of four quarter records by the quarter codes'
/// integer bounds (max over quarters, the documented float steps, max over the group, max over
/// the unit's distant blocks); key codes, integer dots, the documented float steps.
fn reference(q: &[f32], v: &LayerView<'_>, policy: &Policy, h: usize) -> Vec<u32> {
    let g = v.geometry();
    let (d, grp, nb) = (g.head_dim as usize, g.group(), v.blocks());
    let (sink, local) = (policy.sink_blocks as usize, policy.local_blocks as usize);
    if nb as u64 <= policy.budget() {
        return (0..nb as u32).collect();
    }
    let distant: Vec<usize> = (sink..nb - local).collect();
    let k = policy.top_k as usize;
    // Four records a unit: a block of 128 tokens or more has 4, of 64 to 127 has 2, else 1.
    let bt = g.block_tokens as usize;
    let unit = if bt >= 128 {
        1
    } else if bt >= 64 {
        2
    } else {
        4
    };
    let c = (policy.selector.candidates() as usize).max(k + 2 * (unit - 1));
    let want = c.div_ceil(unit);
    // Every distant block is a candidate while the layer has at most 16,384 tokens' worth of
    // units (256 blocks at most; `want` if more).
    let scan = want.max((16_384 / bt).min(256) / unit);
    let heads: Vec<&[f32]> = (0..grp)
        .map(|j| &q[(h * grp + j) * d..(h * grp + j + 1) * d])
        .collect();
    // Queries: absmax / 127, round half to even.
    let quantize = |x: &[f32]| -> (Vec<i32>, f32) {
        let s = x.iter().map(|x| x.abs()).fold(0.0f32, f32::max) / 127.0;
        let c = x
            .iter()
            .map(|x| {
                if s == 0.0 {
                    0
                } else {
                    (x / s).round_ties_even() as i32
                }
            })
            .collect();
        (c, s)
    };
    let quant: Vec<(Vec<i32>, f32)> = heads.iter().map(|qh| quantize(qh)).collect();
    // Stage 1: per head the best quarter's integer bound from the quarter codes (maxima with
    // the positive codes, minima with the negative), then the float steps, max over heads.
    let stage1 = |b: usize| -> f32 {
        let sk = v.sketch(b, h).unwrap();
        let mut best = f32::NEG_INFINITY;
        for (qc, qs) in &quant {
            let m = sk
                .quarter_codes
                .chunks(2 * d)
                .map(|q| {
                    (0..d)
                        .map(|e| {
                            qc[e].max(0) * i32::from(q[e]) + qc[e].min(0) * i32::from(q[d + e])
                        })
                        .sum::<i32>()
                })
                .max()
                .unwrap();
            best = best.max(m as f32 * sk.quarter_scale * qs);
        }
        best + 0.0
    };
    let mut units: Vec<usize> = distant.iter().map(|b| b / unit).collect();
    units.dedup();
    let cands: Vec<usize> = if scan >= units.len() {
        distant.clone()
    } else {
        let unit_score = |u: usize| {
            distant
                .iter()
                .filter(|&&b| b / unit == u)
                .map(|&b| stage1(b))
                .fold(f32::NEG_INFINITY, f32::max)
        };
        let picked = best(&units, unit_score, want);
        distant
            .iter()
            .copied()
            .filter(|b| picked.contains(&(b / unit)))
            .collect()
    };
    // Stage 2: per head the query times the block's channel scales, quantized like a query;
    // the best token's integer dot, then the float step, max over heads.
    let score = |b: usize| -> f32 {
        let sk = v.sketch(b, h).unwrap();
        let mut best = f32::NEG_INFINITY;
        for qh in &heads {
            let p: Vec<f32> = qh
                .iter()
                .zip(sk.channel_scales)
                .map(|(x, s)| x * s)
                .collect();
            let (qc, qs) = quantize(&p);
            let m = (0..bt)
                .map(|t| (0..d).map(|e| qc[e] * code(sk.codes, d, t, e)).sum::<i32>())
                .max()
                .unwrap();
            best = best.max(m as f32 * qs);
        }
        best + 0.0
    };
    let mut keep: Vec<u32> = (0..sink as u32).collect();
    keep.extend(best(&cands, score, k).into_iter().map(|b| b as u32));
    keep.extend((nb - local) as u32..nb as u32);
    keep
}

fn geometries() -> Vec<Geometry> {
    vec![
        Geometry::new(1, 4, 4, 16, DType::F32, 8),   // MHA
        Geometry::new(1, 8, 2, 32, DType::Bf16, 16), // GQA, G = 4
        Geometry::new(1, 7, 1, 21, DType::F16, 5),   // odd D and B
        Geometry::new(1, 8, 2, 32, DType::Bf16, 64), // halves
        Geometry::new(1, 28, 4, 128, DType::Bf16, 128),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// The selector's keep-sets equal the scalar restatement of the rule, for candidate
    /// counts from fewer than k (taken as k) to more than the distant blocks, and layers below
    /// and above the size where scoring splits across threads (64 distant blocks).
    #[test]
    fn keep_sets_equal_the_rule_restated(
        seed in any::<u64>(),
        gi in 0usize..5,
        blocks in 6u64..100,
        k in 1u32..6,
        candidates in 0u32..48,
    ) {
        let g = geometries()[gi];
        let n = (blocks * g.block_tokens as u64) as usize - 3;
        let kv = cache(g, n, seed);
        let mut rng = Rng::new(seed ^ 7);
        let q: Vec<f32> = query(&g, &mut rng).iter().map(|x| x * 4.0).collect();
        let policy = Policy::sketch(1, 2, k, candidates);
        let v = kv.layer(0).unwrap();
        let mut keep = KeepSet::new();
        select(&q, &v, &policy, &mut SelectScratch::default(), &mut keep).unwrap();
        for h in 0..g.kv_heads as usize {
            prop_assert_eq!(keep.head(h), &reference(&q, &v, &policy, h)[..], "head {}", h);
        }
    }
}

/// With candidates covering every distant block, two stages are full sketch scoring; fewer
/// candidates can only keep blocks the full scoring would rank lower, never more blocks.
#[test]
fn candidates_covering_every_block_score_every_block() {
    let g = Geometry::new(1, 8, 2, 32, DType::Bf16, 16);
    let kv = cache(g, 40 * 16, 3);
    let v = kv.layer(0).unwrap();
    let mut rng = Rng::new(4);
    let q = query(&g, &mut rng);
    let all = Policy::sketch(1, 4, 6, 35);
    let huge = Policy::sketch(1, 4, 6, 1 << 20);
    let narrow = Policy::sketch(1, 4, 6, 6);
    let (mut a, mut b, mut c) = (KeepSet::new(), KeepSet::new(), KeepSet::new());
    let mut s = SelectScratch::default();
    select(&q, &v, &all, &mut s, &mut a).unwrap();
    select(&q, &v, &huge, &mut s, &mut b).unwrap();
    select(&q, &v, &narrow, &mut s, &mut c).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.tiles(), c.tiles());
}

/// A layer of at most 16,384 distant tokens skips the first stage: its keep-set is full sketch
/// scoring's however few the candidates; one block more and the first stage narrows to the
/// candidates again (the sketches read say which).
#[test]
fn a_layer_within_the_scan_scores_every_block() {
    let g = Geometry::new(1, 28, 4, 128, DType::Bf16, 128);
    let narrow = Policy::sketch(1, 4, 4, 8);
    let huge = Policy::sketch(1, 4, 4, 1 << 20);
    let per_block = 128 * 68 * 4; // tokens x (D / 2 code bytes + a scale) x kv heads
    for seed in 0..4 {
        // 1 sink + 128 distant + 4 local blocks, the last one partly filled.
        let kv = cache(g, 133 * 128 - 3, seed);
        let v = kv.layer(0).unwrap();
        let q: Vec<f32> = query(&g, &mut Rng::new(seed + 9))
            .iter()
            .map(|x| x * 4.0)
            .collect();
        let (mut a, mut b) = (KeepSet::new(), KeepSet::new());
        let mut s = SelectScratch::default();
        select(&q, &v, &narrow, &mut s, &mut a).unwrap();
        select(&q, &v, &huge, &mut s, &mut b).unwrap();
        assert_eq!(a, b, "seed {seed}");
    }
    assert_eq!(sketch_bytes_read(&g, &narrow, 133), 128 * per_block);
    assert_eq!(sketch_bytes_read(&g, &narrow, 134), 8 * per_block);
    // In 64-token blocks the scan holds 256 blocks (the same tokens).
    let g64 = Geometry::new(1, 28, 4, 128, DType::Bf16, 64);
    let narrow64 = Policy::sketch(2, 8, 8, 8);
    let per_block64 = per_block / 2;
    assert_eq!(sketch_bytes_read(&g64, &narrow64, 266), 256 * per_block64);
    assert_eq!(sketch_bytes_read(&g64, &narrow64, 268), 10 * per_block64); // k + 2 (G - 1)
}

/// The score is the best sketched logit: within the quantization error of the best true
/// logit of the block, and exactly the integer formula.
#[test]
fn the_score_tracks_the_best_true_logit() {
    let g = Geometry::new(1, 4, 1, 64, DType::F32, 32);
    let n = 32 * 12;
    let kv = cache(g, n, 11);
    let v = kv.layer(0).unwrap();
    let mut rng = Rng::new(12);
    let q = query(&g, &mut rng);
    let d = 64;
    let qs = QuerySketch::new(&q, d);
    // Every kv head's quarter bounds contain its keys, rounded outward.
    let keys = keys_of(&g, n, 11);
    for b in 0..12 {
        let quarters = v.sketch(b, 0).unwrap().quarters;
        let widen = |x: u16| f32::from_bits(u32::from(x) << 16);
        for t in 0..32 {
            let key = &keys[(b * 32 + t) * d..(b * 32 + t + 1) * d];
            let j = kvtier_storage::sketch::quarter_of(t, 32);
            let qb = &quarters[j * 2 * d..(j + 1) * 2 * d];
            for (i, x) in key.iter().enumerate() {
                assert!(widen(qb[i]) >= *x && widen(qb[d + i]) <= *x);
            }
        }
    }
    for b in 0..12 {
        let got = qs.score(&v.sketch(b, 0).unwrap());
        let truth = (0..32)
            .flat_map(|t| {
                let key = &keys[(b * 32 + t) * d..(b * 32 + t + 1) * d];
                q.chunks(d)
                    .map(move |qh| qh.iter().zip(key).map(|(a, b)| a * b).sum::<f32>())
            })
            .fold(f32::NEG_INFINITY, f32::max);
        let qn: f32 = q.iter().map(|x| x * x).sum::<f32>().sqrt();
        let kn = (d as f32).sqrt() * 3.0;
        // int4 keys: at most half a step (scale / 2) per element; int8 queries likewise.
        assert!(
            (got - truth).abs() <= 0.2 * qn * kn,
            "block {b}: {got} vs {truth}"
        );
    }
}

/// Layer 0's keys of [`payload`] for a one-kv-head f32 geometry, `[t][d]`.
fn keys_of(g: &Geometry, n: usize, seed: u64) -> Vec<f32> {
    let d = g.head_dim as usize;
    g.dtype.decode_vec(&payload(g, n, seed)[..n * d * 4])
}

/// Prose-like blocks: every block's keys spread wide, so every box is about as wide and the
/// bound cannot tell which block holds the one key that matches the query. The sketch finds
/// it at k = 1 on every seed; the bound on few.
#[test]
fn the_sketch_finds_the_key_the_bound_cannot_tell_apart() {
    let g = Geometry::new(1, 4, 1, 64, DType::Bf16, 32);
    let d = g.head_dim as usize;
    let (mut sketch_found, mut bound_found) = (0, 0);
    let seeds = 30u64;
    for seed in 0..seeds {
        let mut rng = Rng::new(seed);
        let n = 48 * 32;
        let mut k = rng.normals(n * d);
        let v = rng.normals(n * d);
        let q: Vec<f32> = rng.normals(4 * d);
        let reader = rng.below(4) as usize;
        let qh = &q[reader * d..(reader + 1) * d];
        let qn = qh.iter().map(|x| x * x).sum::<f32>().sqrt();
        // One key of a distant block points along the reading head's query: its logit is
        // ~7 standard deviations above the others', its norm that of a typical key.
        let t = 32 * (2 + rng.below(40) as usize) + rng.below(32) as usize;
        for i in 0..d {
            k[t * d + i] = 0.9 * (d as f32).sqrt() * qh[i] / qn;
        }
        let arena = HostArena::new(&ArenaOptions::new(64 * 8192, 8192)).unwrap();
        let mut kv = KvCache::new(g, arena).unwrap();
        kv.append(
            0,
            n as u64,
            &[g.dtype.encode_vec(&k), g.dtype.encode_vec(&v)].concat(),
        )
        .unwrap();
        let layer = kv.layer(0).unwrap();
        let needle = (t / 32) as u32;
        let mut keep = Vec::new();
        for (policy, found) in [
            (Policy::sketch(1, 4, 1, 1 << 20), &mut sketch_found),
            (Policy::bound(1, 4, 1), &mut bound_found),
        ] {
            select_head(
                &q,
                &layer,
                layer.blocks(),
                &policy,
                0,
                &mut SelectScratch::default(),
                &mut keep,
            );
            *found += keep.contains(&needle) as u32;
        }
    }
    assert_eq!(sketch_found, seeds as u32, "the sketch keeps every needle");
    assert!(
        bound_found <= seeds as u32 / 2,
        "the bound kept {bound_found} of {seeds}: the test no longer separates them"
    );
}

/// A sketch policy over a cache made without sketches is a typed error, and nothing changes.
#[test]
fn a_sketch_policy_needs_a_cache_with_sketches() {
    let g = Geometry::new(1, 4, 2, 16, DType::Bf16, 8);
    let arena = HostArena::new(&ArenaOptions::new(64 * 4096, 4096)).unwrap();
    let mut kv = KvCache::new_with(g, arena, false).unwrap();
    kv.append(0, 80, &payload(&g, 80, 1)).unwrap();
    let mut rng = Rng::new(2);
    let q = query(&g, &mut rng);
    let (k, v) = (rows(&g, 1, &mut rng), rows(&g, 1, &mut rng));
    let mut out = vec![0f32; q.len()];
    let e = decode_cpu(
        &mut [DecodeEntry {
            session: 0,
            layer: 0,
            kv: &mut kv,
            policy: Policy::sketch(1, 1, 2, 4),
            position: 80,
            q: &q,
            k: &k,
            v: &v,
            cold: None,
        }],
        &mut out,
    )
    .unwrap_err();
    assert!(matches!(e.root(), KernelError::NoSketches), "{e}");
    assert_eq!(kv.tokens(0).unwrap(), 80);
    let mut keep = KeepSet::new();
    let e = select(
        &q,
        &kv.layer(0).unwrap(),
        &Policy::sketch(1, 1, 2, 4),
        &mut SelectScratch::default(),
        &mut keep,
    )
    .unwrap_err();
    assert!(matches!(e, KernelError::NoSketches), "{e}");
}
