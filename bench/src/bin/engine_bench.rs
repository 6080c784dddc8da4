//! The in-engine step over a running tierd: sessions of Qwen2.5-7B's
//! geometry filled through tierd (APPEND_KV from one memfd), leased and decoded by this process
//! on its own GPU, every layer in one `decode_step`, the way `gpu_bench` times the kernels over
//! its own pinned buffer. Run both in one device call and compare step times.
//!
//! Cold: the device block cache flushed before each step (every kept tile crosses PCIe); warm:
//! consecutive steps with AR(1) queries (rho 0.9), as in gpu_bench. The floor is the bytes the
//! step moved over PCIe at 55.3 GB/s (gpu_bench's).
//!
//! Usage: engine_bench --socket PATH [--context 131072] [--ks 8,32] [--batches 1,8]
//!                     [--selectors bound,sketch,sketch:C] [--steps 12] [--warmup 3] [--device N]
//!                     [--fill-only | --sessions ID,ID,...] [--barrier DIR:PARTIES]
//!                     [--block-tokens 32|64|128]
//! `--block-tokens` sets the sessions' block size; the sink (128 tokens) and the local window
//! (512) stay the same tokens, `--ks` counts blocks of that size.
//! tierd must run with `host.shared = true` and enough `host.capacity` for max(batches)
//! sessions of `context` tokens (58.7 KiB per token), and this process must be allowed to
//! LEASE (an admin peer or tierd's own uid).
//!
//! Several GPUs: `--fill-only` fills the sessions, prints their ids and leaves them
//! in tierd; then one engine_bench per GPU (`--device N --sessions IDS`) decodes them at once,
//! each leasing them and registering tierd's arena in its own process. `--barrier DIR:PARTIES`
//! starts every measured cell in all the processes together (each waits until PARTIES files
//! for the cell exist in DIR), so their steps overlap and their rates add up: tokens/s is
//! batch / step, GB/s the bytes the step read over PCIe / step.
//!
//! `--selectors` runs each k with each selector in turn, one engine each: `bound` (the key
//! bound), `sketch` (key sketches, tierd's default candidates) or `sketch:C`.

use std::os::fd::AsFd;
use std::path::PathBuf;
use std::time::Instant;

use kvtier_bench::median;
use kvtier_engine::InEngine;
use kvtier_kernels::cuda::{CudaConfig, SummaryDtype, Timing};
use kvtier_protocol::client::Client;
use kvtier_protocol::fdpass::sealed_memfd;
use kvtier_protocol::{DType, Geometry, Policy, Selector};
use kvtier_storage::testing::Rng;

const PCIE_FLOOR_GBPS: f64 = 55.3;
const CHUNK: u32 = 1024;

struct Args {
    socket: PathBuf,
    context: u32,
    ks: Vec<u32>,
    selectors: Vec<(String, Selector)>,
    batches: Vec<u32>,
    steps: usize,
    warmup: usize,
    device: usize,
    fill_only: bool,
    block_tokens: u32,
    sessions: Vec<u64>,
    barrier: Option<(PathBuf, usize)>,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        socket: PathBuf::new(),
        context: 131072,
        ks: vec![8, 32],
        selectors: vec![("bound".into(), Selector::Bound)],
        batches: vec![1, 8],
        steps: 12,
        warmup: 3,
        device: 0,
        fill_only: false,
        block_tokens: 128,
        sessions: vec![],
        barrier: None,
    };
    let mut it = std::env::args().skip(1);
    let list = |s: String| -> Result<Vec<u32>, String> {
        s.split(',')
            .map(|x| x.parse().map_err(|e| format!("{x}: {e}")))
            .collect()
    };
    while let Some(k) = it.next() {
        let mut v = || it.next().ok_or(format!("{k} needs a value"));
        match k.as_str() {
            "--socket" => a.socket = v()?.into(),
            "--context" => a.context = v()?.parse().map_err(|e| format!("{e}"))?,
            "--block-tokens" => a.block_tokens = v()?.parse().map_err(|e| format!("{e}"))?,
            "--ks" => a.ks = list(v()?)?,
            "--batches" => a.batches = list(v()?)?,
            "--selectors" => {
                a.selectors = v()?
                    .split(',')
                    .map(|x| Ok((x.to_string(), selector(x)?)))
                    .collect::<Result<_, String>>()?;
            }
            "--steps" => a.steps = v()?.parse().map_err(|e| format!("{e}"))?,
            "--warmup" => a.warmup = v()?.parse().map_err(|e| format!("{e}"))?,
            "--device" => a.device = v()?.parse().map_err(|e| format!("{e}"))?,
            "--fill-only" => a.fill_only = true,
            "--sessions" => {
                a.sessions = v()?
                    .split(',')
                    .map(|x| x.parse().map_err(|e| format!("{x}: {e}")))
                    .collect::<Result<_, _>>()?;
            }
            "--barrier" => {
                let s = v()?;
                let (dir, n) = s.split_once(':').ok_or("--barrier takes DIR:PARTIES")?;
                a.barrier = Some((dir.into(), n.parse().map_err(|e| format!("{n}: {e}"))?));
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if a.socket.as_os_str().is_empty() {
        return Err("--socket is required".into());
    }
    if a.fill_only && !a.sessions.is_empty() {
        return Err("--fill-only fills new sessions; --sessions names existing ones".into());
    }
    Ok(a)
}

/// `bound`, `sketch` (tierd's default candidates) or `sketch:C`.
fn selector(spec: &str) -> Result<Selector, String> {
    match spec.split_once(':') {
        None if spec == "bound" => Ok(Selector::Bound),
        None if spec == "sketch" => Ok(Selector::default()),
        Some(("sketch", c)) => Ok(Selector::Sketch {
            candidates: c.parse().map_err(|e| format!("{spec}: {e}"))?,
        }),
        _ => Err(format!("{spec}: not bound, sketch or sketch:C")),
    }
}

/// Waits until `parties` processes have reached cell `cell` (each leaves a file in `dir`).
fn barrier(at: &Option<(PathBuf, usize)>, cell: &str) -> std::io::Result<()> {
    let Some((dir, parties)) = at else {
        return Ok(());
    };
    std::fs::write(dir.join(format!("{cell}.{}", std::process::id())), b"")?;
    let prefix = format!("{cell}.");
    loop {
        let here = std::fs::read_dir(dir)?
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
            .count();
        if here >= *parties {
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = args()?;
    let geo = Geometry {
        block_tokens: a.block_tokens,
        ..Geometry::QWEN2_5_7B
    };
    if !matches!(a.block_tokens, 32 | 64 | 128) {
        return Err(format!("--block-tokens {}: 32, 64 or 128", a.block_tokens).into());
    }
    // A sink of 128 tokens and a local window of 512, whatever the block size.
    let (sink, local) = (128 / a.block_tokens, 512 / a.block_tokens);
    let n_blocks = a.context / geo.block_tokens;
    let max_batch = *a.batches.iter().max().ok_or("no batches")?;
    let mut c = Client::connect_as(&a.socket, "engine_bench")?;
    let filled = a.sessions.is_empty();
    let sessions = if filled {
        fill(&mut c, geo, max_batch, a.context)?
    } else if a.sessions.len() < max_batch as usize {
        return Err(format!("batch {max_batch} needs {max_batch} --sessions").into());
    } else {
        a.sessions.clone()
    };
    if a.fill_only {
        let ids: Vec<String> = sessions.iter().map(u64::to_string).collect();
        println!("sessions {}", ids.join(","));
        return Ok(());
    }
    println!(
        "{:>8} {:>9} {:>3} {:>5} {:>5} {:>9} {:>9} {:>9} {:>6} {:>8} {:>6}",
        "context",
        "selector",
        "k",
        "batch",
        "mode",
        "step_ms",
        "wall_ms",
        "floor_ms",
        "x_floor",
        "tok_s",
        "GB_s"
    );
    let hqd = (geo.q_heads * geo.head_dim) as usize * geo.layers as usize;
    for (&k, (sel_name, sel)) in
        a.ks.iter()
            .flat_map(|k| a.selectors.iter().map(move |s| (k, s)))
    {
        let policy = Policy {
            selector: *sel,
            ..Policy::bound(sink, local, k)
        };
        let cfg = CudaConfig::new(geo, policy, n_blocks + 8, max_batch, SummaryDtype::F32);
        let t1 = Instant::now();
        let mut e = InEngine::connect(&a.socket, a.device, cfg)?;
        for &s in &sessions[..max_batch as usize] {
            e.attach(s)?;
        }
        e.set_timing(Timing::Step)?;
        println!(
            "k={k} {sel_name}: device {}: leased, mapped, registered ({}) and synced {} sessions in {:.1} s",
            a.device,
            match e.registered_read_only() {
                Some(true) => "read-only",
                _ => "read-write mapping",
            },
            max_batch,
            t1.elapsed().as_secs_f64()
        );
        for &batch in &a.batches {
            for cold in [true, false] {
                let mode = if cold { "cold" } else { "warm" };
                barrier(&a.barrier, &format!("k{k}-{sel_name}-b{batch}-{mode}"))?;
                let mut qrng = Rng::new(0x51ed + k as u64 * 7 + batch as u64 * 131);
                let mut qs: Vec<Vec<f32>> = (0..batch).map(|_| qrng.normals(hqd)).collect();
                let (rho, s) = (0.9f32, (1.0f32 - 0.81).sqrt());
                e.flush_cache()?;
                let (mut step_ms, mut wall_ms, mut bytes) = (vec![], vec![], 0f64);
                for step in 0..a.warmup + a.steps {
                    if cold {
                        e.flush_cache()?;
                    }
                    for q in &mut qs {
                        for x in q.iter_mut() {
                            *x = rho * *x + s * qrng.normal();
                        }
                    }
                    let items: Vec<(u64, &[f32])> = sessions[..batch as usize]
                        .iter()
                        .zip(&qs)
                        .map(|(&id, q)| (id, q.as_slice()))
                        .collect();
                    let t = Instant::now();
                    let out = e.decode_step(&items)?;
                    let wall = t.elapsed().as_secs_f64() * 1e3;
                    if !out.out.iter().all(|x| x.is_finite()) {
                        return Err("non-finite attention output".into());
                    }
                    if step >= a.warmup {
                        step_ms.push(out.step_ms.unwrap_or(f32::NAN) as f64);
                        wall_ms.push(wall);
                        bytes += out.stats.iter().map(|l| l.bytes_moved as f64).sum::<f64>();
                    }
                }
                let per_step = bytes / a.steps as f64;
                let floor = per_step / (PCIE_FLOOR_GBPS * 1e9) * 1e3;
                let step = median(&mut step_ms);
                println!(
                    "{:>8} {:>9} {:>3} {:>5} {:>5} {:>9.3} {:>9.3} {:>9.3} {:>6.2} {:>8.1} {:>6.1}",
                    a.context,
                    sel_name,
                    k,
                    batch,
                    mode,
                    step,
                    median(&mut wall_ms),
                    floor,
                    step / floor,
                    f64::from(batch) / step * 1e3,
                    per_step / step / 1e6
                );
            }
        }
    }
    if filled {
        for s in sessions {
            c.close(s)?;
        }
    }
    Ok(())
}

/// Creates `n` sessions and appends `context` tokens to each: one chunk of random bf16 rows,
/// with each appended copy's signs flipped in its own random pattern over the (kv head, dim)
/// positions, so every block is distinct (bounds and scores). Copies alike would make the
/// selector's keep-sets artificial: every distant pick a copy of the same few blocks, ties
/// going to the lowest index, so the same few tiles recur and a cache hits far more than on
/// distinct data.
fn fill(
    c: &mut Client,
    geo: Geometry,
    n: u32,
    context: u32,
) -> Result<Vec<u64>, Box<dyn std::error::Error>> {
    let t0 = Instant::now();
    let mut rng = Rng::new(0xbe7c);
    let elems = CHUNK as usize * (geo.kv_heads * geo.head_dim) as usize * 2 * geo.layers as usize;
    let base = DType::Bf16.encode_vec(&rng.normals(elems));
    let row = (geo.kv_heads * geo.head_dim) as usize; // the payload's innermost [kv_heads][dim]
    let mut sessions = Vec::new();
    for i in 0..n {
        sessions.push(c.create_session(geo, Policy::default(), &format!("engine-bench-{i}"))?);
    }
    let mut payload = base.clone();
    let mut at = 0;
    while at < context {
        // A bf16's sign is bit 7 of its second (little-endian) byte.
        let mask: Vec<u8> = (0..2 * row)
            .map(|b| {
                if b % 2 == 1 && rng.next_u64() & 1 == 1 {
                    0x80
                } else {
                    0
                }
            })
            .collect();
        for (out, src) in payload
            .chunks_exact_mut(2 * row)
            .zip(base.chunks_exact(2 * row))
        {
            for ((o, s), m) in out.iter_mut().zip(src).zip(&mask) {
                *o = s ^ m;
            }
        }
        let memfd = sealed_memfd(c"engine-bench", &payload)?;
        for &id in &sessions {
            c.append_kv_fd(id, at as u64, CHUNK, memfd.as_fd(), 0, payload.len() as u64)?;
        }
        at += CHUNK;
    }
    println!(
        "filled {n} sessions x {context} tokens in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    Ok(sessions)
}
