//! The remote tier on a Redis Cluster it starts on loopback (3 masters, 3 replicas;
//! `redis-server` and `redis-cli` on PATH), Qwen2.5-7B attention geometry (28 layers, 4 KV
//! heads of 128, bf16, 128-token blocks: 256 KiB block runs):
//! 1. the cluster's own figure: `redis-benchmark --cluster` SET and GET of 256 KiB values;
//! 2. a bulk write and read of one session through `ClusterStore` in process (the floor of an
//!    offload and of a whole-session pull: every page pipelined, `WAIT 1` after the write);
//! 3. through four tierd nodes, two resuming a session by reading every page first
//!    (`remote.resume_from_summaries = false`) and two from its block summaries: a session
//!    built on node A and offloaded, then, round by round and each way in turn, the time from
//!    the first request on another node to its decoded token (the resume, then the step),
//!    against the rest of that step, a second step, and (from summaries) the time until every
//!    block has arrived.
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
use kvtier_remote::{ClusterConfig, ClusterStore, RemoteRun, RemoteStore};
use kvtier_storage::nvme::manifest::{GeometryRecord, PolicyRecord, SessionRecord};
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
    /// Replicas per master in the cluster started (0 halves the memory a long session takes).
    #[arg(long, default_value_t = 1)]
    replicas: u32,
    /// Skip the in-process bulk write and read (which hold a whole session in memory).
    #[arg(long)]
    skip_bulk: bool,
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
    let cluster =
        RedisCluster::start(3, args.replicas as usize).ok_or("redis-server is not installed")?;
    let masters = cluster.masters();
    let bytes = args.tokens as u64 * GEOMETRY.kv_bytes_per_token() as u64;
    println!(
        "remote_bench: Qwen2.5-7B geometry, {} tokens ({:.2} GB of KV), cluster 3 masters + {} replicas on loopback",
        args.tokens,
        bytes as f64 / 1e9,
        3 * args.replicas
    );

    // 1. The cluster's own figure.
    let set = redis_benchmark(masters[0], "set")?;
    let get = redis_benchmark(masters[0], "get")?;
    println!("redis-benchmark --cluster, 256 KiB values, 8 clients: SET {set:.2} GB/s, GET {get:.2} GB/s");

    // 2. Bulk write and read in process.
    if !args.skip_bulk {
        bulk(&cluster, &args, bytes)?;
    }

    // 3. Through tierd nodes.
    nodes(&cluster, &args, bytes)
}

/// Part 2: a session written and read back whole through `ClusterStore`, in process.
fn bulk(cluster: &RedisCluster, args: &Args, bytes: u64) -> Result<(), BoxError> {
    let store = ClusterStore::connect(ClusterConfig {
        seeds: cluster.seeds(),
        // Nothing renews this claim (a node renews its own every third of the TTL): long
        // enough for the largest write.
        claim_ttl: Duration::from_secs(600),
        ..ClusterConfig::default()
    })?;
    let blocks = GEOMETRY.blocks_for(args.tokens as u64) as u32;
    let run = vec![0x3cu8; GEOMETRY.block_bytes()];
    let summary = vec![0x5au8; kvtier_storage::summary_bytes(&GEOMETRY, true)];
    let runs: Vec<RemoteRun<'_>> = (0..GEOMETRY.layers)
        .flat_map(|layer| (0..blocks).map(move |block| (layer, block)))
        .map(|(layer, block)| RemoteRun {
            layer,
            block,
            bytes: &run,
            summary: &summary,
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
        "ClusterStore in process, {} runs of 256 KiB and their summaries: write (pipelined, WAIT {}) {:.2} GB/s, read {:.2} GB/s of runs (medians of {})",
        runs.len(),
        args.replicas,
        median(&mut writes),
        median(&mut reads),
        args.rounds
    );
    Ok(())
}

/// Part 3: offload and resume through tierd nodes, reading every page first and from
/// summaries.
fn nodes(cluster: &RedisCluster, args: &Args, bytes: u64) -> Result<(), BoxError> {
    let tierd = find_tierd(args.tierd.as_deref());
    let seeds = cluster.seeds_setting();
    let capacity = format!("{}MiB", (bytes * 2 / (1 << 20)).max(512));
    let node = |name: &str, from_summaries: bool| {
        let seeds = seeds.clone();
        let capacity = capacity.clone();
        let name = name.to_string();
        let replicas = args.replicas;
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
                format!("remote.resume_from_summaries={from_summaries}"),
                format!("remote.replicas={replicas}"),
            ] {
                c.args(["--set", &s]);
            }
        })
    };
    // A and B read every page first, C and D resume from summaries.
    let nodes = [
        node("node-a", false)?,
        node("node-b", false)?,
        node("node-c", true)?,
        node("node-d", true)?,
    ];
    let mut clients = nodes
        .iter()
        .map(|n| Client::connect(n.socket()))
        .collect::<Result<Vec<_>, _>>()?;
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
    if args.rounds < 2 {
        return Err("--rounds must be at least 2".into());
    }
    let arrived = |c: &mut Client| -> Result<u64, BoxError> {
        let s = c.stats()?;
        Ok(s.get("remote_blocks_fetched_total").unwrap_or(0)
            + s.get("remote_blocks_streamed_total").unwrap_or(0))
    };
    let total_blocks = g.layers as u64 * g.blocks_for(args.tokens as u64);
    let mut offloads = vec![];
    // Per way (0: every page first, 1: from summaries): first token, rest of that step, a
    // later step, and (from summaries) every block arrived.
    let mut firsts = [vec![], vec![]];
    let mut rests = [vec![], vec![]];
    let mut steady = [vec![], vec![]];
    let mut whole = vec![];
    let mut tokens = args.tokens as u64;
    let mut holder = 0;
    // The other nodes in turn: B (pages), C (summaries), A (pages), D (summaries), ...
    let order = [1, 2, 0, 3];
    for i in 0..2 * args.rounds {
        let to = order[i % order.len()];
        let way = (to >= 2) as usize;
        let before = arrived(&mut clients[to])?;
        let t = Instant::now();
        clients[holder].offload(id)?;
        offloads.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        step(&mut clients[to], 0, tokens, &mut rng)?;
        firsts[way].push(t.elapsed().as_secs_f64());
        let t1 = Instant::now();
        for layer in 1..g.layers {
            step(&mut clients[to], layer, tokens, &mut rng)?;
        }
        rests[way].push(t1.elapsed().as_secs_f64());
        tokens += 1;
        if way == 1 {
            while arrived(&mut clients[to])? - before < total_blocks {
                if t.elapsed() > Duration::from_secs(600) {
                    return Err("the resumed session never arrived in full".into());
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            whole.push(t.elapsed().as_secs_f64());
        }
        let t = Instant::now();
        for layer in 0..g.layers {
            step(&mut clients[to], layer, tokens, &mut rng)?;
        }
        steady[way].push(t.elapsed().as_secs_f64());
        tokens += 1;
        holder = to;
    }
    println!(
        "tierd nodes: OFFLOAD of the whole session: {:.2} s, of the 2 tokens a round adds {:.3} s (median)",
        offloads[0],
        median(&mut offloads[1..].to_vec())
    );
    for (way, name) in ["reading every page first", "from summaries"]
        .iter()
        .enumerate()
    {
        let first = median(&mut firsts[way]);
        println!(
            "tierd nodes, resume {name}: first request on the other node to its decoded token (resume + layer 0) {first:.3} s ({:.2} GB/s of KV); the other 27 layers of that step {:.3} s; a whole step after {:.3} s (medians of {})",
            bytes as f64 / 1e9 / first,
            median(&mut rests[way]),
            median(&mut steady[way]),
            args.rounds
        );
    }
    println!(
        "tierd nodes, resume from summaries: every block arrived {:.2} s after the first request (median of {})",
        median(&mut whole),
        args.rounds
    );
    Ok(())
}
