//! The NVMe tier, measured: restore of a ~4 GB session, striping over two links of different
//! bandwidth (bandwidth-proportional vs uniform, against the predicted makespan), a decode
//! step whose keep-set is cold on NVMe vs the same step all in RAM, and decode steps whose
//! keep-set is split across RAM and both NVMe links (proportional vs uniform striping, against
//! the predicted max over links).
//!
//! cargo run --release -p kvtier-bench --bin nvme_bench -- [--tokens 69760]
//!     [--dir target/tier-bench] [--fast-dir /dev/shm/kvtier-bench] [--steps 3] [--workers N]
//!     [--driver auto|pread] [--cold-frac 0.5] [--mixed-steps 9] [--only restore|stripe|mixed|cold]
//!
//! `--dir` should be on the NVMe (or whatever disk) under test; `--fast-dir` on a faster link
//! (tmpfs stands in for a second, faster device on a machine with one disk). `--workers` sets
//! the page store's and the restore's threads (default: one per core, at most 8).
//!
//! The store and restore floors are the session's bytes over the slow link's bandwidth as a
//! plain O_DIRECT reader (writer) measures it: 1 MiB preads (pwrites) of a scratch file on
//! the same number of threads, best of three passes.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_bench::{
    cpu_description, decode_step, decode_step_timed, each_flag, fill_bf16, gbps, median,
};
use kvtier_storage::nvme::link::{probe_path, Link};
use kvtier_storage::nvme::manifest::{GeometryRecord, PolicyRecord, SessionRecord};
use kvtier_storage::nvme::{
    open_best_driver, AlignedBuf, BlockRun, DeviceConfig, DirectFile, IoDriver, NvmeError,
    NvmeTier, PageStore, PageStoreConfig, PreadDriver, TierSource,
};
use kvtier_storage::testing::Rng;
use kvtier_storage::{
    ArenaOptions, ColdSource, Geometry, HostArena, KvCache, Policy, StorageError, StoredBlock,
};

struct Args {
    tokens: u64,
    dir: PathBuf,
    fast_dir: PathBuf,
    steps: usize,
    workers: usize,
    driver: String,
    cold_frac: f64,
    mixed_steps: usize,
    only: Option<String>,
}

impl Args {
    fn runs(&self, section: &str) -> bool {
        self.only.as_deref().is_none_or(|o| o == section)
    }
}

fn parse_args() -> Args {
    let mut a = Args {
        tokens: 69_760,
        dir: PathBuf::from("target/tier-bench"),
        fast_dir: PathBuf::from("/dev/shm/kvtier-bench"),
        steps: 3,
        workers: kvtier_storage::default_workers(),
        driver: "auto".into(),
        cold_frac: 0.5,
        mixed_steps: 9,
        only: None,
    };
    each_flag(|flag, val| match flag {
        "--tokens" => a.tokens = val().parse().expect("--tokens"),
        "--dir" => a.dir = val().into(),
        "--fast-dir" => a.fast_dir = val().into(),
        "--steps" => a.steps = val().parse().expect("--steps"),
        "--workers" => a.workers = val().parse().expect("--workers"),
        "--driver" => a.driver = val(),
        "--cold-frac" => a.cold_frac = val().parse().expect("--cold-frac"),
        "--mixed-steps" => a.mixed_steps = val().parse().expect("--mixed-steps"),
        "--only" => a.only = Some(val()),
        other => kvtier_bench::usage_error(format!("unknown flag {other}")),
    });
    a
}

const G: Geometry = Geometry::QWEN2_5_7B;
const SESSION: u64 = 1;

fn record(kv: &KvCache) -> SessionRecord {
    SessionRecord {
        id: SESSION,
        owner_uid: 0,
        label: "bench".into(),
        geometry: GeometryRecord::from(&G),
        policy: PolicyRecord::from(&Policy::bound(1, 4, 32)),
        layer_tokens: (0..G.layers).map(|l| kv.tokens(l).unwrap()).collect(),
        pages: Vec::new(),
        pinned: false,
        created_unix_ms: 0,
    }
}

fn arena(blocks: usize) -> HostArena {
    HostArena::new(&ArenaOptions::new(
        blocks * G.block_bytes(),
        G.block_bytes(),
    ))
    .expect("arena")
}

/// A fresh tier on `devices` (path, capacity, bandwidth weight) in `dir`.
fn tier(
    dir: &Path,
    devices: &[(PathBuf, u64, f64)],
    driver: Arc<dyn IoDriver>,
    workers: usize,
) -> NvmeTier {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
    for (p, _, _) in devices {
        let _ = std::fs::remove_file(p);
    }
    let store = PageStore::open(
        &PageStoreConfig {
            devices: devices
                .iter()
                .map(|(path, cap, bw)| DeviceConfig {
                    path: path.clone(),
                    capacity_bytes: *cap,
                    bandwidth_bytes_per_s: *bw,
                })
                .collect(),
            max_payload: G.block_bytes(),
        },
        driver,
    )
    .expect("page store");
    store.set_workers(workers).expect("--workers");
    NvmeTier::open(store, dir).expect("tier").0
}

/// Writes every block of `kv` to `tier` in one put_session; returns the time.
fn store_all(tier: &NvmeTier, kv: &KvCache) -> Duration {
    let mut runs = Vec::new();
    for l in 0..G.layers {
        for b in 0..kv.layer(l).unwrap().blocks() as u32 {
            runs.push(BlockRun {
                layer: l,
                block: b,
                bytes: kv.run(l, b).unwrap(),
            });
        }
    }
    let t0 = Instant::now();
    tier.put_session(&record(kv), &runs).expect("store");
    t0.elapsed()
}

/// Reads the whole session back into a fresh cache (warm restart, as tierd does it: the next
/// batch is read and verified while this one's tiles and bounds are rebuilt); returns the time.
fn restore_all(tier: &NvmeTier, tokens: u64, keep: bool) -> (Duration, KvCache) {
    let blocks = G.blocks_for(tokens) as usize * G.layers as usize;
    let mut kv = KvCache::new(G, arena(blocks + 64)).unwrap();
    let bt = G.block_tokens as u64;
    let workers = tier.store().workers();
    let wanted: Vec<(u32, u32)> = (0..G.layers)
        .flat_map(|l| (0..G.blocks_for(tokens) as u32).map(move |b| (l, b)))
        .collect();
    let t0 = Instant::now();
    tier.read_runs_pipelined(SESSION, &wanted, |r, pages| -> Result<(), Failed> {
        let pages = pages.into_iter().collect::<Result<Vec<_>, _>>()?;
        let runs: Vec<StoredBlock> = pages
            .iter()
            .zip(&wanted[r])
            .map(|(page, &(layer, b))| StoredBlock {
                layer,
                run: page.payload(),
                valid: (tokens - b as u64 * bt).min(bt) as usize,
                keep,
            })
            .collect();
        Ok(kv.restore_blocks(&runs, workers)?)
    })
    .expect("restore");
    (t0.elapsed(), kv)
}

/// A failed restore: a page or the rebuild.
#[derive(Debug)]
#[allow(dead_code)] // read through Debug
enum Failed {
    Nvme(NvmeError),
    Storage(StorageError),
}

impl From<NvmeError> for Failed {
    fn from(e: NvmeError) -> Self {
        Failed::Nvme(e)
    }
}

impl From<StorageError> for Failed {
    fn from(e: StorageError) -> Self {
        Failed::Storage(e)
    }
}

/// The link as a plain O_DIRECT reader or writer sees it: 1 MiB preads (pwrites) covering
/// `span` bytes of a scratch file at `path`, split over `threads` threads, each cycling through
/// 32 MiB of buffers (so the data lands in memory, as a page store's does, not in one
/// cache-resident buffer). A write pass writes a fresh file, as storing a session does (on a
/// VM, first writes to fresh tmpfs pages cost several times what rewrites do). Bytes/s,
/// best of three passes. Read passes read what the write passes left.
fn plain_rate(path: &Path, span: u64, threads: usize, write: bool) -> f64 {
    use std::os::unix::fs::FileExt;
    const IO: u64 = 1 << 20;
    const RING: usize = 32;
    let n = span / IO;
    let pass = || {
        if write {
            let _ = std::fs::remove_file(path);
        }
        let f = DirectFile::open(path).expect("open scratch");
        f.ensure_len(n * IO).expect("allocate scratch");
        let t0 = Instant::now();
        std::thread::scope(|s| {
            for t in 0..threads as u64 {
                let f = &f;
                s.spawn(move || {
                    let mut ring: Vec<AlignedBuf> = (0..RING)
                        .map(|_| {
                            let mut b = AlignedBuf::new(IO as usize, f.mem_align()).unwrap();
                            b.fill(0x5A);
                            b
                        })
                        .collect();
                    let (a, b) = (t * n / threads as u64, (t + 1) * n / threads as u64);
                    for (k, i) in (a..b).enumerate() {
                        let buf = &mut ring[k % RING];
                        if write {
                            f.file().write_all_at(buf, i * IO).expect("pwrite");
                        } else {
                            f.file().read_exact_at(buf, i * IO).expect("pread");
                        }
                    }
                });
            }
        });
        (n * IO) as f64 / t0.elapsed().as_secs_f64()
    };
    (0..3).map(|_| pass()).fold(0.0, f64::max)
}

/// The link as tierd probes it at startup (over written bytes, see `probe_path`).
fn probe(driver: &dyn IoDriver, path: &Path) -> Link {
    probe_path(driver, path, Default::default()).expect("probe")
}

fn main() {
    let args = parse_args();
    let driver: Arc<dyn IoDriver> = match args.driver.as_str() {
        "auto" => open_best_driver(Default::default()),
        "pread" => Arc::new(PreadDriver::new()),
        other => panic!("--driver {other}: auto or pread"),
    };
    println!(
        "kvtier nvme_bench: Qwen2.5-7B geometry, {} tokens",
        args.tokens
    );
    println!(
        "machine: {}; I/O driver: {}",
        cpu_description(),
        driver.name()
    );
    println!(
        "links: slow = {}, fast = {}; page store and restore workers: {}",
        args.dir.display(),
        args.fast_dir.display(),
        args.workers
    );
    println!(
        "command: cargo run --release -p kvtier-bench --bin nvme_bench -- {}",
        std::env::args().skip(1).collect::<Vec<_>>().join(" ")
    );
    std::fs::create_dir_all(&args.dir).unwrap();
    std::fs::create_dir_all(&args.fast_dir).unwrap();

    // The session, built in RAM.
    let blocks = G.blocks_for(args.tokens + 64) as usize * G.layers as usize;
    let mut kv = KvCache::new(G, arena(blocks)).unwrap();
    let mut rng = Rng::new(7);
    let mut payload = vec![0u8; 2048 * G.kv_bytes_per_token()];
    let mut at = 0;
    while at < args.tokens {
        let n = 2048.min(args.tokens - at);
        let p = &mut payload[..n as usize * G.kv_bytes_per_token()];
        fill_bf16(&mut rng, p);
        kv.append(at, n, p).unwrap();
        at += n;
    }
    let bytes = kv.extents() as u64 * G.block_bytes() as u64;
    let page = (G.block_bytes() as u64 + 64).next_multiple_of(4096);
    let cap = kv.extents() as u64 * page + (64 << 20);
    println!(
        "session: {:.2} GB of KV in {} blocks",
        bytes as f64 / 1e9,
        kv.extents()
    );

    // Link bandwidths, probed the way tierd does at startup.
    let slow_path = args.dir.join("pages-slow");
    let fast_path = args.fast_dir.join("pages-fast");
    let slow = probe(driver.as_ref(), &slow_path);
    let fast = probe(driver.as_ref(), &fast_path);
    println!(
        "probe: slow {:.2} GB/s ({:.0} us), fast {:.2} GB/s ({:.0} us)",
        slow.bandwidth_bytes_per_s / 1e9,
        slow.latency_s * 1e6,
        fast.bandwidth_bytes_per_s / 1e9,
        fast.latency_s * 1e6
    );

    // The slow link as a plain reader and writer see it (1 GiB of a scratch file).
    let scratch = args.dir.join("plain-scratch");
    let plain_span = bytes.min(1 << 30);
    let plain_write = plain_rate(&scratch, plain_span, args.workers, true);
    let plain_read = plain_rate(&scratch, plain_span, args.workers, false);
    let _ = std::fs::remove_file(&scratch);
    println!(
        "plain O_DIRECT on the slow link, 1 MiB, {} threads: write {:.2} GB/s, read {:.2} GB/s",
        args.workers,
        plain_write / 1e9,
        plain_read / 1e9
    );
    let floor = |rate: f64| Duration::from_secs_f64(bytes as f64 / rate);

    // 1. Restore of the whole session from one device.
    let one = || {
        tier(
            &args.dir.join("one"),
            &[(slow_path.clone(), cap, 1.0)],
            driver.clone(),
            args.workers,
        )
    };
    if args.runs("restore") {
        let t = one();
        let w = store_all(&t, &kv);
        let (r, _) = restore_all(&t, args.tokens, false);
        println!();
        println!(
            "restore ({:.2} GB, one device: {}):",
            bytes as f64 / 1e9,
            args.dir.display()
        );
        println!(
            "  write (pages + fdatasync + manifest): {:>8.2?}  {:.2} GB/s   floor {:.2?} (plain writer)",
            w,
            gbps(bytes, w),
            floor(plain_write)
        );
        println!(
            "  read + verify + rebuild bounds:       {:>8.2?}  {:.2} GB/s   floor {:.2?} (plain reader), {:.2?} at the probed {:.2} GB/s",
            r,
            gbps(bytes, r),
            floor(plain_read),
            Duration::from_secs_f64(bytes as f64 / slow.bandwidth_bytes_per_s),
            slow.bandwidth_bytes_per_s / 1e9
        );
    }

    // 2. Striping over two links: proportional to probed bandwidth vs uniform. Both tiers stay
    // for the mixed decode steps (4).
    let links = [slow, fast];
    let mut striped = Vec::new();
    if args.runs("stripe") || args.runs("mixed") {
        println!();
        println!("striping over two links (read all pages back):");
        println!(
            "  {:<13} {:>10} {:>10} {:>10} {:>11} {:>8}",
            "mode", "slow GB", "fast GB", "read", "predicted", "ratio"
        );
    }
    for (mode, ws, wf) in [
        (
            "proportional",
            slow.bandwidth_bytes_per_s,
            fast.bandwidth_bytes_per_s,
        ),
        ("uniform", 1.0, 1.0),
    ] {
        if !(args.runs("stripe") || args.runs("mixed")) {
            break;
        }
        let t = tier(
            &args.dir.join(mode),
            &[(slow_path.clone(), cap, ws), (fast_path.clone(), cap, wf)],
            driver.clone(),
            args.workers,
        );
        let w = store_all(&t, &kv);
        println!("  ({mode}: stored in {w:.2?})");
        let u = t.store().usage();
        let (bs, bf) = (u.devices[0].bytes_used, u.devices[1].bytes_used);
        if args.runs("stripe") {
            let mut times = Vec::new();
            for _ in 0..3 {
                times.push(restore_all(&t, args.tokens, false).0);
            }
            let r = median(&mut times);
            let predicted = (slow.latency_s + bs as f64 / slow.bandwidth_bytes_per_s)
                .max(fast.latency_s + bf as f64 / fast.bandwidth_bytes_per_s);
            println!(
                "  {:<13} {:>10.2} {:>10.2} {:>10.2?} {:>11.2?} {:>7.2}x",
                mode,
                bs as f64 / 1e9,
                bf as f64 / 1e9,
                r,
                Duration::from_secs_f64(predicted),
                r.as_secs_f64() / predicted
            );
        }
        striped.push((mode, t));
    }

    // 3. A decode step whose keep-set is cold on NVMe vs the same step in RAM.
    if args.runs("cold") {
        let t = one();
        store_all(&t, &kv);
        let (_, mut cold) = restore_all(&t, args.tokens, false);
        let src = TierSource {
            tier: &t,
            session: SESSION,
        };
        let policy = Policy::default();
        let step = |kv: &mut KvCache, cold: Option<&dyn ColdSource>, rng: &mut Rng| {
            let t0 = Instant::now();
            let stats = decode_step(kv, policy, cold, rng);
            let promoted: u64 = stats.iter().map(|s| s.bytes_promoted).sum();
            (t0.elapsed(), promoted)
        };
        println!();
        println!(
            "decode step, 28 layers, k=32 (first step: keep-set cold on {}):",
            args.dir.display()
        );
        let (tc, moved) = step(&mut cold, Some(&src), &mut rng);
        drop(cold);
        let mut warm = Vec::new();
        for _ in 0..args.steps {
            warm.push(step(&mut kv, None, &mut rng).0);
        }
        kv.truncate(args.tokens);
        let tw = median(&mut warm);
        println!(
            "  cold keep-set: {:>8.2?}  ({:.1} MB read from NVMe; floor {:.2?} at the probed bandwidth)",
            tc,
            moved as f64 / 1e6,
            Duration::from_secs_f64(moved as f64 / slow.bandwidth_bytes_per_s)
        );
        println!("  all in RAM:    {:>8.2?}  (median of {})", tw, args.steps);
    }

    // 4. Decode steps whose keep-set spans RAM and both NVMe links.
    if args.runs("mixed") {
        mixed_steps(&args, &mut kv, &striped, &links);
    }
    let _ = std::fs::remove_dir_all(&args.fast_dir);
}

/// One mode's timings of one mixed step.
#[derive(Default, Clone)]
struct MixedStep {
    total: Duration,
    fetch: Duration,
    /// Sum over layers of the max over links of latency + bytes / bandwidth: the layers
    /// promote one after another, each layer's links in parallel.
    predicted: Duration,
    link_bytes: [u64; 2],
    /// Bytes each layer promoted from each link (to re-predict with the tracked links).
    per_layer: Vec<[u64; 2]>,
}

/// Decode steps (28 layers, k=32) whose keep-set is split across RAM and the two NVMe links:
/// a seeded `--cold-frac` of each layer's full blocks is evicted (their durable copies are the
/// pages each tier striped over the links), then each step runs once per striping mode on the
/// same cache state and query, the modes alternating step by step. After each run the step's
/// token is truncated away and the promoted blocks evicted again, so every run starts from the
/// same state. The fetch stage (promotion: read, verify, copy into extents) is compared with the
/// link model's prediction from the probed links.
fn mixed_steps(args: &Args, kv: &mut KvCache, tiers: &[(&str, NvmeTier)], links: &[Link; 2]) {
    let mut pick = Rng::new(11);
    let mut cold: Vec<Vec<u32>> = Vec::new();
    for l in 0..G.layers {
        // The tail block stays: each step appends to it, so its stored page goes stale.
        let full = kv.layer(l).unwrap().blocks() as u32 - 1;
        cold.push(
            (0..full)
                .filter(|_| (pick.uniform() as f64) < args.cold_frac)
                .collect(),
        );
    }
    let evict = |kv: &mut KvCache| {
        for (l, blocks) in cold.iter().enumerate() {
            for &b in blocks {
                kv.evict(l as u32, b);
            }
        }
    };
    evict(kv);
    let cold_bytes: u64 = cold.iter().map(|c| c.len() as u64).sum::<u64>() * G.block_bytes() as u64;
    let device: Vec<std::collections::HashMap<(u32, u32), usize>> = tiers
        .iter()
        .map(|(_, t)| {
            t.session(SESSION)
                .expect("stored session")
                .pages
                .iter()
                .map(|p| ((p.layer, p.block), p.device as usize))
                .collect()
        })
        .collect();
    let policy = Policy::default();
    let mut rng = Rng::new(23);
    let mut runs: Vec<Vec<MixedStep>> = vec![Vec::new(); tiers.len()];
    for step in 0..args.mixed_steps + 1 {
        // Every mode gets the same query and new tokens: the same generator state.
        let start = rng.clone();
        for (m, (_, t)) in tiers.iter().enumerate() {
            let src = TierSource {
                tier: t,
                session: SESSION,
            };
            let mut r = MixedStep::default();
            rng = start.clone();
            let t0 = Instant::now();
            let (_, timings) = decode_step_timed(kv, policy, Some(&src), &mut rng);
            r.total = t0.elapsed();
            r.fetch = Duration::from_nanos(timings.fetch_ns);
            // What came from which link: the designated cold blocks now resident.
            let mut predicted = 0.0;
            for (l, blocks) in cold.iter().enumerate() {
                let mut per = [0u64; 2];
                for &b in blocks {
                    if kv.is_resident(l as u32, b) {
                        per[device[m][&(l as u32, b)]] += G.block_bytes() as u64;
                    }
                }
                predicted += links[0].time(per[0]).max(links[1].time(per[1]));
                r.link_bytes[0] += per[0];
                r.link_bytes[1] += per[1];
                r.per_layer.push(per);
            }
            r.predicted = Duration::from_secs_f64(predicted);
            kv.truncate(args.tokens);
            evict(kv);
            // Step 0 warms the page store's buffer pool and the arena's extents.
            if step > 0 {
                runs[m].push(r);
            }
        }
    }
    // Both modes ran the same steps from the same state, so they promoted the same blocks;
    // only where those blocks' pages lie differs.
    for (i, p) in runs[0].iter().enumerate() {
        for r in &runs[1..] {
            assert_eq!(
                p.link_bytes.iter().sum::<u64>(),
                r[i].link_bytes.iter().sum::<u64>(),
                "step {i}: the striping modes promoted different keep-sets"
            );
        }
    }
    println!();
    println!(
        "decode steps, 28 layers, k=32, keep-set split across RAM and two NVMe links ({:.0}% of blocks cold, {:.2} GB on NVMe only; median of {} steps per mode, modes alternating):",
        args.cold_frac * 100.0,
        cold_bytes as f64 / 1e9,
        args.mixed_steps
    );
    println!(
        "  {:<13} {:>9} {:>9} {:>10} {:>10} {:>8} {:>10} {:>10} {:>8}",
        "mode", "slow MB", "fast MB", "fetch", "predicted", "ratio", "step", "tracked", "ratio"
    );
    let mut fetch_medians = Vec::new();
    let mut tracked_rates = Vec::new();
    for ((mode, t), r) in tiers.iter().zip(&mut runs) {
        let med = |f: &dyn Fn(&MixedStep) -> Duration| {
            let mut xs: Vec<Duration> = r.iter().map(f).collect();
            median(&mut xs)
        };
        let (fetch, predicted, total) =
            (med(&|s| s.fetch), med(&|s| s.predicted), med(&|s| s.total));
        // The same model with the links as the page store tracked them over these reads
        // (whole pages at a decode step's queue depth) instead of as probed at startup.
        let tracked = t.store().read_links();
        let (tp, tr) = match &tracked {
            Some(l) => {
                let d = med(&|s| {
                    Duration::from_secs_f64(
                        s.per_layer
                            .iter()
                            .map(|b| l[0].time(b[0]).max(l[1].time(b[1])))
                            .sum(),
                    )
                });
                tracked_rates.push(format!(
                    "{mode}: slow {:.2} GB/s ({:.0} us), fast {:.2} GB/s ({:.0} us)",
                    l[0].bandwidth_bytes_per_s / 1e9,
                    l[0].latency_s * 1e6,
                    l[1].bandwidth_bytes_per_s / 1e9,
                    l[1].latency_s * 1e6
                ));
                (
                    format!("{d:.2?}"),
                    format!("{:.2}x", fetch.as_secs_f64() / d.as_secs_f64()),
                )
            }
            None => ("-".into(), "-".into()),
        };
        let n = r.len().max(1) as f64;
        let mb = |i: usize| r.iter().map(|s| s.link_bytes[i]).sum::<u64>() as f64 / n / 1e6;
        println!(
            "  {:<13} {:>9.1} {:>9.1} {:>10.2?} {:>10.2?} {:>7.2}x {:>10.2?} {:>10} {:>8}",
            mode,
            mb(0),
            mb(1),
            fetch,
            predicted,
            fetch.as_secs_f64() / predicted.as_secs_f64(),
            total,
            tp,
            tr
        );
        fetch_medians.push(fetch);
    }
    println!(
        "  links as probed at startup: slow {:.2} GB/s ({:.0} us), fast {:.2} GB/s ({:.0} us)",
        links[0].bandwidth_bytes_per_s / 1e9,
        links[0].latency_s * 1e6,
        links[1].bandwidth_bytes_per_s / 1e9,
        links[1].latency_s * 1e6
    );
    for line in tracked_rates {
        println!("  links as tracked after the steps, {line}");
    }
    if let [p, u] = fetch_medians[..] {
        println!(
            "  proportional fetch vs uniform: {:.2}x",
            u.as_secs_f64() / p.as_secs_f64()
        );
    }
}
