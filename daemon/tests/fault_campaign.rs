//! A randomized fault campaign against real tierd processes, reproducible from its seed (in
//! the spirit of TigerBeetle's VOPR and RocksDB's crash tests).
//!
//! Each cycle runs a random mix of CREATE, APPEND_KV (inline and shared memory), DECODE
//! steps, DEMOTE, PROMOTE, PIN/UNPIN and CLOSE on up to six sessions of three geometries
//! (block runs of 1, 4 and 16 KiB: tiny runs take whole extents beside longer ones) under
//! memory pressure (a 1 MiB host tier; for odd seeds it fills to 99% before the pressure pass
//! demotes, so requests make their own room), in a third of the cycles with page I/O failing at
//! random (writes: EIO, ENOSPC, torn writes; reads: EIO, short reads;
//! `tierd::TEST_IO_FAULTS_ENV`; a failed operation must change nothing, a decode step is
//! retried until it goes through) and, where a tmpfs can be mounted (root), with the
//! manifest's filesystem filled and freed at random points; then it stops the daemon with
//! kill -9 or SIGTERM and, while it is down, may flip a bit in a page or in one manifest file.
//! Where a second uid can be run (root), a tenant process of uid nobody works beside the
//! campaign in every cycle without injected faults or a filled filesystem
//! (`campaign_tenant`): sessions of tiny and
//! large runs created, grown, decoded and closed at random, which fragments both tiers and
//! puts another user's pressure on them; every decode it gets is checked against its own
//! oracle, and its sessions are closed before the daemon stops.
//! After every restart an oracle of acknowledged state checks:
//! - every session acknowledged and not closed is listed, nothing else is;
//! - its token count is between what was durable (write-through appends, DEMOTE, a clean
//!   shutdown) and what was acknowledged (a clean shutdown keeps everything);
//! - every token present is bit-correct: a decode step over every layer matches the f64
//!   dense oracle over the restored tokens;
//! - a session reported damaged appears only after a page was corrupted, and answers
//!   DATA_LOSS;
//! - the daemon never panics (exit 101) and a clean shutdown exits 0 unless it reports that
//!   sessions could not be written (then only non-durable tokens may be missing);
//! - no request is refused for want of host RAM or NVMe space while the free bytes hold it
//!   (fragmentation is compaction's to solve): counted, and the campaign fails on any.
//!
//! CI runs a short seed set. The long campaign is a benchmark (docs/benchmarks.md), in release
//! with the fault injection compiled in, tierd included (without `KVTIER_TEST_TIERD` the tests
//! build and run a debug tierd):
//! `KVTIER_TEST_TIERD=<release tierd built with --features test-faults> KVTIER_CAMPAIGN_SEEDS=1-20 KVTIER_CAMPAIGN_CYCLES=100 cargo test --release -p tierd --features test-faults --test fault_campaign -- --nocapture`
//! A failure prints its seed and cycle; `KVTIER_CAMPAIGN_SEEDS=<seed>` replays it.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use common::*;
use kvtier_protocol::client::{Client, ClientError};
use kvtier_protocol::ErrorCode;
use kvtier_storage::testing::Rng;

const ARGS: &[&str] = &[
    "--set",
    "host.max_run_bytes=\"16KiB\"",
    "--set",
    "nvme.write_through=true",
    "--set",
    "host.capacity=\"1MiB\"",
    "--set",
    "nvme.capacity=\"8MiB\"",
];

/// The sessions' geometries: [`small_geometry`] (4 KiB runs), one of 1 KiB runs (a whole
/// 4 KiB extent in either tier, and an NVMe page of one unit) and one of 16 KiB runs.
fn geometries() -> [kvtier_protocol::Geometry; 3] {
    use kvtier_protocol::{DType, Geometry};
    [
        small_geometry(),
        Geometry::new(2, 2, 1, 16, DType::Bf16, 16),
        Geometry::new(2, 4, 2, 64, DType::Bf16, 32),
    ]
}

/// Most tokens a session grows to: six of them overflow the 256-frame host tier (memory
/// pressure demotes) but fit the NVMe tier, so a decode always finds room.
const MAX_TOKENS: u64 = 400;

struct Model {
    shadow: Shadow,
    /// Tokens (every layer) a crash cannot lose.
    durable: u64,
    /// Tokens acknowledged.
    acked: u64,
}

#[derive(Default)]
struct Counts {
    cycles: u64,
    ops: u64,
    acked_tokens: u64,
    kills: u64,
    terms: u64,
    page_flips: u64,
    manifest_flips: u64,
    damaged: u64,
    refused: u64,
    fault_cycles: u64,
    fs_full: u64,
    pages_moved: u64,
    runs_moved: u64,
    tenant_cycles: u64,
}

/// Whether a refusal for room came while the tier's free bytes held the request: the
/// numbers of a host `ArenaFull` or NVMe `Full` message (storage's error texts).
fn refused_with_room(message: &str) -> bool {
    let num = |after: &str| -> Option<u64> {
        let rest = &message[message.find(after)? + after.len()..];
        rest.split(|c: char| !c.is_ascii_digit())
            .next()?
            .parse()
            .ok()
    };
    let (want, free) = if message.contains("host arena full") {
        let want = num("host arena full: ")
            .zip(num(" runs of "))
            .map(|(n, b)| n * b);
        (want, num("do not fit ("))
    } else if message.contains("page store full") {
        let want = num("wanted ").zip(num(" pages of ")).map(|(n, b)| n * b);
        (want, num("bytes, "))
    } else {
        (None, None)
    };
    matches!((want, free), (Some(w), Some(f)) if f >= w)
}

/// The check reads storage's own messages, as the daemon wraps them: a refusal the free bytes
/// held is caught and one they did not hold is not (a changed message must fail here, not
/// turn the campaign's check into one that never fires).
#[test]
fn refusals_with_room_are_read_from_storages_messages() {
    use kvtier_storage::nvme::NvmeError;
    use kvtier_storage::StorageError;
    let host = |free| {
        let e = StorageError::ArenaFull {
            wanted: 2,
            run_bytes: 4096,
            bytes_free: free,
            largest_free: 4096,
            bytes_total: 1 << 20,
        };
        format!("batch entry 0: {e}")
    };
    assert!(refused_with_room(&host(8192)));
    assert!(!refused_with_room(&host(4096)));
    let nvme = |free| {
        let e = NvmeError::Full {
            requested: 2,
            page_bytes: 8192,
            free_bytes: free,
            largest_free_bytes: 4096,
        };
        format!("append rolled back, not durable: NVMe tier: {e}")
    };
    assert!(refused_with_room(&nvme(16384)));
    assert!(!refused_with_room(&nvme(12288)));
    assert!(!refused_with_room(
        "uid 7 would reference 9 bytes of NVMe pages"
    ));
}

fn code<T>(r: &Result<T, ClientError>) -> Option<ErrorCode> {
    r.as_ref().err().and_then(ClientError::code)
}

/// Errors an operation may answer here without anything being wrong: a full tier, a pinned
/// session that cannot be demoted, and in a cycle with injected write faults (`faults`) a
/// failed write (INTERNAL). Anything else fails the campaign. A tolerated error must have
/// changed nothing, which the oracle checks after the next restart.
fn tolerated(
    r: &Result<impl std::fmt::Debug, ClientError>,
    faults: bool,
    what: &str,
    at: &str,
) -> bool {
    match code(r) {
        None => false,
        Some(ErrorCode::ResourceExhausted) => {
            let message = format!("{:?}", r.as_ref().err());
            assert!(
                !refused_with_room(&message),
                "{at}: {what} refused while the free bytes held it: {message}"
            );
            true
        }
        Some(ErrorCode::FailedPrecondition) => true,
        // A failed write or read (INTERNAL), a short read (DATA_LOSS: the bytes were not the
        // page), or a session whose restore under read faults failed (listed damaged).
        Some(ErrorCode::Internal | ErrorCode::DataLoss) if faults => true,
        Some(c) => panic!("{at}: {what} answered {c:?}: {r:?}"),
    }
}

fn seeds() -> Vec<u64> {
    let spec = std::env::var("KVTIER_CAMPAIGN_SEEDS").unwrap_or_else(|_| "1-3".into());
    spec.split(',')
        .flat_map(|part| match part.split_once('-') {
            Some((a, b)) => (a.parse::<u64>().unwrap()..=b.parse().unwrap()).collect::<Vec<_>>(),
            None => vec![part.parse().unwrap()],
        })
        .collect()
}

#[test]
fn fault_campaign() {
    if !tierd::INJECTS_FAULTS {
        panic!(
            "this tierd ignores {}: build release campaigns with --features test-faults",
            tierd::TEST_IO_FAULTS_ENV
        );
    }
    let cycles: u64 = std::env::var("KVTIER_CAMPAIGN_CYCLES")
        .map_or(6, |c| c.parse().expect("KVTIER_CAMPAIGN_CYCLES"));
    let mut total = Counts::default();
    for seed in seeds() {
        let c = run(seed, cycles);
        total.cycles += c.cycles;
        total.ops += c.ops;
        total.acked_tokens += c.acked_tokens;
        total.kills += c.kills;
        total.terms += c.terms;
        total.page_flips += c.page_flips;
        total.manifest_flips += c.manifest_flips;
        total.damaged += c.damaged;
        total.refused += c.refused;
        total.fault_cycles += c.fault_cycles;
        total.fs_full += c.fs_full;
        total.pages_moved += c.pages_moved;
        total.runs_moved += c.runs_moved;
        total.tenant_cycles += c.tenant_cycles;
    }
    println!(
        "fault campaign: {} cycles ({} with I/O faults), {} operations, {} acknowledged tokens, \
         {} kill -9, {} SIGTERM, {} page bit flips, {} manifest bit flips, {} times the \
         manifest's filesystem filled, {} sessions reported damaged, {} operations refused \
         (full tiers or filesystem, failed I/O), {} NVMe pages and {} host runs moved by \
         compaction, {} cycles beside a second uid's tenant; lost 0, wrong 0, panics 0, \
         refused with room 0",
        total.cycles,
        total.fault_cycles,
        total.ops,
        total.acked_tokens,
        total.kills,
        total.terms,
        total.page_flips,
        total.manifest_flips,
        total.fs_full,
        total.damaged,
        total.refused,
        total.pages_moved,
        total.runs_moved,
        total.tenant_cycles
    );
}

fn run(seed: u64, cycles: u64) -> Counts {
    let mut rng = Rng::new(seed);
    let mut n = Counts::default();
    let mut models: BTreeMap<u64, Model> = BTreeMap::new();
    let mut page_flipped = false;
    // The manifest on a small filesystem the campaign can fill (root only), the pages beside
    // the daemon's socket on the ordinary disk.
    let fs = SmallFs::mount(4 << 20);
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let pages = dir.path().join("pages-0");
    let state = fs
        .as_ref()
        .map_or_else(|| dir.path().join("state"), |f| f.dir.path().to_path_buf());
    let state_arg = format!("nvme.dir={:?}", state.to_str().unwrap());
    let devices = format!(
        "nvme.devices=[{{path={:?}, capacity=\"8MiB\"}}]",
        pages.to_str().unwrap()
    );
    let mut args: Vec<&str> = ARGS.to_vec();
    args.extend(["--set", &state_arg, "--set", &devices]);
    // Odd seeds let host RAM fill up (no pressure pass until 99%): requests then make their
    // own room, and free space in pieces is compaction's to place.
    if seed % 2 == 1 {
        args.extend([
            "--set",
            "nvme.high_water=0.99",
            "--set",
            "nvme.low_water=0.98",
        ]);
    }
    let args = &args[..];
    let mut d = Daemon::start_in(dir, args);
    // Whether the running daemon injects write faults.
    let mut faults = false;
    for cycle in 0..cycles {
        let at = format!("seed {seed} cycle {cycle}");
        let mut c = d.client();
        let mut filler = None;
        // Another uid's work beside this cycle's (not under injected faults: its oracle
        // expects every decode to go through or be refused for room).
        let tenant = (!faults && is_root()).then(|| {
            n.tenant_cycles += 1;
            Tenant::spawn(&d, rng.next_u64())
        });
        for _ in 0..5 + rng.below(20) {
            n.ops += 1;
            operate(
                &mut c,
                &mut rng,
                &mut models,
                faults || filler.is_some(),
                tenant.is_some(),
                &mut n,
                &at,
            );
            // Not beside the tenant, whose writes expect a filesystem with room.
            if let (Some(fs), None, 0) = (&fs, &tenant, rng.below(8)) {
                match filler.take() {
                    None => {
                        filler = Some(fs.fill());
                        n.fs_full += 1;
                    }
                    Some(f) => std::fs::remove_file(f).unwrap(),
                }
            }
        }
        // The tenant closes its sessions (which needs a manifest write) before the stop.
        if let Some(f) = filler.take() {
            std::fs::remove_file(f).unwrap();
        }
        if let Some(t) = tenant {
            t.finish(&at);
        }
        // Pages and runs compaction moved in this daemon's life (counted from its start).
        let stats = c.stats().ok();
        let counted = |key| stats.as_ref().and_then(|s| s.get(key)).unwrap_or(0);
        n.pages_moved += counted("nvme_pages_moved_total");
        n.runs_moved += counted("host_runs_moved_total");
        drop(c);
        // Stop: kill -9, or SIGTERM (which writes every session).
        let dir = if rng.below(2) == 0 {
            n.kills += 1;
            d.stop(true)
        } else {
            n.terms += 1;
            d.signal(libc::SIGTERM);
            let status = d.wait(Duration::from_secs(30));
            assert_ne!(status.code(), Some(101), "{at}: tierd panicked");
            if status.success() {
                for m in models.values_mut() {
                    m.durable = m.acked;
                }
            }
            d.into_dir()
        };
        match rng.below(6) {
            0 => {
                page_flipped |= flip_page(&pages, &mut rng);
                n.page_flips += 1;
            }
            1 if flip_manifest(&state, &mut rng) => n.manifest_flips += 1,
            _ => {}
        }
        // The oracle runs without faults; the cycle after it may have them.
        d = Daemon::start_in(dir, args);
        let mut c = d.client();
        check(&mut c, &mut models, page_flipped, &mut n, &at);
        drop(c);
        faults = rng.below(3) == 0;
        if faults {
            n.fault_cycles += 1;
            let spec = format!("{},0.05,0.02", rng.next_u64());
            let dir = d.stop(false);
            d = harness()
                .dir(dir)
                .args(args)
                .env(tierd::TEST_IO_FAULTS_ENV, spec)
                .start();
        }
        n.cycles += 1;
    }
    n
}

/// One random operation, the model updated with what was acknowledged.
fn operate(
    c: &mut Client,
    rng: &mut Rng,
    models: &mut BTreeMap<u64, Model>,
    faults: bool,
    pressure: bool,
    n: &mut Counts,
    at: &str,
) {
    match rng.below(10) {
        0 | 1 if models.len() < 6 => {
            let g = geometries()[rng.below(3) as usize];
            let r = c.create_session(g, policy(), "campaign");
            if !tolerated(&r, faults, "CREATE", at) {
                let seed = rng.next_u64();
                let m = Model {
                    shadow: Shadow::new(g, seed),
                    durable: 0,
                    acked: 0,
                };
                models.insert(r.unwrap(), m);
            } else {
                n.refused += 1;
            }
        }
        0..=3 => {
            let Some(id) = pick(rng, models) else { return };
            let m = models.get_mut(&id).unwrap();
            let k = 1 + rng.below(60);
            if m.acked + k > MAX_TOKENS {
                return;
            }
            let payload = m.shadow.payload(k as usize);
            let r = if rng.below(2) == 0 {
                c.append_kv(id, m.acked, k as u32, &payload)
            } else {
                c.append_kv_shm(id, m.acked, k as u32, &payload)
            };
            if tolerated(&r, faults, "APPEND_KV", at) {
                n.refused += 1;
                m.shadow.truncate(m.acked);
            } else {
                assert_eq!(r.unwrap(), m.acked + k, "{at}: APPEND_KV length");
                m.acked += k;
                m.durable = m.acked; // write-through
                n.acked_tokens += k;
            }
        }
        4..=6 => {
            let Some(id) = pick(rng, models) else { return };
            let m = models.get_mut(&id).unwrap();
            if m.acked == 0 || m.acked >= MAX_TOKENS + 50 {
                return;
            }
            if step(c, id, m, faults, pressure, at) {
                n.acked_tokens += 1;
            } else {
                n.refused += 1;
            }
        }
        7 => {
            let Some(id) = pick(rng, models) else { return };
            let r = c.demote(id);
            if tolerated(&r, faults, "DEMOTE", at) {
                n.refused += 1;
            } else {
                let m = models.get_mut(&id).unwrap();
                m.durable = m.acked;
            }
        }
        8 => {
            let Some(id) = pick(rng, models) else { return };
            let r = if rng.below(2) == 0 {
                c.promote(id).map(|_| ())
            } else {
                c.pin(id, rng.below(2) == 0)
            };
            if tolerated(&r, faults, "PROMOTE/PIN", at) {
                n.refused += 1;
            }
        }
        _ => {
            let Some(id) = pick(rng, models) else { return };
            let r = c.close(id);
            if tolerated(&r, faults, "CLOSE", at) {
                n.refused += 1;
            } else {
                models.remove(&id);
            }
        }
    }
}

/// The oracle after a restart (see the module docs).
fn check(
    c: &mut Client,
    models: &mut BTreeMap<u64, Model>,
    page_flipped: bool,
    n: &mut Counts,
    at: &str,
) {
    let listed: BTreeSet<u64> = c
        .list_sessions()
        .unwrap()
        .iter()
        .map(|s| s.session)
        .collect();
    let known: BTreeSet<u64> = models.keys().copied().collect();
    assert_eq!(listed, known, "{at}: sessions after restart");
    let ids: Vec<u64> = models.keys().copied().collect();
    for id in ids {
        let info = c.session_info(id).unwrap();
        if info.damaged {
            assert!(
                page_flipped,
                "{at}: session {id} damaged, yet no page was corrupted"
            );
            let m = &models[&id];
            let e = c.append_kv(
                id,
                info.tokens_max,
                1,
                &Shadow::new(m.shadow.g, 0).payload(1),
            );
            assert_eq!(
                code(&e),
                Some(ErrorCode::DataLoss),
                "{at}: damaged session {id}"
            );
            c.close(id).unwrap();
            models.remove(&id);
            n.damaged += 1;
            continue;
        }
        let m = models.get_mut(&id).unwrap();
        assert_eq!(
            info.tokens_min, info.tokens_max,
            "{at}: session {id} layers differ"
        );
        let have = info.tokens_max;
        assert!(
            (m.durable..=m.acked).contains(&have),
            "{at}: session {id} has {have} tokens; durable {}, acknowledged {}",
            m.durable,
            m.acked
        );
        m.shadow.truncate(have);
        m.acked = have;
        m.durable = have;
        if have == 0 {
            continue;
        }
        assert!(step(
            c,
            id,
            m,
            false,
            false,
            &format!("{at}, after the restart")
        ));
    }
}

/// One decode step over every layer, each output checked against the dense oracle over the
/// shadow's tokens. Without injected faults any failure fails the campaign (decodes write
/// nothing to NVMe). With them a layer that fails (a failed read promoting its keep-set) is
/// retried, since a failed decode must have changed nothing; false if the first layer cannot
/// go through because the session's restore failed under read faults (it is listed damaged
/// and answers DATA_LOSS), so the layers never diverge. Under another uid's pressure the first
/// layer may be refused for room (false), though never while the free bytes hold its blocks.
fn step(c: &mut Client, id: u64, m: &mut Model, faults: bool, pressure: bool, at: &str) -> bool {
    for layer in 0..m.shadow.g.layers as usize {
        let pos = m.shadow.tokens(layer);
        let (q, k, v) = m.shadow.step_input(layer);
        let qb = f32_bytes(&q);
        let mut attempts = 0;
        let out = loop {
            let r = c.decode(layer as u32, entry(id, pos, &qb, &k, &v), true);
            attempts += 1;
            match r {
                Err(e) if pressure && e.code() == Some(ErrorCode::ResourceExhausted) => {
                    let message = e.to_string();
                    assert!(
                        !refused_with_room(&message),
                        "{at}: DECODE refused with room: {message}"
                    );
                    if layer == 0 {
                        m.shadow.truncate(m.acked);
                        return false;
                    }
                    // The first layer has its token: the others must get theirs.
                    assert!(
                        attempts < 200,
                        "{at}: session {id} layer {layer} never found room"
                    );
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) if faults && attempts < 50 => {
                    let damaged = e.code() == Some(ErrorCode::DataLoss)
                        && c.session_info(id).is_ok_and(|i| i.damaged);
                    if damaged {
                        assert_eq!(layer, 0, "{at}: session {id} damaged after its first layer");
                        m.shadow.truncate(m.acked);
                        return false;
                    }
                }
                r => {
                    break r
                        .unwrap_or_else(|e| panic!("{at}: DECODE session {id} layer {layer}: {e}"))
                }
            }
        };
        m.shadow.check(layer, &q, &out);
    }
    m.acked += 1;
    true
}

/// Flips one bit somewhere in the page file's written part; whether it hit a live page.
fn flip_page(pages: &Path, rng: &mut Rng) -> bool {
    let Ok(mut bytes) = std::fs::read(pages) else {
        return false;
    };
    let used = bytes.iter().rposition(|&b| b != 0).map_or(0, |p| p + 1);
    if used == 0 {
        return false;
    }
    let at = rng.below(used as u64) as usize;
    bytes[at] ^= 1 << rng.below(8);
    std::fs::write(pages, bytes).unwrap();
    true
}

/// Flips one bit of one manifest file, never a second file of the same epoch (both copies of
/// the newest epoch damaged is a double fault the failure model does not promise to survive
/// without losing that epoch). Returns whether it flipped.
fn flip_manifest(state: &Path, rng: &mut Rng) -> bool {
    let files = entries(state, |name| {
        name.starts_with("manifest-") && !name.ends_with(".flipped-by-campaign")
    });
    let mut by_epoch: BTreeMap<String, Vec<std::path::PathBuf>> = BTreeMap::new();
    for f in files {
        let name = f.file_name().unwrap().to_str().unwrap().to_owned();
        let epoch = name.split('.').next().unwrap().to_owned();
        by_epoch.entry(epoch).or_default().push(f);
    }
    // Only an epoch whose files are all intact (a flipped one is left alone from then on:
    // it is rewritten under a new epoch by the next commit).
    let intact: Vec<_> = by_epoch
        .values()
        .filter(|v| v.len() == 2 && !v.iter().any(|p| is_flipped(p)))
        .collect();
    let Some(files) = intact.get(rng.below(intact.len().max(1) as u64) as usize) else {
        return false;
    };
    let f = &files[rng.below(2) as usize];
    let mut bytes = std::fs::read(f).unwrap();
    let at = rng.below(bytes.len() as u64) as usize;
    bytes[at] ^= 1 << rng.below(8);
    std::fs::write(f, bytes).unwrap();
    mark_flipped(f);
    true
}

fn marker(p: &Path) -> std::path::PathBuf {
    let mut m = p.as_os_str().to_owned();
    m.push(".flipped-by-campaign");
    std::path::PathBuf::from(m)
}

fn is_flipped(p: &Path) -> bool {
    marker(p).exists()
}

fn mark_flipped(p: &Path) {
    std::fs::write(marker(p), b"").unwrap();
}

/// The second uid's process beside a cycle (`campaign_tenant`, as nobody).
struct Tenant {
    child: std::process::Child,
    _exe: kvtier_tests::uid::ReachableCopy,
}

impl Tenant {
    fn spawn(d: &Daemon, seed: u64) -> Tenant {
        let exe = kvtier_tests::uid::reachable_copy(&std::env::current_exe().unwrap());
        let child = kvtier_tests::uid::as_nobody(&mut kvtier_tests::sys::rerun_test(
            exe.path(),
            "campaign_tenant",
        ))
        .env(TENANT_SOCKET, d.path())
        .env("KVTIER_TENANT_SEED", seed.to_string())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
        Tenant { child, _exe: exe }
    }

    /// Waits for the tenant; it must have run its checks and passed.
    fn finish(self, at: &str) {
        let out = self.child.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && text.contains("tenant done"),
            "{at}: the second uid's tenant failed:\n{text}"
        );
    }
}

/// The second uid's work beside a cycle of `fault_campaign` (ignored on its own): sessions of
/// 1 KiB and 16 KiB runs created, grown, decoded and closed at random, every decode checked
/// against the dense oracle, every refusal for room checked against the free bytes; all its
/// sessions closed at the end.
#[test]
#[ignore = "run as a second uid by fault_campaign"]
fn campaign_tenant() {
    use kvtier_protocol::{DType, Geometry};
    let Some(mut c) = tenant() else { return };
    let seed: u64 = passed("KVTIER_TENANT_SEED");
    let at = format!("tenant seed {seed}");
    let mut rng = Rng::new(seed);
    let geometries = [
        Geometry::new(2, 2, 1, 16, DType::Bf16, 16),
        Geometry::new(2, 4, 2, 64, DType::Bf16, 32),
    ];
    let mut mine: BTreeMap<u64, Model> = BTreeMap::new();
    let (mut steps, mut refused) = (0, 0);
    // Fragmenting churn first: one-block sessions of tiny runs until the tier or this uid's
    // share refuses one (at most 64), every other one closed: 2-unit holes between the
    // others' runs for the larger runs after them.
    let mut tiny = Vec::new();
    for _ in 0..64 {
        let g = geometries[0];
        let r = c.create_session(g, policy(), "tenant");
        if tolerated(&r, false, "tenant CREATE", &at) {
            refused += 1;
            continue;
        }
        let id = r.unwrap();
        let mut m = Model {
            shadow: Shadow::new(g, rng.next_u64()),
            durable: 0,
            acked: 16,
        };
        let r = c.append_kv(id, 0, 16, &m.shadow.payload(16));
        let full = tolerated(&r, false, "tenant APPEND_KV", &at);
        if full {
            refused += 1;
            m.shadow.truncate(0);
            m.acked = 0;
        }
        tiny.push(id);
        mine.insert(id, m);
        if full {
            break;
        }
    }
    for id in tiny.iter().step_by(2) {
        c.close(*id).unwrap();
        mine.remove(id);
    }
    for _ in 0..40 {
        match rng.below(5) {
            0 if mine.len() < 40 => {
                let g = geometries[rng.below(2) as usize];
                let r = c.create_session(g, policy(), "tenant");
                if tolerated(&r, false, "tenant CREATE", &at) {
                    refused += 1;
                } else {
                    let shadow = Shadow::new(g, rng.next_u64());
                    let m = Model {
                        shadow,
                        durable: 0,
                        acked: 0,
                    };
                    mine.insert(r.unwrap(), m);
                }
            }
            0..=1 => {
                let Some(id) = pick(&mut rng, &mine) else {
                    continue;
                };
                let m = mine.get_mut(&id).unwrap();
                let k = 1 + rng.below(40);
                if m.acked + k > 160 {
                    continue;
                }
                let r = c.append_kv(id, m.acked, k as u32, &m.shadow.payload(k as usize));
                if tolerated(&r, false, "tenant APPEND_KV", &at) {
                    refused += 1;
                    m.shadow.truncate(m.acked);
                } else {
                    m.acked += k;
                }
            }
            2..=3 => {
                let Some(id) = pick(&mut rng, &mine) else {
                    continue;
                };
                let m = mine.get_mut(&id).unwrap();
                if m.acked == 0 {
                    continue;
                }
                if step(&mut c, id, m, false, true, &at) {
                    steps += 1;
                } else {
                    refused += 1;
                }
            }
            _ => {
                let Some(id) = pick(&mut rng, &mine) else {
                    continue;
                };
                c.close(id).unwrap();
                mine.remove(&id);
            }
        }
    }
    for id in mine.keys() {
        c.close(*id).unwrap();
    }
    println!("tenant done: {steps} decode steps checked, {refused} refused for room");
}

/// A session of `models` drawn at random (None without any).
fn pick(rng: &mut Rng, models: &BTreeMap<u64, Model>) -> Option<u64> {
    if models.is_empty() {
        return None;
    }
    let i = rng.below(models.len() as u64) as usize;
    models.keys().nth(i).copied()
}
