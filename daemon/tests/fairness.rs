//! Fair under pressure: the limits a local user cannot defeat. One user's requests never cost
//! another user's sessions their RAM residency or their room at shutdown, free space in
//! pieces does not refuse what it holds, and no uid holds every connection slot. The tests
//! that need a second uid run a tenant (an ignored test of this binary) as nobody, as root.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use common::*;
use kvtier_protocol::client::Client;
use kvtier_protocol::{ErrorCode, Geometry, Request, Response, HEADER_LEN};
use kvtier_tests::wire::{frame, hello_frame, read_reply};

/// Free NVMe space in pieces shorter than a page refused a DEMOTE that fit in the free bytes,
/// and the clean shutdown then lost a never-written session (exit 1, NOT_FOUND after the
/// restart). Now pages move to make room: the DEMOTE succeeds, the shutdown writes every
/// session, and all of them come back whole.
#[test]
fn a_fragmented_nvme_tier_places_writes_that_fit_in_its_free_bytes() {
    // 128 units of 4 KiB. A small session of 16 tokens is 2 pages of 2 units; a large one
    // (f32, 64-token blocks) 2 pages of 9 units.
    let settings = [
        "nvme.capacity=\"512KiB\"",
        "host.max_run_bytes=\"64KiB\"",
        "nvme.write_through=false",
    ];
    let d = Daemon::with(&settings);
    let mut c = d.client();
    let mut small: Vec<(u64, Shadow)> = (0..30).map(|i| open(&mut c, "", 16, 300 + i)).collect();
    for (id, _) in &small {
        c.demote(*id).unwrap();
    }
    // Every other one goes: holes of 4 units between the others' pages.
    let gone: Vec<(u64, Shadow)> = small.iter().step_by(2).cloned().collect();
    small.retain(|(id, _)| !gone.iter().any(|g| g.0 == *id));
    for (id, _) in &gone {
        c.close(*id).unwrap();
    }
    let large = Geometry::new(2, 4, 2, 32, kvtier_protocol::DType::F32, 64);
    let mut big: Vec<(u64, Shadow)> = (0..2)
        .map(|i| {
            let id = c.create_session(large, policy(), "large").unwrap();
            let mut sh = Shadow::new(large, 400 + i);
            c.append_kv(id, 0, 64, &sh.payload(64)).unwrap();
            (id, sh)
        })
        .collect();
    let st = c.stats().unwrap();
    let largest = st.get("nvme_largest_free_bytes").unwrap();
    let free = st.get("nvme_bytes_capacity").unwrap() - st.get("nvme_bytes_used").unwrap();
    let page = 9 * 4096;
    assert!(
        largest < page && free >= 4 * page,
        "largest {largest}, free {free}"
    );
    c.demote(big[0].0)
        .expect("a DEMOTE that fits in the free bytes is placed");
    assert!(c.stats().unwrap().get("nvme_pages_moved_total").unwrap() > 0);
    drop(c);
    // The other large session was never written: the shutdown writes it (exit 0) ...
    let dir = d.stop(false);
    let d = Daemon::start_in(
        dir,
        &settings
            .iter()
            .flat_map(|s| ["--set", s])
            .collect::<Vec<_>>(),
    );
    let mut c = d.client();
    // ... and everything comes back whole.
    for (id, sh) in small.iter_mut().chain(big.iter_mut()) {
        intact(&mut c, *id, sh);
    }
    for (id, _) in &gone {
        assert_eq!(
            c.session_info(*id).unwrap_err().code(),
            Some(ErrorCode::NotFound)
        );
    }
}

/// Free host RAM in pieces shorter than a run refused a request that fit in the free bytes.
/// Now other sessions' runs move inside the tier to make room: the request of another uid is
/// placed, and nothing is demoted (the fragmenting sessions keep every byte in RAM). Runs
/// `fragmented_host_tenant` as nobody where the test runs as root (as CI does); as anyone
/// else, the same request comes from this uid.
#[test]
fn a_fragmented_host_tier_places_runs_that_fit_in_its_free_bytes() {
    // 64 units of 4 KiB; the water marks high enough that nothing is demoted for pressure.
    let d = Daemon::with(&[
        "host.capacity=\"256KiB\"",
        "host.max_run_bytes=\"64KiB\"",
        "nvme.prefetch_blocks=0",
        "nvme.high_water=0.99",
        "nvme.low_water=0.98",
    ]);
    let mut c = d.client();
    // 30 sessions of 16 tokens (a 4 KiB run in each of 2 layers); every other one closed:
    // 2-unit holes between the others' runs, the largest free range 4 units.
    let mut small: Vec<(u64, Shadow)> = (0..30).map(|i| open(&mut c, "", 16, 500 + i)).collect();
    let gone: Vec<u64> = small.iter().step_by(2).map(|(id, _)| *id).collect();
    small.retain(|(id, _)| !gone.contains(id));
    for id in &gone {
        c.close(*id).unwrap();
    }
    let held: Vec<u64> = small
        .iter()
        .map(|(id, _)| c.session_info(*id).unwrap().host_bytes)
        .collect();
    let st = c.stats().unwrap();
    let free = st.get("host_bytes_capacity").unwrap() - st.get("host_bytes_used").unwrap();
    let run = 8 * 4096;
    assert!(
        st.get("host_largest_free_bytes").unwrap() < run && free >= 2 * run,
        "{st:?}"
    );
    if is_root() {
        run_tenant("fragmented_host_tenant", &d, &[]);
    } else {
        place_large_session(&mut c);
    }
    let st = c.stats().unwrap();
    assert!(st.get("host_runs_moved_total").unwrap() > 0, "{st:?}");
    assert_eq!(st.get("demotions_total"), Some(0), "{st:?}");
    for ((id, _), bytes) in small.iter().zip(held) {
        assert_eq!(
            c.session_info(*id).unwrap().host_bytes,
            bytes,
            "session {id}"
        );
    }
    // Moved runs hold their bytes (this uid's own steps may demote its own sessions now).
    for (id, sh) in &mut small {
        intact(&mut c, *id, sh);
    }
}

/// A session of two 32 KiB runs (f32, 64-token blocks), decoded once.
fn place_large_session(c: &mut Client) {
    let large = Geometry::new(2, 4, 2, 32, kvtier_protocol::DType::F32, 64);
    let id = c.create_session(large, policy(), "large").unwrap();
    let mut sh = Shadow::new(large, 600);
    c.append_kv(id, 0, 64, &sh.payload(64))
        .expect("a request that fits in the free bytes is placed");
    sh.step(c, id);
}

/// The second-uid half of the test above (ignored on its own).
#[test]
#[ignore = "run as a second uid by a_fragmented_host_tier_places_runs_that_fit_in_its_free_bytes"]
fn fragmented_host_tenant() {
    let Some(mut c) = tenant() else { return };
    place_large_session(&mut c);
    println!("tenant done");
}

/// Idle and half-open connections are closed, so they cannot hold every connection slot:
/// the handshake deadline counts from the accept whatever the peer sends, and idleness from
/// the last completed request, not the last byte.
#[test]
fn idle_connections_time_out_and_free_their_slots() {
    let d = Daemon::with(&[
        "server.max_connections=4",
        "server.admin_connections=0",
        "server.handshake_timeout_ms=300",
        "server.idle_timeout_ms=600",
    ]);
    // Closed by the server within `limit`: a read sees EOF (after any replies).
    let closed_within = |s: &mut UnixStream, limit: Duration| {
        s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        let t0 = Instant::now();
        let mut buf = [0u8; 4096];
        while t0.elapsed() < limit {
            match s.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
                Err(_) => return true,
            }
        }
        false
    };
    // A peer that sends a request every 100 ms but never HELLO: each is answered
    // FAILED_PRECONDITION, and the handshake deadline still closes it.
    let mut pre = UnixStream::connect(d.path()).unwrap();
    let t0 = Instant::now();
    let mut closed = false;
    for i in 0..30 {
        if pre.write_all(&frame(&Request::Stats, i + 1)).is_err()
            || closed_within(&mut pre, Duration::from_millis(100))
        {
            closed = true;
            break;
        }
    }
    assert!(closed, "requests before HELLO kept the connection open");
    assert!(
        t0.elapsed() < Duration::from_millis(2000),
        "{:?}",
        t0.elapsed()
    );
    // After HELLO, a header trickled a byte every 100 ms is no request: the idle deadline
    // closes the connection.
    let mut slow = UnixStream::connect(d.path()).unwrap();
    slow.write_all(&hello_frame(1, 1, u16::MAX, "slow"))
        .unwrap();
    read_reply(&mut slow).unwrap();
    let t0 = Instant::now();
    let stats = frame(&Request::Stats, 2);
    let mut closed = false;
    for b in &stats[..HEADER_LEN - 1] {
        if slow.write_all(std::slice::from_ref(b)).is_err()
            || closed_within(&mut slow, Duration::from_millis(100))
        {
            closed = true;
            break;
        }
    }
    assert!(closed, "a trickled header kept the connection open");
    assert!(
        t0.elapsed() < Duration::from_millis(2000),
        "{:?}",
        t0.elapsed()
    );
    // Completed requests are activity: a client asking every 200 ms outlives the idle limit.
    let mut busy = d.client();
    for _ in 0..8 {
        busy.stats().unwrap();
        std::thread::sleep(Duration::from_millis(200));
    }
    // Four connections that never say HELLO take every slot ...
    let idle: Vec<UnixStream> = (0..4)
        .map(|_| UnixStream::connect(d.path()).unwrap())
        .collect();
    // ... until the handshake limit closes them.
    for mut s in idle {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let t0 = Instant::now();
        // EOF (one may first get a "too many connections" frame, if the startup probe's
        // connection still held its slot).
        let mut rest = Vec::new();
        s.read_to_end(&mut rest)
            .expect("closed by the server, not timed out here");
        assert!(t0.elapsed() < Duration::from_secs(5));
    }
    // A client that said HELLO and then idles is closed after the idle limit.
    let mut c = d.client();
    c.stats().unwrap();
    std::thread::sleep(Duration::from_millis(2500));
    assert!(c.stats().is_err(), "an idle connection is closed");
    // Slots are free again.
    let mut c = d.client();
    c.stats().unwrap();
}

/// Per-uid session quota (admins exempt; here nobody is an admin).
#[test]
fn a_uid_cannot_hold_more_sessions_than_its_quota() {
    let d = Daemon::with(&["quota.max_sessions_per_uid=2", "auth.admin_uids=[]"]);
    let mut c = d.client();
    let g: Geometry = small_geometry();
    let a = c.create_session(g, policy(), "").unwrap();
    c.create_session(g, policy(), "").unwrap();
    let e = c.create_session(g, policy(), "").unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::ResourceExhausted), "{e}");
    assert!(e.to_string().contains("max_sessions_per_uid"), "{e}");
    c.close(a).unwrap();
    c.create_session(g, policy(), "").unwrap();
}

/// Per-uid shares of the host and NVMe tiers (admin uids exempt; here nobody is an admin): a
/// user filling its share gets RESOURCE_EXHAUSTED, others' room is untouched, and closing a
/// session gives its share back.
#[test]
fn a_uid_cannot_take_more_than_its_share_of_the_tiers() {
    // 256 host extents of 4 KiB: a quarter is 64 extents, 32 blocks per layer here.
    let settings = ["host.capacity=\"1MiB\"", "quota.host_share_per_uid=0.25"];
    let (d, mut c, id, mut sh) = quota_daemon(&settings, 400, 30);
    let e = c.append_kv(id, 400, 200, &sh.payload(200)).unwrap_err();
    refused_by(&e, "host_share_per_uid");
    sh.truncate(400);
    intact(&mut c, id, &mut sh);
    let used = c.stats().unwrap().get("host_extents_used").unwrap();
    assert!(used <= 64, "{used} extents");
    c.close(id).unwrap();
    let (id, _) = open(&mut c, "", 500, 31);
    assert_eq!(c.session_info(id).unwrap().tokens_max, 500);
    drop((c, d));

    // 12 NVMe pages of 8 KiB: half is 6 pages, fewer than the session's 2 x 4 runs.
    let settings = ["nvme.capacity=\"96KiB\"", "quota.nvme_share_per_uid=0.5"];
    let (_d, mut c, id, mut sh) = quota_daemon(&settings, 64, 32);
    refused_by(&c.demote(id).unwrap_err(), "nvme_share_per_uid");
    intact(&mut c, id, &mut sh);
    let (small, _) = open(&mut c, "", 40, 33);
    c.demote(small).unwrap();
}

/// A daemon with `settings` and no admin uid (so root's quotas apply), a client, and a session
/// of `n` tokens on it.
fn quota_daemon(settings: &[&str], n: u32, seed: u64) -> (Daemon, Client, u64, Shadow) {
    let d = Daemon::with(&[settings, &["auth.admin_uids=[]"]].concat());
    let mut c = d.client();
    let (id, sh) = open(&mut c, "", n, seed);
    (d, c, id, sh)
}

/// A RESOURCE_EXHAUSTED refusal that names the quota `setting`.
fn refused_by(e: &kvtier_protocol::client::ClientError, setting: &str) {
    assert_eq!(e.code(), Some(ErrorCode::ResourceExhausted), "{e}");
    assert!(e.to_string().contains(setting), "{e}");
}

/// Memory pressure by one uid demotes that uid's own sessions, never another uid's that is
/// within its fair share (the tier's extents divided among the uids holding any), though a lone
/// uid may use the whole tier. Needs a second uid: runs `fair_share_tenant` as nobody (root
/// only, as CI runs).
#[test]
fn memory_pressure_from_one_uid_does_not_push_another_uids_sessions_out() {
    if !can_run_second_uid() {
        return;
    }
    // 256 extents of 4 KiB; high water 0.9.
    let d = Daemon::with(&["host.capacity=\"1MiB\"", "nvme.prefetch_blocks=0"]);
    let mut c = d.client();
    // Root's session: 38 blocks x 2 layers = 76 extents, then left idle (least recently used).
    let (mine, mut sh) = open(&mut c, "", 600, 40);
    let full = c.session_info(mine).unwrap().host_bytes;
    run_tenant("fair_share_tenant", &d, &[]);
    let stats = c.stats().unwrap();
    assert!(stats.get("demotions_total").unwrap() > 0, "{stats:?}");
    assert_eq!(
        c.session_info(mine).unwrap().host_bytes,
        full,
        "another uid's pressure demoted this uid's session"
    );
    intact(&mut c, mine, &mut sh);
}

/// The second-uid half of the test above (ignored on its own).
#[test]
#[ignore = "run as a second uid by memory_pressure_from_one_uid_does_not_push_another_uids_sessions_out"]
fn fair_share_tenant() {
    let Some(mut c) = tenant() else { return };
    // Six sessions of 50 extents: more than the 180 extents left; over its fair share (128)
    // this uid's own older sessions are demoted to make room.
    for i in 0..6 {
        let (id, mut sh) = open(&mut c, "", 400, 50 + i);
        sh.step(&mut c, id);
    }
    println!("tenant done");
}

/// Making room takes only what the request may take: a request that cannot fit demotes
/// nothing, nor does one larger than the whole tier or one its own share of the tier refuses;
/// one that fits demotes the requester's own least recently used sessions, only as many as it
/// needs. Another uid's sessions, within their fair share, keep their residency throughout.
/// Runs `room_tenant` as nobody (root only, as CI runs).
#[test]
fn making_room_takes_only_what_the_request_may_take() {
    if !can_run_second_uid() {
        return;
    }
    for share in ["1.0", "0.5"] {
        // 256 extents of 4 KiB; the water marks high enough that only requests make room.
        let share_setting = format!("quota.host_share_per_uid={share}");
        let d = Daemon::with(&[
            "host.capacity=\"1MiB\"",
            "nvme.prefetch_blocks=0",
            "nvme.high_water=0.99",
            "nvme.low_water=0.98",
            "auth.admin_uids=[]",
            &share_setting,
        ]);
        let mut c = d.client();
        // Root's four sessions, 16 blocks x 2 layers = 32 extents each: 128 extents, half the
        // tier, root's fair share once a second uid holds any (and its cap at share 0.5). 255
        // tokens: the decode step that checks each at the end opens no block.
        let mut mine: Vec<(u64, Shadow)> = (0..4).map(|i| open(&mut c, "", 255, 60 + i)).collect();
        let held: Vec<u64> = mine
            .iter()
            .map(|(id, _)| c.session_info(*id).unwrap().host_bytes)
            .collect();
        run_tenant("room_tenant", &d, &[("KVTIER_TENANT_SHARE", share)]);
        for ((id, sh), bytes) in mine.iter_mut().zip(held) {
            assert_eq!(
                c.session_info(*id).unwrap().host_bytes,
                bytes,
                "share {share}: another uid's request demoted session {id}"
            );
            intact(&mut c, *id, sh);
        }
    }
}

/// The second-uid half of the test above (ignored on its own).
#[test]
#[ignore = "run as a second uid by making_room_takes_only_what_the_request_may_take"]
fn room_tenant() {
    let Some(mut c) = tenant() else { return };
    let capped = std::env::var("KVTIER_TENANT_SHARE").unwrap() != "1.0";
    let extents = |c: &mut Client, id| c.session_info(id).unwrap().host_bytes / 4096;
    let demotions = |c: &mut Client| c.stats().unwrap().get("demotions_total").unwrap();
    // X: 4 blocks x 2 layers, then on NVMe. 128 extents are free.
    let (x, mut sx) = open(&mut c, "", 64, 70);
    c.demote(x).unwrap();
    let before = demotions(&mut c);
    // 1,280 tokens open 160 extents; 4,200 tokens more than the tier's 256.
    for n in [1280, 4200] {
        let e = c.append_kv(x, 64, n, &sx.payload(n as usize)).unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::ResourceExhausted), "{e}");
        sx.truncate(64);
    }
    assert_eq!(
        demotions(&mut c),
        before,
        "a refused request demoted sessions"
    );
    if !capped {
        // Two sessions of this uid's, 48 extents each: 32 extents free. X asks 72 (576 tokens):
        // the older of the two is demoted, and only it.
        let (a, _) = open(&mut c, "", 384, 71);
        std::thread::sleep(Duration::from_millis(5));
        let (b, _) = open(&mut c, "", 384, 72);
        c.append_kv(x, 64, 576, &sx.payload(576)).unwrap();
        assert_eq!(
            extents(&mut c, a),
            0,
            "the least recently used own session was kept"
        );
        assert_eq!(
            extents(&mut c, b),
            48,
            "more was demoted than the request needed"
        );
        assert_eq!(extents(&mut c, x), 72);
        sx.step(&mut c, x);
    }
    println!("tenant done");
}

/// No uid can take every connection slot: one non-admin uid holds at most
/// `server.max_connections_per_uid`, and the last `server.admin_connections` slots are kept
/// for admins, so root connects while another user holds all it may. Runs
/// `connection_tenant` as nobody (root only, as CI runs).
#[test]
fn no_uid_can_hold_every_connection_slot() {
    if !can_run_second_uid() {
        return;
    }
    // (settings, connections nobody gets, what refuses the next one)
    let cases = [
        (
            [
                "server.max_connections=16",
                "server.max_connections_per_uid=3",
            ],
            3,
            "max_connections_per_uid",
        ),
        (
            [
                "server.max_connections=6",
                "server.max_connections_per_uid=0",
            ],
            4,
            "admin_connections",
        ),
    ];
    for (settings, held, refusal) in cases {
        let d = Daemon::with(&[settings[0], settings[1], "server.admin_connections=2"]);
        let exe = kvtier_tests::uid::reachable_copy(&std::env::current_exe().unwrap());
        let mut tenant = kvtier_tests::uid::as_nobody(&mut kvtier_tests::sys::rerun_test(
            exe.path(),
            "connection_tenant",
        ))
        .env(TENANT_SOCKET, d.path())
        .env("KVTIER_TENANT_HELD", held.to_string())
        .env("KVTIER_TENANT_REFUSAL", refusal)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
        let mut out = std::io::BufReader::new(tenant.stdout.take().unwrap());
        let mut line = String::new();
        while !line.contains("holding") {
            line.clear();
            assert!(
                std::io::BufRead::read_line(&mut out, &mut line).unwrap() > 0,
                "connection_tenant ended before holding its connections"
            );
        }
        // The tenant holds every slot it may; root (an admin) still connects.
        let mut c = d.client();
        c.stats().unwrap();
        drop(tenant.stdin.take());
        let status = tenant.wait().unwrap();
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
        assert!(
            status.success() && rest.contains("tenant done"),
            "{refusal}: {rest}"
        );
        c.stats().unwrap();
    }
}

/// The second-uid half of the test above (ignored on its own): opens connections until
/// refused, checks how many and why, and holds them until its stdin closes.
#[test]
#[ignore = "run as a second uid by no_uid_can_hold_every_connection_slot"]
fn connection_tenant() {
    let Some(path) = tenant_socket() else { return };
    let held: usize = passed("KVTIER_TENANT_HELD");
    let refusal: String = passed("KVTIER_TENANT_REFUSAL");
    let mut open = Vec::new();
    // A refused connection gets its error frame unasked; an accepted one waits for HELLO.
    let err = loop {
        let mut s = UnixStream::connect(&path).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        if let Some((_, reply)) = read_reply(&mut s) {
            break reply;
        }
        s.set_read_timeout(None).unwrap();
        let mut c = Client::handshake(s, "tenant").unwrap();
        c.stats().unwrap();
        open.push(c);
        assert!(open.len() <= held, "more than {held} connections");
    };
    assert_eq!(open.len(), held, "{err:?}");
    let Response::Error(e) = err else {
        panic!("expected a refusal, got {err:?}");
    };
    assert_eq!(e.code, ErrorCode::ResourceExhausted, "{e:?}");
    assert!(e.message.contains(&refusal), "{e:?}");
    println!("holding {held}");
    std::io::stdout().flush().unwrap();
    let mut rest = String::new();
    std::io::stdin().read_to_string(&mut rest).unwrap();
    for c in &mut open {
        c.stats().unwrap();
    }
    println!("tenant done");
}

/// One uid cannot fill the NVMe tier that another uid's sessions are written to at shutdown:
/// once it holds more than an equal split, its writes must leave room for the others'
/// unwritten blocks. Runs `nvme_tenant` as nobody (root only, as CI runs).
#[test]
fn one_uid_cannot_take_the_nvme_room_another_needs_at_shutdown() {
    if !can_run_second_uid() {
        return;
    }
    // 128 pages of 8 KiB (a 4 KiB run and its header); root is an admin, nobody is not.
    let d = Daemon::with(&["nvme.capacity=\"1MiB\""]);
    let mut c = d.client();
    // Root's four sessions in RAM, 4 blocks x 2 layers each: 32 pages to write at shutdown.
    let mut mine: Vec<(u64, Shadow)> = (0..4).map(|i| open(&mut c, "", 64, 80 + i)).collect();
    run_tenant("nvme_tenant", &d, &[]);
    drop(c);
    // The clean shutdown writes every session (Daemon::stop checks exit 0) ...
    let dir = d.stop(false);
    // ... and root's sessions come back whole.
    let d = Daemon::start_in(dir, &["--set", "nvme.capacity=\"1MiB\""]);
    let mut c = d.client();
    for (id, sh) in &mut mine {
        intact(&mut c, *id, sh);
    }
}

/// The second-uid half of the test above (ignored on its own): demotes sessions of 8 pages
/// each until refused, which must happen with root's 32 pages still free.
#[test]
#[ignore = "run as a second uid by one_uid_cannot_take_the_nvme_room_another_needs_at_shutdown"]
fn nvme_tenant() {
    let Some(mut c) = tenant() else { return };
    let mut demoted = 0;
    let refusal = loop {
        let (id, _) = open(&mut c, "", 64, 90 + demoted);
        match c.demote(id) {
            Ok(_) => demoted += 1,
            Err(e) => {
                c.close(id).unwrap();
                break e;
            }
        }
        assert!(demoted < 16, "the tier is full and nothing refused it");
    };
    assert_eq!(
        refusal.code(),
        Some(ErrorCode::ResourceExhausted),
        "{refusal}"
    );
    assert!(refusal.to_string().contains("at shutdown"), "{refusal}");
    // 12 sessions: 96 pages, leaving root's 32.
    assert_eq!(demoted, 12, "{refusal}");
    println!("tenant done");
}
