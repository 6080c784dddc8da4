//! The remote tier on a Redis Cluster it starts on loopback (3 masters, 3 replicas;
//! `redis-server` and `redis-cli` on PATH), Qwen2.5-7B attention geometry (28 layers, 4 KV
//! heads of 128, bf16, 128-token blocks: 256 KiB block runs):
//! 1. the cluster's own figure: `redis-benchmark --cluster` SET and GET of 256 KiB values;
//! 2. a bulk write and read of one session through `ClusterStore` in process (the floor of an
//!    offload and of a whole-session pull: every page pipelined, `WAIT 1` after the write);
//! 3. through tierd nodes: a session built on one node and offloaded, then, round by round
//!    and each way in turn (every page read first, `remote.resume_from_summaries = false`;
//!    from summaries with the rest streamed behind; from summaries with blocks read only on
//!    demand, `remote.stream_resumed = false`), resumed on a fresh node: the time from its
//!    first request to the decoded token, the whole first step, a later step, and (streamed)
//!    until every block has arrived. One node holds the session at a time.
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
    if args.rounds < 2 {
        return Err("--rounds must be at least 2".into());
    }
    let tierd = find_tierd(args.tierd.as_deref());
    let seeds = cluster.seeds_setting();
    let capacity = format!("{}MiB", (bytes * 2 / (1 << 20)).max(512));
    // A fresh node per resume, the one before it stopped once it has offloaded the session:
    // at most one node holds it (and its memory) at a time.
    let node = |name: &str, way: Way| {
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
                format!("remote.resume_from_summaries={}", way != Way::Pages),
                format!("remote.stream_resumed={}", way == Way::Streamed),
                format!("remote.replicas={replicas}"),
            ] {
                c.args(["--set", &s]);
            }
        })
    };
    let mut holder = node("node-0", Way::Pages)?;
    let mut client = Client::connect(holder.socket())?;
    let mut rng = Rng::new(7);
    let id = client.create_session(GEOMETRY, Policy::default(), "bench")?;
    let t = Instant::now();
    let chunk = 256u32;
    let mut at = 0u64;
    while at < args.tokens as u64 {
        let n = chunk.min(args.tokens - at as u32);
        at = client.append_kv(id, at, n, &payload(n as usize, &mut rng))?;
    }
    println!(
        "node 0: {} tokens appended in {:.1} s",
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
    let arrived = |c: &mut Client| -> Result<(u64, u64), BoxError> {
        let s = c.stats()?;
        Ok((
            s.get("remote_blocks_fetched_total").unwrap_or(0),
            s.get("remote_blocks_streamed_total").unwrap_or(0),
        ))
    };
    let total_blocks = g.layers as u64 * g.blocks_for(args.tokens as u64);
    let mut offloads = vec![];
    let ways = [Way::Pages, Way::Streamed, Way::OnDemand];
    // Per way: the first token (resume + layer 0), the whole first step, a later step, the
    // blocks read for the first step, and (streamed) every block arrived.
    let mut firsts = [vec![], vec![], vec![]];
    let mut first_steps = [vec![], vec![], vec![]];
    let mut steady = [vec![], vec![], vec![]];
    let mut fetched = [vec![], vec![], vec![]];
    let mut whole = vec![];
    let mut tokens = args.tokens as u64;
    for i in 0..ways.len() * args.rounds {
        let w = i % ways.len();
        let next = node(&format!("node-{}", i + 1), ways[w])?;
        let mut to = Client::connect(next.socket())?;
        let t = Instant::now();
        client.offload(id)?;
        offloads.push(t.elapsed().as_secs_f64());
        drop(client);
        drop(std::mem::replace(&mut holder, next));
        let t = Instant::now();
        step(&mut to, 0, tokens, &mut rng)?;
        firsts[w].push(t.elapsed().as_secs_f64());
        for layer in 1..g.layers {
            step(&mut to, layer, tokens, &mut rng)?;
        }
        first_steps[w].push(t.elapsed().as_secs_f64());
        fetched[w].push(arrived(&mut to)?.0 as f64);
        tokens += 1;
        if ways[w] == Way::Streamed {
            loop {
                let (f, s) = arrived(&mut to)?;
                if f + s >= total_blocks {
                    break;
                }
                if t.elapsed() > Duration::from_secs(900) {
                    return Err("the resumed session never arrived in full".into());
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            whole.push(t.elapsed().as_secs_f64());
        }
        let t = Instant::now();
        for layer in 0..g.layers {
            step(&mut to, layer, tokens, &mut rng)?;
        }
        steady[w].push(t.elapsed().as_secs_f64());
        tokens += 1;
        client = to;
    }
    println!(
        "tierd nodes: OFFLOAD of the whole session: {:.2} s, of the 2 tokens a round adds {:.3} s (median)",
        offloads[0],
        median(&mut offloads[1..].to_vec())
    );
    for (w, way) in ways.iter().enumerate() {
        let first = median(&mut firsts[w]);
        println!(
            "tierd nodes, resume {}: first request on a fresh node to its decoded token (resume + layer 0) {first:.3} s; the whole first step (28 layers) {:.3} s ({:.2} GB/s of KV), {:.0} blocks read on demand in it; a later step {:.3} s (medians of {})",
            way.name(),
            median(&mut first_steps[w]),
            bytes as f64 / 1e9 / median(&mut first_steps[w]),
            median(&mut fetched[w]),
            median(&mut steady[w]),
            args.rounds
        );
    }
    println!(
        "tierd nodes, resume from summaries, streamed: every block arrived {:.2} s after the first request (median of {})",
        median(&mut whole),
        args.rounds
    );
    Ok(())
}

/// How a node resumes the session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    /// Every page read before the first step (`remote.resume_from_summaries = false`).
    Pages,
    /// From summaries, the rest streamed in behind.
    Streamed,
    /// From summaries, blocks read only when a step keeps them (`remote.stream_resumed =
    /// false`).
    OnDemand,
}

impl Way {
    fn name(self) -> &'static str {
        match self {
            Way::Pages => "reading every page first",
            Way::Streamed => "from summaries, the rest streamed",
            Way::OnDemand => "from summaries, blocks on demand only",
        }
    }
}
