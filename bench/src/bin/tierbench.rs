//! tierbench: load generator for a running `tierd`, over the real Unix socket.
//!
//! cargo run --release -p kvtier-bench --bin tierbench -- [--spawn] [--socket PATH]
//!     [--sessions 1,4,16] [--contexts 8192,32768,131072] [--steps 16] [--max-seconds 4]
//!     [--layers 28 --q-heads 28 --kv-heads 4 --head-dim 128] [--small] [--json FILE]
//!
//! For each (sessions, context) cell: one client thread and connection per session creates a
//! session, prefills `context` random bf16 tokens through shared-memory APPEND_KV (in chunks),
//! then runs decode steps, one DECODE request per layer per step, until `--steps` steps or
//! `--max-seconds` have passed. Reported per cell: per-request latency p50 / p99 / max,
//! layer-decodes/s and tokens/s (decode steps completed per second over all sessions).
//! Separately, the small-payload round trip (1 layer, 1/1 heads, D=8, context 128) on one
//! connection, against the p50 <= 50 us target. `--small` runs the matrix itself with that
//! small geometry (context 128 unless --contexts is given). Cells whose KV would not fit
//! `--host-budget` are skipped and say so. `--spawn` starts a private tierd on a temporary
//! socket and stops it with SIGTERM at the end.

use std::ffi::OsString;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Barrier;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use kvtier_bench::daemon::{find_tierd, BoxError, Daemon};
use kvtier_bench::{cpu_description, fill_bf16, percentile};
use kvtier_protocol::client::{default_socket_path, Client};
use kvtier_protocol::{
    stats_keys, DType, DecodeEntryRef, DecodeRequest, Geometry, Policy, Request, HEADER_LEN,
};
use kvtier_storage::testing::Rng;
use serde::Serialize;

#[derive(Debug, Parser)]
#[command(
    name = "tierbench",
    about = "Load generator for tierd over its Unix socket"
)]
struct Args {
    /// Daemon socket (default: the same default tierd uses, see tierctl --help).
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Concurrent sessions per cell, comma separated; one client thread/connection each.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    sessions: Vec<u32>,
    /// Prefilled context lengths in tokens, comma separated.
    #[arg(long, value_delimiter = ',')]
    contexts: Option<Vec<u64>>,
    /// Decode steps per session per cell (each step = one request per layer).
    #[arg(long, default_value_t = 16)]
    steps: u64,
    /// Stop a cell's decode phase after this many seconds even if steps remain.
    #[arg(long, default_value_t = 4.0)]
    max_seconds: f64,
    #[arg(long, default_value_t = 28)]
    layers: u32,
    #[arg(long, default_value_t = 28)]
    q_heads: u32,
    #[arg(long, default_value_t = 4)]
    kv_heads: u32,
    #[arg(long, default_value_t = 128)]
    head_dim: u32,
    #[arg(long, default_value_t = 128)]
    block_tokens: u32,
    /// Run the matrix with the small geometry (1 layer, 1/1 heads, D=8, context 128).
    #[arg(long)]
    small: bool,
    /// Small-payload round trips to time (one connection, after the matrix).
    #[arg(long, default_value_t = 5000)]
    rtt_requests: u32,
    /// Tokens per shared-memory APPEND_KV during prefill.
    #[arg(long, default_value_t = 1024)]
    prefill_chunk: u32,
    /// Host RAM the cells may fill, in MiB; larger cells are skipped. Default: half of
    /// MemAvailable.
    #[arg(long)]
    host_budget_mib: Option<u64>,
    /// Write results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Start a private tierd on a temporary socket (stopped with SIGTERM at the end).
    #[arg(long)]
    spawn: bool,
    /// tierd binary for --spawn (default: next to this binary, else `tierd` on PATH).
    #[arg(long)]
    tierd: Option<PathBuf>,
}

const SMALL: Geometry = Geometry {
    layers: 1,
    q_heads: 1,
    kv_heads: 1,
    head_dim: 8,
    dtype: DType::Bf16,
    block_tokens: 128,
};
const SMALL_CONTEXT: u64 = 128;

#[derive(Debug, Serialize)]
struct Latency {
    p50_us: f64,
    mean_us: f64,
    p90_us: f64,
    p99_us: f64,
    max_us: f64,
}

impl Latency {
    fn of(mut xs: Vec<Duration>) -> Self {
        xs.sort_unstable();
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        let mean = xs.iter().map(|&d| us(d)).sum::<f64>() / xs.len().max(1) as f64;
        Self {
            p50_us: us(percentile(&xs, 50.0)),
            mean_us: mean,
            p90_us: us(percentile(&xs, 90.0)),
            p99_us: us(percentile(&xs, 99.0)),
            max_us: us(xs.last().copied().unwrap_or_default()),
        }
    }
}

#[derive(Debug, Serialize)]
struct Cell {
    sessions: u32,
    context: u64,
    /// Set when the cell did not run.
    skipped: Option<String>,
    prefill_s: f64,
    prefill_gb_per_s: f64,
    steps_completed: u64,
    layer_decodes: u64,
    decode_s: f64,
    latency: Option<Latency>,
    layer_decodes_per_s: f64,
    tokens_per_s: f64,
}

#[derive(Debug, Serialize)]
struct Rtt {
    requests: u32,
    latency: Latency,
    target_p50_us: f64,
    target_met: bool,
    /// The floor: the same request and reply sizes bounced between two threads over a bare
    /// Unix socket pair (no protocol, no daemon), in the same run.
    socket_floor: Latency,
}

#[derive(Debug, Serialize)]
struct Report {
    machine: String,
    command: String,
    unix_time: u64,
    server: String,
    geometry: Geometry,
    steps: u64,
    max_seconds: f64,
    cells: Vec<Cell>,
    rtt: Rtt,
}

fn mem_available_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Host bytes a session of `tokens` occupies: every (layer, block) run takes an extent of its
/// size rounded up to a 4 KiB page.
fn session_host_bytes(g: &Geometry, tokens: u64) -> u64 {
    let blocks = g.blocks_for(tokens);
    let extent = kvtier_storage::arena::extent_bytes(g.block_bytes()) as u64;
    blocks * u64::from(g.layers) * extent
}

fn random_f32_bytes(rng: &mut Rng, n: usize) -> Vec<u8> {
    (0..n).flat_map(|_| rng.normal().to_le_bytes()).collect()
}

/// Prefill `context` tokens into `session` through shared-memory appends.
fn prefill(
    c: &mut Client,
    g: &Geometry,
    session: u64,
    context: u64,
    chunk: u32,
    rng: &mut Rng,
) -> Result<(), BoxError> {
    let mut pos = 0u64;
    let mut payload = Vec::new();
    while pos < context {
        let n = u32::try_from((context - pos).min(u64::from(chunk)))?;
        let len = g.append_payload_bytes(n).ok_or("payload size overflows")?;
        payload.resize(usize::try_from(len)?, 0);
        fill_bf16(rng, &mut payload);
        let got = c.append_kv_shm(session, pos, n, &payload)?;
        pos += u64::from(n);
        if got != pos {
            return Err(format!("append returned length {got}, expected {pos}").into());
        }
    }
    Ok(())
}

struct ThreadResult {
    latencies: Vec<Duration>,
    steps: u64,
}

/// What the client threads of one cell share: the phase barriers and the progress bar.
struct Phases {
    /// Every thread has connected and created its session: prefill timing starts.
    start: Barrier,
    /// Every thread has prefilled: decode timing starts.
    prefilled: Barrier,
    bar: ProgressBar,
}

/// One client thread: connect, create, prefill, wait for the others, decode, close. Reaches
/// both barriers even when it fails early, so one failure cannot deadlock the cell.
fn session_worker(
    sock: &Path,
    g: Geometry,
    context: u64,
    args: &Args,
    seed: u64,
    ph: &Phases,
) -> Result<ThreadResult, BoxError> {
    let mut rng = Rng::new(seed);
    let mut setup = (|| -> Result<_, BoxError> {
        let mut c = Client::connect_as(sock, "tierbench")?;
        let session = c.create_session(g, Policy::default(), &format!("tierbench-{seed}"))?;
        Ok((c, session))
    })();
    ph.start.wait();
    let filled = match &mut setup {
        Ok((c, session)) => prefill(c, &g, *session, context, args.prefill_chunk, &mut rng),
        Err(_) => Ok(()),
    };
    ph.prefilled.wait();
    let (mut c, session) = setup?;
    filled?;
    let bar = &ph.bar;
    let q = random_f32_bytes(&mut rng, (g.q_heads * g.head_dim) as usize);
    let mut kv = vec![0u8; 2 * usize::try_from(g.kv_token_bytes().ok_or("kv size")?)?];
    let deadline = Instant::now() + Duration::from_secs_f64(args.max_seconds);
    let mut latencies = Vec::with_capacity((args.steps * u64::from(g.layers)) as usize);
    let mut steps = 0;
    'steps: for step in 0..args.steps {
        for layer in 0..g.layers {
            fill_bf16(&mut rng, &mut kv);
            let (k, v) = kv.split_at(kv.len() / 2);
            let entry = DecodeEntryRef {
                session,
                position: context + step,
                q: &q,
                k,
                v,
            };
            let t0 = Instant::now();
            let out = c.decode(layer, entry, false)?;
            latencies.push(t0.elapsed());
            if out.out.len() != (g.q_heads * g.head_dim) as usize {
                return Err(format!("decode output has {} floats", out.out.len()).into());
            }
            bar.inc(1);
            // Stop only between steps so every completed step covers all layers.
            if layer + 1 == g.layers && Instant::now() > deadline {
                steps = step + 1;
                break 'steps;
            }
        }
        steps = step + 1;
    }
    c.close(session)?;
    Ok(ThreadResult { latencies, steps })
}

fn run_cell(
    sock: &Path,
    g: Geometry,
    sessions: u32,
    context: u64,
    args: &Args,
) -> Result<Cell, BoxError> {
    let n = sessions as usize;
    let bar = ProgressBar::new(u64::from(sessions) * args.steps * u64::from(g.layers));
    bar.set_style(ProgressStyle::with_template(
        "{prefix} [{elapsed_precise}] {wide_bar} {pos}/{len} layer-decodes ({per_sec})",
    )?);
    bar.set_prefix(format!("{sessions} x {context}"));
    let ph = Phases {
        start: Barrier::new(n + 1),
        prefilled: Barrier::new(n + 1),
        bar,
    };
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = (0..sessions)
            .map(|i| {
                let ph = &ph;
                let seed = u64::from(i) + 1 + context * 1000;
                s.spawn(move || session_worker(sock, g, context, args, seed, ph))
            })
            .collect();
        ph.start.wait();
        let t0 = Instant::now();
        ph.prefilled.wait();
        let prefill_s = t0.elapsed();
        ph.bar.reset_elapsed();
        let t1 = Instant::now();
        let res: Vec<_> = handles.into_iter().map(|h| h.join()).collect();
        (prefill_s, t1.elapsed(), res)
    });
    ph.bar.finish_and_clear();
    let (prefill_t, decode_t, res) = results;
    let mut latencies = Vec::new();
    let mut steps = 0;
    for r in res {
        let r = r.map_err(|_| "a session thread panicked")??;
        latencies.extend(r.latencies);
        steps += r.steps;
    }
    let layer_decodes = latencies.len() as u64;
    let prefill_bytes = g.append_payload_bytes(1).unwrap_or(0) * context * u64::from(sessions);
    let secs = decode_t.as_secs_f64();
    Ok(Cell {
        sessions,
        context,
        skipped: None,
        prefill_s: prefill_t.as_secs_f64(),
        prefill_gb_per_s: prefill_bytes as f64 / prefill_t.as_secs_f64() / 1e9,
        steps_completed: steps,
        layer_decodes,
        decode_s: secs,
        latency: Some(Latency::of(latencies)),
        layer_decodes_per_s: layer_decodes as f64 / secs,
        tokens_per_s: steps as f64 / secs,
    })
}

/// Small-payload DECODE round trips on one connection. Every decode appends a token, so the
/// session is replaced (untimed) every `SMALL_CONTEXT` requests: the timed requests always
/// see a context in [128, 256), not one that grows with the request count.
fn measure_rtt(sock: &Path, requests: u32) -> Result<Rtt, BoxError> {
    let g = SMALL;
    let mut rng = Rng::new(7);
    let mut c = Client::connect_as(sock, "tierbench-rtt")?;
    let mut payload = vec![0u8; usize::try_from(g.append_payload_bytes(128).ok_or("size")?)?];
    fill_bf16(&mut rng, &mut payload);
    let q = random_f32_bytes(&mut rng, (g.q_heads * g.head_dim) as usize);
    let mut kv = vec![0u8; 2 * usize::try_from(g.kv_token_bytes().ok_or("size")?)?];
    fill_bf16(&mut rng, &mut kv);
    let (k, v) = kv.split_at(kv.len() / 2);
    let warmup = 200;
    let mut lat = Vec::with_capacity(requests as usize);
    let mut session = None;
    for i in 0..u64::from(requests) + warmup {
        let step = i % SMALL_CONTEXT;
        if step == 0 {
            if let Some(old) = session.take() {
                c.close(old)?;
            }
            let s = c.create_session(g, Policy::default(), "tierbench-rtt")?;
            c.append_kv(s, 0, SMALL_CONTEXT as u32, &payload)?;
            session = Some(s);
        }
        let entry = DecodeEntryRef {
            session: session.ok_or("no rtt session")?,
            position: SMALL_CONTEXT + step,
            q: &q,
            k,
            v,
        };
        let t0 = Instant::now();
        c.decode(0, entry, false)?;
        if i >= warmup {
            lat.push(t0.elapsed());
        }
    }
    if let Some(s) = session {
        c.close(s)?;
    }
    let latency = Latency::of(lat);
    let request_bytes = {
        let mut buf = Vec::new();
        let entry = DecodeEntryRef {
            session: 1,
            position: 0,
            q: &q,
            k,
            v,
        };
        Request::Decode(DecodeRequest {
            layer: 0,
            want_stats: false,
            entries: vec![entry],
        })
        .encode_frame(1, &mut buf)?;
        buf.len()
    };
    // Reply: header + count + out_len + Hq*D f32 + has_stats.
    let reply_bytes = HEADER_LEN + 4 + 4 + 4 * (g.q_heads * g.head_dim) as usize + 1;
    Ok(Rtt {
        requests,
        target_p50_us: 50.0,
        target_met: latency.p50_us <= 50.0,
        latency,
        socket_floor: socket_ping_pong(request_bytes, reply_bytes, requests)?,
    })
}

/// Round trips of `req` bytes out and `resp` bytes back between this thread and an echo
/// thread over a Unix socket pair: what the kernel and the scheduler alone cost.
fn socket_ping_pong(req: usize, resp: usize, requests: u32) -> Result<Latency, BoxError> {
    use std::io::{Read, Write};
    let (mut a, mut b) = UnixStream::pair()?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut inb, out) = (vec![0u8; req], vec![0u8; resp]);
        loop {
            if b.read_exact(&mut inb).is_err() {
                return Ok(());
            }
            b.write_all(&out)?;
        }
    });
    let (out, mut inb) = (vec![0u8; req], vec![0u8; resp]);
    let mut lat = Vec::with_capacity(requests as usize);
    for i in 0..requests + 200 {
        let t0 = Instant::now();
        a.write_all(&out)?;
        a.read_exact(&mut inb)?;
        if i >= 200 {
            lat.push(t0.elapsed());
        }
    }
    drop(a);
    echo.join().map_err(|_| "echo thread panicked")??;
    Ok(Latency::of(lat))
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

fn main() -> std::process::ExitCode {
    match run(Args::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tierbench: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<(), BoxError> {
    let command = std::env::args_os()
        .map(|a: OsString| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ");
    let g = if args.small {
        SMALL
    } else {
        Geometry {
            layers: args.layers,
            q_heads: args.q_heads,
            kv_heads: args.kv_heads,
            head_dim: args.head_dim,
            dtype: DType::Bf16,
            block_tokens: args.block_tokens,
        }
    };
    let contexts = args.contexts.clone().unwrap_or_else(|| {
        if args.small {
            vec![SMALL_CONTEXT]
        } else {
            vec![8192, 32768, 131072]
        }
    });
    if args.sessions.contains(&0) || contexts.contains(&0) || args.steps == 0 {
        return Err("--sessions, --contexts and --steps must be positive".into());
    }
    if args.prefill_chunk == 0 {
        return Err("--prefill-chunk must be positive".into());
    }
    let mut budget = args
        .host_budget_mib
        .map(|m| m << 20)
        .or_else(|| mem_available_bytes().map(|b| b / 2))
        .unwrap_or(4 << 30);
    // Decode steps add tokens too: size every cell for its final length.
    let cell_bytes = |s: u32, ctx: u64| u64::from(s) * session_host_bytes(&g, ctx + args.steps);
    let largest_fitting = args
        .sessions
        .iter()
        .flat_map(|&s| contexts.iter().map(move |&c| cell_bytes(s, c)))
        .filter(|&b| b <= budget)
        .max()
        .unwrap_or(0);

    let mut daemon = None;
    let sock = if args.spawn {
        // Room for the largest cell plus the RTT session, with slack for rounding.
        let cap_mib = (largest_fitting >> 20) + 64;
        let bin = find_tierd(args.tierd.as_deref());
        let d = Daemon::spawn(&bin, "tierbench-", |cmd, _| {
            cmd.arg("--host-capacity").arg(format!("{cap_mib}MiB"));
            // Host tier only: no page file to preallocate, and no memory-pressure demotion
            // moving sessions to NVMe in the middle of a cell.
            cmd.args(["--set", "nvme.enabled=false"]);
        })?;
        let sock = d.socket().to_owned();
        println!(
            "spawned {} --host-capacity {cap_mib}MiB on {}",
            bin.display(),
            sock.display()
        );
        daemon = Some(d);
        sock
    } else {
        args.socket.clone().unwrap_or_else(default_socket_path)
    };

    // The daemon's free host RAM decides which cells fit.
    let server = {
        let mut c = Client::connect_as(&sock, "tierbench")
            .map_err(|e| format!("connecting to tierd at {}: {e}", sock.display()))?;
        let h = c.server();
        let server = format!(
            "{} {} (protocol v{})",
            h.server_name, h.server_version, h.version
        );
        let st = c.stats()?;
        let (cap, used) = (
            st.get(stats_keys::HOST_BYTES_CAPACITY),
            st.get(stats_keys::HOST_BYTES_USED),
        );
        if let (Some(c), Some(u)) = (cap, used) {
            // Leave room for the RTT session (a few runs).
            budget = budget.min(
                c.saturating_sub(u)
                    .saturating_sub(64 * g.block_bytes() as u64),
            );
        }
        server
    };

    println!("kvtier tierbench: decode requests over the tierd Unix socket");
    println!("machine: {}", cpu_description());
    println!("server:  {server} at {}", sock.display());
    println!("command: {command}");
    println!(
        "geometry: L={} Hq={} Hkv={} D={} {} B={}; policy sink 1, local 4, top-k 32; \
         {} steps or {:.1} s per cell; host budget {:.1} GiB",
        g.layers,
        g.q_heads,
        g.kv_heads,
        g.head_dim,
        g.dtype.name(),
        g.block_tokens,
        args.steps,
        args.max_seconds,
        gib(budget)
    );

    let mut cells = Vec::new();
    for &s in &args.sessions {
        for &ctx in &contexts {
            let need = cell_bytes(s, ctx);
            if need > budget {
                let why = format!(
                    "needs {:.1} GiB of host RAM, budget (free in tierd, at most --host-budget-mib) {:.1} GiB",
                    gib(need),
                    gib(budget)
                );
                eprintln!("skipping {s} x {ctx}: {why}");
                cells.push(Cell {
                    sessions: s,
                    context: ctx,
                    skipped: Some(why),
                    prefill_s: 0.0,
                    prefill_gb_per_s: 0.0,
                    steps_completed: 0,
                    layer_decodes: 0,
                    decode_s: 0.0,
                    latency: None,
                    layer_decodes_per_s: 0.0,
                    tokens_per_s: 0.0,
                });
                continue;
            }
            cells.push(run_cell(&sock, g, s, ctx, &args)?);
        }
    }
    let rtt = measure_rtt(&sock, args.rtt_requests)?;

    println!();
    println!(
        "{:>8} {:>8} {:>9} {:>8} {:>10} {:>10} {:>10} {:>10} {:>13} {:>9}",
        "sessions",
        "context",
        "prefill_s",
        "steps",
        "p50_us",
        "mean_us",
        "p99_us",
        "max_us",
        "layer-dec/s",
        "tok/s"
    );
    for c in &cells {
        match (&c.latency, &c.skipped) {
            (Some(l), _) => println!(
                "{:>8} {:>8} {:>9.2} {:>8} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>13.0} {:>9.1}",
                c.sessions,
                c.context,
                c.prefill_s,
                c.steps_completed,
                l.p50_us,
                l.mean_us,
                l.p99_us,
                l.max_us,
                c.layer_decodes_per_s,
                c.tokens_per_s
            ),
            (None, why) => println!(
                "{:>8} {:>8}  skipped: {}",
                c.sessions,
                c.context,
                why.as_deref().unwrap_or("")
            ),
        }
    }
    println!();
    println!(
        "small-payload round trip (L=1, 1/1 heads, D=8, ctx {SMALL_CONTEXT}..{ctx_end}, {} requests, one \
         connection): p50 {:.1} us, p99 {:.1} us, max {:.1} us; target p50 <= 50 us: {}",
        rtt.requests,
        rtt.latency.p50_us,
        rtt.latency.p99_us,
        rtt.latency.max_us,
        if rtt.target_met { "met" } else { "MISSED" },
        ctx_end = 2 * SMALL_CONTEXT - 1
    );
    println!(
        "floor: the same bytes bounced over a bare Unix socket pair between two threads: p50 {:.1} us, \
         p99 {:.1} us",
        rtt.socket_floor.p50_us, rtt.socket_floor.p99_us
    );

    let report = Report {
        machine: cpu_description(),
        command,
        unix_time: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        server,
        geometry: g,
        steps: args.steps,
        max_seconds: args.max_seconds,
        cells,
        rtt,
    };
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")?;
        println!("wrote {}", path.display());
    }
    if let Some(mut d) = daemon {
        let st = d.stop()?;
        println!("tierd stopped: {st}");
    }
    Ok(())
}
