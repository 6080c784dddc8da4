//! The in-engine step over a running tierd (issue 24's benchmark): sessions of Qwen2.5-7B's
//! geometry filled through tierd (APPEND_KV from one memfd), leased and decoded by this process
//! on its own GPU, every layer in one `decode_step`, the way `gpu_bench` times the kernels over
//! its own pinned buffer. Run both in one device call and compare step times.
//!
//! Cold: the device block cache flushed before each step (every kept tile crosses PCIe); warm:
//! consecutive steps with AR(1) queries (rho 0.9), as in gpu_bench. The floor is the bytes the
//! step moved over PCIe at 55.3 GB/s (gpu_bench's).
//!
//! Usage: engine_bench --socket PATH [--context 131072] [--ks 8,32] [--batches 1,8]
//!                     [--steps 12] [--warmup 3]
//! tierd must run with `host.shared = true` and enough `host.capacity` for max(batches)
//! sessions of `context` tokens (58.7 KiB per token), and this process must be allowed to
//! LEASE (an admin peer or tierd's own uid).

use std::os::fd::AsFd;
use std::path::PathBuf;
use std::time::Instant;

use kvtier_engine::InEngine;
use kvtier_kernels::cuda::{CudaConfig, SummaryDtype, Timing};
use kvtier_protocol::client::Client;
use kvtier_protocol::fdpass::sealed_memfd;
use kvtier_protocol::{DType, Geometry, Policy};
use kvtier_storage::testing::Rng;

const PCIE_FLOOR_GBPS: f64 = 55.3;
const CHUNK: u32 = 1024;

struct Args {
    socket: PathBuf,
    context: u32,
    ks: Vec<u32>,
    batches: Vec<u32>,
    steps: usize,
    warmup: usize,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        socket: PathBuf::new(),
        context: 131072,
        ks: vec![8, 32],
        batches: vec![1, 8],
        steps: 12,
        warmup: 3,
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
            "--ks" => a.ks = list(v()?)?,
            "--batches" => a.batches = list(v()?)?,
            "--steps" => a.steps = v()?.parse().map_err(|e| format!("{e}"))?,
            "--warmup" => a.warmup = v()?.parse().map_err(|e| format!("{e}"))?,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if a.socket.as_os_str().is_empty() {
        return Err("--socket is required".into());
    }
    Ok(a)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = args()?;
    let geo = Geometry::QWEN2_5_7B;
    let n_blocks = a.context / geo.block_tokens;
    let max_batch = *a.batches.iter().max().ok_or("no batches")?;
    let mut c = Client::connect_as(&a.socket, "engine_bench")?;

    // One chunk of random bf16 rows, appended to every session at every position.
    let t0 = Instant::now();
    let mut rng = Rng::new(0xbe7c);
    let elems = CHUNK as usize * (geo.kv_heads * geo.head_dim) as usize * 2 * geo.layers as usize;
    let payload = DType::Bf16.encode_vec(&rng.normals(elems));
    let memfd = sealed_memfd(c"engine-bench", &payload)?;
    let mut sessions = Vec::new();
    for i in 0..max_batch {
        let id = c.create_session(geo, Policy::default(), &format!("engine-bench-{i}"))?;
        let mut at = 0;
        while at < a.context {
            c.append_kv_fd(id, at as u64, CHUNK, memfd.as_fd(), 0, payload.len() as u64)?;
            at += CHUNK;
        }
        sessions.push(id);
    }
    println!(
        "filled {max_batch} sessions x {} tokens in {:.1} s",
        a.context,
        t0.elapsed().as_secs_f64()
    );
    println!(
        "{:>8} {:>3} {:>5} {:>5} {:>9} {:>9} {:>9} {:>6}",
        "context", "k", "batch", "mode", "step_ms", "wall_ms", "floor_ms", "x_floor"
    );
    let hqd = (geo.q_heads * geo.head_dim) as usize * geo.layers as usize;
    for &k in &a.ks {
        let policy = Policy {
            sink_blocks: 1,
            local_blocks: 4,
            top_k: k,
        };
        let cfg = CudaConfig::new(geo, policy, n_blocks + 8, max_batch, SummaryDtype::F32);
        let t1 = Instant::now();
        let mut e = InEngine::connect(&a.socket, 0, cfg)?;
        for &s in &sessions {
            e.attach(s)?;
        }
        e.set_timing(Timing::Step)?;
        println!(
            "k={k}: leased, mapped, registered ({}) and synced {} sessions in {:.1} s",
            match e.registered_read_only() {
                Some(true) => "read-only",
                _ => "read-write mapping",
            },
            sessions.len(),
            t1.elapsed().as_secs_f64()
        );
        for &batch in &a.batches {
            for cold in [true, false] {
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
                let floor = bytes / a.steps as f64 / (PCIE_FLOOR_GBPS * 1e9) * 1e3;
                let step = median(&mut step_ms);
                println!(
                    "{:>8} {:>3} {:>5} {:>5} {:>9.3} {:>9.3} {:>9.3} {:>6.2}",
                    a.context,
                    k,
                    batch,
                    if cold { "cold" } else { "warm" },
                    step,
                    median(&mut wall_ms),
                    floor,
                    step / floor
                );
            }
        }
    }
    for s in sessions {
        c.close(s)?;
    }
    Ok(())
}
