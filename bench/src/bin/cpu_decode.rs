//! CPU decode step, sparse vs dense, in one run: Qwen2.5-7B attention geometry, all 28 layers.
//!
//! cargo run --release -p kvtier-bench --bin cpu_decode -- [--contexts 8192,32768,131072]
//!     [--steps 15] [--dense-steps 3] [--json FILE]
//!
//! Per context it builds a session of that many random bf16 tokens in a host arena, then times
//! full decode steps (28 layers of append + select + attend, batch 1): sparse with k=32, sink 1,
//! local 4, and dense (every block selected) through the same kernels. Prints medians, bytes
//! read per step (summaries + selected K/V rows) and the achieved read bandwidth.

use std::time::{Duration, Instant};

use kvtier_bench::{
    cpu_description, decode_step, each_flag, fill_bf16, gbps, median, process_cpu_time,
};
use kvtier_storage::testing::Rng;
use kvtier_storage::{ArenaOptions, Geometry, HostArena, KvCache, Policy};

struct Args {
    contexts: Vec<u64>,
    steps: usize,
    dense_steps: usize,
    json: Option<String>,
}

fn parse_args() -> Args {
    let mut a = Args {
        contexts: vec![8192, 32768, 131072],
        steps: 15,
        dense_steps: 3,
        json: None,
    };
    each_flag(|flag, val| match flag {
        "--contexts" => {
            a.contexts = val()
                .split(',')
                .map(|s| s.parse().expect("--contexts: integers"))
                .collect()
        }
        "--steps" => a.steps = val().parse().expect("--steps: integer"),
        "--dense-steps" => a.dense_steps = val().parse().expect("--dense-steps: integer"),
        "--json" => a.json = Some(val()),
        other => panic!("unknown flag {other}"),
    });
    a
}

struct Row {
    context: u64,
    mode: &'static str,
    step: Duration,
    cpu: Duration,
    bytes: u64,
    tiles: u64,
}

/// Times `steps` decode steps of all layers; returns (median wall time, median CPU time, bytes
/// read, tiles per step).
fn run_steps(
    kv: &mut KvCache,
    policy: Policy,
    steps: usize,
    rng: &mut Rng,
) -> (Duration, Duration, u64, u64) {
    let mut times = Vec::new();
    let mut cpu = Vec::new();
    let (mut bytes, mut tiles) = (0, 0);
    for _ in 0..steps {
        let (t0, c0) = (Instant::now(), process_cpu_time());
        let stats = decode_step(kv, policy, None, rng);
        times.push(t0.elapsed());
        cpu.push(process_cpu_time() - c0);
        bytes = stats.iter().map(|s| s.bytes_touched).sum();
        tiles = stats.iter().map(|s| s.tiles_selected as u64).sum();
    }
    (median(&mut times), median(&mut cpu), bytes, tiles)
}

fn main() {
    let args = parse_args();
    let g = Geometry::QWEN2_5_7B;
    // Sink 1, local 4, top-32.
    let sparse = Policy::default();
    let dense = Policy {
        sink_blocks: 0,
        local_blocks: 1,
        top_k: u32::MAX >> 12,
    };
    println!("kvtier cpu_decode: Qwen2.5-7B attention geometry (28 layers, 28/4 heads, D=128, bf16, B=128), batch 1");
    println!("machine: {}", cpu_description());
    println!(
        "command: cargo run --release -p kvtier-bench --bin cpu_decode -- {}",
        std::env::args().skip(1).collect::<Vec<_>>().join(" ")
    );
    let mut rows = Vec::new();
    let mut rng = Rng::new(0x5EED);
    for &ctx in &args.contexts {
        let extra = (args.steps + args.dense_steps) as u64 + g.block_tokens as u64;
        let frames = g.blocks_for(ctx + extra) as usize * g.layers as usize;
        let arena = HostArena::new(&ArenaOptions::new(
            frames * g.block_bytes(),
            g.block_bytes(),
        ))
        .expect("arena");
        let mut kv = KvCache::new(g, arena).unwrap();
        let t0 = Instant::now();
        let chunk = 2048u64;
        let mut payload = vec![0u8; chunk as usize * g.kv_bytes_per_token()];
        let mut at = 0;
        while at < ctx {
            let n = chunk.min(ctx - at);
            let p = &mut payload[..n as usize * g.kv_bytes_per_token()];
            fill_bf16(&mut rng, p);
            kv.append(at, n, p).unwrap();
            at += n;
        }
        eprintln!(
            "context {ctx}: built {:.1} GB in {:.1?}",
            kv.host_bytes() as f64 / 1e9,
            t0.elapsed()
        );
        let (t, c, b, n) = run_steps(&mut kv, sparse, args.steps, &mut rng);
        rows.push(Row {
            context: ctx,
            mode: "sparse k=32",
            step: t,
            cpu: c,
            bytes: b,
            tiles: n,
        });
        let (t, c, b, n) = run_steps(&mut kv, dense, args.dense_steps, &mut rng);
        rows.push(Row {
            context: ctx,
            mode: "dense",
            step: t,
            cpu: c,
            bytes: b,
            tiles: n,
        });
    }
    println!();
    println!(
        "{:>8}  {:<12} {:>10} {:>10} {:>8} {:>12} {:>7} {:>8}",
        "context", "mode", "wall ms", "cpu ms", "tiles", "bytes read", "GB/s", "speedup"
    );
    let mut json = Vec::new();
    for pair in rows.chunks(2) {
        let speedup = pair[1].step.as_secs_f64() / pair[0].step.as_secs_f64();
        for r in pair {
            let &Row {
                context,
                mode,
                tiles,
                bytes,
                ..
            } = r;
            let (ms, cpu_ms) = (r.step.as_secs_f64() * 1e3, r.cpu.as_secs_f64() * 1e3);
            let gb = gbps(bytes, r.step);
            let s = if mode == "dense" {
                String::from("1.0x")
            } else {
                format!("{speedup:.1}x")
            };
            println!(
                "{context:>8}  {mode:<12} {ms:>10.2} {cpu_ms:>10.2} {tiles:>8} {bytes:>12} {gb:>7.2} {s:>8}"
            );
            json.push(format!(
                "{{\"context\":{context},\"mode\":\"{mode}\",\"step_ms\":{ms:.3},\"cpu_ms\":{cpu_ms:.3},\"tiles\":{tiles},\"bytes_read\":{bytes},\"gbps\":{gb:.3}}}"
            ));
        }
    }
    if let Some(path) = args.json {
        std::fs::write(&path, format!("[{}]\n", json.join(",\n"))).expect("write json");
        println!("wrote {path}");
    }
}
