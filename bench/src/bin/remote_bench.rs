//! The remote tier on a Redis Cluster it starts on loopback (3 masters, 3 replicas;
//! `redis-server` and `redis-cli` on PATH), Qwen2.5-7B attention geometry (28 layers, 4 KV
//! heads of 128, bf16, 128-token blocks: 256 KiB block runs):
//! 1. the cluster's own figure: `redis-benchmark --cluster` SET and GET of 256 KiB values;
//! 2. a bulk write and read of one session through `ClusterStore` in process (the floor of an
//!    offload and of a whole-session pull: every page pipelined, `WAIT 1` after the write);
//! 3. through two tierd nodes: a session built on node A and offloaded, then the time from the
//!    first request on node B to its decoded token (the resume: claim, pull every page,
//!    rebuild tiles and bounds, then the step), against the rest of that step and a second
//!    step, alternating nodes each round.
//!
//! `cargo build --release -p tierd -p kvtier-bench --bin remote_bench`, then
//! `target/release/remote_bench --tokens 32768 --rounds 3`.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use clap::Parser;
use kvtier_bench::daemon::{find_tierd, BoxError, Daemon};
use kvtier_bench::median;
use kvtier_protocol::client::Client;
use kvtier_protocol::{DType, DecodeEntryRef, Geometry, Policy};
use kvtier_remote::{ClusterConfig, ClusterStore, RemoteStore};
use kvtier_storage::nvme::manifest::{GeometryRecord, PolicyRecord, SessionRecord};
use kvtier_storage::nvme::BlockRun;
use kvtier_storage::testing::Rng;
use kvtier_tests::redis::RedisCluster;

#[derive(Parser)]
#[command(about = "the remote tier: cluster throughput, offload and resume on another node")]
struct Args {
    /// Tokens of the benchmark session (57,344 bytes of KV each).
    #[arg(long, default_value_t = 32768)]
    tokens: u32,
    /// Rounds of each measurement (medians are reported).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// The tierd binary (default: next to this one, else on PATH).
    #[arg(long)]
    tierd: Option<PathBuf>,
}

const GEOMETRY: Geometry = Geometry::new(28, 28, 4, 128, DType::Bf16, 128);

fn gb_s(bytes: u64, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

/// `redis-benchmark --cluster` of `op` (SET or GET) on 256 KiB values: GB/s.
fn redis_benchmark(port: u16, op: &str) -> Result<f64, BoxError> {
    let out = Command::new("redis-benchmark")
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "--cluster",
            "-q",
        ])
        .args([
            "-t", op, "-d", "262144", "-n", "2000", "-c", "8", "-r", "1000",
        ])
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    // "SET: 1234.56 requests per second, p50=..."
    let rps: f64 = text
        .split(['\r', '\n'])
        .filter_map(|l| l.trim().strip_prefix(&format!("{}: ", op.to_uppercase())))
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .next_back()
        .ok_or_else(|| format!("no {op} figure in redis-benchmark's output: {text}"))?;
    Ok(rps * 262_144.0 / 1e9)
}

fn record(id: u64, tokens: u32) -> SessionRecord {
    SessionRecord {
        id,
        owner_uid: 0,
        label: "bench".into(),
        geometry: GeometryRecord::from(&GEOMETRY),
        policy: PolicyRecord::from(&Policy::default()),
        layer_tokens: vec![tokens as u64; GEOMETRY.layers as usize],
        pages: Vec::new(),
        pinned: false,
        created_unix_ms: 0,
    }
}

/// One APPEND_KV payload of `n` tokens: every layer's K rows, then its V rows.
fn payload(n: usize, rng: &mut Rng) -> Vec<u8> {
    let g = GEOMETRY;
    let mut out = Vec::new();
    for _ in 0..g.layers {
        for _ in 0..2 {
            out.extend(
                g.dtype
                    .encode_vec(&rng.normals(n * (g.kv_heads * g.head_dim) as usize)),
            );
        }
    }
    out
}

fn main() -> Result<(), BoxError> {
    let args = Args::parse();
    let cluster = RedisCluster::start(3, 1).ok_or("redis-server is not installed")?;
    let masters = cluster.masters();
    let bytes = args.tokens as u64 * GEOMETRY.kv_bytes_per_token() as u64;
    println!(
        "remote_bench: Qwen2.5-7B geometry, {} tokens ({:.2} GB of KV), cluster 3 masters + 3 replicas on loopback",
        args.tokens,
        bytes as f64 / 1e9
    );

    // 1. The cluster's own figure.
    let set = redis_benchmark(masters[0], "set")?;
    let get = redis_benchmark(masters[0], "get")?;
    println!("redis-benchmark --cluster, 256 KiB values, 8 clients: SET {set:.2} GB/s, GET {get:.2} GB/s");

    // 2. Bulk write and read in process.
    let store = ClusterStore::connect(ClusterConfig {
        seeds: cluster.seeds(),
        // Nothing renews this claim (a node renews its own every third of the TTL): long
        // enough for the largest write.
        claim_ttl: Duration::from_secs(600),
        ..ClusterConfig::default()
    })?;
    let blocks = GEOMETRY.blocks_for(args.tokens as u64) as u32;
    let run = vec![0x3cu8; GEOMETRY.block_bytes()];
    let runs: Vec<BlockRun<'_>> = (0..GEOMETRY.layers)
        .flat_map(|layer| (0..blocks).map(move |block| (layer, block)))
        .map(|(layer, block)| BlockRun {
            layer,
            block,
            bytes: &run,
        })
        .collect();
    let wanted: Vec<(u32, u32)> = runs.iter().map(|r| (r.layer, r.block)).collect();
    let (mut writes, mut reads) = (Vec::new(), Vec::new());
    for round in 0..args.rounds {
        let id = 1_000 + round as u64;
        let claim = store.claim(id, "bench")?;
        let t = Instant::now();
        store.put_session(&claim, &record(id, args.tokens), &runs)?;
        writes.push(gb_s(bytes, t.elapsed()));
        let rec = store.record(id)?.ok_or("no record")?;
        let t = Instant::now();
        let got = store.read_runs(&rec, &wanted)?;
        reads.push(gb_s(bytes, t.elapsed()));
        assert_eq!(got.len(), runs.len());
        drop(got);
        store.delete_session(&claim)?;
        store.give_up(&claim)?;
    }
    println!(
        "ClusterStore in process, {} runs of 256 KiB: write (pipelined, WAIT 1) {:.2} GB/s, read {:.2} GB/s (medians of {})",
        runs.len(),
        median(&mut writes),
        median(&mut reads),
        args.rounds
    );

    // 3. Through two tierd nodes.
    let tierd = find_tierd(args.tierd.as_deref());
    let seeds = cluster.seeds_setting();
    let capacity = format!("{}MiB", (bytes * 2 / (1 << 20)).max(512));
    let node = |name: &str| {
        let seeds = seeds.clone();
        let capacity = capacity.clone();
        let name = name.to_string();
        Daemon::spawn(&tierd, "remote-bench", move |c, _| {
            c.args(["--host-capacity", &capacity]);
            for s in [
                "nvme.enabled=false".to_string(),
                "host.lock_memory=false".into(),
                "host.huge_pages=false".into(),
                "remote.enabled=true".into(),
                seeds,
                format!("remote.node=\"{name}\""),
                // The whole session is written by the OFFLOAD measured, not by periodic
                // writes while it is appended.
                "remote.flush_interval_ms=0".into(),
            ] {
                c.args(["--set", &s]);
            }
        })
    };
    let nodes = [node("node-a")?, node("node-b")?];
    let mut clients = [
        Client::connect(nodes[0].socket())?,
        Client::connect(nodes[1].socket())?,
    ];
    let mut rng = Rng::new(7);
    let id = clients[0].create_session(GEOMETRY, Policy::default(), "bench")?;
    let t = Instant::now();
    let chunk = 256u32;
    let mut at = 0u64;
    while at < args.tokens as u64 {
        let n = chunk.min(args.tokens - at as u32);
        at = clients[0].append_kv(id, at, n, &payload(n as usize, &mut rng))?;
    }
    println!(
        "node A: {} tokens appended in {:.1} s",
        args.tokens,
        t.elapsed().as_secs_f64()
    );
    let g = GEOMETRY;
    let q: Vec<u8> = rng
        .normals((g.q_heads * g.head_dim) as usize)
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let step = |c: &mut Client, layer: u32, pos: u64, rng: &mut Rng| {
        let kv = g
            .dtype
            .encode_vec(&rng.normals((g.kv_heads * g.head_dim) as usize));
        c.decode(
            layer,
            DecodeEntryRef {
                session: id,
                position: pos,
                q: &q,
                k: &kv,
                v: &kv,
            },
            false,
        )
    };
    let (mut offloads, mut firsts, mut rests, mut steady) = (vec![], vec![], vec![], vec![]);
    if args.rounds < 2 {
        return Err("--rounds must be at least 2".into());
    }
    let mut tokens = args.tokens as u64;
    for round in 0..args.rounds {
        let (from, to) = (round % 2, 1 - round % 2);
        let t = Instant::now();
        clients[from].offload(id)?;
        offloads.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        step(&mut clients[to], 0, tokens, &mut rng)?;
        firsts.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        for layer in 1..g.layers {
            step(&mut clients[to], layer, tokens, &mut rng)?;
        }
        rests.push(t.elapsed().as_secs_f64());
        tokens += 1;
        let t = Instant::now();
        for layer in 0..g.layers {
            step(&mut clients[to], layer, tokens, &mut rng)?;
        }
        steady.push(t.elapsed().as_secs_f64());
        tokens += 1;
    }
    println!(
        "tierd nodes: OFFLOAD of the whole session: {:.2} s, of the 2 tokens a round adds {:.3} s (median)",
        offloads[0],
        median(&mut offloads[1..].to_vec())
    );
    let first = median(&mut firsts);
    println!(
        "tierd nodes: first request on the other node to its decoded token (resume + layer 0) {first:.2} s ({:.2} GB/s of KV); the other 27 layers of that step {:.3} s; a whole step after {:.3} s (medians of {})",
        bytes as f64 / 1e9 / first,
        median(&mut rests),
        median(&mut steady),
        args.rounds
    );
    Ok(())
}
