//! The main job end to end: start tierd on embedded defaults (CPU backend), load a synthetic
//! long-context session with a planted "needle" key, decode, and show per step the keep-set,
//! the bytes touched, whether the needle's block was selected, and the speed against dense.
//!
//!     scripts/demo.sh [--context 32768] [--steps 6] [--layers 28]
//!
//! Two sessions hold the same KV: one with the sparse policy (sink 1, local 4, top-32), one
//! dense (every block). Each step sends the same query and new token to both, all layers.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvtier_bench::daemon::Daemon;
use kvtier_bench::{cpu_description, each_flag, fill_bf16, parse_flag, usage_error};
use kvtier_protocol::client::Client;
use kvtier_protocol::{DType, DecodeEntryRef, Geometry, Policy};
use kvtier_storage::testing::Rng;

struct Args {
    context: u64,
    steps: usize,
    layers: u32,
    tierd: Option<PathBuf>,
}

fn parse_args() -> Args {
    let mut a = Args {
        context: 32768,
        steps: 6,
        layers: 28,
        tierd: None,
    };
    each_flag(|flag, val| match flag {
        "--context" => a.context = parse_flag(flag, &val(), "a token count"),
        "--steps" => a.steps = parse_flag(flag, &val(), "a step count"),
        "--layers" => a.layers = parse_flag(flag, &val(), "a layer count"),
        "--tierd" => a.tierd = Some(val().into()),
        "-h" | "--help" => {
            println!(
                "usage: kvtier_demo [--context TOKENS] [--steps N] [--layers L] [--tierd PATH]

Starts tierd on embedded defaults (a private socket and state directory, removed after),
loads one synthetic long-context session twice -- once under the sparse default policy, once
attending every block (the dense oracle) -- with a planted needle key, then decodes and prints
per step the sparse and dense times, the tiles kept, the bytes touched, whether the needle's
block was kept, and how far the sparse output is from the dense one.

  --context TOKENS  tokens per session (default 32768)
  --steps N         decode steps (default 6)
  --layers L        layers of the Qwen2.5-7B attention geometry (default 28)
  --tierd PATH      the tierd binary (default: next to this one)"
            );
            std::process::exit(0);
        }
        other => usage_error(format!("unknown flag {other} (try --help)")),
    });
    a
}

fn start_tierd(path: &Path) -> Daemon {
    // Embedded defaults: only the socket and the NVMe state directory are private, so the demo
    // never meets a system tierd or its sessions.
    Daemon::spawn(path, "kvtier-demo-", |cmd, dir| {
        cmd.arg("--set").arg(format!(
            "nvme.dir={:?}",
            dir.join("state").to_str().unwrap()
        ));
    })
    .unwrap_or_else(|e| panic!("{e}"))
}

fn main() {
    let args = parse_args();
    let tierd = args
        .tierd
        .clone()
        .unwrap_or_else(|| std::env::current_exe().unwrap().with_file_name("tierd"));
    let g = Geometry {
        layers: args.layers,
        ..Geometry::QWEN2_5_7B
    };
    // Sink 1, local 4, top-32.
    let sparse_policy = Policy::default();
    let dense_policy = Policy::bound(0, 1, 1 << 20);
    println!(
        "kvtier demo: tierd on embedded defaults (CPU backend unless a CUDA device is present) serving a {}-token session",
        args.context
    );
    println!("geometry: {} layers, 28 query / 4 KV heads, D=128, bf16, 128-token blocks (Qwen2.5-7B attention)", g.layers);
    println!("machine: {}", cpu_description());
    let daemon = start_tierd(&tierd);
    let mut c = Client::connect(daemon.socket()).expect("connect");
    println!(
        "connected: {} {}",
        c.server().server_name,
        c.server().server_version
    );
    let sparse = c
        .create_session(g, sparse_policy, "demo-sparse")
        .expect("create");
    let dense = c
        .create_session(g, dense_policy, "demo-dense")
        .expect("create");

    // The needle: one key of kv head 0 at a distant position, aligned with a fixed direction u
    // that the queries of head group 0 also lean towards.
    let mut rng = Rng::new(2026);
    let d = 128usize;
    let u: Vec<f32> = {
        let v = rng.normals(d);
        let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        v.iter().map(|x| x / n).collect()
    };
    let needle_pos = args.context / 3 + 17;
    let needle_block = (needle_pos / 128) as u32;
    let row = g.kv_heads as usize * d * 2;
    let chunk = 2048u64;
    println!(
        "loading the same {} tokens into 2 sessions: sparse (the default policy: sink 1, local 4, top-{} by the sketch selector) and dense (every block: the oracle) ...",
        args.context, sparse_policy.top_k
    );
    let t0 = Instant::now();
    let mut payload = Vec::new();
    let mut at = 0;
    while at < args.context {
        let n = chunk.min(args.context - at);
        payload.resize(n as usize * row * 2 * g.layers as usize, 0);
        fill_bf16(&mut rng, &mut payload);
        if (at..at + n).contains(&needle_pos) {
            let t = (needle_pos - at) as usize;
            let key = DType::Bf16.encode_vec(&u.iter().map(|x| x * 64.0).collect::<Vec<_>>());
            for layer in 0..g.layers as usize {
                // Layer l's K block starts at 2*l*n*row; kv head 0 is the row's first D values.
                let off = 2 * layer * n as usize * row + t * row;
                payload[off..off + d * 2].copy_from_slice(&key);
            }
        }
        for s in [sparse, dense] {
            c.append_kv_shm(s, at, n as u32, &payload).expect("append");
        }
        at += n;
    }
    let gb = 2.0 * args.context as f64 * (row * 2 * g.layers as usize) as f64 / 1e9;
    println!(
        "loaded 2 x {} tokens ({gb:.1} GB of KV) through shared memory in {:.1?}; needle at token {needle_pos} (block {needle_block}, kv head 0)",
        args.context,
        t0.elapsed()
    );
    println!();
    println!("per step, over all layers: tiles/layer = (block, kv head) tiles the sparse step kept; needle found = layers whose keep-set held the needle's block; max diff = largest |sparse - dense| output of the needle's query heads, the sparse step's error (0 when the kept tiles hold all of the attention)");
    println!(
        "{:>4}  {:>12} {:>11} {:>8}  {:>15} {:>13}  {:>14}  {:>10}",
        "step",
        "sparse ms",
        "dense ms",
        "speedup",
        "tiles/layer",
        "MB touched",
        "needle found",
        "max diff"
    );
    let mut speedups = Vec::new();
    for step in 0..args.steps {
        let q: Vec<f32> = (0..28 * d)
            .map(|i| {
                let noise = rng.normal() * 0.5;
                // Heads 0..7 (kv head 0's group) look for the needle.
                if i / d < 7 {
                    noise + 4.0 * u[i % d]
                } else {
                    noise
                }
            })
            .collect();
        let qb: Vec<u8> = q.iter().flat_map(|x| x.to_le_bytes()).collect();
        let mut kv = vec![0u8; 2 * row];
        let (mut t_sparse, mut t_dense) = (Duration::ZERO, Duration::ZERO);
        let (mut tiles, mut touched, mut found, mut diff) = (0u64, 0u64, 0u32, 0f32);
        let pos = args.context + step as u64;
        for layer in 0..g.layers {
            fill_bf16(&mut rng, &mut kv);
            let (k, v) = kv.split_at(row);
            // One session's decode of this layer's token, its wall time added to `total`.
            let mut timed = |session, want_stats, total: &mut Duration, what: &str| {
                let t = Instant::now();
                let entry = DecodeEntryRef {
                    session,
                    position: pos,
                    q: &qb,
                    k,
                    v,
                };
                let out = c
                    .decode(layer, entry, want_stats)
                    .unwrap_or_else(|e| panic!("{what} decode: {e:?}"));
                *total += t.elapsed();
                out
            };
            let s = timed(sparse, true, &mut t_sparse, "sparse");
            let o = timed(dense, false, &mut t_dense, "dense");
            let st = s.stats.expect("stats");
            tiles += st.blocks_selected as u64;
            touched += st.bytes_touched;
            found += st.selected[0].contains(&needle_block) as u32;
            // How far the sparse answer is from exact dense attention (heads of the needle group).
            for (a, b) in s.out.iter().zip(&o.out).take(7 * d) {
                diff = diff.max((a - b).abs());
            }
        }
        let speedup = t_dense.as_secs_f64() / t_sparse.as_secs_f64();
        speedups.push(speedup);
        println!(
            "{:>4}  {:>12.1} {:>11.1} {:>7.1}x  {:>15} {:>13.1}  {:>11}/{:<2}  {:>10.2e}",
            step,
            t_sparse.as_secs_f64() * 1e3,
            t_dense.as_secs_f64() * 1e3,
            speedup,
            tiles / g.layers as u64,
            touched as f64 / 1e6,
            found,
            g.layers,
            diff
        );
    }
    speedups.sort_by(f64::total_cmp);
    let blocks = args.context.div_ceil(128);
    println!();
    println!(
        "median speedup of the sparse step over dense: {:.1}x ({} of {} blocks per kv head attended)",
        speedups[speedups.len() / 2],
        (sparse_policy.sink_blocks + sparse_policy.local_blocks + sparse_policy.top_k).min(blocks as u32),
        blocks
    );
    let info = c.session_info(sparse).expect("info");
    println!(
        "session {}: {} tokens, {} blocks, {:.1} MB in the host tier",
        info.session,
        info.tokens_max,
        info.blocks,
        info.host_bytes as f64 / 1e6
    );
    for s in [sparse, dense] {
        c.close(s).expect("close");
    }
    drop(c);
    drop(daemon);
}
