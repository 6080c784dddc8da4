//! Unit tests of the manifest files: format versions, fallback, commits and quarantine.

use super::*;

fn geometry() -> GeometryRecord {
    GeometryRecord {
        layers: 2,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 32,
        dtype: 0,
        block_tokens: 16,
    }
}

fn policy() -> PolicyRecord {
    PolicyRecord {
        sink_blocks: 1,
        local_blocks: 1,
        top_k: 2,
        selector: 0,
        candidates: 0,
    }
}

fn page(block: u32) -> PageRecord {
    PageRecord {
        layer: 1,
        block,
        device: 0,
        page: block as u64 + 3,
        generation: 7,
        crc: 0xDEAD_BEEF,
        payload_len: 4096,
    }
}

/// Writes `payload` as manifest file `epoch` of format `version`, as a tierd of that
/// version would have.
fn write_as(dir: &Path, version: u32, epoch: u64, payload: &[u8]) {
    write_file(&dir.join(file_name(epoch)), version, epoch, payload).unwrap();
}

/// The one page file the old-version manifests below name.
fn one_device() -> Vec<DeviceRecord> {
    vec![DeviceRecord {
        path: "/x/pages-0".into(),
        pages: 100,
    }]
}

/// A version 1-4 policy: sink 1, local 1, top-k 2 (the key bound, as [`policy`]).
fn v4_policy() -> v4::PolicyRecord {
    v4::PolicyRecord {
        sink_blocks: 1,
        local_blocks: 1,
        top_k: 2,
    }
}

/// A manifest naming [`one_device`] with `sessions` in any version's layout.
fn on_one_device<S>(epoch: u64, page_size: u64, sessions: Vec<S>) -> ManifestOf<S> {
    ManifestOf {
        epoch,
        page_size,
        devices: one_device(),
        sessions,
    }
}

/// A version 1 session record of two pages; upgraded, the start of every later layout's.
fn v1_session(id: u64, label: &str) -> v1::SessionRecord {
    v1::SessionRecord {
        id,
        owner_uid: 1000,
        label: label.into(),
        geometry: geometry(),
        policy: v4_policy(),
        layer_tokens: vec![40, 40],
        pages: vec![page(0), page(1)],
    }
}

/// `m` (a manifest of any version's layout) serialized, as the tierd of its version wrote it.
fn bytes_of<T>(m: &T) -> rkyv::util::AlignedVec
where
    T: for<'a> rkyv::Serialize<
        rkyv::api::high::HighSerializer<
            rkyv::util::AlignedVec,
            rkyv::ser::allocator::ArenaHandle<'a>,
            rancor::Error,
        >,
    >,
{
    rkyv::to_bytes::<rancor::Error>(m).unwrap()
}

/// Writes `old` (an old version's manifest, [`bytes_of`]) as the only file, at `epoch`, and
/// opens the directory: the store and what it loaded, which must be that file at `version`.
fn open_old(dir: &Path, version: u32, epoch: u64, old: &[u8]) -> (ManifestStore, Loaded) {
    write_as(dir, version, epoch, old);
    let (store, loaded) = ManifestStore::open(dir).unwrap();
    let loaded = loaded.expect("a manifest");
    assert_eq!(loaded.current_version, version);
    (store, loaded)
}

/// Page lookups binary-search: a file whose page records are out of order (the format
/// allows it) loads sorted, and every record is found.
#[test]
fn page_records_load_sorted_and_are_found_by_binary_search() {
    let dir = tempfile::tempdir().unwrap();
    let mut pages: Vec<PageRecord> = (0..40).map(page).collect();
    pages.extend((0..10).map(|b| PageRecord {
        layer: 0,
        ..page(b)
    }));
    pages.reverse();
    pages.swap(3, 17);
    let m = Manifest {
        epoch: 2,
        page_size: 8192,
        devices: Vec::new(),
        sessions: vec![SessionRecord {
            id: 1,
            owner_uid: 0,
            label: String::new(),
            geometry: geometry(),
            policy: policy(),
            layer_tokens: vec![160, 640],
            pages: pages.clone(),
            pinned: false,
            created_unix_ms: 1_795_000_000_000,
        }],
    };
    let bytes = rkyv::to_bytes::<rancor::Error>(&m).unwrap();
    write_as(dir.path(), VERSION, 2, &bytes);
    let loaded = load_file(&dir.path().join(file_name(2))).unwrap();
    let s = &loaded.sessions[0];
    assert!(s.pages.is_sorted_by_key(|p| (p.layer, p.block)));
    for p in &pages {
        assert_eq!(s.page(p.layer, p.block), Some(p));
    }
    assert_eq!(s.page(0, 10), None);
    assert_eq!(s.page(2, 0), None);
}

#[test]
fn a_version_1_manifest_loads_with_sessions_unpinned_and_is_upgraded_on_commit() {
    let dir = tempfile::tempdir().unwrap();
    let old = on_one_device(4, 8192, vec![v1_session(42, "old")]);
    let (mut store, loaded) = open_old(dir.path(), 1, 4, &bytes_of(&old));
    assert_eq!(loaded.previous_version, None);
    let mut m = loaded.current;
    assert_eq!(m.epoch, 4);
    assert_eq!(m.devices, old.devices);
    let s = &m.sessions[0];
    assert_eq!(
        (
            s.id,
            s.owner_uid,
            s.label.as_str(),
            &s.layer_tokens,
            s.pinned
        ),
        (42, 1000, "old", &vec![40, 40], false)
    );
    assert_eq!(s.pages, old.sessions[0].pages);
    assert_eq!((&s.geometry, &s.policy), (&geometry(), &policy()));

    // The next commit is the current version and carries the flag.
    m.sessions[0].pinned = true;
    let epoch = store.commit(&mut m).unwrap();
    let path = dir.path().join(file_name(epoch));
    let raw = fs::read(&path).unwrap();
    assert_eq!(u32::from_le_bytes(raw[8..12].try_into().unwrap()), VERSION);
    assert!(load_file(&path).unwrap().sessions[0].pinned);
}

#[test]
fn a_version_4_manifest_loads_its_sessions_with_the_bound_selector() {
    let dir = tempfile::tempdir().unwrap();
    let session = v4::SessionRecord {
        pinned: true,
        ..v1_session(9, "before sketches").into()
    };
    let old = on_one_device(7, 4096, vec![session]);
    let (mut store, loaded) = open_old(dir.path(), 4, 7, &bytes_of(&old));
    let mut m = loaded.current;
    let s = &m.sessions[0];
    assert_eq!(
        s.policy.policy(),
        Some(crate::Policy::bound(1, 1, 2)),
        "sessions made before sketches keep the selector they were made with"
    );
    assert!(s.pinned);
    let epoch = store.commit(&mut m).unwrap();
    let back = load_file(&dir.path().join(file_name(epoch))).unwrap();
    assert_eq!(back.sessions[0].policy, policy());
}

#[test]
fn a_version_5_manifest_loads_with_creation_times_unknown_and_commits_them() {
    let dir = tempfile::tempdir().unwrap();
    let v4: v4::SessionRecord = v1_session(5, "before creation times").into();
    let session = v5::SessionRecord {
        policy: PolicyRecord::from(&crate::Policy::sketch(1, 4, 8, 16)),
        pinned: true,
        ..v4.into()
    };
    let old = on_one_device(3, 4096, vec![session]);
    let (mut store, loaded) = open_old(dir.path(), 5, 3, &bytes_of(&old));
    let mut m = loaded.current;
    let s = &m.sessions[0];
    assert_eq!((s.id, s.pinned, s.created_unix_ms), (5, true, 0));
    assert_eq!(s.policy.policy(), Some(crate::Policy::sketch(1, 4, 8, 16)));
    assert_eq!(s.pages, old.sessions[0].pages);
    m.sessions[0].created_unix_ms = 1_795_000_000_123;
    let epoch = store.commit(&mut m).unwrap();
    let back = load_file(&dir.path().join(file_name(epoch))).unwrap();
    assert_eq!(back.sessions[0].created_unix_ms, 1_795_000_000_123);
}

#[test]
fn a_selector_this_build_does_not_know_is_none() {
    let rec = PolicyRecord {
        selector: 7,
        ..policy()
    };
    assert_eq!(rec.policy(), None);
    let p = crate::Policy::sketch(1, 4, 8, 16);
    assert_eq!(PolicyRecord::from(&p).policy(), Some(p));
}

#[test]
fn an_unknown_version_is_a_typed_error_naming_it_and_stops_open() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = ManifestStore::open(dir.path()).unwrap().0;
    let mut m = Manifest {
        page_size: 8192,
        ..Default::default()
    };
    store.commit(&mut m).unwrap();
    // A newer tierd's manifest after it: intact, but of format version 9.
    let bytes = rkyv::to_bytes::<rancor::Error>(&m).unwrap();
    write_as(dir.path(), 9, 2, &bytes);
    let path = dir.path().join(file_name(2));
    let e = load_file(&path).unwrap_err();
    assert!(
        matches!(
            e,
            NvmeError::UnsupportedManifestVersion {
                found: 9,
                oldest: OLDEST_VERSION,
                newest: VERSION,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("format version 9"), "{e}");
    // Not skipped for the older epoch 1: that would serve stale data.
    let e = ManifestStore::open(dir.path()).unwrap_err();
    assert!(
        matches!(e, NvmeError::UnsupportedManifestVersion { found: 9, .. }),
        "{e:?}"
    );
    // The same file damaged (checksum fails) is corruption, skipped as before.
    let mut raw = fs::read(&path).unwrap();
    let last = raw.len() - 1;
    raw[last] ^= 1;
    fs::write(&path, raw).unwrap();
    let (_, loaded) = ManifestStore::open(dir.path()).unwrap();
    let loaded = loaded.unwrap();
    assert_eq!(loaded.current.epoch, 1);
    assert!(matches!(
        loaded.skipped[0].1,
        NvmeError::CorruptManifest { .. }
    ));
}

fn committed(dir: &Path, n: usize) -> ManifestStore {
    let mut store = ManifestStore::open(dir).unwrap().0;
    for i in 0..n {
        let mut m = Manifest {
            page_size: 8192 + i as u64,
            ..Default::default()
        };
        store.commit(&mut m).unwrap();
    }
    store
}

fn flip(path: &Path, at: usize) {
    let mut raw = fs::read(path).unwrap();
    raw[at] ^= 0x10;
    fs::write(path, raw).unwrap();
}

/// A commit that fails (here: its temporary name is taken by something it cannot
/// remove, as a full filesystem leaves a commit unfinished) leaves nothing behind and
/// does not stop the next one, which used to fail with EEXIST forever.
#[test]
fn a_failed_commit_does_not_wedge_the_next_one() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = committed(dir.path(), 1);
    let blocked = dir.path().join(format!("{}.tmp", file_name(2)));
    fs::create_dir(&blocked).unwrap();
    let mut m = Manifest::default();
    assert!(store.commit(&mut m).is_err());
    fs::remove_dir(&blocked).unwrap();
    let epoch = store.commit(&mut m).unwrap();
    assert_eq!(epoch, 3, "the failed commit's epoch is never reused");
    let (_, loaded) = ManifestStore::open(dir.path()).unwrap();
    assert_eq!(loaded.unwrap().current.epoch, 3);
    let names: Vec<String> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(!names.iter().any(|n| n.ends_with(".tmp")), "{names:?}");
}

/// Each epoch is two files: damaging one loses nothing (the newest commit is still the
/// one loaded); a flipped bit in the version field is corruption, not a newer format.
#[test]
fn one_damaged_file_of_the_newest_epoch_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    committed(dir.path(), 2);
    let primary = dir.path().join(file_name(2));
    let copy = dir.path().join(copy_name(2));
    flip(&primary, HEADER + 3);
    let (_, loaded) = ManifestStore::open(dir.path()).unwrap();
    let loaded = loaded.unwrap();
    assert_eq!(loaded.current.epoch, 2, "loaded from the copy");
    assert_eq!(loaded.current.page_size, 8193);
    assert_eq!(loaded.previous.unwrap().epoch, 1);
    assert_eq!(loaded.skipped.len(), 1);
    // The copy's version field damaged too: both files of epoch 2 are corrupt (not an
    // unsupported version that would refuse startup), so epoch 1 serves.
    flip(&copy, 9);
    let e = load_file(&copy).unwrap_err();
    assert!(matches!(e, NvmeError::CorruptManifest { .. }), "{e:?}");
    let (_, loaded) = ManifestStore::open(dir.path()).unwrap();
    assert_eq!(loaded.unwrap().current.epoch, 1);
}

/// A version 2 file (checksum without the version field) still loads.
#[test]
fn a_version_2_file_still_loads() {
    let dir = tempfile::tempdir().unwrap();
    let m = Manifest {
        epoch: 5,
        page_size: 4096,
        ..Default::default()
    };
    let bytes = rkyv::to_bytes::<rancor::Error>(&m).unwrap();
    write_as(dir.path(), 2, 5, &bytes);
    let (_, loaded) = ManifestStore::open(dir.path()).unwrap();
    let loaded = loaded.unwrap();
    assert_eq!(loaded.current_version, 2);
    assert_eq!(loaded.current, m);
}

/// Every manifest damaged: open refuses (starting empty would reuse their pages) until the
/// files are quarantined, which moves them and the page files aside, intact.
#[test]
fn all_manifests_damaged_refuses_until_quarantined() {
    let dir = tempfile::tempdir().unwrap();
    committed(dir.path(), 2);
    let pages = dir.path().join("pages-0");
    fs::write(&pages, b"old pages").unwrap();
    for e in 1..=2 {
        for name in [file_name(e), copy_name(e)] {
            flip(&dir.path().join(name), HEADER);
        }
    }
    let e = ManifestStore::open(dir.path()).unwrap_err();
    assert!(
        matches!(e, NvmeError::DamagedManifests { files: 4, .. }),
        "{e:?}"
    );
    assert!(e.to_string().contains("quarantine"), "{e}");
    let q = quarantine(dir.path(), std::slice::from_ref(&pages)).unwrap();
    assert!(!pages.exists());
    assert_eq!(fs::read(q.join("pages-0")).unwrap(), b"old pages");
    assert!(q.join(file_name(2)).exists() && q.join(copy_name(1)).exists());
    let (_, loaded) = ManifestStore::open(dir.path()).unwrap();
    assert!(loaded.is_none(), "a clean start once they are aside");
}

/// Every version's layout is fixed: the bytes of one manifest of each, as the tierd of that
/// version wrote them (the digests were taken with the layouts' own types), are pinned here
/// by length and crc32c, so a change to the types that would make old files unreadable
/// fails here rather than on a user's disk.
#[test]
fn each_versions_layout_serializes_to_the_bytes_it_always_had() {
    let digest = |bytes: rkyv::util::AlignedVec| (bytes.len(), crc32c::crc32c(&bytes));
    // Each layout's record as the upgrade from the one before makes it.
    let v1 = v1_session(3, "chat");
    let v4 = v4::SessionRecord::from(v1.clone());
    let v5 = v5::SessionRecord::from(v4.clone());
    let current = SessionRecord::from(v5.clone());
    let got = [
        digest(bytes_of(&on_one_device(9, 8192, vec![current]))),
        digest(bytes_of(&on_one_device(9, 8192, vec![v5]))),
        digest(bytes_of(&on_one_device(9, 8192, vec![v4]))),
        digest(bytes_of(&on_one_device(9, 8192, vec![v1]))),
    ];
    let want = [
        (256, 0x27fa_5fe0),
        (248, 0x4d15_e933),
        (240, 0xc8fa_f5d9),
        (232, 0x70e4_938a),
    ];
    assert_eq!(
        got, want,
        "(bytes, crc32c) of the current, 5, 4 and 1 layouts"
    );
}
