//! The in-engine path on a GPU against tierd's own CUDA path, over a real tierd: the same
//! appended data and queries give bit-identical keep-sets and outputs (and the outputs match
//! the dense oracle over the keep-set), and a restarted tierd is a typed error for the engine.
//! Skips (saying so) without a CUDA device.

use kvtier_engine::{EngineError, HeadShard, InEngine};
use kvtier_kernels::cuda::{CudaConfig, DeviceIo, SummaryDtype};
use kvtier_protocol::client::ClientError;
use kvtier_protocol::{DType, Geometry};
use kvtier_tests::kv::f32_bytes;
use kvtier_tests::session::{entry, policy, Shadow};
use kvtier_tests::{bins, Tierd};

/// Qwen2.5-7B's attention shape (28 query heads, 4 KV heads, D=128, bf16, 128-token blocks) on
/// 3 layers.
const GEO: Geometry = Geometry::new(3, 28, 4, 128, DType::Bf16, 128);

/// The configuration tierd's CUDA decoder gives such sessions by default (gpu/decoder/,
/// backend.cuda defaults: 8 sessions of up to 8192 blocks).
fn daemon_like_config() -> CudaConfig {
    CudaConfig::new(GEO, policy(), 8192, 8, SummaryDtype::F32)
}

fn cuda_tierd(dir: Option<tempfile::TempDir>) -> Tierd {
    let b = Tierd::builder(bins::tierd())
        .host_capacity("2GiB")
        .args(["--backend", "cuda"])
        .set("host.shared=true");
    match dir {
        Some(d) => b.dir(d).start(),
        None => b.start(),
    }
}

/// tierd on the CPU (only the engines use the device) with `n` sessions of `tokens` tokens of
/// deterministic KV (seeds from `seed`).
fn cpu_tierd_with_sessions(n: u64, tokens: u64, seed: u64) -> (Tierd, Vec<u64>) {
    let d = Tierd::builder(bins::tierd())
        .host_capacity("2GiB")
        .args(["--backend", "cpu"])
        .set("host.shared=true")
        .start();
    let mut c = d.client();
    let sessions = (0..n)
        .map(|i| {
            let s = c.create_session(GEO, policy(), "engines").unwrap();
            let mut sh = Shadow::new(GEO, seed + i);
            for at in (0..tokens).step_by(500) {
                c.append_kv(s, at, 500, &sh.payload(500)).unwrap();
            }
            s
        })
        .collect();
    (d, sessions)
}

/// This test binary again, running only the `#[ignore]`d child test `name` with `spec` in the
/// environment variable `var`; stdout piped.
fn spawn_child(name: &str, var: &str, spec: String) -> std::process::Child {
    kvtier_tests::sys::rerun_test(&std::env::current_exe().unwrap(), name)
        .env(var, spec)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn the_in_engine_path_answers_bit_identically_to_the_daemons_cuda_path() {
    if !kvtier_kernels::cuda::device_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    let d = cuda_tierd(None);
    let mut c = d.client();
    // Session a decodes through tierd (DECODE), b in this process; both hold the same KV.
    let a = c.create_session(GEO, policy(), "daemon-path").unwrap();
    let b = c.create_session(GEO, policy(), "in-engine").unwrap();
    let mut sh = Shadow::new(GEO, 2024);
    let prefill = 4000u32; // 32 blocks, the last partial
    let chunk = 500u32;
    let mut at = 0;
    while at < prefill {
        let p = sh.payload(chunk as usize);
        c.append_kv(a, at as u64, chunk, &p).unwrap();
        c.append_kv(b, at as u64, chunk, &p).unwrap();
        at += chunk;
    }
    let mut engine = InEngine::connect(d.path(), 0, daemon_like_config()).unwrap();
    engine.attach(b).unwrap();

    let layers = GEO.layers as usize;
    let mut compared = 0;
    for step in 0..12 {
        let pos = sh.tokens(0);
        let inputs: Vec<_> = (0..layers).map(|l| sh.step_input(l)).collect();
        // tierd's path: one DECODE per layer (append + attend), keep-sets in the stats.
        let daemon: Vec<_> = inputs
            .iter()
            .enumerate()
            .map(|(l, (q, k, v))| {
                let out = c
                    .decode(l as u32, entry(a, pos, &f32_bytes(q), k, v), true)
                    .unwrap();
                sh.check(l, q, &out);
                out
            })
            .collect();
        // The engine's: one APPEND_KV of the step's rows, one sync, then attention per layer.
        let payload: Vec<u8> = inputs
            .iter()
            .flat_map(|(_, k, v)| k.iter().chain(v.iter()).copied())
            .collect();
        c.append_kv(b, pos, 1, &payload).unwrap();
        engine.sync(b).unwrap();
        for (l, (q, _, _)) in inputs.iter().enumerate() {
            let got = engine.decode_layer(l as u32, &[(b, q)]).unwrap();
            let keep = engine.last_keep_sets(l as u32).unwrap();
            let want = &daemon[l];
            assert_eq!(
                keep[0],
                want.stats.as_ref().unwrap().selected,
                "step {step} layer {l}: keep-sets"
            );
            let same = got
                .out
                .iter()
                .zip(&want.out)
                .all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "step {step} layer {l}: outputs differ");
            compared += 1;
        }
    }
    eprintln!("in-engine == tierd's CUDA path, bit for bit, over {compared} layer steps");
    device_path_matches_the_host_path(&mut engine, b, &mut sh);

    // tierd restarts: the engine's next sync is a typed error, not a hang or stale data.
    let dir = d.stop(false);
    let d = cuda_tierd(Some(dir));
    match engine.sync(b) {
        Err(EngineError::Daemon(ClientError::Closed | ClientError::Io(_))) => {}
        other => panic!("expected a closed connection, got {other:?}"),
    }
    // A new engine over the restarted tierd serves the session again.
    let mut again = InEngine::connect(d.path(), 0, daemon_like_config()).unwrap();
    again.attach(b).unwrap();
    let q = vec![0.25f32; (GEO.q_heads * GEO.head_dim) as usize];
    let out = again.decode_layer(0, &[(b, &q)]).unwrap();
    assert!(out.out.iter().all(|x| x.is_finite()));
}

/// The device path (the engine's own device buffers, enqueued on its stream) gives the host
/// path's outputs bit for bit, and a log-sum-exp per query head; without a bound batch, or after
/// a sync, it is a typed error.
fn device_path_matches_the_host_path(engine: &mut InEngine, b: u64, sh: &mut Shadow) {
    use cudarc::driver::DevicePtr;
    use kvtier_kernels::cuda::{device_context, CudaError, DeviceTail};

    let hqd = (GEO.q_heads * GEO.head_dim) as usize;
    let ctx = device_context(0).unwrap();
    let st = ctx.new_stream().unwrap();
    let od = st.alloc_zeros::<f32>(hqd).unwrap();
    let lsed = st.alloc_zeros::<f32>(GEO.q_heads as usize).unwrap();
    let not_bound = |r| matches!(r, Err(EngineError::Cuda(CudaError::NotBound)));
    let qs: Vec<Vec<f32>> = (0..GEO.layers as usize)
        .map(|l| sh.step_input(l).0)
        .collect();
    let qd: Vec<_> = qs.iter().map(|q| st.clone_htod(q).unwrap()).collect();
    let ptr = |s: &cudarc::driver::CudaSlice<f32>| s.device_ptr(&st).0;
    let io = |l: usize| DeviceIo {
        q: ptr(&qd[l]),
        out: ptr(&od),
        lse: ptr(&lsed),
        tail: DeviceTail::default(),
    };
    let enqueue = |e: &mut InEngine, l: usize, io: DeviceIo| {
        // SAFETY: every address is 0 (refused) or a live allocation of device 0's primary
        // context sized for a batch of one, read back on `st` before it is dropped at the end.
        unsafe { e.decode_layer_device(l as u32, io, st.cu_stream()) }
    };
    assert!(not_bound(enqueue(engine, 0, io(0))));
    engine.bind(&[b]).unwrap();
    let null = DeviceIo { q: 0, ..io(0) };
    assert!(matches!(
        enqueue(engine, 0, null),
        Err(EngineError::Cuda(CudaError::NullBuffer))
    ));
    for (l, q) in qs.iter().enumerate() {
        enqueue(engine, l, io(l)).unwrap();
        let got = st.clone_dtoh(&od).unwrap();
        let lse = st.clone_dtoh(&lsed).unwrap();
        let want = engine.decode_layer(l as u32, &[(b, q)]).unwrap();
        assert!(
            got.iter()
                .zip(&want.out)
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "layer {l}: device path differs from the host path"
        );
        assert!(lse.iter().all(|x| x.is_finite()), "layer {l}: lse {lse:?}");
        // The host call unbound the batch (it reuses the batch buffers).
        assert!(not_bound(enqueue(engine, l, io(l))));
        engine.bind(&[b]).unwrap();
    }
    device_tail_is_merged_like_the_f64_oracle(engine, &st, &qs[1], |e, io| enqueue(e, 1, io));

    // The step's device calls captured in a CUDA graph on the engine's stream and replayed:
    // each replay equals the same calls made eagerly, bit for bit, with the queries rewritten
    // between rounds (the graph reads them where they lie).
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let layers = GEO.layers as usize;
    let mut qd = qd;
    let mut outs: Vec<_> = (0..layers)
        .map(|_| st.alloc_zeros::<f32>(hqd).unwrap())
        .collect();
    // Addresses taken before the capture: nothing but the engine's calls may touch the stream
    // while it captures.
    let ios: Vec<DeviceIo> = (0..layers)
        .map(|l| DeviceIo {
            q: ptr(&qd[l]),
            out: ptr(&outs[l]),
            lse: 0,
            tail: DeviceTail::default(),
        })
        .collect();
    st.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    let captured: Vec<_> = ios
        .iter()
        .enumerate()
        .map(|(l, &io)| enqueue(engine, l, io))
        .collect();
    let graph = st
        .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
        .unwrap()
        .expect("the step's work was captured");
    for r in captured {
        r.unwrap();
    }
    let mut last: Option<Vec<Vec<f32>>> = None;
    for round in 0..3 {
        for (l, q) in qd.iter_mut().enumerate() {
            st.memcpy_htod(&query(100 + round, l), q).unwrap();
        }
        for (l, &io) in ios.iter().enumerate() {
            enqueue(engine, l, io).unwrap();
        }
        let eager: Vec<Vec<f32>> = outs.iter().map(|o| st.clone_dtoh(o).unwrap()).collect();
        // Cleared, so each replay must write every output itself.
        for o in &mut outs {
            st.memset_zeros(o).unwrap();
        }
        graph.launch().unwrap();
        let replay: Vec<Vec<f32>> = outs.iter().map(|o| st.clone_dtoh(o).unwrap()).collect();
        for l in 0..layers {
            assert!(
                eager[l]
                    .iter()
                    .zip(&replay[l])
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "round {round} layer {l}: the graph's replay differs from the eager calls"
            );
        }
        assert_ne!(last.as_ref(), Some(&replay), "new queries, new outputs");
        last = Some(replay);
    }
    eprintln!(
        "a captured step replayed 3 times == the same device calls made eagerly, bit for bit"
    );
    drop((graph, outs));

    let stats = engine.bound_stats().unwrap();
    assert_eq!(stats.len(), GEO.layers as usize);
    engine.sync(b).unwrap();
    engine.bind(&[b]).unwrap();
    drop((od, lsed));
}

/// A device call with a tail (tokens the engine holds on the GPU) gives attention over the
/// keep-set and the tail: the call's own no-tail output and log-sum-exp merged with the tail's
/// scores and values in f64 (the oracle), for a partial and a full tail; an empty tail gives
/// the no-tail output bit for bit; a half-given or misaligned tail is a typed error.
fn device_tail_is_merged_like_the_f64_oracle(
    engine: &mut InEngine,
    st: &std::sync::Arc<cudarc::driver::CudaStream>,
    q: &[f32],
    enqueue: impl Fn(&mut InEngine, DeviceIo) -> Result<(), EngineError>,
) {
    use cudarc::driver::DevicePtr;
    use kvtier_kernels::cuda::{CudaError, DeviceTail};

    let (hq, hkv, d, bt) = (
        GEO.q_heads as usize,
        GEO.kv_heads as usize,
        GEO.head_dim as usize,
        GEO.block_tokens as usize,
    );
    let group = hq / hkv;
    // [Hkv][K, V][bt][D] bf16 (a block run's layout), random, truncated from f32.
    let mut rng = kvtier_storage::testing::Rng::new(77);
    let tail_f: Vec<f32> = rng
        .normals(hkv * 2 * bt * d)
        .iter()
        .map(|x| f32::from_bits(x.to_bits() & 0xffff_0000))
        .collect();
    let tail_bits: Vec<u16> = tail_f.iter().map(|x| (x.to_bits() >> 16) as u16).collect();
    let qd = st.clone_htod(q).unwrap();
    let kvd = st.clone_htod(&tail_bits).unwrap();
    let od = st.alloc_zeros::<f32>(hq * d).unwrap();
    let lsed = st.alloc_zeros::<f32>(hq).unwrap();
    let (qp, kvp) = (qd.device_ptr(st).0, kvd.device_ptr(st).0);
    let (op, lsep) = (od.device_ptr(st).0, lsed.device_ptr(st).0);
    // `last`: the tail's newest row, or None for a call without a tail.
    let run = |engine: &mut InEngine, last: Option<i64>| {
        let lastd = st.clone_htod(&[last.unwrap_or(0)]).unwrap();
        let tail = match last {
            None => DeviceTail::default(),
            Some(_) => DeviceTail {
                kv: kvp,
                last: lastd.device_ptr(st).0,
            },
        };
        let io = DeviceIo {
            q: qp,
            out: op,
            lse: lsep,
            tail,
        };
        enqueue(engine, io).unwrap();
        let r = (st.clone_dtoh(&od).unwrap(), st.clone_dtoh(&lsed).unwrap());
        drop(lastd);
        r
    };
    let (base, base_lse) = run(engine, None);
    let (empty, empty_lse) = run(engine, Some(-1));
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&base),
        bits(&empty),
        "an empty tail changed the output"
    );
    assert_eq!(bits(&base_lse), bits(&empty_lse));
    for last in [40i64, bt as i64 - 1] {
        let (got, got_lse) = run(engine, Some(last));
        let mut worst = 0f64;
        for h in 0..hq {
            let kvh = h / group;
            let k = |t: usize| &tail_f[((kvh * 2) * bt + t) * d..][..d];
            let v = |t: usize| &tail_f[((kvh * 2 + 1) * bt + t) * d..][..d];
            let qh = &q[h * d..][..d];
            let scores: Vec<f64> = (0..=last as usize)
                .map(|t| {
                    let dot: f64 = qh
                        .iter()
                        .zip(k(t))
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum();
                    dot / (d as f64).sqrt()
                })
                .collect();
            // Weights relative to the larger of the keep-set's log-sum-exp and the tail's
            // scores: the keep-set contributes exp(lse) * its output.
            let m = scores.iter().copied().fold(base_lse[h] as f64, f64::max);
            let w_kv = (base_lse[h] as f64 - m).exp();
            let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let total = w_kv + w.iter().sum::<f64>();
            for x in 0..d {
                let num = w_kv * base[h * d + x] as f64
                    + w.iter()
                        .enumerate()
                        .map(|(t, wt)| wt * v(t)[x] as f64)
                        .sum::<f64>();
                let want = num / total;
                worst = worst.max((got[h * d + x] as f64 - want).abs());
            }
            let want_lse = m + total.ln();
            assert!(
                (got_lse[h] as f64 - want_lse).abs() < 1e-4,
                "tail to row {last}, head {h}: lse {} != {want_lse}",
                got_lse[h]
            );
        }
        // Outputs are O(1) (values ~N(0, 1), softmax weights): an absolute bound.
        assert!(worst < 1e-4, "tail to row {last}: worst error {worst:e}");
        eprintln!("device tail to row {last}: worst error {worst:.2e} against the f64 oracle");
    }
    let half = DeviceIo {
        q: qp,
        out: op,
        lse: lsep,
        tail: DeviceTail { kv: kvp, last: 0 },
    };
    let bad_tail = |r| matches!(r, Err(EngineError::Cuda(CudaError::BadTail(_))));
    assert!(bad_tail(enqueue(engine, half)));
    let lastd = st.clone_htod(&[5i64]).unwrap();
    let misaligned = DeviceIo {
        tail: DeviceTail {
            kv: kvp + 2,
            last: lastd.device_ptr(st).0,
        },
        ..half
    };
    assert!(bad_tail(enqueue(engine, misaligned)));
}

/// Queries of the two-process test: layer `l` of session number `i`, deterministic.
fn query(i: usize, l: usize) -> Vec<f32> {
    let mut rng = kvtier_storage::testing::Rng::new(0x9e37 + (i * 31 + l) as u64);
    rng.normals((GEO.q_heads * GEO.head_dim) as usize)
}

/// Output bits of `session` at every layer, hashed (FNV-1a over the f32 bits).
fn output_hashes(e: &mut InEngine, i: usize, session: u64) -> Vec<u64> {
    (0..GEO.layers as usize)
        .map(|l| {
            let q = query(i, l);
            hash_bits(&e.decode_layer(l as u32, &[(session, &q)]).unwrap().out)
        })
        .collect()
}

/// The device of engine process number `i` of a test: one process per GPU, round robin (all on
/// device 0 on a one-GPU host, so the same tests run there).
fn device_of(i: usize) -> usize {
    i % kvtier_kernels::cuda::device_count().max(1)
}

/// The engine-process half of `engine_processes_one_per_gpu_share_one_arena`: attaches the
/// sessions named in `KVTIER_ENGINE_CHILD` (`socket device i:session ...`) on CUDA device
/// `device` and prints their hashes.
#[test]
#[ignore = "run as a child process by engine_processes_one_per_gpu_share_one_arena"]
fn engine_child() {
    let Ok(spec) = std::env::var("KVTIER_ENGINE_CHILD") else {
        return;
    };
    let mut words = spec.split_whitespace();
    let socket = words.next().unwrap().to_owned();
    let device: usize = words.next().unwrap().parse().unwrap();
    let mut e = InEngine::connect(socket.as_ref(), device, daemon_like_config()).unwrap();
    for w in words {
        let (i, s) = w.split_once(':').unwrap();
        let (i, s): (usize, u64) = (i.parse().unwrap(), s.parse().unwrap());
        e.attach(s).unwrap();
        let h = output_hashes(&mut e, i, s);
        println!("hashes {i} {h:?}");
    }
}

/// One tierd, one arena, two engine processes, each on its own GPU where the host has several
/// (both on one GPU otherwise), each decoding its own sessions in place: every output is
/// bit-identical to one engine on device 0 serving all four sessions.
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn engine_processes_one_per_gpu_share_one_arena() {
    if !kvtier_kernels::cuda::device_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    let (d, sessions) = cpu_tierd_with_sessions(4, 2000, 77);
    // One engine serving all four: the reference.
    let want: Vec<Vec<u64>> = {
        let mut e = InEngine::connect(d.path(), 0, daemon_like_config()).unwrap();
        sessions
            .iter()
            .enumerate()
            .map(|(i, &s)| {
                e.attach(s).unwrap();
                output_hashes(&mut e, i, s)
            })
            .collect()
    };
    // Two engine processes at once, two sessions each, over the same arena.
    let spawn = |device: usize, pairs: &[(usize, u64)]| {
        let mut spec = format!("{} {device}", d.path().to_str().unwrap());
        for (i, s) in pairs {
            spec.push_str(&format!(" {i}:{s}"));
        }
        spawn_child("engine_child", "KVTIER_ENGINE_CHILD", spec)
    };
    let children = [
        spawn(device_of(0), &[(0, sessions[0]), (1, sessions[1])]),
        spawn(device_of(1), &[(2, sessions[2]), (3, sessions[3])]),
    ];
    let mut seen = 0;
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "an engine process failed");
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let Some(at) = line.find("hashes ") else {
                continue;
            };
            let rest = &line[at + 7..];
            let (i, h) = rest.split_once(' ').unwrap();
            let i: usize = i.parse().unwrap();
            assert_eq!(h, format!("{:?}", want[i]), "session {i}: outputs differ");
            seen += 1;
        }
    }
    assert_eq!(
        seen, 4,
        "every session answered by one of the two processes"
    );
    eprintln!(
        "two engine processes on devices {} and {} == one engine, bit for bit",
        device_of(0),
        device_of(1)
    );
}

/// Engines of one process over one tierd share the arena's mapping and registration: a later
/// engine on the device reuses it (no cuMemHostRegister of the whole arena again), also while
/// another engine holds it, and answers bit for bit as the first did.
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn engines_of_a_process_share_the_arena_registration() {
    if !kvtier_kernels::cuda::device_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    let (d, sessions) = cpu_tierd_with_sessions(2, 2000, 91);
    let (want, first) = {
        let mut e = InEngine::connect(d.path(), 0, daemon_like_config()).unwrap();
        let want: Vec<Vec<u64>> = sessions
            .iter()
            .enumerate()
            .map(|(i, &s)| {
                e.attach(s).unwrap();
                output_hashes(&mut e, i, s)
            })
            .collect();
        assert_eq!(e.arena_reused(), Some(false));
        (want, e.registration().unwrap().1)
    };
    let mut second = InEngine::connect(d.path(), 0, daemon_like_config()).unwrap();
    second.attach(sessions[0]).unwrap();
    assert_eq!(
        second.arena_reused(),
        Some(true),
        "the first engine's arena is reused"
    );
    assert_eq!(output_hashes(&mut second, 0, sessions[0]), want[0]);
    let mut third = InEngine::connect(d.path(), 0, daemon_like_config()).unwrap();
    third.attach(sessions[1]).unwrap();
    assert_eq!(
        third.arena_reused(),
        Some(true),
        "shared while the second holds it"
    );
    assert_eq!(output_hashes(&mut third, 1, sessions[1]), want[1]);
    eprintln!(
        "arena mapped and registered once ({first:?}), then reused ({:?}, {:?}), outputs bit for bit",
        second.registration().unwrap().1,
        third.registration().unwrap().1
    );
}

/// Layer `l` of session number `i` on engine `e`: the output bits hashed (FNV-1a) and the
/// keep-sets, for the query heads of `e`'s shard (the whole query for a whole engine).
fn shard_layer(e: &mut InEngine, i: usize, session: u64, l: usize) -> (u64, Vec<Vec<u32>>) {
    let g = e.config().geometry;
    let per = (g.q_heads * g.head_dim) as usize;
    let rank = e.shard().rank as usize;
    let q = query(i, l);
    let out = e
        .decode_layer(l as u32, &[(session, &q[rank * per..(rank + 1) * per])])
        .unwrap();
    let keep = e.last_keep_sets(l as u32).unwrap().remove(0);
    (hash_bits(&out.out), keep)
}

fn hash_bits(v: &[f32]) -> u64 {
    v.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, x| {
        (h ^ u64::from(x.to_bits())).wrapping_mul(0x100_0000_01b3)
    })
}

/// The engine-process half of `head_shards_in_separate_processes_equal_the_whole_engine`:
/// `KVTIER_SHARD_CHILD` = `socket rank world i:session ...`; runs on device `device_of(rank)`
/// and prints each layer's hash and keep-sets.
#[test]
#[ignore = "run as a child process by head_shards_in_separate_processes_equal_the_whole_engine"]
fn shard_child() {
    let Ok(spec) = std::env::var("KVTIER_SHARD_CHILD") else {
        return;
    };
    let mut words = spec.split_whitespace();
    let socket = words.next().unwrap().to_owned();
    let rank: u32 = words.next().unwrap().parse().unwrap();
    let world: u32 = words.next().unwrap().parse().unwrap();
    let shard = HeadShard { rank, world };
    let device = device_of(rank as usize);
    let mut e =
        InEngine::connect_shard(socket.as_ref(), device, daemon_like_config(), shard).unwrap();
    for w in words {
        let (i, s) = w.split_once(':').unwrap();
        let (i, s): (usize, u64) = (i.parse().unwrap(), s.parse().unwrap());
        e.attach(s).unwrap();
        for l in 0..GEO.layers as usize {
            let (h, keep) = shard_layer(&mut e, i, s, l);
            println!("shard {i} {l} {h} {keep:?}");
        }
    }
}

/// Tensor parallelism over KV heads: engine processes that each attend a shard of every
/// session's heads (2 and 4 shards of Qwen2.5-7B's 4 KV heads, all processes at once, rank r on
/// GPU r mod the host's GPUs, each with its own registration of the arena) give, per shard, the
/// whole engine's (on device 0) keep-sets of those heads and its output for those query heads,
/// bit for bit. A shard that does not divide the heads is a typed error.
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn head_shards_in_separate_processes_equal_the_whole_engine() {
    if !kvtier_kernels::cuda::device_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    let (d, sessions) = cpu_tierd_with_sessions(2, 3000, 301);
    let bad = HeadShard { rank: 0, world: 3 };
    assert!(matches!(
        InEngine::connect_shard(d.path(), 0, daemon_like_config(), bad),
        Err(EngineError::Shard {
            world: 3,
            kv_heads: 4,
            ..
        })
    ));
    // The whole engine: each layer's output split by shard of query heads, and keep-sets.
    let hq = (GEO.q_heads * GEO.head_dim) as usize;
    let mut whole = InEngine::connect(d.path(), 0, daemon_like_config()).unwrap();
    let mut want = Vec::new(); // (i, l, out, keep)
    for (i, &s) in sessions.iter().enumerate() {
        whole.attach(s).unwrap();
        for l in 0..GEO.layers as usize {
            let out = whole
                .decode_layer(l as u32, &[(s, &query(i, l))])
                .unwrap()
                .out;
            assert_eq!(out.len(), hq);
            let keep = whole.last_keep_sets(l as u32).unwrap().remove(0);
            want.push((i, l, out, keep));
        }
    }
    drop(whole);
    for world in [2u32, 4] {
        let children: Vec<_> = (0..world)
            .map(|rank| {
                let mut spec = format!("{} {rank} {world}", d.path().to_str().unwrap());
                for (i, s) in sessions.iter().enumerate() {
                    spec.push_str(&format!(" {i}:{s}"));
                }
                spawn_child("shard_child", "KVTIER_SHARD_CHILD", spec)
            })
            .collect();
        let mut seen = 0;
        for (rank, child) in children.into_iter().enumerate() {
            let out = child.wait_with_output().unwrap();
            assert!(out.status.success(), "shard {rank} of {world} failed");
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                let Some(at) = line.find("shard ") else {
                    continue;
                };
                let mut f = line[at + 6..].splitn(4, ' ');
                let i: usize = f.next().unwrap().parse().unwrap();
                let l: usize = f.next().unwrap().parse().unwrap();
                let h: u64 = f.next().unwrap().parse().unwrap();
                let keep = f.next().unwrap();
                let (_, _, full, full_keep) = want.iter().find(|w| w.0 == i && w.1 == l).unwrap();
                let (per_q, per_kv) = (hq / world as usize, (GEO.kv_heads / world) as usize);
                let part = &full[rank * per_q..(rank + 1) * per_q];
                assert_eq!(
                    h,
                    hash_bits(part),
                    "world {world} rank {rank} session {i} layer {l}"
                );
                let kv = &full_keep[rank * per_kv..(rank + 1) * per_kv];
                assert_eq!(
                    keep,
                    format!("{kv:?}"),
                    "keep-sets, world {world} rank {rank}"
                );
                seen += 1;
            }
        }
        assert_eq!(seen, world as usize * sessions.len() * GEO.layers as usize);
        let devices: Vec<usize> = (0..world as usize).map(device_of).collect();
        eprintln!("{world} head shards on devices {devices:?} == the whole engine, bit for bit");
    }
}

/// The engine-process half of `an_engine_killed_mid_step_leaves_tierd_serving`:
/// `KVTIER_LOOP_CHILD` = `socket session`; decodes every layer in a loop until killed.
#[test]
#[ignore = "run as a child process by an_engine_killed_mid_step_leaves_tierd_serving"]
fn decode_loop_child() {
    let Ok(spec) = std::env::var("KVTIER_LOOP_CHILD") else {
        return;
    };
    let (socket, s) = spec.split_once(' ').unwrap();
    let s: u64 = s.parse().unwrap();
    let mut e = InEngine::connect(socket.as_ref(), 0, daemon_like_config()).unwrap();
    e.attach(s).unwrap();
    let hqd = (GEO.q_heads * GEO.head_dim) as usize * GEO.layers as usize;
    let q = vec![0.5f32; hqd];
    for step in 0u64.. {
        e.decode_step(&[(s, &q)]).unwrap();
        if step == 3 {
            println!("decoding");
        }
    }
}

/// An engine process SIGKILLed while it decodes (its lease held, its device busy over the
/// arena) leaves tierd serving: the lease ends with the connection, so the session can be
/// demoted and promoted again; DECODEs of another session go on matching the oracle, and a new
/// engine decodes the session.
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn an_engine_killed_mid_step_leaves_tierd_serving() {
    use std::io::{BufRead, BufReader};
    use std::os::unix::process::ExitStatusExt;

    if !kvtier_kernels::cuda::device_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    let d = cuda_tierd(None);
    let mut c = d.client();
    let leased = c.create_session(GEO, policy(), "leased").unwrap();
    let other = c.create_session(GEO, policy(), "other").unwrap();
    let mut sh = Shadow::new(GEO, 4242);
    let p = sh.payload(2000);
    c.append_kv(leased, 0, 2000, &p).unwrap();
    c.append_kv(other, 0, 2000, &p).unwrap();
    let spec = format!("{} {leased}", d.path().to_str().unwrap());
    let mut child = spawn_child("decode_loop_child", "KVTIER_LOOP_CHILD", spec);
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(
        lines.any(|l| l.unwrap().contains("decoding")),
        "the engine process never decoded"
    );
    // While it holds the lease, tierd refuses to move the session's runs.
    assert!(c.demote(leased).is_err(), "DEMOTE of a leased session");
    std::thread::sleep(std::time::Duration::from_millis(100));
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(9), "killed mid-step, not exited");
    // The lease ended with the engine's connection.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        match c.demote(leased) {
            Ok(_) => break,
            Err(e) if std::time::Instant::now() < deadline => {
                eprintln!("demote not yet: {e}");
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            Err(e) => panic!("the dead engine's lease was never reclaimed: {e}"),
        }
    }
    c.promote(leased).unwrap();
    // tierd serves: DECODEs of the other session match the oracle.
    for l in 0..GEO.layers as usize {
        let (q, k, v) = sh.step_input(l);
        let pos = sh.tokens(l) - 1;
        let out = c
            .decode(l as u32, entry(other, pos, &f32_bytes(&q), &k, &v), true)
            .unwrap();
        sh.check(l, &q, &out);
    }
    // And a new engine decodes the session the dead one held.
    let mut e = InEngine::connect(d.path(), 0, daemon_like_config()).unwrap();
    e.attach(leased).unwrap();
    let q = vec![0.25f32; (GEO.q_heads * GEO.head_dim) as usize];
    let out = e.decode_layer(0, &[(leased, &q)]).unwrap();
    assert!(out.out.iter().all(|x| x.is_finite()));
}

/// Attaching a session of a tierd that does not share its arena is tierd's own refusal
/// (FAILED_PRECONDITION naming `host.shared`), and leaves the engine usable.
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn attach_without_a_shared_arena_is_the_daemons_typed_error() {
    if !kvtier_kernels::cuda::device_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    let d = Tierd::builder(bins::tierd())
        .host_capacity("1GiB")
        .args(["--backend", "cpu"])
        .start();
    let mut c = d.client();
    let s = c.create_session(GEO, policy(), "private").unwrap();
    c.append_kv(s, 0, 500, &Shadow::new(GEO, 5).payload(500))
        .unwrap();
    let mut e = InEngine::connect(d.path(), 0, daemon_like_config()).unwrap();
    for _ in 0..2 {
        match e.attach(s) {
            Err(EngineError::Daemon(err)) => {
                assert!(err.to_string().contains("host.shared"), "{err}")
            }
            other => panic!("expected tierd's refusal, got {other:?}"),
        }
    }
    assert_eq!(e.slot(s), None);
}
