//! CUDA backend, selector: tied scores, long layers, thousands of blocks and the largest
//! supported context, exactly the CPU selector's keep-sets (and attention within the f64
//! reference's tolerance).
//! Every test is `#[ignore]`d with the reason, so a machine without a GPU reports it as ignored;
//! bench/gpu/run.sh runs them with `--include-ignored`. Run anyway without a device, each prints
//! "skipped: no CUDA device" and passes.
#![cfg(feature = "cuda")]

mod gpu_common;

use gpu_common::{check_layer, geom, gpu, Harness, KeyGen, POLICY};
use kvtier_kernels::cuda::{
    CudaConfig, LaunchMode, SummaryDtype, MAX_CANDIDATES, MAX_CANDIDATE_UNITS,
};
use kvtier_storage::{DType, Policy};

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
        let policy = Policy::bound(2, 3, top_k);
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

/// Thousands of blocks: several candidates per top-k thread, full radix passes, exact match.
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn selector_large_context_exact() {
    if !gpu() {
        return;
    }
    let p = Policy::bound(1, 4, 32);
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
        let p = Policy::bound(1, 4, top_k);
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

/// The sketch selector on the device (quarter bounds in the scorer, the candidates reranked by
/// their key sketches) equals the CPU's keep-sets exactly, fused and split, for several
/// geometries, candidate counts (fewer than k: taken as k) and tied quarter bounds (templates),
/// and a batch of a long and a short session.
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn sketch_selector_matches_cpu() {
    if !gpu() {
        return;
    }
    let cases = [
        (
            geom(28, 4, 128, 16, DType::Bf16),
            Policy::sketch(1, 4, 8, 32),
            0,
        ),
        (
            geom(28, 4, 128, 16, DType::Bf16),
            Policy::sketch(1, 4, 8, 8),
            5,
        ),
        (
            geom(28, 4, 128, 16, DType::Bf16),
            Policy::sketch(2, 3, 5, 3),
            0,
        ),
        (
            geom(4, 1, 256, 64, DType::Bf16),
            Policy::sketch(1, 4, 8, 16),
            0,
        ),
        (
            geom(8, 8, 64, 16, DType::F16),
            Policy::sketch(1, 2, 4, 20),
            3,
        ),
        (
            geom(16, 2, 64, 16, DType::F32),
            Policy::sketch(1, 2, 32, 32),
            0,
        ),
        // Candidate lists of two and four keys per lane, and top_k above 32.
        (
            geom(28, 4, 128, 16, DType::Bf16),
            Policy::sketch(1, 4, 8, 64),
            0,
        ),
        (
            geom(28, 4, 128, 16, DType::Bf16),
            Policy::sketch(1, 4, 8, 100),
            5,
        ),
        (
            geom(8, 8, 64, 16, DType::F16),
            Policy::sketch(1, 2, 40, 128),
            0,
        ),
        // Four quarter records per block (128 tokens), tied bounds.
        (
            geom(28, 4, 128, 128, DType::Bf16),
            Policy::sketch(1, 4, 8, 64),
            5,
        ),
        // 32 candidates: the short session's 118 distant blocks are within the scan (16,384
        // tokens), so every one is scored; the long one's first stage keeps 32.
        (
            geom(28, 4, 128, 128, DType::Bf16),
            Policy::sketch(1, 4, 8, 32),
            0,
        ),
        // The budget of 8 blocks of 128 tokens in blocks of 64 (two halves) and of 32 (one
        // record; a sink of 128 tokens, a local window of 512).
        (
            geom(28, 4, 128, 64, DType::Bf16),
            Policy::sketch(2, 8, 16, 128),
            0,
        ),
        (
            geom(28, 4, 128, 32, DType::Bf16),
            Policy::sketch(4, 16, 32, 128),
            5,
        ),
        // 64 units of four 32-token blocks: a rerank list of 256 keys (eight per lane).
        (
            geom(28, 4, 128, 32, DType::Bf16),
            Policy::sketch(4, 16, 32, MAX_CANDIDATES),
            0,
        ),
    ];
    for (i, (g, policy, templates)) in cases.into_iter().enumerate() {
        for mode in [LaunchMode::Fused, LaunchMode::Split] {
            let cfg = CudaConfig::new(g, policy, 300, 2, SummaryDtype::F32);
            let mut h = Harness::new(cfg, 90 + i as u64);
            h.be.set_launch_mode(mode);
            let bt = g.block_tokens;
            let a = h.add_session(300 * bt, KeyGen { templates });
            // Just within the scan (16,384 distant tokens, at most 256 blocks): every distant
            // block is scored, in a rerank list of up to 256.
            let short = (16_384 / bt).min(256) - 5;
            let b = h.add_session(short * bt + 5, KeyGen { templates });
            check_layer(&mut h, 0, &[a, b]);
            check_layer(&mut h, 1, &[b, a]);
            // Appends grow the tail: its sketch is uploaded again, and selection follows.
            h.append(b, bt + 3);
            check_layer(&mut h, 0, &[b]);
        }
    }
}

/// The sketch selector over the largest context of the list merge (32,768 blocks: four
/// quarter records each), exactly the CPU's.
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn sketch_selector_max_blocks_exact() {
    if !gpu() {
        return;
    }
    let cfg = CudaConfig::new(
        geom(4, 1, 32, 16, DType::Bf16),
        Policy::sketch(1, 4, 8, 32),
        32_768,
        2,
        SummaryDtype::F32,
    );
    check_two_sessions(cfg, 97, 32_768 * 16, 9_000 * 16 + 7, 0);
    let cfg = CudaConfig::new(
        geom(4, 1, 32, 16, DType::Bf16),
        Policy::sketch(1, 4, 8, MAX_CANDIDATES),
        32_768,
        2,
        SummaryDtype::F32,
    );
    check_two_sessions(cfg, 98, 32_768 * 16, 9_000 * 16 + 7, 0);
}

/// Configurations the device's sketch selector does not take are typed errors.
#[test]
fn sketch_configs_the_device_refuses() {
    let g = geom(28, 4, 128, 16, DType::Bf16);
    let e = CudaConfig::new(
        g,
        Policy::sketch(1, 4, 8, MAX_CANDIDATES + 1),
        64,
        1,
        SummaryDtype::F32,
    )
    .validate()
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("at most 128 candidate units and 256 candidate blocks"),
        "{e}"
    );
    // In 128-token blocks a unit is a block: 129 candidates are 129 units.
    let e = CudaConfig::new(
        geom(28, 4, 128, 128, DType::Bf16),
        Policy::sketch(1, 4, 8, MAX_CANDIDATE_UNITS + 1),
        64,
        1,
        SummaryDtype::F32,
    )
    .validate()
    .unwrap_err()
    .to_string();
    assert!(e.contains("(129 units, 129 blocks"), "{e}");
}
