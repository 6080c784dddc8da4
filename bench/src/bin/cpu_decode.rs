//! CPU decode step, sparse vs dense, in one run: Qwen2.5-7B attention geometry, all 28 layers.
//!
//! cargo run --release -p kvtier-bench --bin cpu_decode -- [--contexts 8192,32768,131072]
//!     [--modes sketch:32,bound:32,dense] [--steps 15] [--dense-steps 3] [--block-tokens 128]
//!     [--json FILE]
//!
//! Per context it builds a session of that many random bf16 tokens in a host arena, then times
//! full decode steps (28 layers of append + select + attend, batch 1) of each mode in turn, all
//! through the same kernels: `sketch:K[:C]` (the sketch selector, top-K, C candidates, default
//! the daemon's; `all` scores every block), `bound:K` (the key-bound selector), a sink of 128
//! tokens and a local window of 512 for both (1 and 4 blocks of the default 128 tokens), and
//! `dense` (every block selected). Prints medians, bytes read per step
//! (summaries, sketches scored, selected K/V rows), the achieved read bandwidth and each mode's
//! speedup over dense.

use std::time::{Duration, Instant};

use kvtier_bench::{
    cpu_description, decode_step, each_flag, fill_bf16, gbps, median, process_cpu_time,
};
use kvtier_storage::testing::Rng;
use kvtier_storage::{ArenaOptions, Geometry, HostArena, KvCache, Policy};

struct Args {
    contexts: Vec<u64>,
    modes: Vec<(String, Policy)>,
    block_tokens: u32,
    steps: usize,
    dense_steps: usize,
    json: Option<String>,
}

fn parse_args() -> Args {
    let mut specs = String::from("sketch:32,bound:32,dense");
    let mut a = Args {
        contexts: vec![8192, 32768, 131072],
        modes: Vec::new(),
        block_tokens: Geometry::QWEN2_5_7B.block_tokens,
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
        "--modes" => specs = val(),
        "--block-tokens" => {
            a.block_tokens = val().parse().expect("--block-tokens: integer");
            assert!(
                a.block_tokens > 0 && 512 % a.block_tokens == 0,
                "--block-tokens: a divisor of 512"
            );
        }
        "--steps" => a.steps = val().parse().expect("--steps: integer"),
        "--dense-steps" => a.dense_steps = val().parse().expect("--dense-steps: integer"),
        "--json" => a.json = Some(val()),
        other => kvtier_bench::usage_error(format!("unknown flag {other}")),
    });
    a.modes = specs.split(',').map(|m| mode(m, a.block_tokens)).collect();
    a
}

/// A mode's name and policy in blocks of `bt` tokens: `dense`, `bound:K` or `sketch:K[:C]` (C a
/// count or `all`).
fn mode(spec: &str, bt: u32) -> (String, Policy) {
    let (sink, local) = (128u32.div_ceil(bt), 512 / bt);
    let parts: Vec<&str> = spec.split(':').collect();
    let num = |s: &str| -> u32 {
        if s == "all" {
            kvtier_storage::geometry::MAX_POLICY_BLOCKS
        } else {
            s.parse()
                .unwrap_or_else(|_| panic!("--modes: {spec:?}: {s:?} is not a count"))
        }
    };
    let policy = match parts[..] {
        ["dense"] => Policy::bound(0, 1, u32::MAX >> 12),
        ["bound", k] => Policy::bound(sink, local, num(k)),
        ["sketch", k] => Policy::sketch(
            sink,
            local,
            num(k),
            kvtier_storage::geometry::DEFAULT_CANDIDATES,
        ),
        ["sketch", k, c] => Policy::sketch(sink, local, num(k), num(c)),
        _ => panic!("--modes: {spec:?} is not dense, bound:K or sketch:K[:C]"),
    };
    (spec.to_string(), policy)
}

struct Row {
    context: u64,
    mode: String,
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
    let g = Geometry {
        block_tokens: args.block_tokens,
        ..Geometry::QWEN2_5_7B
    };
    println!(
        "kvtier cpu_decode: Qwen2.5-7B attention geometry (28 layers, 28/4 heads, D=128, bf16, B={}), batch 1",
        g.block_tokens
    );
    println!("machine: {}", cpu_description());
    println!(
        "command: cargo run --release -p kvtier-bench --bin cpu_decode -- {}",
        std::env::args().skip(1).collect::<Vec<_>>().join(" ")
    );
    let mut rows = Vec::new();
    let mut rng = Rng::new(0x5EED);
    for &ctx in &args.contexts {
        let steps: usize = args
            .modes
            .iter()
            .map(|(name, _)| {
                if name == "dense" {
                    args.dense_steps
                } else {
                    args.steps
                }
            })
            .sum();
        let extra = steps as u64 + g.block_tokens as u64;
        let extents = g.blocks_for(ctx + extra) as usize * g.layers as usize;
        let arena = HostArena::new(&ArenaOptions::new(
            extents * g.block_bytes(),
            g.block_bytes(),
        ))
        .expect("arena");
        let sketches = args.modes.iter().any(|(_, p)| p.selector.needs_sketches());
        let mut kv = KvCache::new_with(g, arena, sketches).unwrap();
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
            "context {ctx}: built {:.1} GB (+{:.2} GB of key sketches) in {:.1?}",
            kv.host_bytes() as f64 / 1e9,
            kv.sketch_bytes() as f64 / 1e9,
            t0.elapsed()
        );
        for (name, policy) in &args.modes {
            let n = if name == "dense" {
                args.dense_steps
            } else {
                args.steps
            };
            let (t, c, b, tiles) = run_steps(&mut kv, *policy, n, &mut rng);
            rows.push(Row {
                context: ctx,
                mode: name.clone(),
                step: t,
                cpu: c,
                bytes: b,
                tiles,
            });
        }
    }
    println!();
    println!(
        "{:>8}  {:<16} {:>10} {:>10} {:>8} {:>12} {:>7} {:>14}",
        "context", "mode", "wall ms", "cpu ms", "tiles", "bytes read", "GB/s", "vs dense"
    );
    let mut json = Vec::new();
    for r in &rows {
        let dense = rows
            .iter()
            .find(|d| d.context == r.context && d.mode == "dense");
        let Row {
            context,
            mode,
            tiles,
            bytes,
            ..
        } = r;
        let (ms, cpu_ms) = (r.step.as_secs_f64() * 1e3, r.cpu.as_secs_f64() * 1e3);
        let gb = gbps(*bytes, r.step);
        let s = dense.map_or(String::from("-"), |d| {
            format!("{:.1}x faster", d.step.as_secs_f64() / r.step.as_secs_f64())
        });
        println!(
            "{context:>8}  {mode:<16} {ms:>10.2} {cpu_ms:>10.2} {tiles:>8} {bytes:>12} {gb:>7.2} {s:>14}"
        );
        json.push(format!(
            "{{\"context\":{context},\"mode\":\"{mode}\",\"step_ms\":{ms:.3},\"cpu_ms\":{cpu_ms:.3},\"tiles\":{tiles},\"bytes_read\":{bytes},\"gbps\":{gb:.3}}}"
        ));
    }
    if let Some(path) = args.json {
        std::fs::write(&path, format!("[{}]\n", json.join(",\n"))).expect("write json");
        println!("wrote {path}");
    }
}
