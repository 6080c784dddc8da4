//! Manifest durability: reopen loops, corrupt/truncated fallback, and kill -9 of a child
//! process in the middle of page + manifest writes, many times.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use kvtier_storage::nvme::io::UringConfig;
use kvtier_storage::nvme::manifest::{
    load_file, GeometryRecord, Manifest, ManifestStore, PageRecord, PolicyRecord, SessionRecord,
};
use kvtier_storage::nvme::store::{PageRead, PageWrite};
use kvtier_storage::nvme::{
    open_best_driver, BlockRun, DeviceConfig, NvmeError, NvmeTier, PageAddr, PageId, PageStore,
    PageStoreConfig, RecoveryReport,
};
use kvtier_storage::{Geometry, Policy};
use kvtier_tests::kv::xorshift_bytes;
use kvtier_tests::sys::{scratch_dir, spawn_lines, ScratchDir};

fn test_dir(name: &str) -> ScratchDir {
    scratch_dir(env!("CARGO_TARGET_TMPDIR"), name)
}

/// Pages in use on every device of `store`.
fn pages_used(store: &PageStore) -> u64 {
    store.usage().devices.iter().map(|d| d.pages).sum()
}

const PAYLOAD: usize = 12_000;
const LAYERS: u32 = 2;
const BLOCKS: u32 = 4;
const SESSIONS: u64 = 4;

fn store_cfg(dir: &Path) -> PageStoreConfig {
    PageStoreConfig {
        devices: vec![
            DeviceConfig {
                path: dir.join("dev0"),
                capacity_bytes: 256 * 16384,
                bandwidth_bytes_per_s: 2.0,
            },
            DeviceConfig {
                path: dir.join("dev1"),
                capacity_bytes: 256 * 16384,
                bandwidth_bytes_per_s: 1.0,
            },
        ],
        max_payload: PAYLOAD,
    }
}

/// The bytes of a page are a function of its identity, so a verifier can recompute them.
fn content(id: PageId) -> Vec<u8> {
    let state = id.session
        ^ (u64::from(id.layer) << 20)
        ^ (u64::from(id.block) << 32)
        ^ id.generation.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let len = PAYLOAD - (id.generation as usize % 7) * 100;
    xorshift_bytes(state, len)
}

fn session_record(id: u64) -> SessionRecord {
    SessionRecord {
        id,
        owner_uid: 1000 + id as u32,
        label: format!("session-{id}"),
        geometry: GeometryRecord::from(&Geometry {
            layers: LAYERS,
            ..Geometry::QWEN2_5_7B
        }),
        policy: PolicyRecord::from(&Policy::bound(1, 4, 32)),
        layer_tokens: vec![u64::from(BLOCKS) * 128; LAYERS as usize],
        pages: Vec::new(),
        pinned: id % 2 == 1,
        created_unix_ms: 1_795_000_000_000 + id,
    }
}

/// Reads every page the manifest references and checks it against the recomputed content.
fn verify_all(store: &PageStore, m: &Manifest) -> Result<usize, String> {
    let mut reads = Vec::new();
    let mut ids = Vec::new();
    for s in &m.sessions {
        for p in &s.pages {
            let id = PageId {
                session: s.id,
                layer: p.layer,
                block: p.block,
                generation: p.generation,
            };
            reads.push(PageRead {
                addr: p.addr(store.unit() as u64),
                id,
                expected_crc: Some(p.crc),
            });
            ids.push(id);
        }
    }
    let res = store.read_pages(&reads).map_err(|e| e.to_string())?;
    for (r, id) in res.into_iter().zip(&ids) {
        let d = r.map_err(|e| format!("{id:?}: {e}"))?;
        if d.payload() != &content(*id)[..] {
            return Err(format!("{id:?}: wrong bytes"));
        }
    }
    Ok(ids.len())
}

/// One writer step: rewrite all pages of one session at a new generation (copy on write),
/// make them durable, commit the manifest. Returns the pages retired by this commit.
fn rewrite_session(
    store: &PageStore,
    ms: &mut ManifestStore,
    m: &mut Manifest,
    session: u64,
) -> Result<Vec<PageAddr>, NvmeError> {
    let generation = ms.next_epoch();
    let n = (LAYERS * BLOCKS) as usize;
    let mut ids = Vec::with_capacity(n);
    for layer in 0..LAYERS {
        for block in 0..BLOCKS {
            ids.push(PageId {
                session,
                layer,
                block,
                generation,
            });
        }
    }
    // One generation, one payload length (see `content`).
    let payloads: Vec<Vec<u8>> = ids.iter().map(|&id| content(id)).collect();
    let addrs = store.alloc(session, n, payloads[0].len())?;
    let writes: Vec<PageWrite> = addrs
        .iter()
        .zip(&ids)
        .zip(&payloads)
        .map(|((&addr, &id), p)| PageWrite {
            addr,
            id,
            payload: p,
        })
        .collect();
    let crcs = match store
        .write_pages(&writes)
        .and_then(|c| store.sync().map(|_| c))
    {
        Ok(c) => c,
        Err(e) => {
            store.free(&addrs)?;
            return Err(e);
        }
    };
    let pages: Vec<PageRecord> = addrs
        .iter()
        .zip(&ids)
        .zip(crcs)
        .zip(&payloads)
        .map(|(((a, id), crc), p)| PageRecord {
            layer: id.layer,
            block: id.block,
            device: a.device,
            page: a.page,
            generation,
            crc,
            payload_len: p.len() as u32,
        })
        .collect();
    let mut next = m.clone();
    let retired = match next.sessions.iter_mut().find(|s| s.id == session) {
        Some(s) => std::mem::replace(&mut s.pages, pages)
            .iter()
            .map(|p| p.addr(store.unit() as u64))
            .collect(),
        None => {
            let mut s = session_record(session);
            s.pages = pages;
            next.sessions.push(s);
            Vec::new()
        }
    };
    ms.commit(&mut next)?;
    *m = next;
    Ok(retired)
}

fn open_all(dir: &Path) -> (PageStore, ManifestStore, Manifest, Vec<PageAddr>) {
    let driver = open_best_driver(UringConfig { queue_depth: 32 });
    let store = PageStore::open(&store_cfg(dir), driver).unwrap();
    let (ms, loaded) = ManifestStore::open(&dir.join("manifest")).unwrap();
    let (m, deferred) = match loaded {
        Some(mut l) => {
            let deferred = l.recover_into(&store).unwrap();
            (l.current, deferred)
        }
        None => (Manifest::for_store(&store), Vec::new()),
    };
    (store, ms, m, deferred)
}

#[test]
fn reopen_loop_sees_every_commit() {
    let dir = test_dir("reopen");
    let mut expect_epoch = 0;
    for round in 0..30u64 {
        let (store, mut ms, mut m, mut deferred) = open_all(&dir);
        assert_eq!(m.epoch, expect_epoch, "round {round}");
        verify_all(&store, &m).unwrap();
        for k in 0..3 {
            let retired = rewrite_session(&store, &mut ms, &mut m, (round + k) % SESSIONS).unwrap();
            store.free(&deferred).unwrap();
            deferred = retired;
        }
        expect_epoch = m.epoch;
        // Nothing leaks: used pages = referenced + kept for the fallback.
        let used = pages_used(&store);
        assert_eq!(used as usize, m.page_addrs().count() + deferred.len());
        // At most two epochs on disk, two files each: the current one and its fallback.
        let files = std::fs::read_dir(dir.join("manifest")).unwrap().count();
        assert!(files <= 4, "{files} manifest files");
    }
}

#[test]
fn corrupt_or_truncated_newest_manifest_falls_back_to_previous() {
    let dir = test_dir("fallback");
    let (store, mut ms, mut m, _) = open_all(&dir);
    rewrite_session(&store, &mut ms, &mut m, 1).unwrap();
    let first = m.clone();
    rewrite_session(&store, &mut ms, &mut m, 2).unwrap();
    drop((store, ms));
    let mdir = dir.join("manifest");
    let newest = mdir.join(format!("manifest-{:020}", m.epoch));
    // Both files of the newest epoch are damaged alike (one alone loses nothing: its copy
    // serves, src/nvme/manifest.rs tests).
    let newest_copy = mdir.join(format!("manifest-{:020}.copy", m.epoch));
    let good = std::fs::read(&newest).unwrap();
    type Damage = fn(&mut Vec<u8>);
    let damages: &[(&str, Damage)] = &[
        ("truncated payload", |b| b.truncate(b.len() - 10)),
        ("truncated header", |b| b.truncate(20)),
        ("empty", |b| b.clear()),
        ("flipped payload bit", |b| {
            let n = b.len();
            b[n - 5] ^= 4
        }),
        ("flipped epoch", |b| b[16] ^= 1),
        ("bad magic", |b| b[0] = b'X'),
        ("extra bytes", |b| b.extend_from_slice(&[0; 16])),
    ];
    for (name, damage) in damages {
        let mut bytes = good.clone();
        damage(&mut bytes);
        std::fs::write(&newest, &bytes).unwrap();
        std::fs::write(&newest_copy, &bytes).unwrap();
        assert!(
            matches!(load_file(&newest), Err(NvmeError::CorruptManifest { .. })),
            "{name}"
        );
        let (_, loaded) = ManifestStore::open(&mdir).unwrap();
        let l = loaded.unwrap();
        assert_eq!(
            l.current, first,
            "{name}: falls back to the previous manifest"
        );
        assert_eq!(l.skipped.len(), 2, "{name}");
        // And the fallback's pages are intact (the reuse rule kept them).
        let driver = open_best_driver(UringConfig::default());
        let store = PageStore::open(&store_cfg(&dir), driver).unwrap();
        l.current.recover_into(&store, None).unwrap();
        assert_eq!(verify_all(&store, &l.current).unwrap(), 8, "{name}");
    }
    // A crc-valid file whose rkyv body is garbage is caught by validation.
    let mut bytes = good.clone();
    let n = bytes.len();
    for b in &mut bytes[48..n] {
        *b = 0xFF;
    }
    // From version 3 the checksum covers the version field too.
    let head = crc32c::crc32c_append(crc32c::crc32c(&bytes[8..12]), &bytes[16..48]);
    let crc = crc32c::crc32c_append(head, &bytes[48..]);
    bytes[12..16].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(&newest, &bytes).unwrap();
    let err = load_file(&newest).unwrap_err();
    assert!(
        matches!(&err, NvmeError::CorruptManifest { reason, .. } if reason.contains("rkyv")),
        "{err}"
    );
    // Leftover temp files are removed and never loaded; a new commit gets a fresh epoch.
    std::fs::write(&newest, &good).unwrap();
    std::fs::write(
        mdir.join(format!("manifest-{:020}.tmp", m.epoch + 1)),
        b"junk",
    )
    .unwrap();
    let (ms, loaded) = ManifestStore::open(&mdir).unwrap();
    assert_eq!(loaded.unwrap().current, m);
    assert_eq!(ms.next_epoch(), m.epoch + 1);
    assert!(!mdir
        .join(format!("manifest-{:020}.tmp", m.epoch + 1))
        .exists());
}

#[test]
fn manifest_from_other_devices_is_rejected() {
    let dir = test_dir("mismatch");
    let (store, mut ms, mut m, _) = open_all(&dir);
    rewrite_session(&store, &mut ms, &mut m, 1).unwrap();
    let mut cfg = store_cfg(&dir);
    cfg.devices[1].capacity_bytes += 4096; // a device of another size
    cfg.devices[0].path = dir.join("other0");
    cfg.devices[1].path = dir.join("other1");
    let other = PageStore::open(&cfg, open_best_driver(UringConfig::default())).unwrap();
    assert!(matches!(
        m.recover_into(&other, None),
        Err(NvmeError::ManifestMismatch { .. })
    ));
    // A manifest of another unit.
    let store2 =
        PageStore::open(&store_cfg(&dir), open_best_driver(UringConfig::default())).unwrap();
    let mut other_unit = m.clone();
    other_unit.page_size = 8192;
    assert!(matches!(
        other_unit.recover_into(&store2, None),
        Err(NvmeError::ManifestMismatch { .. })
    ));
    // The same page referenced twice is a mismatch too.
    let mut dup = m.clone();
    let p = dup.sessions[0].pages[0].clone();
    dup.sessions[0].pages.push(p);
    assert!(matches!(
        dup.recover_into(&store2, None),
        Err(NvmeError::ManifestMismatch { .. })
    ));
}

fn open_tier(dir: &Path) -> (NvmeTier, RecoveryReport) {
    let driver = open_best_driver(UringConfig { queue_depth: 32 });
    let store = PageStore::open(&store_cfg(dir), driver).unwrap();
    NvmeTier::open(store, &dir.join("manifest")).unwrap()
}

/// Reads every run of every session through the tier and checks the bytes.
fn verify_tier(tier: &NvmeTier) -> Result<usize, String> {
    let mut n = 0;
    for id in tier.session_ids() {
        let s = tier.session(id).unwrap();
        let keys: Vec<(u32, u32)> = s.pages.iter().map(|p| (p.layer, p.block)).collect();
        for (r, p) in tier
            .read_runs(id, &keys)
            .map_err(|e| e.to_string())?
            .into_iter()
            .zip(&s.pages)
        {
            let d = r.map_err(|e| format!("session {id} {:?}: {e}", (p.layer, p.block)))?;
            let want = content(PageId {
                session: id,
                layer: p.layer,
                block: p.block,
                generation: p.generation,
            });
            if d.payload() != &want[..] {
                return Err(format!(
                    "session {id} {:?}: wrong bytes",
                    (p.layer, p.block)
                ));
            }
            n += 1;
        }
    }
    Ok(n)
}

/// One writer step through the tier: rewrite a random subset of one session's runs.
fn tier_step(tier: &NvmeTier, k: u64) -> u64 {
    let session = (k >> 33) % SESSIONS;
    let generation = tier.next_generation();
    let mut keys = Vec::new();
    for layer in 0..LAYERS {
        for block in 0..BLOCKS {
            // Always all runs for a new session, otherwise about half of them.
            if tier.session(session).is_none() || (k >> (layer * BLOCKS + block)) & 1 == 1 {
                keys.push((layer, block));
            }
        }
    }
    let payloads: Vec<Vec<u8>> = keys
        .iter()
        .map(|&(layer, block)| {
            content(PageId {
                session,
                layer,
                block,
                generation,
            })
        })
        .collect();
    let runs: Vec<BlockRun> = keys
        .iter()
        .zip(&payloads)
        .map(|(&(layer, block), p)| BlockRun {
            layer,
            block,
            bytes: p,
        })
        .collect();
    tier.put_session(&session_record(session), &runs).unwrap()
}

#[test]
fn tier_partial_updates_and_bad_input() {
    let dir = test_dir("tier");
    {
        let (tier, report) = open_tier(&dir);
        assert_eq!(report, RecoveryReport::default());
        for k in 0..20u64 {
            tier_step(&tier, k.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        }
        assert!(verify_tier(&tier).unwrap() > 0);
        let bad_layer = [BlockRun {
            layer: LAYERS,
            block: 0,
            bytes: &[1],
        }];
        assert!(matches!(
            tier.put_session(&session_record(1), &bad_layer),
            Err(NvmeError::InvalidArgument { .. })
        ));
        let dup = [
            BlockRun {
                layer: 0,
                block: 0,
                bytes: &[1],
            },
            BlockRun {
                layer: 0,
                block: 0,
                bytes: &[2],
            },
        ];
        assert!(matches!(
            tier.put_session(&session_record(1), &dup),
            Err(NvmeError::InvalidArgument { .. })
        ));
        let big = vec![0u8; PAYLOAD + 1];
        let too_big = [BlockRun {
            layer: 0,
            block: 0,
            bytes: &big,
        }];
        assert!(matches!(
            tier.put_session(&session_record(1), &too_big),
            Err(NvmeError::InvalidArgument { .. })
        ));
        assert!(tier.read_runs(99, &[(0, 0)]).is_err(), "unknown session");
        let s0 = tier.session_ids()[0];
        let r = tier.read_runs(s0, &[(0, 0), (0, BLOCKS + 5)]).unwrap();
        assert!(r[0].is_ok());
        assert!(
            matches!(r[1], Err(NvmeError::InvalidArgument { .. })),
            "run not stored"
        );
        let used_before = pages_used(tier.store());
        tier.delete_session(s0).unwrap();
        assert!(tier.session(s0).is_none());
        assert!(tier.delete_session(s0).is_err());
        // Its pages come back one commit later.
        tier_step(&tier, 5 << 33);
        let used_after = pages_used(tier.store());
        assert!(used_after < used_before, "{used_after} < {used_before}");
    }
    // Reopen: same content, and page accounting matches references + fallback.
    let (tier, report) = open_tier(&dir);
    assert_eq!(report.epoch, tier.epoch());
    assert!(report.pages > 0);
    verify_tier(&tier).unwrap();
}

#[test]
fn pins_are_committed_and_survive_reopen() {
    let dir = test_dir("tier-pins");
    {
        let (tier, _) = open_tier(&dir);
        tier_step(&tier, 0); // session 0, written unpinned
        assert!(!tier.session(0).unwrap().pinned);
        let before = tier.epoch();
        let epoch = tier.set_pinned(0, true).unwrap().expect("a commit");
        assert_eq!((epoch, tier.epoch()), (before + 1, before + 1));
        assert!(tier.session(0).unwrap().pinned);
        assert_eq!(
            tier.set_pinned(0, true).unwrap(),
            None,
            "no change, no commit"
        );
        assert_eq!(tier.epoch(), epoch);
        assert!(matches!(
            tier.set_pinned(77, true),
            Err(NvmeError::InvalidArgument { .. })
        ));
        // A commit without page changes must not free pages still referenced.
        verify_tier(&tier).unwrap();
    }
    {
        let (tier, _) = open_tier(&dir);
        assert!(tier.session(0).unwrap().pinned, "pinned after reopen");
        verify_tier(&tier).unwrap();
        // A later put_session writes the flag its record carries.
        tier_step(&tier, 0);
        assert!(!tier.session(0).unwrap().pinned);
        tier.set_pinned(0, true).unwrap();
        tier.set_pinned(0, false).unwrap();
    }
    let (tier, _) = open_tier(&dir);
    assert!(!tier.session(0).unwrap().pinned, "unpinned after reopen");
    verify_tier(&tier).unwrap();
}

/// The child side of the crash test: recover, then rewrite sessions forever through
/// `NvmeTier`, printing "ACK <epoch>" only after each `put_session` returned. Runs only when
/// re-executed by the parent.
#[test]
fn crash_child() {
    let Ok(dir) = std::env::var("KVTIER_CRASH_DIR") else {
        return;
    };
    let seed: u64 = std::env::var("KVTIER_CRASH_SEED").unwrap().parse().unwrap();
    let (tier, _) = open_tier(Path::new(&dir));
    // A restarted writer checks its own state before writing (the parent checks too).
    verify_tier(&tier).unwrap();
    println!("READY {}", tier.epoch());
    let mut k = seed;
    loop {
        k = k
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let epoch = tier_step(&tier, k);
        println!("ACK {epoch}");
    }
}

#[test]
fn kill9_during_page_and_manifest_writes() {
    let dir = test_dir("crash");
    let exe = std::env::current_exe().unwrap();
    let cycles = 200u64;
    let started = Instant::now();
    let mut acked = 0u64;
    let mut total_acks = 0u64;
    let mut pages_checked = 0usize;
    for cycle in 0..cycles {
        // Killed if this test fails, so no writer outlives it.
        let (mut child, rx, reader) = spawn_lines(
            Command::new(&exe)
                .args(["crash_child", "--exact", "--nocapture", "--test-threads=1"])
                .env("KVTIER_CRASH_DIR", &dir)
                .env("KVTIER_CRASH_SEED", cycle.to_string()),
        );
        // Wait until the child has recovered, then let it write for a varying time.
        let ready = loop {
            match rx.recv_timeout(Duration::from_secs(20)) {
                // libtest prints "test crash_child ... " before the test's own output.
                Ok(l) if l.contains("READY ") => break l[l.find("READY ").unwrap()..].to_string(),
                Ok(_) => continue,
                Err(e) => panic!("cycle {cycle}: child never got ready ({e})"),
            }
        };
        let recovered: u64 = ready[6..].parse().unwrap();
        assert!(
            recovered >= acked,
            "cycle {cycle}: child recovered epoch {recovered} < acked {acked}"
        );
        std::thread::sleep(Duration::from_micros(2_000 + (cycle * 7919) % 48_000));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        reader.join().unwrap();
        for l in rx.try_iter() {
            if let Some(e) = l.strip_prefix("ACK ") {
                acked = acked.max(e.parse().unwrap());
                total_acks += 1;
            }
        }
        // Every acknowledged commit survived, and every page it references verifies.
        let (tier, report) = open_tier(&dir);
        assert!(
            report.epoch >= acked,
            "cycle {cycle}: loaded epoch {} < acked {acked}",
            report.epoch
        );
        assert!(
            report.skipped_manifests.is_empty(),
            "{:?}",
            report.skipped_manifests
        );
        pages_checked += verify_tier(&tier).unwrap_or_else(|e| panic!("cycle {cycle}: {e}"));
    }
    eprintln!(
        "{cycles} kill -9 cycles, {total_acks} acknowledged commits, {pages_checked} page checks, {:?}",
        started.elapsed()
    );
    // Commits cost several fsyncs, so how many fit between kills depends on the disk; the
    // test only needs enough of them to be meaningful (typically ~100 here).
    assert!(
        total_acks >= cycles / 10,
        "the children made too little progress between kills: {total_acks}"
    );
    assert!(started.elapsed() < Duration::from_secs(120));
}
