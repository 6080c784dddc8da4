//! tierd with `backend.kind = "cuda"` against tierd on the CPU backend, over real sockets:
//! the same sessions and steps give identical keep-sets and outputs within bf16 tolerance.
//! Skips (saying so) without a CUDA device.

mod common;

use common::*;
use kvtier_kernels::dense::max_rel_err;

#[test]
fn the_cuda_daemon_answers_like_the_cpu_daemon() {
    if !kvtier_kernels::cuda::device_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    let gpu = Daemon::start(&["--backend", "cuda", "--log-level", "info"]);
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
                let pos = sh.tokens(layer);
                let (q, k, v) = sh.step_input(layer);
                let qb = f32_bytes(&q);
                let og = cg
                    .decode(layer as u32, entry(*a, pos, &qb, &k, &v), true)
                    .unwrap();
                let oc = cc
                    .decode(layer as u32, entry(*b, pos, &qb, &k, &v), true)
                    .unwrap();
                let (sg, sc) = (og.stats.as_ref().unwrap(), oc.stats.as_ref().unwrap());
                assert_eq!(
                    sg.selected, sc.selected,
                    "step {step} layer {layer}: keep-sets"
                );
                let err = max_rel_err(&og.out, &oc.out);
                assert!(err <= 2e-3, "step {step} layer {layer}: rel err {err}");
                sh.check(layer, &q, &og);
                hits += sg.cache_hits;
            }
        }
    }
    assert!(
        hits > 0,
        "the GPU path served the steps (block cache hits: {hits})"
    );
    eprintln!("cuda daemon == cpu daemon over 144 decode steps; GPU block-cache hits {hits}");
}
