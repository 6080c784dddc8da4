//! CUDA KV path benchmark: per decode step, 28 layers of select + zero-copy gather + split-k
//! attention, Qwen2.5-7B attention geometry (28 layers, 28/4 heads, D=128, bf16, B=128 unless
//! `--block-tokens`).
//!
//! Compares measured step time with the PCIe floor (bytes moved / 55.3 GB/s), cold cache (the
//! block cache flushed before each step) and warm (consecutive steps, AR(1) queries).
//!
//! Host KV: one anonymous mapping (default 60 GB, the 1M-token KV of one session) filled with
//! random bf16 and registered with CUDA. Extents are assigned (slot, layer, block) -> extent
//! modulo the extent count, so batch 8 at 1M (8 x 60 GB) wraps onto the same extents: bytes moved
//! and timing are unaffected, contents repeat. Block summaries are synthetic (random bounds,
//! a few variants rotated over sessions and layers): the selector's cost does not depend on
//! values, and its exactness is covered by the GPU tests.
//!
//! Usage: gpu_bench [--host-gb 60] [--steps 20] [--warmup 3] [--rho 0.9] [--contexts 131072,1048576]
//!                  [--ks 8,32] [--batches 1,8] [--json PATH] [--summaries-bf16] [--trace]
//!                  [--split-step] [--simt-attention] [--no-pdl] [--no-dense] [--sketch C]
//!                  [--block-tokens 128]
//!
//! `--trace` with `KVTIER_NVRTC_DEFINES=-DSEL_TRACE=1` prints the phase breakdown of the last
//! layer's select_score in every measured step (diagnostics; bench/gpu/NOTES.md v24).
//! `--split-step` times the split pass by step only, like the Auto pass (a like-for-like
//! split_ms; no per-kernel columns). `--simt-attention` attends tiles with fp32 FMAs instead of
//! tensor cores (the A/B of bench/gpu/NOTES.md v27). `--no-pdl` launches every layer after
//! the previous layer's merge has ended (no programmatic dependent launch; the A/B of v30).
//!
//! `--sketch C` runs the sketch selector with C candidates (synthetic quarter bounds and key
//! sketches, like the summaries) instead of the key bound. `--block-tokens BT` sets the block
//! size; the sink stays 128 tokens and the local window 512 (one budget of keys at every BT).
//!
//! Beside the sparse path, for each context and batch: dense attention over every block with the
//! KV in GPU memory (where it fits in free device memory) and with the KV read from host memory
//! over PCIe (`CudaBackend::dense_step`); `--no-dense` skips it.

use std::time::Instant;

use kvtier_bench::median;
use kvtier_kernels::cuda::{
    AnonMapping, AttentionMath, CudaBackend, CudaConfig, DenseKv, LaunchMode, PinnedRegion,
    StepItem, SummaryDtype, Timing,
};
use kvtier_storage::sketch::BlockSketches;
use kvtier_storage::testing::XorShift64 as Rng;
use kvtier_storage::{DType, Geometry, Policy};

mod args;
mod dense;
mod rows;
use args::{parse, Args};
use dense::run_dense;
use rows::{overlap, trace_phases, Queries, Row};

const PCIE_GBPS: f64 = 55.3;
/// GPU memory copy bandwidth measured on the H200 (read + write counted; DESIGN.md): the floor
/// quoted for dense attention over KV in GPU memory.
const HBM_GBPS: f64 = 4240.0;
/// Steps timed for dense from host (each reads the whole context over PCIe).
const DENSE_HOST_STEPS: usize = 3;
const LAYERS: u32 = 28;
const HQ: u32 = 28;
const HKV: u32 = 4;
const D: u32 = 128;

/// Uniform in (0, 1).
fn unif(rng: &mut Rng) -> f64 {
    ((rng.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// Standard normal (Box-Muller).
fn normal(rng: &mut Rng) -> f64 {
    (-2.0 * unif(rng).ln()).sqrt() * (std::f64::consts::TAU * unif(rng)).cos()
}

/// Allocates, fills (random bf16 in +-[0.5, 1), all threads) and pins the host KV buffer,
/// halving the size on failure.
fn host_region(be: &CudaBackend, mut bytes: usize, extent: usize) -> Result<PinnedRegion, String> {
    loop {
        bytes -= bytes % extent;
        let t0 = Instant::now();
        let attempt = AnonMapping::new(bytes).map_err(|e| e.to_string()).and_then(|mut m| {
            let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(4);
            let buf = m.as_mut_slice();
            let chunk = buf.len().div_ceil(threads).next_multiple_of(8);
            std::thread::scope(|s| {
                for (i, c) in buf.chunks_mut(chunk).enumerate() {
                    s.spawn(move || {
                        let mut r = Rng(0x9e37_79b9_7f4a_7c15 ^ ((i as u64 + 1) * 0x1234_5678_9abc_def1));
                        for w in c.chunks_exact_mut(8) {
                            let x = (r.next_u64() & 0x807f_807f_807f_807f) | 0x3f00_3f00_3f00_3f00;
                            w.copy_from_slice(&x.to_le_bytes());
                        }
                    });
                }
            });
            let filled = t0.elapsed().as_secs_f64();
            let t1 = Instant::now();
            let r = PinnedRegion::register_owned(be.context(), m).map_err(|e| e.to_string())?;
            println!(
                "host KV buffer: {:.1} GB, filled in {:.1} s, cuMemHostRegister {:.2} s ({} chunks)",
                bytes as f64 / 1e9,
                filled,
                t1.elapsed().as_secs_f64(),
                r.chunk_count()
            );
            Ok(r)
        });
        match attempt {
            Ok(r) => return Ok(r),
            Err(e) if bytes > (4usize << 30) => {
                println!(
                    "host buffer of {:.1} GB failed ({e}); retrying with half",
                    bytes as f64 / 1e9
                );
                bytes /= 2;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Synthetic sketches of `n_blocks` blocks (host layout, kvtier_storage::sketch): random
/// quarter codes, codes and channel scales. The selector's cost does not depend on the values.
fn synthetic_sketches(geo: &Geometry, n_blocks: u32, rng: &mut Rng) -> BlockSketches {
    let mut s = BlockSketches::new(geo, n_blocks as usize);
    for c in s.quarter_codes.iter_mut() {
        *c = (rng.next_u64() % 255) as i8;
    }
    for x in s.quarter_scales.iter_mut() {
        *x = 0.01 + normal(rng).abs() as f32;
    }
    for c in s.codes.iter_mut() {
        *c = rng.next_u64() as u8;
    }
    for x in s.channel_scales.iter_mut() {
        *x = 0.1 + normal(rng).abs() as f32;
    }
    s
}

/// The sink and local window in blocks of `bt` tokens: 128 and 512 tokens at every block size.
fn fixed_blocks(bt: u32) -> (u32, u32) {
    ((128 / bt).max(1), (512 / bt).max(1))
}

fn config(n_blocks: u32, k: u32, batch: u32, a: &Args) -> CudaConfig {
    let (sum_bf16, simt) = (a.sum_bf16, a.simt);
    let (sink, local) = fixed_blocks(a.bt);
    let policy = match a.sketch {
        Some(c) => Policy::sketch(sink, local, k, c),
        None => Policy::bound(sink, local, k),
    };
    let geometry = Geometry::new(LAYERS, HQ, HKV, D, DType::Bf16, a.bt);
    let summaries = if sum_bf16 {
        SummaryDtype::Bf16Outward
    } else {
        SummaryDtype::F32
    };
    CudaConfig {
        attention: if simt {
            AttentionMath::Simt
        } else {
            AttentionMath::TensorCores
        },
        ..CudaConfig::new(geometry, policy, n_blocks, batch, summaries)
    }
}

/// Cold: cache flushed before every step. Warm: consecutive AR(1) queries. Hot: the same
/// query every step, so the keep-set is (nearly) all cache hits: attention over staged tiles.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Cold,
    Warm,
    Hot,
}

#[allow(clippy::too_many_arguments)]
fn run_mode(
    be: &mut CudaBackend,
    args: &Args,
    ctx: u32,
    k: u32,
    batch: u32,
    mode: Mode,
    rho: f64,
    steps: usize,
) -> Result<Row, Box<dyn std::error::Error>> {
    let cold = mode == Mode::Cold;
    let n_blocks = ctx / args.bt;
    let mut qs = Queries::new(
        batch,
        rho,
        0x51ed + ctx as u64 + k as u64 * 7 + batch as u64 * 131,
    );
    be.flush_cache()?;
    let (mut step_ms, mut wall_ms, mut sel, mut gat, mut att) =
        (vec![], vec![], vec![], vec![], vec![]);
    let (mut bytes, mut tiles, mut hits, mut ov, mut ovn) = (0f64, 0f64, 0f64, 0f64, 0usize);
    let mut prev_keep: Option<Vec<Vec<Vec<u32>>>> = None;
    let mut traces: Vec<[f64; 16]> = Vec::new();
    let mut ktraces: Vec<[f64; 10]> = Vec::new();
    let sample_layer = LAYERS - 1;
    for step in 0..args.warmup + steps {
        if cold {
            be.flush_cache()?;
        }
        if mode != Mode::Hot || step == 0 {
            qs.advance();
        }
        let items: Vec<StepItem> =
            qs.q.iter()
                .enumerate()
                .map(|(i, q)| StepItem { slot: i as u32, q })
                .collect();
        let t0 = Instant::now();
        let out = be.decode_step(&items)?;
        let wall = t0.elapsed().as_secs_f64() * 1e3;
        if !out.out.iter().all(|x| x.is_finite()) {
            return Err("non-finite attention output".into());
        }
        let keep = be.last_keep_sets(sample_layer)?;
        if args.trace && step >= args.warmup {
            let (Some(t), Some(k)) = (be.trace("sel_trace")?, be.trace("k_trace")?) else {
                return Err("--trace needs KVTIER_NVRTC_DEFINES=-DSEL_TRACE=1".into());
            };
            traces.extend(trace_phases(&t));
            // The last layer's kernels, relative to plan_fixed's start (its layer's first).
            ktraces.push(std::array::from_fn(|x| k[x] as f64 - k[0] as f64));
        }
        if step >= args.warmup {
            step_ms.push(out.step_ms.unwrap_or(f32::NAN) as f64);
            wall_ms.push(wall);
            // Per-kernel times exist only with split launches and per-layer timing (see main).
            if let Some(timing) = &out.timing {
                for t in timing {
                    sel.extend(t.select_ms.map(|x| x as f64 * 1e3));
                    att.extend(t.fetch_attend_ms.map(|x| x as f64 * 1e3));
                }
                if let Some(f) = timing
                    .iter()
                    .map(|t| t.fetch_attend_ms.map(f64::from))
                    .sum::<Option<f64>>()
                {
                    gat.push(f);
                }
            }
            for s in &out.stats {
                bytes += s.bytes_moved as f64;
                tiles += s.tiles as f64;
                hits += s.hits as f64;
            }
            if let Some(p) = &prev_keep {
                let (sink, local) = fixed_blocks(args.bt);
                let (o, n) = overlap(p, &keep, sink, n_blocks, local);
                ov += o * n as f64;
                ovn += n;
            }
        }
        prev_keep = Some(keep);
    }
    if !traces.is_empty() {
        let names = [
            "span",
            "start spread",
            "q staged",
            "scored",
            "block top-32",
            "list published",
            "counted",
            "last arrival",
            "merge",
            "plan",
            "cyc q",
            "cyc scored",
            "cyc top-32",
            "cyc published",
            "cyc counted",
            "cyc merge+plan",
        ];
        let cols: Vec<String> = (0..16)
            .map(|c| {
                let mut v: Vec<f64> = traces.iter().map(|t| t[c]).collect();
                let m = median(&mut v);
                if c < 10 {
                    format!("{} {:.2}", names[c], m / 1e3)
                } else {
                    format!("{} {:.0}", names[c], m)
                }
            })
            .collect();
        println!(
            "    select_score trace (us, layer {sample_layer}, median of {} steps): {}",
            traces.len(),
            cols.join(", ")
        );
    }
    if !ktraces.is_empty() {
        let names = [
            "plan_fixed",
            "attend fixed",
            "select_score",
            "attend distant",
            "attend_merge",
        ];
        let cols: Vec<String> = (0..5)
            .map(|c| {
                let mut a: Vec<f64> = ktraces.iter().map(|t| t[2 * c]).collect();
                let mut z: Vec<f64> = ktraces.iter().map(|t| t[2 * c + 1]).collect();
                format!(
                    "{} {:.2}-{:.2}",
                    names[c],
                    median(&mut a) / 1e3,
                    median(&mut z) / 1e3
                )
            })
            .collect();
        println!("    kernels of layer {sample_layer} (us from plan_fixed's start; latest block start-end): {}", cols.join(", "));
    }
    let n = steps as f64;
    let tile = (2 * args.bt * D * 2) as f64;
    let (sink, local) = fixed_blocks(args.bt);
    let distant = (n_blocks - sink - local) as f64;
    Ok(Row {
        ctx,
        k,
        batch,
        mode: match mode {
            Mode::Cold => "cold",
            Mode::Warm => "warm",
            Mode::Hot => "hot",
        },
        step_ms: median(&mut step_ms),
        split_ms: f64::NAN,
        wall_ms: median(&mut wall_ms),
        bytes: bytes / n,
        keep_bytes: tiles * tile / n,
        hit_rate: hits / tiles.max(1.0),
        sel_us: median(&mut sel),
        fetch_ms: median(&mut gat),
        att_us: median(&mut att),
        overlap: if ovn > 0 { ov / ovn as f64 } else { f64::NAN },
        chance: (k as f64 / distant).min(1.0),
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse()?;
    let cmd: Vec<String> = std::env::args().collect();
    let extent = (HKV * 2 * args.bt * D * 2) as usize;
    let mut rows = Vec::new();
    let mut overlap_rows = Vec::new();
    let mut dense_rows = Vec::new();
    let mut region: Option<std::sync::Arc<PinnedRegion>> = None;
    let mut device = String::new();
    let mut pdl = false;
    for &ctx in &args.contexts {
        let n_blocks = ctx / args.bt;
        for &k in &args.ks {
            let max_batch = *args.batches.iter().max().unwrap_or(&1);
            let cfg = config(n_blocks, k, max_batch, &args);
            let t0 = Instant::now();
            let mut be = CudaBackend::new(0, cfg)?;
            be.set_dependent_launch(!args.no_pdl);
            pdl = be.dependent_launch();
            device = be.device_name()?;
            println!(
                "backend ctx={ctx} k={k}: created (NVRTC + device alloc) in {:.2} s",
                t0.elapsed().as_secs_f64()
            );
            let r = match region.take() {
                Some(r) => r,
                None => host_region(&be, (args.host_gb * 1e9) as usize, extent)?.into(),
            };
            let n_extents = (r.len() / extent) as u64;
            be.attach_host(r)?;
            // Sessions: summaries (4 synthetic variants), extents, token counts.
            let t1 = Instant::now();
            let per = cfg.geometry.summary_floats_per_block();
            let mut rng = Rng(77);
            let variants: Vec<Vec<f32>> = (0..4)
                .map(|_| {
                    let mut v = vec![0f32; n_blocks as usize * per];
                    for row in v.chunks_mut(2 * D as usize) {
                        for d in 0..D as usize {
                            let a = normal(&mut rng) as f32;
                            let b = normal(&mut rng) as f32;
                            row[d] = a.max(b);
                            row[D as usize + d] = a.min(b);
                        }
                    }
                    v
                })
                .collect();
            let sketches: Vec<BlockSketches> = if cfg.sketch() {
                (0..4)
                    .map(|_| synthetic_sketches(&cfg.geometry, n_blocks, &mut rng))
                    .collect()
            } else {
                Vec::new()
            };
            for slot in 0..max_batch {
                be.open_session(slot)?;
                for l in 0..LAYERS {
                    let v = ((slot + l) % 4) as usize;
                    if let Some(sk) = sketches.get(v) {
                        be.upload_sketches(slot, l, 0, &sk.as_ref())?;
                    } else {
                        be.upload_summaries(slot, l, 0, &variants[v])?;
                    }
                    let base = (slot as u64 * LAYERS as u64 + l as u64) * n_blocks as u64;
                    let offs: Vec<u64> = (0..n_blocks as u64)
                        .map(|b| ((base + b) % n_extents) * extent as u64)
                        .collect();
                    be.map_blocks(slot, l, 0, &offs)?;
                    be.set_tokens(slot, l, ctx)?;
                }
            }
            let wraps = max_batch as u64 * LAYERS as u64 * n_blocks as u64 > n_extents;
            println!(
                "  sessions ready in {:.2} s{}",
                t1.elapsed().as_secs_f64(),
                if wraps {
                    " (block extents wrap: host buffer smaller than batch KV)"
                } else {
                    ""
                }
            );
            for &batch in &args.batches {
                for mode in [Mode::Cold, Mode::Warm, Mode::Hot] {
                    // Measured twice in a row: in the default launch mode (Auto: a layer is
                    // one launch while its tiles mostly miss the block cache) timing only the
                    // step, as the decode path runs (the row's step time); then with split
                    // launches throughout and every layer timed (the split step time and the
                    // per-kernel selector and attention times only split launches can time;
                    // the events between kernels make that step slower, NOTES.md v25).
                    be.set_timing(Timing::Step)?;
                    let mut row =
                        run_mode(&mut be, &args, ctx, k, batch, mode, args.rho, args.steps)?;
                    be.set_launch_mode(LaunchMode::Split);
                    be.set_timing(if args.split_step {
                        Timing::Step
                    } else {
                        Timing::Layers
                    })?;
                    let split = run_mode(&mut be, &args, ctx, k, batch, mode, args.rho, args.steps);
                    be.set_launch_mode(LaunchMode::Auto);
                    let split = split?;
                    row.split_ms = split.step_ms;
                    row.sel_us = split.sel_us;
                    row.att_us = split.att_us;
                    row.fetch_ms = split.fetch_ms;
                    println!(
                        "  ctx={} k={} batch={} {}: step {:.3} ms (split launches {:.3} ms), floor {:.3} ms, sel {:.1} us, fetch+att {:.1} us",
                        ctx, k, batch, row.mode, row.step_ms, row.split_ms, row.floor_ms(), row.sel_us, row.att_us
                    );
                    rows.push(row);
                }
                // Dense does not depend on k: measured with the first k's backend.
                if !args.no_dense && k == args.ks[0] {
                    let d = run_dense(&mut be, &args, ctx, batch)?;
                    println!(
                        "  ctx={ctx} batch={batch} dense: {:.1} GB per step, GPU memory {}, from host {:.1} ms",
                        d.bytes / 1e9,
                        d.gpu_ms.map_or("does not fit".into(), |m| format!("{m:.3} ms")),
                        d.host_ms
                    );
                    dense_rows.push(d);
                }
            }
            // Overlap of consecutive keep-sets vs query correlation (batch 1, warm; Auto, the
            // step alone timed).
            if ctx == *args.contexts.last().unwrap() && k == *args.ks.last().unwrap() {
                be.set_timing(Timing::Step)?;
                for rho in [0.0, 0.5, 0.9, 0.99] {
                    let row = run_mode(&mut be, &args, ctx, k, 1, Mode::Warm, rho, args.steps)?;
                    overlap_rows.push((rho, row));
                }
            }
            for slot in 0..max_batch {
                be.close_session(slot)?;
            }
            region = Some(be.detach_host()?);
        }
    }

    println!();
    println!("device: {device}");
    println!("command: {}", cmd.join(" "));
    println!(
        "geometry: Qwen2.5-7B attention (28 layers, 28/4 heads, D=128, bf16, B={}), sink {}, local {}; summaries {} on the device; tile attention on {}",
        args.bt,
        fixed_blocks(args.bt).0,
        fixed_blocks(args.bt).1,
        if args.sum_bf16 { "bf16 outward" } else { "exact (bf16: lossless for bf16 keys)" },
        if args.simt { "CUDA cores (fp32 FMA)" } else { "tensor cores (bf16 MMA, fp32 factors split hi + lo)" }
    );
    println!(
        "dependent launch (a layer's first kernel starts during the previous layer's merge; step-timed runs only): {}",
        if pdl { "on" } else { "off" }
    );
    println!("step = 28 x (select + plan + fetch/attend), device time by CUDA events (median of {} steps); wall includes uploads, sync, readback", args.steps);
    println!("step_ms: LaunchMode::Auto (a layer is one launch, layer_fused, while its tiles mostly miss the block cache), the step alone timed (Timing::Step, as the decode path runs); split_ms: the same mode run next with split launches (plan_fixed + fixed tiles beside select_score, then the distant tiles), {}",
        if args.split_step {
            "also timed by step only (--split-step: no per-kernel columns)"
        } else {
            "every layer timed (Timing::Layers: 3 events per layer, which slow the step), whose per-kernel times give sel_us, f+att_us and fetchGB/s"
        });
    println!(
        "floor = bytes moved / {PCIE_GBPS} GB/s; warm = consecutive steps, AR(1) queries rho={}",
        args.rho
    );
    println!(
        "{:>8} {:>3} {:>5} {:>5} | {:>8} {:>8} {:>8} {:>8} {:>6} | {:>9} {:>9} {:>6} {:>6} | {:>7} {:>8} {:>7} | {:>7} {:>7}",
        "ctx", "k", "batch", "cache", "step_ms", "split_ms", "wall_ms", "floor_ms", "ratio", "moved_MB", "keep_MB", "GB/s", "hit%", "sel_us", "f+att_us", "fetchGB/s", "overlap", "chance"
    );
    for r in &rows {
        println!(
            "{:>8} {:>3} {:>5} {:>5} | {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>6.2} | {:>9.1} {:>9.1} {:>6.1} {:>6.1} | {:>7.1} {:>8.1} {:>7.1} | {:>7.3} {:>7.4}",
            r.ctx,
            r.k,
            r.batch,
            r.mode,
            r.step_ms,
            r.split_ms,
            r.wall_ms,
            r.floor_ms(),
            r.step_ms / r.floor_ms(),
            r.bytes / 1e6,
            r.keep_bytes / 1e6,
            r.gbps(),
            r.hit_rate * 100.0,
            r.sel_us,
            r.att_us,
            r.bytes / (r.fetch_ms * 1e-3) / 1e9,
            r.overlap,
            r.chance
        );
    }
    if !overlap_rows.is_empty() {
        println!();
        println!("keep-set overlap vs query correlation (ctx {}, k {}, batch 1, warm, layer 27 distant blocks):", overlap_rows[0].1.ctx, overlap_rows[0].1.k);
        println!(
            "{:>5} {:>8} {:>7} {:>6} {:>9} {:>8}",
            "rho", "overlap", "chance", "hit%", "moved_MB", "step_ms"
        );
        for (rho, r) in &overlap_rows {
            println!(
                "{:>5} {:>8.3} {:>7.4} {:>6.1} {:>9.1} {:>8.3}",
                rho,
                r.overlap,
                r.chance,
                r.hit_rate * 100.0,
                r.bytes / 1e6,
                r.step_ms
            );
        }
    }
    if !dense_rows.is_empty() {
        println!();
        println!("dense attention (every block, no selection; step = 28 layers, median; device time) beside the sparse path's cold and hot steps (k {} and {}):", args.ks[0], args.ks.last().unwrap());
        println!("floors: in GPU memory bytes / {HBM_GBPS} GB/s (measured device copy), from host bytes / {PCIE_GBPS} GB/s");
        println!(
            "{:>8} {:>5} | {:>9} | {:>10} {:>8} {:>6} | {:>11} {:>9} {:>6} | {:>13} {:>13}",
            "ctx",
            "batch",
            "KV_GB",
            "gpu_ms",
            "floor",
            "ratio",
            "host_ms",
            "floor",
            "ratio",
            "x sparse cold",
            "x sparse hot"
        );
        for d in &dense_rows {
            let sparse = |mode: &str| -> Vec<f64> {
                rows.iter()
                    .filter(|r| r.ctx == d.ctx && r.batch == d.batch && r.mode == mode)
                    .map(|r| r.step_ms)
                    .collect()
            };
            let (cold, hot) = (sparse("cold"), sparse("hot"));
            let best = d.gpu_ms.unwrap_or(d.host_ms);
            let xs = |v: &[f64]| {
                v.iter()
                    .map(|s| format!("{:.1}", best / s))
                    .collect::<Vec<_>>()
                    .join("/")
            };
            let gpu_floor = d.bytes / (HBM_GBPS * 1e9) * 1e3;
            let host_floor = d.bytes / (PCIE_GBPS * 1e9) * 1e3;
            println!(
                "{:>8} {:>5} | {:>9.1} | {:>10} {:>8.3} {:>6} | {:>11.1} {:>9.1} {:>6.2} | {:>13} {:>13}",
                d.ctx,
                d.batch,
                d.bytes / 1e9,
                d.gpu_ms.map_or("no fit".into(), |m| format!("{m:.3}")),
                gpu_floor,
                d.gpu_ms.map_or("-".into(), |m| format!("{:.2}", m / gpu_floor)),
                d.host_ms,
                host_floor,
                d.host_ms / host_floor,
                xs(&cold),
                xs(&hot)
            );
        }
        println!("x sparse: the fastest dense (GPU memory where it fits, else from host) over the sparse step, per k");
    }
    if let Some(path) = &args.json {
        let mut s = String::from("[\n");
        for (i, r) in rows.iter().enumerate() {
            s += &format!(
                "  {{\"ctx\":{},\"k\":{},\"batch\":{},\"cache\":\"{}\",\"step_ms\":{:.4},\"split_step_ms\":{:.4},\"wall_ms\":{:.4},\"floor_ms\":{:.4},\"bytes\":{:.0},\"keep_bytes\":{:.0},\"hit_rate\":{:.4},\"select_us\":{:.2},\"fetch_ms_step\":{:.4},\"attend_us\":{:.2},\"overlap\":{:.4},\"chance\":{:.5}}}{}\n",
                r.ctx, r.k, r.batch, r.mode, r.step_ms, r.split_ms, r.wall_ms, r.floor_ms(), r.bytes, r.keep_bytes, r.hit_rate, r.sel_us, r.fetch_ms, r.att_us, r.overlap, r.chance,
                if i + 1 < rows.len() { "," } else { "" }
            );
        }
        s += "]\n";
        std::fs::write(path, s)?;
    }
    Ok(())
}
