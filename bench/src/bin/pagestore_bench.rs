//! Page store random-read benchmark against a plain O_DIRECT pread reader, side by side, at
//! the same transfer size (one page) and queue depth, on the same file.
//!
//! cargo run --release -p kvtier-bench --bin pagestore_bench -- \
//!     [--dir DIR] [--file-mib 1024] [--payload 262144] [--qd 1,4,16,32] [--secs 3] [--rounds 6] [--json FILE]
//!
//! Rows:
//! - `pread`: QD threads, each a loop of one O_DIRECT pread of a random page (fio psync-like).
//! - `store/uring xQD threads`: QD threads, each reading one random page per call through
//!   `PageStore::read_pages` (io_uring driver, header + crc32c verification included).
//! - `store/uring batch`: one thread, `read_pages` of QD random pages per call (how the daemon
//!   fetches a keep-set's misses); latency is per batch.
//! - `uring raw batch`: the io_uring driver alone, QD reads per submit, no verification.

use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_storage::nvme::io::{UringConfig, UringDriver};
use kvtier_storage::nvme::store::{PageRead, PageWrite};
use kvtier_storage::nvme::{
    AlignedBuf, DeviceConfig, IoDriver, IoRequest, PageAddr, PageId, PageStore, PageStoreConfig,
};

struct Args {
    dir: PathBuf,
    file_mib: u64,
    payload: usize,
    qds: Vec<usize>,
    secs: f64,
    rounds: usize,
    json: Option<PathBuf>,
}

fn parse_args() -> Args {
    let mut a = Args {
        dir: std::env::temp_dir(),
        file_mib: 1024,
        payload: 256 << 10,
        qds: vec![1, 4, 16, 32],
        secs: 3.0,
        rounds: 6,
        json: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        match k.as_str() {
            "--dir" => a.dir = v().into(),
            "--file-mib" => a.file_mib = v().parse().expect("--file-mib"),
            "--payload" => a.payload = v().parse().expect("--payload"),
            "--qd" => a.qds = v().split(',').map(|s| s.parse().expect("--qd")).collect(),
            "--secs" => a.secs = v().parse().expect("--secs"),
            "--rounds" => a.rounds = v().parse().expect("--rounds"),
            "--json" => a.json = Some(v().into()),
            other => kvtier_bench::usage_error(format!("unknown argument {other}")),
        }
    }
    a
}

struct Row {
    mode: String,
    qd: usize,
    bytes: u64,
    ops: u64,
    secs: f64,
    lat_us: Vec<f64>,
}

impl Row {
    /// (GB/s, pages of `page` bytes per second, p50 us, p99 us).
    fn rates(&self, page: usize) -> (f64, f64, f64, f64) {
        (
            self.bytes as f64 / self.secs / 1e9,
            self.bytes as f64 / page as f64 / self.secs,
            self.pct(0.5),
            self.pct(0.99),
        )
    }

    fn pct(&self, p: f64) -> f64 {
        if self.lat_us.is_empty() {
            return f64::NAN;
        }
        let i = ((self.lat_us.len() as f64 - 1.0) * p).round() as usize;
        self.lat_us[i]
    }
}

struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) % n
    }
}

/// Runs `threads` workers for `secs`; each calls `op` (returning bytes moved) in a loop.
fn run_threads<F>(mode: &str, qd: usize, threads: usize, secs: f64, op: F) -> Row
where
    F: Fn(&mut Rng) -> u64 + Sync,
{
    let stop = AtomicBool::new(false);
    let start = Instant::now();
    let results: Vec<(u64, u64, Vec<f64>)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                let stop = &stop;
                let op = &op;
                s.spawn(move || {
                    let mut rng = Rng(t as u64 * 7919 + 1);
                    let (mut bytes, mut ops, mut lat) = (0u64, 0u64, Vec::new());
                    while !stop.load(Ordering::Relaxed) {
                        let t0 = Instant::now();
                        bytes += op(&mut rng);
                        lat.push(t0.elapsed().as_secs_f64() * 1e6);
                        ops += 1;
                    }
                    (bytes, ops, lat)
                })
            })
            .collect();
        std::thread::sleep(Duration::from_secs_f64(secs));
        stop.store(true, Ordering::Relaxed);
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let secs = start.elapsed().as_secs_f64();
    let mut lat: Vec<f64> = results.iter().flat_map(|r| r.2.iter().copied()).collect();
    lat.sort_by(f64::total_cmp);
    Row {
        mode: mode.into(),
        qd,
        bytes: results.iter().map(|r| r.0).sum(),
        ops: results.iter().map(|r| r.1).sum(),
        secs,
        lat_us: lat,
    }
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown cpu".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_string();
    format!("{cpu}, {cores} cores, Linux {kernel}")
}

fn main() {
    let a = parse_args();
    let dir = a
        .dir
        .join(format!("kvtier-pagestore-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let uring = Arc::new(UringDriver::new(UringConfig { queue_depth: 64 }).expect("io_uring"));
    let cfg = PageStoreConfig {
        devices: vec![DeviceConfig {
            path: dir.join("dev0"),
            capacity_bytes: a.file_mib << 20,
            bandwidth_bytes_per_s: 1.0,
        }],
        max_payload: a.payload,
    };
    let store = PageStore::open(&cfg, uring.clone()).unwrap();
    let page = store.page_bytes(a.payload) as usize;
    let units = store.page_units(a.payload);
    let n = store.device_units()[0] / u64::from(units);
    eprintln!("filling {n} pages of {page} bytes ...");
    // A fresh store hands out the pages one after another: page k is at unit k * units.
    let addrs: Vec<PageAddr> = store.alloc(1, n as usize, a.payload).unwrap();
    let payload: Vec<u8> = (0..a.payload).map(|i| (i * 31 + 7) as u8).collect();
    let id = |p: u64| PageId {
        session: 1,
        layer: 0,
        block: p as u32,
        generation: 1,
    };
    for chunk in addrs.chunks(64) {
        let w: Vec<PageWrite> = chunk
            .iter()
            .map(|&addr| PageWrite {
                addr,
                id: id(addr.page),
                payload: &payload,
            })
            .collect();
        store.write_pages(&w).unwrap();
    }
    store.sync().unwrap();
    let file = store.device_files()[0].clone();
    let read = |rng: &mut Rng| PageRead {
        addr: PageAddr {
            device: 0,
            page: rng.below(n) * u64::from(units),
            units,
        },
        id: PageId {
            session: 1,
            layer: 0,
            block: 0,
            generation: 1,
        },
        expected_crc: None,
    };
    let fix = |mut r: PageRead| {
        r.id = id(r.addr.page);
        r
    };

    // The modes take turns in short slices so that drift of a shared virtual disk hits all
    // of them alike; each row is the sum of its slices.
    let mut rows: Vec<Row> = Vec::new();
    let slice = a.secs / a.rounds as f64;
    for (round, &qd) in (0..a.rounds).flat_map(|r| a.qds.iter().map(move |q| (r, q))) {
        eprintln!("round {round} qd {qd} ...");
        let f = file.clone();
        rows.push(run_threads("pread", qd, qd, slice, move |rng| {
            thread_local! {
                static BUF: std::cell::RefCell<Option<AlignedBuf>> = const { std::cell::RefCell::new(None) };
            }
            BUF.with(|b| {
                let mut b = b.borrow_mut();
                let buf = b.get_or_insert_with(|| AlignedBuf::for_file(&f, page).unwrap());
                let off = rng.below(n) * page as u64;
                f.file().read_exact_at(buf, off).unwrap();
                page as u64
            })
        }));
        rows.push(run_threads(
            "store/uring xQD threads",
            qd,
            qd,
            slice,
            |rng| {
                let r = store.read_pages(&[fix(read(rng))]).unwrap();
                let d = r.into_iter().next().unwrap().unwrap();
                assert_eq!(d.payload().len(), a.payload);
                page as u64
            },
        ));
        rows.push(run_threads("store/uring batch", qd, 1, slice, |rng| {
            let reads: Vec<PageRead> = (0..qd).map(|_| fix(read(rng))).collect();
            for r in store.read_pages(&reads).unwrap() {
                r.unwrap();
            }
            (qd * page) as u64
        }));
        let f = file.clone();
        let eng = uring.clone();
        rows.push(run_threads("uring raw batch", qd, 1, slice, move |rng| {
            thread_local! {
                static BUFS: std::cell::RefCell<Vec<AlignedBuf>> = const { std::cell::RefCell::new(Vec::new()) };
            }
            BUFS.with(|bufs| {
                let mut bufs = bufs.borrow_mut();
                while bufs.len() < qd {
                    bufs.push(AlignedBuf::for_file(&f, page).unwrap());
                }
                let reqs = bufs
                    .drain(..)
                    .map(|buf| IoRequest::read(f.clone(), rng.below(n) * page as u64, buf).unwrap())
                    .collect();
                for c in eng.submit(reqs).unwrap() {
                    c.result.unwrap();
                    bufs.push(c.buf);
                }
            });
            (qd * page) as u64
        }));
    }
    let mut merged: Vec<Row> = Vec::new();
    for r in rows {
        match merged.iter_mut().find(|m| m.mode == r.mode && m.qd == r.qd) {
            Some(m) => {
                m.bytes += r.bytes;
                m.ops += r.ops;
                m.secs += r.secs;
                m.lat_us.extend(r.lat_us);
            }
            None => merged.push(r),
        }
    }
    for m in &mut merged {
        m.lat_us.sort_by(f64::total_cmp);
    }
    let rows = merged;
    let cmd = std::env::args().collect::<Vec<_>>().join(" ");
    println!("# page store random reads vs O_DIRECT pread");
    println!("machine: {}", machine());
    println!(
        "file: {} ({} MiB, {} pages of {} bytes; payload {} bytes)",
        dir.join("dev0").display(),
        a.file_mib,
        n,
        page,
        a.payload
    );
    println!("command: {cmd}");
    println!();
    println!("| mode | qd | GB/s | IOPS (pages/s) | p50 us | p99 us | latency of |");
    println!("|---|---:|---:|---:|---:|---:|---|");
    for r in &rows {
        let per = if r.mode.contains("batch") {
            "batch"
        } else {
            "one read"
        };
        let (gb, iops, p50, p99) = r.rates(page);
        println!(
            "| {} | {} | {gb:.3} | {iops:.0} | {p50:.0} | {p99:.0} | {per} |",
            r.mode, r.qd
        );
    }
    if let Some(path) = &a.json {
        let items: Vec<String> = rows
            .iter()
            .map(|r| {
                let (gb, iops, p50, p99) = r.rates(page);
                format!(
                    "{{\"mode\":\"{}\",\"qd\":{},\"gb_per_s\":{gb:.4},\"pages_per_s\":{iops:.1},\"p50_us\":{p50:.1},\"p99_us\":{p99:.1},\"ops\":{}}}",
                    r.mode, r.qd, r.ops
                )
            })
            .collect();
        let json = format!(
            "{{\"machine\":\"{}\",\"command\":\"{}\",\"page_size\":{},\"rows\":[{}]}}\n",
            machine().replace('"', "'"),
            cmd.replace('"', "'"),
            page,
            items.join(",")
        );
        std::fs::write(path, json).unwrap();
    }
    drop(store);
    std::fs::remove_dir_all(&dir).unwrap();
}
