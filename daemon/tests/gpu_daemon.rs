//! tierd with `backend.kind = "cuda"` against tierd on the CPU backend, over real sockets:
//! the same sessions and steps give identical keep-sets and outputs within bf16 tolerance.
//! Skips (saying so) without a CUDA device.
#![cfg(feature = "cuda")]

mod common;

use common::*;
use kvtier_kernels::dense::max_rel_err;

/// The harness daemon plus `args` (with `--backend cuda`), or None (the test passes, saying
/// so) without a CUDA device.
fn cuda_daemon(args: &[&str]) -> Option<Daemon> {
    if !kvtier_kernels::cuda::device_available() {
        eprintln!("skipped: no CUDA device");
        return None;
    }
    Some(Daemon::start(args))
}
use kvtier_protocol::client::Client;
use kvtier_protocol::DecodeOutput;

/// One decode of `layer` at the shadow's next position, on the GPU daemon's session `a` and on
/// the CPU daemon's `b`: the same keep-sets, outputs within bf16 tolerance, the GPU's output
/// checked against the oracle and returned. `what` starts the assertion messages.
fn decode_both(
    (cg, a): (&mut Client, u64),
    (cc, b): (&mut Client, u64),
    sh: &mut Shadow,
    layer: usize,
    what: &str,
) -> DecodeOutput {
    let pos = sh.tokens(layer);
    let (q, k, v) = sh.step_input(layer);
    let qb = f32_bytes(&q);
    let og = cg
        .decode(layer as u32, entry(a, pos, &qb, &k, &v), true)
        .unwrap();
    let oc = cc
        .decode(layer as u32, entry(b, pos, &qb, &k, &v), true)
        .unwrap();
    let (sg, sc) = (og.stats.as_ref().unwrap(), oc.stats.as_ref().unwrap());
    assert_eq!(
        sg.selected, sc.selected,
        "{what}layer {layer} at {pos}: keep-sets"
    );
    let err = max_rel_err(&og.out, &oc.out);
    assert!(err <= 2e-3, "{what}layer {layer} at {pos}: rel err {err}");
    sh.check(layer, &q, &og);
    og
}

#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn the_cuda_daemon_answers_like_the_cpu_daemon() {
    let Some(gpu) = cuda_daemon(&["--backend", "cuda"]) else {
        return;
    };
    let cpu = Daemon::start(&["--backend", "cpu"]);
    let (mut cg, mut cc) = (gpu.client(), cpu.client());
    let g = small_geometry();
    let mut sessions = Vec::new();
    for i in 0..3u64 {
        let a = cg.create_session(g, policy(), "gpu").unwrap();
        let b = cc.create_session(g, policy(), "cpu").unwrap();
        let mut sh = Shadow::new(g, 500 + i);
        let n = 150 + 40 * i as u32;
        let p = sh.payload(n as usize);
        cg.append_kv(a, 0, n, &p).unwrap();
        cc.append_kv(b, 0, n, &p).unwrap();
        sessions.push((a, b, sh));
    }
    let mut hits = 0;
    for step in 0..24 {
        for (a, b, sh) in &mut sessions {
            for layer in 0..2usize {
                let what = format!("step {step} ");
                let og = decode_both((&mut cg, *a), (&mut cc, *b), sh, layer, &what);
                hits += og.stats.unwrap().cache_hits;
            }
        }
    }
    assert!(
        hits > 0,
        "the GPU path served the steps (block cache hits: {hits})"
    );
    eprintln!("cuda daemon == cpu daemon over 144 decode steps; GPU block-cache hits {hits}");
}

#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn a_demoted_session_decodes_on_the_gpu_like_the_cpu_daemon_over_ram() {
    // On-demand promotion only, so every read is the decode step's own.
    let Some(gpu) = cuda_daemon(&["--backend", "cuda", "--set", "nvme.prefetch_blocks=0"]) else {
        return;
    };
    let cpu = Daemon::start(&["--backend", "cpu"]);
    let (mut cg, mut cc) = (gpu.client(), cpu.client());
    let g = small_geometry();
    let a = cg.create_session(g, policy(), "gpu-cold").unwrap();
    let b = cc.create_session(g, policy(), "cpu-ram").unwrap();
    let mut sh = Shadow::new(g, 77);
    let n = 600; // 38 blocks of 16 per layer, the last one partial
    let p = sh.payload(n);
    cg.append_kv(a, 0, n as u32, &p).unwrap();
    cc.append_kv(b, 0, n as u32, &p).unwrap();
    // Warm the GPU's tile cache, then move every block to NVMe.
    let (mut entries, mut nvme_steps, mut hits) = (0u64, 0, 0u64);
    let mut step = |cg: &mut Client, cc: &mut Client, sh: &mut Shadow| {
        let mut nvme = 0;
        for layer in 0..2usize {
            let og = decode_both((cg, a), (cc, b), sh, layer, "");
            let sg = og.stats.as_ref().unwrap();
            if sg.blocks_nvme > 0 {
                nvme += 1;
                assert!(
                    sg.bytes_moved >= sg.blocks_nvme as u64 / g.kv_heads as u64 * 4096,
                    "NVMe reads count in bytes_moved: {sg:?}"
                );
            }
            // A block read back may also be a GPU cache hit (the host cannot see the device's
            // cache), so the three counts may overlap; RAM and NVMe never do.
            assert!(
                sg.blocks_ram + sg.blocks_nvme <= sg.blocks_selected,
                "{sg:?}"
            );
            assert!(sg.cache_hits <= sg.blocks_selected, "{sg:?}");
            hits += sg.cache_hits as u64;
            entries += 1;
        }
        nvme
    };
    for _ in 0..4 {
        step(&mut cg, &mut cc, &mut sh);
    }
    assert_eq!(cg.demote(a).unwrap(), 2 * 38);
    assert_eq!(cg.session_info(a).unwrap().host_bytes, 0);
    for i in 0..12 {
        nvme_steps += step(&mut cg, &mut cc, &mut sh);
        if i == 5 {
            // Cold again, the decoded tokens too.
            assert!(cg.demote(a).unwrap() > 0);
        }
    }
    let stats = cg.stats().unwrap();
    let get = |k: &str| stats.get(k).unwrap_or_else(|| panic!("STATS lacks {k}"));
    assert!(nvme_steps >= 2, "steps reading NVMe: {nvme_steps}");
    assert!(get("blocks_promoted_total") > 0);
    assert_eq!(
        get("gpu_decode_entries_total"),
        entries,
        "every step, cold ones included, was answered by the device"
    );
    assert_eq!(get("gpu_cpu_fallbacks_total"), 0);
    assert_eq!(get("gpu_cold_divergences_total"), 0);
    assert!(hits > 0, "GPU tile-cache hits {hits}");
    assert!(
        cc.stats()
            .unwrap()
            .get("gpu_decode_entries_total")
            .is_none(),
        "the CPU daemon reports no GPU counters"
    );
    eprintln!(
        "demoted session on the cuda daemon == cpu daemon over RAM: {entries} entries, {nvme_steps} read NVMe, {hits} GPU cache hits"
    );
}

#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn concurrent_decodes_share_device_calls_and_match_the_oracle() {
    // backend.coalesce = "auto": on with the CUDA backend. One lane (the default: every request
    // through one coalescer, eight connections queue behind each other's calls) and four (two
    // sessions per lane, lanes at once; a lane's two sessions mostly take turns, one's call
    // running while the other's reply travels, so sharing is not asserted there).
    for lanes in ["1", "4"] {
        let set = format!("backend.cuda.lanes={lanes}");
        let Some(gpu) = cuda_daemon(&["--backend", "cuda", "--set", &set]) else {
            return;
        };
        let s = concurrent_steps(&gpu, 8, 16);
        let (requests, steps) = (s.requests, s.steps.expect("decode_steps_total"));
        let coalesced = s.coalesced.expect("coalescing is on with CUDA");
        let stats = gpu.client().stats().unwrap();
        assert_eq!(stats.get("gpu_cpu_fallbacks_total"), Some(0));
        assert_eq!(
            stats.get("gpu_decode_entries_total"),
            Some(requests),
            "{lanes} lanes: every request on the device"
        );
        if lanes == "1" {
            assert!(
                coalesced > 0,
                "no request shared a device call in {requests}"
            );
            assert!(steps < requests, "{steps} steps for {requests} requests");
        }
        eprintln!(
            "{lanes} lanes: {coalesced} of {requests} requests shared a device call; {steps} steps"
        );
    }
}

#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn open_model_geometries_on_default_extents_decode_on_the_gpu_like_the_cpu_daemon() {
    use kvtier_protocol::{DType, Geometry};
    if !kvtier_kernels::cuda::device_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    // Embedded defaults (not the harness's 4 KiB runs): runs of 32 to 512 KiB share the
    // arena the GPU has registered, with a zero extent as large as host.max_run_bytes.
    let daemon = |backend: &str| {
        tierd()
            .host_capacity("512MiB")
            .no_nvme()
            .args(["--backend", backend, "--set", "backend.cuda.max_backends=4"])
            .start()
    };
    let (gpu, cpu) = (daemon("cuda"), daemon("cpu"));
    let (mut cg, mut cc) = (gpu.client(), cpu.client());
    let models = [
        Geometry::new(2, 4, 1, 256, DType::Bf16, 32), // Gemma 3 270M: 32 KiB runs
        Geometry::new(2, 32, 8, 128, DType::Bf16, 128), // Llama-3-8B: 512 KiB
        Geometry::new(2, 28, 4, 128, DType::F32, 128), // Qwen2.5-7B f32: 512 KiB
        Geometry::new(2, 40, 10, 128, DType::Bf16, 64), // Phi-4 14B: 320 KiB, no power of two
    ];
    let mut sessions = Vec::new();
    for (i, g) in models.into_iter().enumerate() {
        let a = cg.create_session(g, policy(), "gpu").unwrap();
        let b = cc.create_session(g, policy(), "cpu").unwrap();
        let mut sh = Shadow::new(g, 900 + i as u64);
        let n = g.block_tokens * 6 + 5;
        let p = sh.payload(n as usize);
        cg.append_kv(a, 0, n, &p).unwrap();
        cc.append_kv(b, 0, n, &p).unwrap();
        sessions.push((a, b, sh, 0u64));
    }
    for step in 0..6 {
        for (a, b, sh, hits) in &mut sessions {
            for layer in 0..2usize {
                let what = format!("{:?} step {step} ", sh.g);
                let og = decode_both((&mut cg, *a), (&mut cc, *b), sh, layer, &what);
                *hits += u64::from(og.stats.unwrap().cache_hits);
            }
        }
    }
    for (_, _, sh, hits) in &sessions {
        assert!(*hits > 0, "{:?}: the GPU path served the steps", sh.g);
    }
}
