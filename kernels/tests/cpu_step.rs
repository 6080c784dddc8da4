//! The CPU decode step against the f64 dense oracle, plus the selector's defining properties.

use kvtier_kernels::dense::{max_rel_err, reference_attention};
use kvtier_kernels::select::{block_score, select_head};
use kvtier_kernels::simd::dot;
use kvtier_kernels::{decode_cpu, select, DecodeEntry, KeepSet, KernelError, SelectScratch};
use kvtier_storage::testing::Rng;
use kvtier_storage::{ArenaOptions, DType, Geometry, HostArena, KvCache, Policy, StorageError};
use kvtier_tests::kv::{layer_rows, payload, query, rows};
use proptest::prelude::*;

fn arena(frame_bytes: usize, frames: usize) -> HostArena {
    HostArena::new(&ArenaOptions::new(frames * frame_bytes, frame_bytes)).unwrap()
}

fn frame_for(g: &Geometry) -> usize {
    g.block_bytes().next_multiple_of(4096)
}

/// A session with `n` random tokens in every layer, plus layer 0's stored K/V as f32
/// (`[t][kv_head][d]`), the oracle's input.
struct Fixture {
    kv: KvCache,
    k: Vec<f32>,
    v: Vec<f32>,
}

fn fixture(g: Geometry, n: usize, seed: u64) -> Fixture {
    let blocks = g.blocks_for(n as u64 + 64) as usize * g.layers as usize;
    let mut kv = KvCache::new(g, arena(frame_for(&g), blocks + 8)).unwrap();
    let p = payload(&g, n, seed);
    kv.append(0, n as u64, &p).unwrap();
    let (k0, v0) = layer_rows(&g, &p, n, 0, 0..n);
    Fixture {
        kv,
        k: g.dtype.decode_vec(k0),
        v: g.dtype.decode_vec(v0),
    }
}

/// A batch entry over `kv` with no cold source.
fn entry<'a>(
    kv: &'a mut KvCache,
    policy: Policy,
    position: u64,
    q: &'a [f32],
    k: &'a [u8],
    v: &'a [u8],
) -> DecodeEntry<'a> {
    DecodeEntry {
        session: 0,
        layer: 0,
        kv,
        policy,
        position,
        q,
        k,
        v,
        cold: None,
    }
}

fn geometries() -> Vec<Geometry> {
    let g = |layers, q_heads, kv_heads, head_dim, block_tokens, dtype| {
        Geometry::new(layers, q_heads, kv_heads, head_dim, dtype, block_tokens)
    };
    vec![
        g(1, 4, 4, 16, 8, DType::F32),      // MHA
        g(2, 8, 2, 32, 16, DType::F32),     // GQA, G = 4
        g(1, 7, 1, 20, 5, DType::F32),      // D not a multiple of 8, odd B
        g(1, 28, 4, 128, 128, DType::Bf16), // Qwen2.5-7B heads
        g(2, 6, 2, 64, 32, DType::Bf16),
        g(1, 4, 2, 24, 8, DType::F16),
    ]
}

/// One layer, two query heads on one KV head, D = 8, f32: small enough to reason about by hand.
fn tiny(block_tokens: u32) -> Geometry {
    Geometry {
        layers: 1,
        q_heads: 2,
        kv_heads: 1,
        head_dim: 8,
        dtype: DType::F32,
        block_tokens,
    }
}

fn tolerance(dt: DType) -> f64 {
    match dt {
        DType::F32 => 1e-5,
        DType::Bf16 | DType::F16 => 2e-3,
    }
}

/// Decodes one new token at layer 0 and returns (output, stats, the new token's f32 K/V).
fn step(
    f: &mut Fixture,
    policy: Policy,
    q: &[f32],
    rng: &mut Rng,
) -> (Vec<f32>, kvtier_kernels::StepStats) {
    let g = *f.kv.geometry();
    let (k, v) = (rows(&g, 1, rng), rows(&g, 1, rng));
    f.k.extend(g.dtype.decode_vec(&k));
    f.v.extend(g.dtype.decode_vec(&v));
    let position = f.kv.tokens(0).unwrap();
    let mut out = vec![0f32; (g.q_heads * g.head_dim) as usize];
    let stats = decode_cpu(
        &mut [entry(&mut f.kv, policy, position, q, &k, &v)],
        &mut out,
    )
    .unwrap();
    (out, stats.into_iter().next().unwrap())
}

fn in_keep(keep: &KeepSet, bt: u32) -> impl Fn(usize, usize) -> bool + '_ {
    move |h, t| keep.head(h).binary_search(&(t as u32 / bt)).is_ok()
}

#[test]
fn sparse_equals_dense_masked_to_the_keep_set() {
    for (gi, g) in geometries().into_iter().enumerate() {
        for (n, k) in [(1usize, 2u32), (37, 1), (200, 3), (1000, 4)] {
            let mut rng = Rng::new(gi as u64 * 1000 + n as u64);
            let mut f = fixture(g, n, rng.next_u64());
            let q = query(&g, &mut rng);
            // Each step appends a token: the sketch step sees one more than the bound's.
            for policy in [Policy::bound(1, 2, k), Policy::sketch(1, 2, k, 2)] {
                let (out, stats) = step(&mut f, policy, &q, &mut rng);
                let want = reference_attention(
                    &g,
                    &q,
                    &f.k,
                    &f.v,
                    in_keep(stats.keep.as_ref().unwrap(), g.block_tokens),
                );
                let err = max_rel_err(&out, &want);
                assert!(
                    err <= tolerance(g.dtype),
                    "{g:?} n={n} {policy:?}: rel err {err}"
                );
                let blocks = g.blocks_for(f.k.len() as u64 / (g.kv_heads * g.head_dim) as u64);
                let expect = (policy.budget()).min(blocks) as usize * g.kv_heads as usize;
                assert_eq!(
                    stats.keep.as_ref().unwrap().tiles(),
                    expect,
                    "{g:?} n={n}: keep-set size"
                );
                assert_eq!(stats.blocks_total as u64, blocks);
            }
        }
    }
}

#[test]
fn covering_every_block_equals_full_dense_attention() {
    for (gi, g) in geometries().into_iter().enumerate() {
        let mut rng = Rng::new(77 + gi as u64);
        let n = 3 * g.block_tokens as usize + 7;
        let mut f = fixture(g, n, rng.next_u64());
        let q: Vec<f32> = query(&g, &mut rng).iter().map(|x| 2.0 * x).collect();
        let dense = Policy::bound(0, 1, 1 << 20);
        let (out, stats) = step(&mut f, dense, &q, &mut rng);
        let blocks = g.blocks_for(n as u64 + 1) as usize;
        assert_eq!(stats.keep, Some(KeepSet::all(g.kv_heads as usize, blocks)));
        let want = reference_attention(&g, &q, &f.k, &f.v, |_, _| true);
        let err = max_rel_err(&out, &want);
        assert!(err <= tolerance(g.dtype), "{g:?}: rel err {err}");
    }
}

#[test]
fn a_batch_equals_its_entries_decoded_alone() {
    for policy in [Policy::bound(1, 1, 2), Policy::sketch(1, 1, 2, 3)] {
        batch_equals_entries_alone(policy);
    }
}

fn batch_equals_entries_alone(policy: Policy) {
    let gs = geometries();
    let mut rng = Rng::new(5);
    let mut alone = Vec::new();
    let mut batch_fix = Vec::new();
    let mut inputs = Vec::new();
    for (i, g) in gs.iter().enumerate() {
        let n = 50 + 13 * i;
        let mut a = fixture(*g, n, i as u64);
        let b = fixture(*g, n, i as u64);
        let q = query(g, &mut rng);
        let (k, v) = (rows(g, 1, &mut rng), rows(g, 1, &mut rng));
        let mut out = vec![0f32; q.len()];
        decode_cpu(
            &mut [entry(&mut a.kv, policy, n as u64, &q, &k, &v)],
            &mut out,
        )
        .unwrap();
        alone.extend(out);
        batch_fix.push(b);
        inputs.push((q, k, v, n as u64));
    }
    let mut entries: Vec<DecodeEntry<'_>> = batch_fix
        .iter_mut()
        .zip(&inputs)
        .map(|(f, (q, k, v, n))| entry(&mut f.kv, policy, *n, q, k, v))
        .collect();
    let mut out = vec![0f32; alone.len()];
    decode_cpu(&mut entries, &mut out).unwrap();
    assert_eq!(
        out, alone,
        "batched decode is bit-identical to single decodes"
    );
}

#[test]
fn short_contexts_select_everything_and_ties_prefer_lower_blocks() {
    let g = tiny(4);
    let policy = Policy::bound(1, 1, 2);
    let mut kv = KvCache::new(g, arena(4096, 64)).unwrap();
    // 16 identical keys -> 4 blocks with identical bounds: everything ties.
    let same = g.dtype.encode_vec(&[0.5f32; 8].repeat(16));
    kv.append(0, 16, &[same.clone(), same].concat()).unwrap();
    let q = vec![1.0f32; 16];
    let mut keep = KeepSet::new();
    let select_all = |kv: &KvCache, keep: &mut KeepSet| {
        select(
            &q,
            &kv.layer(0).unwrap(),
            &policy,
            &mut SelectScratch::default(),
            keep,
        )
        .unwrap()
    };
    select_all(&kv, &mut keep);
    assert_eq!(
        keep.head(0),
        &[0, 1, 2, 3],
        "4 blocks <= budget of 4: all kept"
    );
    let more = g.dtype.encode_vec(&[0.5f32; 8].repeat(12));
    kv.append(16, 12, &[more.clone(), more].concat()).unwrap();
    select_all(&kv, &mut keep);
    assert_eq!(
        keep.head(0),
        &[0, 1, 2, 6],
        "ties among 1..6 go to blocks 1 and 2"
    );
}

#[test]
fn bad_requests_are_typed_errors_and_change_nothing() {
    let g = geometries()[1];
    let mut rng = Rng::new(9);
    let mut f = fixture(g, 40, 3);
    let q = query(&g, &mut rng);
    let k = rows(&g, 1, &mut rng);
    let v = k.clone();
    let before = f.kv.tokens(0).unwrap();
    let mut out = vec![0f32; q.len()];
    let mut run = |layer: u32, position: u64, q: &[f32], k: &[u8]| {
        decode_cpu(
            &mut [DecodeEntry {
                layer,
                ..entry(&mut f.kv, Policy::default(), position, q, k, &v)
            }],
            &mut out,
        )
        .unwrap_err()
    };
    let e = run(0, 39, &q, &k);
    assert!(
        matches!(
            e.root(),
            KernelError::Storage(StorageError::PositionMismatch {
                expected: 40,
                got: 39,
                ..
            })
        ),
        "{e}"
    );
    let e = run(0, 41, &q, &k);
    assert!(
        matches!(
            e.root(),
            KernelError::Storage(StorageError::PositionMismatch { .. })
        ),
        "{e}"
    );
    let e = run(2, 40, &q, &k);
    assert!(
        matches!(
            e.root(),
            KernelError::Storage(StorageError::LayerOutOfRange { layer: 2, .. })
        ),
        "{e}"
    );
    let e = run(0, 40, &q[1..], &k);
    assert!(matches!(e.root(), KernelError::QuerySize { .. }), "{e}");
    let mut nan = q.clone();
    nan[5] = f32::NAN;
    let e = run(0, 40, &nan, &k);
    assert!(
        matches!(e.root(), KernelError::NonFiniteQuery { index: 5 }),
        "{e}"
    );
    let e = run(0, 40, &q, &k[..k.len() - 4]);
    assert!(
        matches!(
            e.root(),
            KernelError::Storage(StorageError::PayloadSize { what: "k", .. })
        ),
        "{e}"
    );
    assert!(e.to_string().starts_with("batch entry 0:"), "{e}");
    assert_eq!(f.kv.tokens(0).unwrap(), before);
}

#[test]
fn a_full_arena_fails_the_whole_batch_before_any_append() {
    let g = tiny(2);
    let shared = arena(4096, 3);
    let mut a = KvCache::new(g, shared.clone()).unwrap();
    let mut b = KvCache::new(g, shared.clone()).unwrap();
    let row = g.dtype.encode_vec(&[1.0f32; 8]);
    let two = [row.clone(), row.clone(), row.clone(), row.clone()].concat();
    a.append(0, 2, &two).unwrap(); // 1 frame, full block
    b.append(0, 2, &two).unwrap(); // 1 frame, full block
    let _hog = shared.alloc(4096).unwrap(); // the last frame
    let q = vec![0.5f32; 16];
    let mut out = vec![0f32; 32];
    let e = decode_cpu(
        &mut [
            entry(&mut a, Policy::default(), 2, &q, &row, &row),
            entry(&mut b, Policy::default(), 2, &q, &row, &row),
        ],
        &mut out,
    )
    .unwrap_err();
    assert!(
        matches!(
            e.root(),
            KernelError::Storage(StorageError::ArenaFull { .. })
        ),
        "{e}"
    );
    assert_eq!(
        (a.tokens(0).unwrap(), b.tokens(0).unwrap()),
        (2, 2),
        "no entry appended"
    );
}

/// A key far more aligned with the query than any other, in a distant block, wins at k = 1.
#[test]
fn a_planted_needle_is_always_selected() {
    let g = Geometry::QWEN2_5_7B;
    let g = Geometry { layers: 1, ..g };
    for seed in 0..20u64 {
        let mut rng = Rng::new(seed);
        let n = 40 * g.block_tokens as usize;
        let d = g.head_dim as usize;
        let hkv = g.kv_heads as usize;
        let mut k = rng.normals(n * hkv * d);
        let v = rng.normals(n * hkv * d);
        let q = rng.normals(g.q_heads as usize * d);
        let head = rng.below(hkv as u64) as usize;
        let qh = head * g.group() + rng.below(g.group() as u64) as usize;
        let t = g.block_tokens as usize * (2 + rng.below(30) as usize) + rng.below(128) as usize;
        for i in 0..d {
            k[(t * hkv + head) * d + i] = 4.0 * q[qh * d + i];
        }
        let mut kv = KvCache::new(g, arena(frame_for(&g), 64)).unwrap();
        kv.append(
            0,
            n as u64,
            &[g.dtype.encode_vec(&k), g.dtype.encode_vec(&v)].concat(),
        )
        .unwrap();
        let layer = kv.layer(0).unwrap();
        for policy in [Policy::bound(1, 4, 1), Policy::sketch(1, 4, 1, 2)] {
            let mut keep = Vec::new();
            select_head(
                &q,
                &layer,
                layer.blocks(),
                &policy,
                head,
                &mut SelectScratch::default(),
                &mut keep,
            );
            let needle = (t / g.block_tokens as usize) as u32;
            assert!(
                keep.contains(&needle),
                "seed {seed} {policy:?}: needle block {needle} not in {keep:?}"
            );
            assert_eq!(keep.len(), 6);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// The block score bounds every key's dot product with every query head of the group,
    /// exactly in f32 (same lane order, monotone rounding), so no key can beat its block's score.
    #[test]
    fn block_score_bounds_every_key(seed in any::<u64>(), n in 1usize..64, dt in prop_oneof![Just(DType::Bf16), Just(DType::F32)]) {
        let g = Geometry { layers: 1, q_heads: 6, kv_heads: 2, head_dim: 36, dtype: dt, block_tokens: 8 };
        let f = fixture(g, n, seed);
        let mut rng = Rng::new(seed ^ 1);
        let q: Vec<f32> = rng.normals(6 * 36).iter().map(|x| x * 3.0).collect();
        let layer = f.kv.layer(0).unwrap();
        let d = 36;
        for t in 0..n {
            for h in 0..2 {
                let (hi, lo) = layer.bounds(t / 8, h);
                let score = block_score(&q[h * 3 * d..(h + 1) * 3 * d], hi, lo);
                let key = &f.k[(t * 2 + h) * d..(t * 2 + h + 1) * d];
                for gi in 0..3 {
                    let qg = &q[(h * 3 + gi) * d..(h * 3 + gi + 1) * d];
                    prop_assert!(dot(qg, key) <= score, "t={} h={} g={}", t, h, gi);
                }
            }
        }
    }

    /// Building a session in one append or token by token (each token decoded) gives
    /// bit-identical selections and outputs for the next step.
    #[test]
    fn append_batching_does_not_change_decode(seed in any::<u64>(), n in 2usize..90, k in 0u32..4, sketch in any::<bool>()) {
        let g = Geometry { layers: 1, q_heads: 4, kv_heads: 2, head_dim: 16, dtype: DType::Bf16, block_tokens: 4 };
        let policy = if sketch { Policy::sketch(1, 1, k, 2) } else { Policy::bound(1, 1, k) };
        let mut rng = Rng::new(seed);
        let ks: Vec<Vec<u8>> = (0..n).map(|_| rows(&g, 1, &mut rng)).collect();
        let vs: Vec<Vec<u8>> = (0..n).map(|_| rows(&g, 1, &mut rng)).collect();
        let qs: Vec<Vec<f32>> = (0..n).map(|_| query(&g, &mut rng)).collect();
        let mut bulk = KvCache::new(g, arena(4096, 64)).unwrap();
        bulk.append(0, n as u64 - 1, &[ks[..n - 1].concat(), vs[..n - 1].concat()].concat()).unwrap();
        let mut stepwise = KvCache::new(g, arena(4096, 64)).unwrap();
        let mut out = vec![0f32; 64];
        for t in 0..n - 1 {
            decode_cpu(&mut [entry(&mut stepwise, policy, t as u64, &qs[t], &ks[t], &vs[t])], &mut out).unwrap();
        }
        let last = n - 1;
        let run = |kv: &mut KvCache| {
            let mut out = vec![0f32; 64];
            let s = decode_cpu(&mut [entry(kv, policy, last as u64, &qs[last], &ks[last], &vs[last])], &mut out).unwrap();
            (out.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), s)
        };
        prop_assert_eq!(run(&mut bulk), run(&mut stepwise));
    }
}

#[test]
fn timed_decode_reports_every_stage_and_changes_nothing_else() {
    use kvtier_kernels::{decode_cpu_timed, StageTimings};
    let g = geometries()[3];
    let (mut a, mut b) = (fixture(g, 4000, 11), fixture(g, 4000, 11));
    let mut rng = Rng::new(12);
    let q = query(&g, &mut rng);
    let (k, v) = (rows(&g, 1, &mut rng), rows(&g, 1, &mut rng));
    let n = (g.q_heads * g.head_dim) as usize;
    let (mut out_a, mut out_b) = (vec![0f32; n], vec![0f32; n]);
    let p = Policy::default();
    let plain = decode_cpu(&mut [entry(&mut a.kv, p, 4000, &q, &k, &v)], &mut out_a).unwrap();
    let mut t = StageTimings::default();
    let timed = decode_cpu_timed(
        &mut [entry(&mut b.kv, p, 4000, &q, &k, &v)],
        &mut out_b,
        &mut t,
    )
    .unwrap();
    assert_eq!(plain, timed);
    assert_eq!(out_a, out_b, "timing must not change the answer");
    assert!(
        t.append_ns > 0 && t.select_ns > 0 && t.attend_ns > 0,
        "{t:?}"
    );
    // A failed step leaves the timings as they were.
    let before = t;
    let bad = DecodeEntry {
        position: 7,
        ..entry(&mut b.kv, p, 4000, &q, &k, &v)
    };
    decode_cpu_timed(&mut [bad], &mut out_b, &mut t).unwrap_err();
    assert_eq!(t, before);
}
