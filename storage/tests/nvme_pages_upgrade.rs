//! Variable-size NVMe pages across upgrades and restarts: a manifest of the fixed-page format
//! (version 3) converted to units in place, and recovery of pages of several sizes side by
//! side (their extents marked exactly, an overlapping record refused).

mod common;

use std::path::Path;

use kvtier_storage::nvme::io::UringConfig;
use kvtier_storage::nvme::manifest::{
    v4, GeometryRecord, Manifest, ManifestStore, PageRecord, PolicyRecord, SessionRecord,
};
use kvtier_storage::nvme::{
    open_best_driver, BlockRun, NvmeError, NvmeTier, PageId, PageStore, PageStoreConfig,
};
use kvtier_tests::kv::xorshift_bytes;

use common::{devices, layer0_runs, store_cfg, test_dir};

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
            selector: 0,
            candidates: 0,
        },
        layer_tokens: vec![u64::from(blocks) * 64],
        pages: Vec::new(),
        pinned: false,
        created_unix_ms: 0,
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
    // Version 3's layout: the policy without its selector (every session here has the bound).
    let old = v4::Manifest {
        epoch: m.epoch,
        page_size: m.page_size,
        devices: m.devices.clone(),
        sessions: m
            .sessions
            .iter()
            .map(|s| v4::SessionRecord {
                id: s.id,
                owner_uid: s.owner_uid,
                label: s.label.clone(),
                geometry: s.geometry.clone(),
                policy: v4::PolicyRecord {
                    sink_blocks: s.policy.sink_blocks,
                    local_blocks: s.policy.local_blocks,
                    top_k: s.policy.top_k,
                },
                layer_tokens: s.layer_tokens.clone(),
                pages: s.pages.clone(),
                pinned: s.pinned,
            })
            .collect(),
    };
    let payload = rkyv::to_bytes::<rkyv::rancor::Error>(&old).unwrap();
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
/// writes the current version, which opens again beside its version 3 fallback.
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
        devices: devices(&dir, caps.iter().map(|&c| (c, 1.0))),
        // Not what the old store had: variable pages do not depend on it.
        max_payload: MIB,
    };
    let open_store = || PageStore::open(&cfg, open_best_driver(UringConfig::default())).unwrap();
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

        // A new session of 512 KiB runs and a rewrite of one 100 KiB run: the current version.
        let big: Vec<Vec<u8>> = (0..4).map(|b| run_bytes(3, b, 8, 512 * KIB)).collect();
        let runs = layer0_runs(&big);
        assert_eq!(tier.next_generation(), 8);
        assert_eq!(
            tier.put_session(&one_layer_session(3, 4), &runs).unwrap(),
            8
        );
        assert_eq!(
            file_version(&mdir.join(format!("manifest-{:020}", 8))),
            kvtier_storage::nvme::manifest::VERSION
        );
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
        max_payload: 3 * MIB,
        ..store_cfg(&dir, &[1.0, 1.0], 16 * MIB as u64)
    };
    let open_store = || PageStore::open(&cfg, open_best_driver(UringConfig::default())).unwrap();
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
    // As stored, but page `page` of session `session` placed `units` units into the 3 MiB one.
    let moved = |session: u64, page: usize, units: u64| {
        let mut l = loaded();
        let s = l.current.sessions.iter_mut().find(|s| s.id == session);
        let p = &mut s.unwrap().pages[page];
        (p.device, p.page) = (big.device, big.page + units);
        l
    };
    // A 20 KiB page moved inside the 3 MiB one, or a 512 KiB one reaching into it.
    for (name, mut l) in [("inside", moved(4, 0, 700)), ("reaching", moved(2, 5, 768))] {
        let e = l.recover_into(&open_store()).unwrap_err();
        assert!(
            matches!(&e, NvmeError::ManifestMismatch { what } if what.contains("overlaps")),
            "{name}: {e:?}"
        );
    }
}
