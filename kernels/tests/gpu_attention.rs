//! CUDA backend, attention: one layer on the device, the Qwen geometry at batch 1 and 8, other
//! geometries and dtypes, tensor cores against fp32, dense mode and dense attention, against the
//! CPU selector (bit for bit) and an f64 attention reference.
//! Every test is `#[ignore]`d with the reason, so a machine without a GPU reports it as ignored;
//! bench/gpu/run.sh runs them with `--include-ignored`. Run anyway without a device, each prints
//! "skipped: no CUDA device" and passes.
#![cfg(feature = "cuda")]

mod gpu_common;

use gpu_common::{
    check_layer, geom, gpu, qwen_config, rel_err, step_items, Harness, KeyGen, POLICY,
};
use kvtier_kernels::cuda::{
    AttentionMath, CudaConfig, CudaError, DecodeItem, DenseKv, StepItem, SummaryDtype,
};
use kvtier_storage::{DType, Policy};

#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn smoke_device_and_one_layer() {
    let cfg = CudaConfig::new(
        geom(28, 4, 128, 128, DType::Bf16),
        POLICY,
        24,
        1,
        SummaryDtype::F32,
    );
    let Some(mut h) = Harness::start(cfg, 1) else {
        return;
    };
    println!("device: {}", h.be.device_name().unwrap());
    let s = h.add_session(20 * 128 + 77, KeyGen { templates: 0 });
    check_layer(&mut h, 0, &[s]);
}

/// Qwen2.5-7B geometry (B=128, bf16), batch 1 and 8, sessions of different lengths, both
/// the top-k path and the all-blocks path.
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn qwen_geometry_batch_1_and_8() {
    let Some(mut h) = Harness::start(qwen_config(64, 8), 2) else {
        return;
    };
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
            Policy::bound(2, 3, 4),
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
            Policy::bound(0, 1, 3),
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

/// Dense mode (top_k covers every block) equals plain softmax attention over all tokens.
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn dense_mode_is_plain_attention() {
    if !gpu() {
        return;
    }
    let p = Policy::bound(1, 2, 40);
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

/// Dense attention (the benchmark's baseline): every block, from host extents and from a copy in
/// GPU memory, equals the f64 reference over all blocks (batch 2, one session with a partial
/// tail, one short); both sources give bit-identical outputs; the statistics count every tile;
/// the sparse path gives the same output before and after; a session whose copy is missing or
/// stale is refused with a typed error.
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn dense_attention_matches_reference() {
    let Some(mut h) = Harness::start(qwen_config(60, 3), 92) else {
        return;
    };
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
    assert_eq!(
        kv.bytes(),
        (60 + 9) * 2 * h.cfg.geometry.block_bytes() as u64
    );
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
        assert_eq!(hs.bytes_moved, tiles * h.cfg.geometry.tile_bytes() as u64);
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
