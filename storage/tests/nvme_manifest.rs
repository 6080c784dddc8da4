//! Manifest durability: reopen loops, corrupt/truncated fallback, and kill -9 of a child
//! process in the middle of page + manifest writes, many times.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvtier_storage::nvme::io::UringConfig;
use kvtier_storage::nvme::manifest::{
    load_file, GeometryRecord, Manifest, ManifestStore, PageRecord, PolicyRecord, SessionRecord,
};
use kvtier_storage::nvme::store::{PageRead, PageWrite};
use kvtier_storage::nvme::{
    open_best_engine, BlockRun, DeviceConfig, NvmeError, NvmeTier, PageAddr, PageId, PageStore,
    PageStoreConfig, RecoveryReport,
};
use kvtier_tests::kv::xorshift_bytes;
use kvtier_tests::sys::{scratch_dir, Reaped};

fn test_dir(name: &str) -> PathBuf {
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
        geometry: GeometryRecord {
            layers: LAYERS,
            q_heads: 28,
            kv_heads: 4,
            head_dim: 128,
            dtype: 0,
            block_tokens: 128,
        },
        policy: PolicyRecord {
            sink_blocks: 1,
            local_blocks: 4,
            top_k: 32,
        },
        layer_tokens: vec![u64::from(BLOCKS) * 128; LAYERS as usize],
        pages: Vec::new(),
        pinned: id % 2 == 1,
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
    let engine = open_best_engine(UringConfig { queue_depth: 32 });
    let store = PageStore::open(&store_cfg(dir), engine).unwrap();
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
        let engine = open_best_engine(UringConfig::default());
        let store = PageStore::open(&store_cfg(&dir), engine).unwrap();
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
    let other = PageStore::open(&cfg, open_best_engine(UringConfig::default())).unwrap();
    assert!(matches!(
        m.recover_into(&other, None),
        Err(NvmeError::ManifestMismatch { .. })
    ));
    // A manifest of another unit.
    let store2 =
        PageStore::open(&store_cfg(&dir), open_best_engine(UringConfig::default())).unwrap();
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
    let engine = open_best_engine(UringConfig { queue_depth: 32 });
    let store = PageStore::open(&store_cfg(dir), engine).unwrap();
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
        let child = Command::new(&exe)
            .args(["crash_child", "--exact", "--nocapture", "--test-threads=1"])
            .env("KVTIER_CRASH_DIR", &dir)
            .env("KVTIER_CRASH_SEED", cycle.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Killed if this test fails, so no writer outlives it.
        let mut child = Reaped(child);
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
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

// ---- Variable-size pages: format version 4, the upgrade from fixed pages, mixed sizes ----

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// Bytes of a run, a function of where it belongs, so a reader can recompute them.
fn run_bytes(session: u64, block: u32, generation: u64, len: usize) -> Vec<u8> {
    let state = session.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (u64::from(block) << 40)
        ^ generation.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    xorshift_bytes(state, len)
}

fn one_layer_session(id: u64, blocks: u32) -> SessionRecord {
    SessionRecord {
        id,
        owner_uid: 1000,
        label: format!("s{id}"),
        geometry: GeometryRecord {
            layers: 1,
            q_heads: 8,
            kv_heads: 8,
            head_dim: 128,
            dtype: 0,
            block_tokens: 64,
        },
        policy: PolicyRecord {
            sink_blocks: 1,
            local_blocks: 1,
            top_k: 4,
        },
        layer_tokens: vec![u64::from(blocks) * 64],
        pages: Vec::new(),
        pinned: false,
    }
}

/// Checks every run of every session of `tier` against [`run_bytes`]; the number checked.
fn verify_runs(tier: &NvmeTier) -> usize {
    let mut n = 0;
    for id in tier.session_ids() {
        let s = tier.session(id).unwrap();
        let keys: Vec<(u32, u32)> = s.pages.iter().map(|p| (p.layer, p.block)).collect();
        for (r, p) in tier.read_runs(id, &keys).unwrap().into_iter().zip(&s.pages) {
            let d = r.unwrap_or_else(|e| panic!("session {id} block {}: {e}", p.block));
            let want = run_bytes(id, p.block, p.generation, p.payload_len as usize);
            assert!(d.payload() == &want[..], "session {id} block {}", p.block);
            n += 1;
        }
    }
    n
}

/// Writes `m` as both files of epoch `m.epoch` in format version 3, byte for byte as a tierd
/// of fixed pages did: the 48-byte header (magic, version, crc32c over the version field,
/// bytes 16..48 and the payload, epoch, payload length) and the rkyv payload.
fn write_v3(mdir: &Path, m: &Manifest) {
    std::fs::create_dir_all(mdir).unwrap();
    let payload = rkyv::to_bytes::<rkyv::rancor::Error>(m).unwrap();
    let mut bytes = vec![0u8; 48];
    bytes[0..8].copy_from_slice(b"KVTMANI1");
    bytes[8..12].copy_from_slice(&3u32.to_le_bytes());
    bytes[16..24].copy_from_slice(&m.epoch.to_le_bytes());
    bytes[24..32].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    let head = crc32c::crc32c_append(crc32c::crc32c(&bytes[8..12]), &bytes[16..48]);
    let crc = crc32c::crc32c_append(head, &payload);
    bytes[12..16].copy_from_slice(&crc.to_le_bytes());
    bytes.extend_from_slice(&payload);
    for suffix in ["", ".copy"] {
        let name = format!("manifest-{:020}{suffix}", m.epoch);
        std::fs::write(mdir.join(name), &bytes).unwrap();
    }
}

fn file_version(path: &Path) -> u32 {
    let raw = std::fs::read(path).unwrap();
    u32::from_le_bytes(raw[8..12].try_into().unwrap())
}

/// A tierd of fixed pages (format version 3) left sessions on NVMe in 260 KiB-payload pages
/// (270,336 bytes, 66 units of 4 KiB). After the upgrade the tier opens on the same files:
/// every page address is converted to units where the page already is, every run reads back
/// verified, the fallback manifest's pages are kept until the next commit, and that commit
/// writes version 4, which opens again beside its version 3 fallback.
#[test]
fn a_version_3_manifest_of_fixed_pages_is_converted_to_units_and_keeps_its_sessions() {
    use kvtier_storage::nvme::manifest::DeviceRecord;
    use kvtier_storage::nvme::page;

    const OLD_PAGE: u64 = 270_336; // round_up(64 + 260 KiB, 4 KiB)
    const PER_PAGE: u64 = OLD_PAGE / 4096;
    let dir = test_dir("v3-upgrade");
    let mdir = dir.join("manifest");
    // Capacities that are no whole number of old pages: 41 and 30 of them.
    let caps = [41 * OLD_PAGE + 5000, 30 * OLD_PAGE + 200_000];
    let cfg = PageStoreConfig {
        devices: caps
            .iter()
            .enumerate()
            .map(|(i, &c)| DeviceConfig {
                path: dir.join(format!("dev{i}")),
                capacity_bytes: c,
                bandwidth_bytes_per_s: 1.0,
            })
            .collect(),
        // Not what the old store had: variable pages do not depend on it.
        max_payload: MIB,
    };
    let open_store = || PageStore::open(&cfg, open_best_engine(UringConfig::default())).unwrap();
    drop(open_store()); // creates the files

    // (session, block, device, old page, payload length); generation 7 (the epoch).
    let layout: &[(u64, u32, u16, u64, usize)] = &[
        (1, 0, 0, 3, 256 * KIB),
        (1, 1, 1, 0, 256 * KIB),
        (1, 2, 0, 7, 256 * KIB),
        (1, 3, 1, 29, 256 * KIB),
        (1, 4, 0, 40, 256 * KIB),
        (2, 0, 0, 0, 100 * KIB),
        (2, 1, 1, 1, 100 * KIB),
        (2, 2, 0, 8, 100 * KIB),
    ];
    // The old page format, padded to the old page, at page * OLD_PAGE.
    let write_old_page = |dev: u16, q: u64, id: PageId, payload: &[u8]| -> u32 {
        use std::os::unix::fs::FileExt;
        let mut buf = vec![0u8; OLD_PAGE as usize];
        let crc = page::encode(&mut buf, id, payload);
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join(format!("dev{dev}")))
            .unwrap();
        f.write_all_at(&buf, q * OLD_PAGE).unwrap();
        f.sync_all().unwrap();
        crc
    };
    let mut sessions = vec![one_layer_session(1, 5), one_layer_session(2, 3)];
    for &(s, block, device, q, len) in layout {
        let id = PageId {
            session: s,
            layer: 0,
            block,
            generation: 7,
        };
        let crc = write_old_page(device, q, id, &run_bytes(s, block, 7, len));
        sessions[s as usize - 1].pages.push(PageRecord {
            layer: 0,
            block,
            device,
            page: q,
            generation: 7,
            crc,
            payload_len: len as u32,
        });
    }
    let devices: Vec<DeviceRecord> = [41, 30]
        .iter()
        .enumerate()
        .map(|(i, &pages)| DeviceRecord {
            path: dir.join(format!("dev{i}")).display().to_string(),
            pages,
        })
        .collect();
    let current = Manifest {
        epoch: 7,
        page_size: OLD_PAGE,
        devices: devices.clone(),
        sessions: sessions.clone(),
    };
    // The fallback (epoch 6) had session 1's block 0 on old page 20 of device 0.
    let mut previous = current.clone();
    previous.epoch = 6;
    previous.sessions[0].pages[0].page = 20;
    previous.sessions[0].pages[0].generation = 6;
    write_v3(&mdir, &previous);
    write_v3(&mdir, &current);

    let units_used = |tier: &NvmeTier| -> u64 {
        tier.store()
            .usage()
            .devices
            .iter()
            .map(|d| d.units_used)
            .sum()
    };
    let referenced = |tier: &NvmeTier| -> u64 {
        tier.session_ids()
            .iter()
            .flat_map(|&id| tier.session(id).unwrap().pages)
            .map(|p| tier.store().page_units(p.payload_len as usize) as u64)
            .sum()
    };
    {
        let (tier, report) = NvmeTier::open(open_store(), &mdir).unwrap();
        assert_eq!((report.epoch, report.sessions, report.pages), (7, 2, 8));
        assert!(report.skipped_manifests.is_empty());
        for &(s, block, device, q, len) in layout {
            let p = tier.session(s).unwrap().page(0, block).unwrap().clone();
            assert_eq!((p.device, p.page), (device, q * PER_PAGE), "{s}/{block}");
            let addr = p.addr(4096);
            assert_eq!(addr.units, tier.store().page_units(len));
            assert!(addr.units as u64 <= PER_PAGE);
        }
        assert_eq!(verify_runs(&tier), 8);
        // The pages of both epochs are in use (epoch 6's old block 0 until the next commit).
        let kept = tier.store().page_units(256 * KIB) as u64;
        assert_eq!(units_used(&tier), referenced(&tier) + kept);

        // A new session of 512 KiB runs and a rewrite of one 100 KiB run: version 4.
        let big: Vec<Vec<u8>> = (0..4).map(|b| run_bytes(3, b, 8, 512 * KIB)).collect();
        let runs: Vec<BlockRun> = big
            .iter()
            .enumerate()
            .map(|(b, p)| BlockRun {
                layer: 0,
                block: b as u32,
                bytes: p,
            })
            .collect();
        assert_eq!(tier.next_generation(), 8);
        assert_eq!(
            tier.put_session(&one_layer_session(3, 4), &runs).unwrap(),
            8
        );
        assert_eq!(file_version(&mdir.join(format!("manifest-{:020}", 8))), 4);
        assert_eq!(file_version(&mdir.join(format!("manifest-{:020}", 7))), 3);
        // Epoch 6's page was freed after epoch 8 (nothing else retired).
        assert_eq!(units_used(&tier), referenced(&tier));
    }
    {
        // Version 4 beside its version 3 fallback: both in units, the same pages.
        let (tier, report) = NvmeTier::open(open_store(), &mdir).unwrap();
        assert_eq!((report.epoch, report.sessions, report.pages), (8, 3, 12));
        assert_eq!(verify_runs(&tier), 12);
        assert_eq!(units_used(&tier), referenced(&tier));
        let again = run_bytes(2, 0, 9, 100 * KIB);
        let run = [BlockRun {
            layer: 0,
            block: 0,
            bytes: &again,
        }];
        assert_eq!(tier.put_session(&one_layer_session(2, 3), &run).unwrap(), 9);
        assert_eq!(verify_runs(&tier), 12);
        // Session 2's old block 0 is kept for the fallback, epoch 8.
        let kept = tier.store().page_units(100 * KIB) as u64;
        assert_eq!(units_used(&tier), referenced(&tier) + kept);
    }
    // Version 4 beside a version 4 fallback: the same sessions, in place.
    let (tier, report) = NvmeTier::open(open_store(), &mdir).unwrap();
    assert_eq!((report.epoch, report.sessions, report.pages), (9, 3, 12));
    assert_eq!(verify_runs(&tier), 12);
    let p = tier.session(1).unwrap().page(0, 4).unwrap().clone();
    assert_eq!((p.device, p.page), (0, 40 * PER_PAGE));
    drop(tier);

    // What does not convert is a mismatch, never a guess.
    let refused = |name: &str, m: &Manifest, version: u32| {
        let mdir = dir.join(name);
        if version == 3 {
            write_v3(&mdir, m);
        } else {
            let mut m = m.clone();
            ManifestStore::open(&mdir)
                .unwrap()
                .0
                .commit(&mut m)
                .unwrap();
        }
        let e = NvmeTier::open(open_store(), &mdir).unwrap_err();
        assert!(
            matches!(e, NvmeError::ManifestMismatch { .. }),
            "{name}: {e:?}"
        );
    };
    let mut m = current.clone();
    m.devices[0].pages = 42;
    refused("other-devices", &m, 3);
    let mut m = current.clone();
    m.page_size = 6000;
    refused("not-whole-units", &m, 3);
    let mut m = current.clone();
    m.sessions[1].pages[0].payload_len = (OLD_PAGE - 63) as u32;
    refused("payload-past-its-page", &m, 3);
    // Device 0 holds 41 old pages and a unit more: a small page "at" old page 41 would fit
    // in that unit, but there was never a page there.
    let mut m = current.clone();
    m.sessions[1].pages[0].page = 41;
    m.sessions[1].pages[0].payload_len = 1000;
    refused("past-the-last-old-page", &m, 3);
    // Version 4 is in units already: one of another unit is not converted.
    let mut m = current.clone();
    m.page_size = 8192;
    m.devices[0].pages = caps[0] / 8192;
    m.devices[1].pages = caps[1] / 8192;
    refused("v4-other-unit", &m, 4);
}

/// Sessions of three run sizes written, partly rewritten and deleted through the tier, so
/// pages of different sizes sit side by side and in reused space. After a restart the
/// manifest's extents are marked exactly (everything reads back, the space used is what the
/// pages and the fallback's take); a manifest where a page overlaps another is refused.
#[test]
fn recovery_of_pages_of_several_sizes_marks_their_extents_and_refuses_an_overlap() {
    let dir = test_dir("mixed-recovery");
    let mdir = dir.join("manifest");
    let cfg = PageStoreConfig {
        devices: (0..2)
            .map(|i| DeviceConfig {
                path: dir.join(format!("dev{i}")),
                capacity_bytes: 16 * MIB as u64,
                bandwidth_bytes_per_s: 1.0,
            })
            .collect(),
        max_payload: 3 * MIB,
    };
    let open_store = || PageStore::open(&cfg, open_best_engine(UringConfig::default())).unwrap();
    let put = |tier: &NvmeTier, id: u64, blocks: std::ops::Range<u32>, total: u32, len: usize| {
        let generation = tier.next_generation();
        let bytes: Vec<Vec<u8>> = blocks
            .clone()
            .map(|b| run_bytes(id, b, generation, len))
            .collect();
        let runs: Vec<BlockRun> = blocks
            .zip(&bytes)
            .map(|(block, p)| BlockRun {
                layer: 0,
                block,
                bytes: p,
            })
            .collect();
        tier.put_session(&one_layer_session(id, total), &runs)
            .unwrap();
    };
    let used = |store: &PageStore| -> (u64, u64) {
        let u = store.usage();
        (
            u.devices.iter().map(|d| d.units_used).sum(),
            u.devices.iter().map(|d| d.pages).sum(),
        )
    };
    let before = {
        let (tier, _) = NvmeTier::open(open_store(), &mdir).unwrap();
        put(&tier, 1, 0..8, 8, 20 * KIB);
        put(&tier, 2, 0..6, 6, 512 * KIB);
        put(&tier, 3, 0..2, 2, 3 * MIB);
        put(&tier, 2, 0..3, 6, 512 * KIB);
        tier.delete_session(1).unwrap();
        put(&tier, 4, 0..8, 8, 20 * KIB);
        put(&tier, 5, 0..4, 4, 20 * KIB);
        assert_eq!(verify_runs(&tier), 6 + 2 + 8 + 4);
        used(tier.store())
    };
    let (tier, report) = NvmeTier::open(open_store(), &mdir).unwrap();
    assert_eq!((report.sessions, report.pages), (4, 20));
    assert_eq!(verify_runs(&tier), 20);
    assert_eq!(used(tier.store()), before, "the same extents, exactly");
    drop(tier);

    let loaded = || ManifestStore::open(&mdir).unwrap().1.unwrap();
    // As stored, it recovers into fresh bookkeeping.
    loaded().recover_into(&open_store()).unwrap();
    let big = loaded().current.session(3).unwrap().pages[0].clone();
    assert_eq!(big.addr(4096).units, 769);
    // A 20 KiB page moved inside the 3 MiB one, or a 512 KiB one reaching into it.
    let mut inside = loaded();
    let p = &mut inside
        .current
        .sessions
        .iter_mut()
        .find(|s| s.id == 4)
        .unwrap()
        .pages[0];
    (p.device, p.page) = (big.device, big.page + 700);
    let mut reaching = loaded();
    let p = &mut reaching
        .current
        .sessions
        .iter_mut()
        .find(|s| s.id == 2)
        .unwrap()
        .pages[5];
    (p.device, p.page) = (big.device, big.page + 768);
    for (name, mut l) in [("inside", inside), ("reaching", reaching)] {
        let e = l.recover_into(&open_store()).unwrap_err();
        assert!(
            matches!(&e, NvmeError::ManifestMismatch { what } if what.contains("overlaps")),
            "{name}: {e:?}"
        );
    }
}
