//! Compaction: a write whose pages fit in the free bytes but in no free extent moves other
//! sessions' pages out of the way, on real files, while readers keep reading; every page
//! still reads back as written, before and after a reopen, and after kill -9 of a process
//! in the middle of fragmenting churn.

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_storage::nvme::io::{Fault, FaultRule, FaultyDriver, OpKind, Trigger, UringConfig};
use kvtier_storage::nvme::{
    open_best_driver, BlockRun, DeviceConfig, IoDriver, NvmeError, NvmeTier, PageAddr, PageStore,
    PageStoreConfig, PreadDriver,
};
use kvtier_tests::kv::xorshift_bytes;

mod common;
use common::{layer0_runs, one_layer_record};
use kvtier_tests::sys::{scratch_dir, spawn_lines};

/// Pages of one unit: 64 sessions x 8 blocks, written block by block across the sessions so
/// that each session's pages are spread over the device.
const SESSIONS: u64 = 64;
const BLOCKS: u32 = 8;
const SMALL: usize = 3_000;
/// The device of the first test: room for the small pages and a little more.
const DEVICE_UNITS: u64 = 516;
/// The churn's: the small pages and a little more.
const CHURN_UNITS: u64 = 540;

fn store_cfg(dir: &Path, units: u64) -> PageStoreConfig {
    PageStoreConfig {
        devices: vec![DeviceConfig {
            path: dir.join("dev0"),
            capacity_bytes: units * 4096,
            bandwidth_bytes_per_s: 1.0,
        }],
        max_payload: 64 * 4096,
    }
}

fn open_tier(dir: &Path, units: u64) -> NvmeTier {
    open_tier_on(
        dir,
        units,
        open_best_driver(UringConfig { queue_depth: 32 }),
    )
}

fn open_tier_on(dir: &Path, units: u64, driver: Arc<dyn IoDriver>) -> NvmeTier {
    let store = PageStore::open(&store_cfg(dir, units), driver).unwrap();
    NvmeTier::open(store, &dir.join("manifest")).unwrap().0
}

/// 64 sessions' one-unit pages written block by block across the sessions, then every other
/// session deleted (and two more commits so its pages are free): one-unit holes all over.
fn fragment(tier: &NvmeTier) {
    for block in 0..BLOCKS {
        for s in 0..SESSIONS {
            put(tier, s, block, SMALL).unwrap();
        }
    }
    for s in (0..SESSIONS).step_by(2) {
        tier.delete_session(s).unwrap();
    }
    tier.set_pinned(1, true).unwrap();
    tier.set_pinned(1, false).unwrap();
}

/// A run's bytes are a function of where it belongs and its length.
fn content(session: u64, block: u32, len: usize) -> Vec<u8> {
    xorshift_bytes(session * 1_000 + u64::from(block) + 1, len)
}

fn put(tier: &NvmeTier, session: u64, block: u32, len: usize) -> Result<u64, NvmeError> {
    let bytes = content(session, block, len);
    tier.put_session(
        &one_layer_record(session, BLOCKS),
        &[BlockRun {
            layer: 0,
            block,
            bytes: &bytes,
        }],
    )
}

/// Reads every run of every session and checks its bytes; the runs read.
fn verify(tier: &NvmeTier) -> Result<usize, String> {
    let mut n = 0;
    for id in tier.session_ids() {
        let Some(s) = tier.session(id) else {
            continue; // deleted since the list was taken
        };
        let keys: Vec<(u32, u32)> = s.pages.iter().map(|p| (p.layer, p.block)).collect();
        let read = tier.read_runs(id, &keys).map_err(|e| e.to_string())?;
        for (r, p) in read.into_iter().zip(&s.pages) {
            let d = r.map_err(|e| format!("session {id} block {}: {e}", p.block))?;
            if d.payload() != &content(id, p.block, p.payload_len as usize)[..] {
                return Err(format!("session {id} block {}: wrong bytes", p.block));
            }
            n += 1;
        }
    }
    Ok(n)
}

fn addrs(tier: &NvmeTier) -> Vec<(u64, PageAddr)> {
    let unit = tier.store().unit() as u64;
    let mut out: Vec<(u64, PageAddr)> = tier
        .session_ids()
        .into_iter()
        .flat_map(|id| {
            let s = tier.session(id).unwrap();
            s.pages
                .iter()
                .map(|p| (id, p.addr(unit)))
                .collect::<Vec<_>>()
        })
        .collect();
    out.sort();
    out
}

#[test]
fn a_write_that_fits_in_the_free_bytes_moves_pages_and_loses_none() {
    let dir = scratch_dir(env!("CARGO_TARGET_TMPDIR"), "compaction");
    let tier = open_tier(&dir, DEVICE_UNITS);
    let unit = tier.store().unit();
    assert_eq!(unit, 4096, "the test sizes pages in 4 KiB units");
    fragment(&tier);
    let store = tier.store();
    let big = 40 * unit - 64; // 40 units with its header
    let big_bytes = store.page_bytes(big);
    assert!(store.free_bytes() >= big_bytes, "{}", store.free_bytes());
    assert!(
        store.largest_free_bytes() < big_bytes,
        "fragmented: largest free {}",
        store.largest_free_bytes()
    );

    // Pages for more than the free bytes: refused, and nothing moves.
    let before = addrs(&tier);
    let wide = 60 * unit - 64;
    let blocks = store.free_bytes() / store.page_bytes(wide) + 1;
    let payloads: Vec<Vec<u8>> = (0..blocks as u32)
        .map(|b| content(1_000, b, wide))
        .collect();
    let runs = layer0_runs(&payloads);
    assert!(matches!(
        tier.put_session(&one_layer_record(1_000, BLOCKS), &runs),
        Err(NvmeError::Full { .. })
    ));
    assert_eq!(addrs(&tier), before, "a refused write moves nothing");

    // Readers run throughout; none may see a page move under it.
    let stop = AtomicBool::new(false);
    let reads = std::thread::scope(|sc| {
        let reader = sc.spawn(|| {
            let mut rounds = 0;
            while !stop.load(Ordering::Relaxed) {
                verify(&tier)?;
                rounds += 1;
            }
            Ok::<_, String>(rounds)
        });
        put(&tier, 2_000, 0, big).expect("compaction places the page");
        stop.store(true, Ordering::Relaxed);
        reader.join().unwrap()
    });
    reads.expect("every read during compaction verified");
    let after = addrs(&tier);
    let moved = before
        .iter()
        .filter(|(id, a)| !after.contains(&(*id, *a)))
        .count();
    assert!(moved > 0, "pages moved to make room");
    let n = verify(&tier).unwrap();
    assert_eq!(n, (SESSIONS / 2) as usize * BLOCKS as usize + 1);
    drop(tier);

    // After a reopen the manifest references the moved pages, and every page verifies.
    let tier = open_tier(&dir, DEVICE_UNITS);
    assert_eq!(addrs(&tier), after);
    assert_eq!(verify(&tier).unwrap(), n);
}

/// Every stored run: (session, block) -> payload length.
fn stored(tier: &NvmeTier) -> HashMap<(u64, u32), u64> {
    tier.session_ids()
        .into_iter()
        .flat_map(|s| {
            let r = tier.session(s).unwrap();
            r.pages
                .iter()
                .map(|p| ((s, p.block), u64::from(p.payload_len)))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The payload of a large page: 40 units with its header.
fn big_len(unit: usize) -> usize {
    40 * unit - 64
}

/// The child side of the kill -9 test: recover, verify, then churn forever in rounds: fill
/// the device with small pages block by block across 64 sessions (so each session's pages
/// are spread over it), delete every other session (one-unit holes), put large pages while
/// they fit (each only by compaction once the tail is used), delete those. Prints "TRY <op>"
/// before and "ACK <op>" after each operation that returned Ok, where an op is
/// `PUT <session> <block> <len> <compacted>` or `DEL <session>`. Runs only when re-executed
/// by the parent.
#[test]
fn churn_child() {
    let Ok(dir) = std::env::var("KVTIER_CHURN_DIR") else {
        return;
    };
    let seed: u64 = std::env::var("KVTIER_CHURN_SEED").unwrap().parse().unwrap();
    let tier = open_tier(Path::new(&dir), CHURN_UNITS);
    verify(&tier).unwrap();
    println!("READY");
    let big = big_len(tier.store().unit());
    let has = |s: u64, b: u32| {
        tier.session(s)
            .is_some_and(|r| r.pages.iter().any(|p| p.block == b))
    };
    // One operation: false when the device is full (or there was nothing to delete).
    let put_op = |s: u64, b: u32, len: usize| {
        let compacted = tier.store().largest_free_bytes() < tier.store().page_bytes(len);
        let op = format!("PUT {s} {b} {len} {}", u8::from(compacted));
        println!("TRY {op}");
        match put(&tier, s, b, len) {
            Ok(_) => {
                println!("ACK {op}");
                true
            }
            Err(NvmeError::Full { .. }) => false,
            Err(e) => panic!("{op}: {e}"),
        }
    };
    let del_op = |s: u64| {
        if tier.session(s).is_some() {
            println!("TRY DEL {s}");
            tier.delete_session(s).unwrap();
            println!("ACK DEL {s}");
        }
    };
    // The first round starts at a phase the seed picks, so that kills land in all three.
    for round in seed.. {
        let first = if round == seed { seed % 3 } else { 0 };
        'fill: for b in 0..BLOCKS {
            for s in 0..SESSIONS {
                if first < 1 && !has(s, b) && !put_op(s, b, SMALL) {
                    break 'fill;
                }
            }
        }
        for s in (round % 2..SESSIONS).step_by(2) {
            if first < 2 {
                del_op(s);
            }
        }
        for b in 0..8 {
            if !put_op(100 + u64::from(b / 4), b % 4, big) {
                break;
            }
        }
        del_op(100);
        del_op(101);
    }
}

#[test]
fn kill9_during_fragmenting_churn_and_compaction() {
    let dir = scratch_dir(env!("CARGO_TARGET_TMPDIR"), "compaction-kill9");
    let exe = std::env::current_exe().unwrap();
    // KVTIER_CHURN_CYCLES runs a longer campaign (a benchmark, not CI).
    let cycles: u64 = std::env::var("KVTIER_CHURN_CYCLES")
        .map_or(40, |v| v.parse().expect("KVTIER_CHURN_CYCLES is a count"));
    let started = Instant::now();
    // Fragmented from the start, so that a cycle which begins by placing large pages needs
    // compaction however little the cycles before it did.
    let mut acked: HashMap<(u64, u32), u64> = {
        let tier = open_tier(&dir, CHURN_UNITS);
        fragment(&tier);
        let unit = tier.store().unit() as u64;
        assert!(tier.store().largest_free_bytes() < 40 * unit);
        // What the acknowledged operations left: (session, block) -> payload length.
        stored(&tier)
    };
    // Operations acknowledged; writes that needed compaction, tried and acknowledged.
    let (mut acks, mut tried, mut compactions) = (0u64, 0u64, 0u64);
    for cycle in 0..cycles {
        let (mut child, rx, reader) = spawn_lines(
            Command::new(&exe)
                .args(["churn_child", "--exact", "--nocapture", "--test-threads=1"])
                .env("KVTIER_CHURN_DIR", &dir)
                .env("KVTIER_CHURN_SEED", (cycle * 7_919 + 1).to_string()),
        );
        loop {
            match rx.recv_timeout(Duration::from_secs(20)) {
                Ok(l) if l.contains("READY") => break,
                Ok(_) => continue,
                Err(e) => panic!("cycle {cycle}: child never got ready ({e})"),
            }
        }
        std::thread::sleep(Duration::from_millis(50 + (cycle * 37) % 400));
        child.kill().unwrap();
        child.wait().unwrap();
        reader.join().unwrap();
        let mut in_flight = None;
        for l in rx.try_iter() {
            if let Some(op) = l.strip_prefix("TRY ") {
                tried += u64::from(op.starts_with("PUT") && op.ends_with(" 1"));
                in_flight = Some(op.to_string());
            } else if let Some(op) = l.strip_prefix("ACK ") {
                in_flight = None;
                acks += 1;
                let w: Vec<u64> = op[4..].split(' ').map(|x| x.parse().unwrap()).collect();
                if op.starts_with("DEL") {
                    acked.retain(|&(s, _), _| s != w[0]);
                } else {
                    acked.insert((w[0], w[1] as u32), w[2]);
                    compactions += w[3];
                }
            }
        }
        // Every page verifies, and every acknowledged write is there unless the operation
        // the kill interrupted (which may or may not have committed) replaced it.
        let tier = open_tier(&dir, CHURN_UNITS);
        verify(&tier).unwrap_or_else(|e| panic!("cycle {cycle}: {e}"));
        let touched = |s: u64, b: u32| {
            in_flight.as_deref().is_some_and(|op| {
                let w: Vec<u64> = op[4..].split(' ').map(|x| x.parse().unwrap()).collect();
                w[0] == s && (op.starts_with("DEL") || w[1] == u64::from(b))
            })
        };
        for (&(s, b), &len) in &acked {
            let found = tier
                .session(s)
                .and_then(|r| r.pages.iter().find(|p| p.block == b).map(|p| p.payload_len));
            if found != Some(len as u32) && !touched(s, b) {
                panic!(
                    "cycle {cycle}: acknowledged session {s} block {b} ({len} bytes) is {found:?}"
                );
            }
        }
        // Start the next cycle from what is on disk.
        acked = stored(&tier);
    }
    eprintln!(
        "{cycles} kill -9 cycles, {acks} acknowledged operations, {tried} writes that needed compaction tried and {compactions} acknowledged, {:?}",
        started.elapsed()
    );
    assert!(
        acks >= cycles * 5,
        "too little progress between kills: {acks}"
    );
    // Timing decides how many the kills interrupt; the first test covers the success path.
    assert!(
        tried > 0,
        "no write needed compaction: the churn does not fragment"
    );
}

/// Page writes failing at random (5%) while pages move: a failed compaction or write changes
/// nothing a reader can see (every page verifies after each failure), and once the writes go
/// through every page, moved or new, reads back after a reopen.
#[test]
fn compaction_under_write_faults_loses_nothing() {
    let dir = scratch_dir(env!("CARGO_TARGET_TMPDIR"), "compaction-faults");
    fragment(&open_tier(&dir, DEVICE_UNITS));
    let faulty = FaultyDriver::new(
        PreadDriver::new(),
        vec![FaultRule {
            kind: Some(OpKind::Write),
            fault: Fault::Eio,
            trigger: Trigger::Probability(0.05),
        }],
        7,
    )
    .unwrap();
    let tier = open_tier_on(&dir, DEVICE_UNITS, Arc::new(faulty));
    let big = big_len(tier.store().unit());
    let (mut placed, mut failed) = (0, 0);
    for s in 0..5u64 {
        for _ in 0..100 {
            match put(&tier, 3_000 + s, 0, big) {
                Ok(_) => {
                    placed += 1;
                    break;
                }
                Err(NvmeError::Full { .. }) => panic!("refused with the free bytes there"),
                Err(_) => {
                    failed += 1;
                    verify(&tier).unwrap_or_else(|e| panic!("after a failed write: {e}"));
                }
            }
        }
    }
    eprintln!("{placed} large pages placed, {failed} attempts failed on injected EIO");
    assert_eq!(placed, 5);
    assert!(failed > 0, "no fault hit a write");
    assert!(tier.pages_moved() > 0);
    let n = verify(&tier).unwrap();
    drop(tier);
    assert_eq!(verify(&open_tier(&dir, DEVICE_UNITS)).unwrap(), n);
}
