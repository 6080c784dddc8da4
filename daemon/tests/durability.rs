//! Durability under shutdown, demotion, full disks and damaged files: one regression test per
//! fault that once lost sessions or answered INTERNAL (docs/operations.md, "Failure model").
//! What one local user can do to another's sessions is in fairness.rs.

mod common;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use common::*;
use kvtier_protocol::{stats_keys, ErrorCode, Policy, Request, HEADER_LEN, PROTOCOL_VERSION};
use kvtier_tests::wire::{frame, hello_frame, read_reply};

/// The newest manifest file of a daemon's state directory (the primary, not its copy).
fn newest_manifest(state: &Path) -> PathBuf {
    entries(state, |n| n.starts_with("manifest-") && !n.contains('.'))
        .pop()
        .expect("a manifest")
}

fn flip_byte(path: &Path, at: u64) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[at as usize] ^= 0x20;
    std::fs::write(path, bytes).unwrap();
}

/// A session whose last block is partial, once demoted, could not be demoted again, made
/// SIGTERM panic half-way through writing every session (sessions lost, exit 101), and made
/// ordinary DECODEs answer INTERNAL after a restart under memory pressure.
#[test]
fn a_demoted_partial_tail_is_demoted_again_and_shutdown_writes_every_session() {
    let d = Daemon::with(&["nvme.write_through=false"]);
    let mut c = d.client();
    // 1000 tokens: 62 full blocks of 16 and a partial one.
    let (demoted, mut dsh) = open(&mut c, "", 1000, 1);
    assert!(c.demote(demoted).unwrap() > 0);
    assert_eq!(c.demote(demoted).unwrap(), 0, "nothing left to free");
    let mut others: Vec<(u64, Shadow)> = (0..6)
        .map(|i| open(&mut c, "", 100 + i, 10 + i as u64))
        .collect();
    drop(c);
    // SIGTERM writes every session and exits 0 (Daemon::stop checks).
    let dir = d.stop(false);

    // Restart under memory pressure: 64 extents of 4 KiB for 7 sessions of 2 layers.
    let d = Daemon::start_in(dir, &["--set", "host.capacity=\"256KiB\""]);
    let mut c = d.client();
    intact(&mut c, demoted, &mut dsh);
    for (id, sh) in &mut others {
        intact(&mut c, *id, sh);
    }
    for _ in 0..3 {
        dsh.step(&mut c, demoted);
        for (id, sh) in &mut others {
            sh.step(&mut c, *id);
        }
    }
    // Demoted twice again, partial tail and all (memory pressure may have demoted it
    // already), and still decoding.
    c.demote(demoted).unwrap();
    assert_eq!(c.demote(demoted).unwrap(), 0);
    dsh.step(&mut c, demoted);
}

/// A shutdown that cannot write every session says so in its exit status, and a full NVMe
/// tier does not stop sessions that live in RAM from decoding.
#[test]
fn a_shutdown_that_loses_sessions_exits_nonzero() {
    // 12 pages of 8 KiB: no room for these sessions.
    let mut d = Daemon::with(&["nvme.capacity=\"96KiB\""]);
    let mut c = d.client();
    let mut a = open(&mut c, "", 400, 2);
    let mut b = open(&mut c, "", 400, 3);
    assert_eq!(
        c.demote(a.0).unwrap_err().code(),
        Some(ErrorCode::ResourceExhausted)
    );
    a.1.step(&mut c, a.0);
    b.1.step(&mut c, b.0);
    drop(c);
    let status = d.terminate();
    assert!(
        !status.success(),
        "sessions could not be written, yet exit status {status}"
    );
}

/// Write-through appends survive the newest manifest file being damaged (each epoch has two
/// files), and a flipped bit in a manifest's version field is corruption (fall back), not a
/// newer format that refuses startup.
#[test]
fn write_through_survives_a_damaged_newest_manifest() {
    for (what, at) in [("payload", 60u64), ("version field", 9)] {
        let d = Daemon::with(&["nvme.write_through=true"]);
        let mut c = d.client();
        let (id, mut sh) = open(&mut c, "", 40, 4);
        c.append_kv(id, 40, 8, &sh.payload(8)).unwrap();
        drop(c);
        let dir = d.stop(true);
        flip_byte(&newest_manifest(&dir.path().join("state")), at);
        let d = Daemon::start_in(dir, &[]);
        let mut c = d.client();
        assert_eq!(c.session_info(id).unwrap().tokens_max, 48, "{what}");
        intact(&mut c, id, &mut sh);
    }
}

/// Every manifest damaged: tierd refuses to start (naming the option) and touches nothing;
/// with quarantine it moves them and the page file aside, intact, and starts empty.
#[test]
fn all_manifests_damaged_refuses_to_start_or_quarantines() {
    let d = Daemon::start(&[]);
    let mut c = d.client();
    let (id, _) = open(&mut c, "", 64, 5);
    c.demote(id).unwrap();
    drop(c);
    let pages = d.page_file();
    let dir = d.stop(false);
    let state = dir.path().join("state");
    for p in entries(&state, |n| n.starts_with("manifest-")) {
        flip_byte(&p, 50);
    }
    let page_bytes = std::fs::read(&pages).unwrap();
    let out = tierd()
        .socket(dir.path().join("refused.sock"))
        .nvme_dir(&state)
        .set("host.max_run_bytes=\"4KiB\"")
        .output();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started over damaged manifests");
    assert!(err.contains("nvme.damaged_manifests"), "{err}");
    assert_eq!(
        std::fs::read(&pages).unwrap(),
        page_bytes,
        "pages untouched"
    );

    let d = Daemon::start_in(dir, &["--set", "nvme.damaged_manifests=\"quarantine\""]);
    let mut c = d.client();
    assert!(c.list_sessions().unwrap().is_empty());
    let q = entries(&state, |n| n.starts_with("quarantine-"))
        .pop()
        .expect("a quarantine directory");
    assert_eq!(std::fs::read(q.join("pages-0")).unwrap(), page_bytes);
    // The new tier works.
    let (id, mut sh) = open(&mut c, "", 40, 6);
    c.demote(id).unwrap();
    sh.step(&mut c, id);
}

/// A page that fails verification at startup: its session stays listed as damaged (DATA_LOSS
/// on use, CLOSE deletes it) while the other sessions serve.
#[test]
fn a_corrupt_page_at_startup_leaves_the_session_listed_as_damaged() {
    let d = Daemon::start(&[]);
    let mut c = d.client();
    let (bad, _) = open(&mut c, "", 64, 7);
    let (good, mut gsh) = open(&mut c, "", 64, 8);
    c.demote(bad).unwrap();
    drop(c);
    let pages = d.page_file();
    let dir = d.stop(false);
    // Pages of `bad` were written first, by DEMOTE: its first page is page 0 (8 KiB pages).
    flip_byte(&pages, 100);
    let d = Daemon::start_in(dir, &[]);
    let mut c = d.client();
    let info = c.session_info(bad).unwrap();
    assert!(info.damaged, "{info:?}");
    assert_eq!(info.tokens_max, 64);
    assert_eq!(c.list_sessions().unwrap().len(), 2);
    let mut sh = Shadow::new(small_geometry(), 9);
    let (q, k, v) = sh.step_input(0);
    let qb = f32_bytes(&q);
    let e = c.decode(0, entry(bad, 64, &qb, &k, &v), false).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::DataLoss), "{e}");
    let e = c.append_kv(bad, 64, 1, &sh.payload(1)).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::DataLoss), "{e}");
    intact(&mut c, good, &mut gsh);
    c.close(bad).unwrap();
    assert_eq!(
        c.session_info(bad).unwrap_err().code(),
        Some(ErrorCode::NotFound)
    );
}

/// A DECODE whose reply could not be sent is refused before it appends anything.
#[test]
fn a_decode_whose_reply_exceeds_the_frame_limit_appends_nothing() {
    let d = Daemon::with(&["server.max_frame_bytes=\"4KiB\""]);
    let mut c = d.client();
    let g = small_geometry();
    let wide = Policy::bound(1, 1, 500);
    let id = c.create_session(g, wide, "").unwrap();
    let mut sh = Shadow::new(g, 11);
    // 502 blocks: stats list 502 ids per kv head, more than 4 KiB of reply.
    let n = 502 * 16;
    let payload = sh.payload(n);
    c.append_kv_shm(id, 0, n as u32, &payload).unwrap();
    let (q, k, v) = sh.step_input(0);
    let qb = f32_bytes(&q);
    let e = c
        .decode(0, entry(id, n as u64, &qb, &k, &v), true)
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::ResourceExhausted), "{e}");
    assert_eq!(
        c.session_info(id).unwrap().tokens_max,
        n as u64,
        "nothing appended"
    );
    // Without stats the reply fits: the same step goes through at the same position.
    c.decode(0, entry(id, n as u64, &qb, &k, &v), false)
        .unwrap();
    assert_eq!(c.session_info(id).unwrap().tokens_max, n as u64 + 1);
}

/// rejected_total counts what protocol.md §5.7 says: limits, permissions, malformed requests.
#[test]
fn rejections_count_limits_permissions_and_malformed_requests() {
    let d = Daemon::with(&["auth.admin_uids=[]"]);
    let mut c = d.client();
    let (id, _) = open(&mut c, "", 16, 12);
    let before = c.stats().unwrap().get(stats_keys::REJECTED_TOTAL).unwrap();
    assert_eq!(
        c.evict(id).unwrap_err().code(),
        Some(ErrorCode::PermissionDenied)
    );
    // A CLOSE_SESSION whose body is 3 bytes instead of 8.
    let mut s = UnixStream::connect(d.path()).unwrap();
    s.write_all(&hello_frame(1, PROTOCOL_VERSION, PROTOCOL_VERSION, "raw"))
        .unwrap();
    read_reply(&mut s).unwrap();
    let mut bad = frame(&Request::CloseSession { session: id }, 2);
    bad.truncate(HEADER_LEN + 3);
    bad[4..8].copy_from_slice(&3u32.to_le_bytes());
    s.write_all(&bad).unwrap();
    read_reply(&mut s).unwrap();
    let after = c.stats().unwrap().get(stats_keys::REJECTED_TOTAL).unwrap();
    assert_eq!(after, before + 2);
}

/// A full filesystem under the manifest: commits fail with RESOURCE_EXHAUSTED and change
/// nothing (a CLOSE that could not delete the durable copy leaves the session), sessions in
/// RAM keep decoding, and once space is freed every operation works again without a restart
/// (a failed commit used to leave a temporary file that wedged every later one).
#[test]
fn a_full_filesystem_fails_commits_cleanly_and_recovers_when_space_is_freed() {
    let Some(fs) = SmallFs::mount(256 << 10) else {
        eprintln!("cannot mount a tmpfs here (needs root): full-filesystem test not applicable");
        return;
    };
    let pages = tempfile::tempdir().unwrap();
    let devices = format!(
        "nvme.devices=[{{path={:?}, capacity=\"1MiB\"}}]",
        pages.path().join("pages-0").to_str().unwrap()
    );
    let state = format!("nvme.dir={:?}", fs.dir.path().to_str().unwrap());
    let d = Daemon::with(&[&devices, &state]);
    let mut c = d.client();
    let (stored, mut ssh) = open(&mut c, "", 40, 20);
    c.demote(stored).unwrap();
    let (ram, mut rsh) = open(&mut c, "", 40, 21);

    let filler = fs.fill();
    let full = |r: Result<(), kvtier_protocol::client::ClientError>, what: &str| {
        let e = r.expect_err(what);
        assert_eq!(e.code(), Some(ErrorCode::ResourceExhausted), "{what}: {e}");
    };
    full(c.pin(stored, true), "PIN");
    full(c.close(stored), "CLOSE");
    full(c.demote(ram).map(|_| ()), "DEMOTE");
    assert!(
        c.session_info(stored).is_ok(),
        "a failed CLOSE leaves the session"
    );
    rsh.step(&mut c, ram);
    ssh.step(&mut c, stored);

    std::fs::remove_file(filler).unwrap();
    c.pin(stored, true).unwrap();
    c.pin(stored, false).unwrap();
    c.demote(ram).unwrap();
    c.close(stored).unwrap();
    drop(c);
    let dir = d.stop(false);
    let d = Daemon::start_in(dir, &["--set", &devices, "--set", &state]);
    let mut c = d.client();
    assert_eq!(
        c.session_info(stored).unwrap_err().code(),
        Some(ErrorCode::NotFound),
        "closed stays closed"
    );
    intact(&mut c, ram, &mut rsh);
    drop(c);
    drop(d);
}
