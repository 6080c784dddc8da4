//! tierd under a service manager: the test owns the NOTIFY_SOCKET, as systemd would, and checks
//! READY=1 (only once the socket accepts), WATCHDOG=1 keep-alives at half of WATCHDOG_USEC,
//! STATUS= lines and STOPPING=1.

mod common;

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use kvtier_protocol::client::Client;
use kvtier_protocol::stats_keys;
use kvtier_tests::tierd::PATIENCE;

/// Starts the harness daemon through `sh`, so WATCHDOG_PID can be the daemon's own pid
/// (`exec` keeps the shell's pid), as systemd sets it. `watchdog_pid` None: the daemon's pid;
/// Some(p): p. Its NVMe tier is on: READY=1 also waits for its index.
fn spawn(notify: &str, watchdog_usec: u64, watchdog_pid: Option<u32>) -> Tierd {
    let pid = watchdog_pid.map_or("$$".to_string(), |p| p.to_string());
    harness()
        .via([
            "sh",
            "-c",
            &format!("WATCHDOG_PID={pid} exec \"$0\" \"$@\""),
        ])
        .env("NOTIFY_SOCKET", notify)
        .env("WATCHDOG_USEC", watchdog_usec.to_string())
        .spawn()
}

/// The next notification datagram within `limit`, as text.
fn recv(sock: &UnixDatagram, limit: Duration) -> Option<String> {
    sock.set_read_timeout(Some(limit)).unwrap();
    let mut buf = [0u8; 4096];
    match sock.recv(&mut buf) {
        Ok(n) => Some(String::from_utf8(buf[..n].to_vec()).expect("notifications are text")),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            None
        }
        Err(e) => panic!("notify socket: {e}"),
    }
}

fn has(msg: &str, line: &str) -> bool {
    msg.lines().any(|l| l == line)
}

/// Waits for READY=1, checking that the daemon's socket accepts the moment it arrives.
fn wait_ready(notify: &UnixDatagram, socket: &Path) -> Vec<String> {
    let mut before = Vec::new();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(20) {
        let Some(msg) = recv(notify, Duration::from_secs(20)) else {
            break;
        };
        if has(&msg, "READY=1") {
            let mut c =
                Client::connect(socket).expect("READY=1 was sent before the socket accepted");
            assert_eq!(c.stats().unwrap().get("ready"), Some(1));
            before.push(msg);
            return before;
        }
        before.push(msg);
    }
    panic!("no READY=1; got {before:?}");
}

#[test]
fn ready_follows_the_socket_then_watchdog_keepalives_then_stopping() {
    let dir = tempfile::tempdir().unwrap();
    let notify_path = dir.path().join("notify");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    // WatchdogSec=1 s: keep-alives every 500 ms.
    let mut d = spawn(notify_path.to_str().unwrap(), 1_000_000, None);

    let before = wait_ready(&notify, d.path());
    assert!(
        before
            .iter()
            .any(|m| has(m, "STATUS=building the host tier")),
        "a STATUS line precedes readiness: {before:?}"
    );
    let ready = before.last().unwrap();
    assert!(
        ready
            .lines()
            .any(|l| l.starts_with("STATUS=serving: 0 sessions")),
        "{ready:?}"
    );

    // Keep-alives arrive at about half of WATCHDOG_USEC, never close to the full timeout.
    let mut c = d.client();
    c.create_session(small_geometry(), policy(), "watched")
        .unwrap();
    let mut last = Instant::now();
    let mut pings = 0;
    let mut saw_session = false;
    while pings < 6 {
        let msg = recv(&notify, Duration::from_secs(3)).expect("watchdog keep-alive");
        assert!(has(&msg, "WATCHDOG=1"), "unexpected notification {msg:?}");
        let gap = last.elapsed();
        assert!(
            gap < Duration::from_millis(900),
            "keep-alive gap {gap:?} nears WatchdogSec"
        );
        last = Instant::now();
        pings += 1;
        saw_session |= msg.contains("STATUS=serving: 1 sessions");
    }
    assert!(saw_session, "STATUS lines track the daemon's state");
    assert_eq!(c.stats().unwrap().get(stats_keys::SESSIONS), Some(1));
    drop(c);

    d.signal(libc::SIGTERM);
    let mut stopping = false;
    while let Some(msg) = recv(&notify, Duration::from_secs(5)) {
        if has(&msg, "STOPPING=1") {
            stopping = true;
            break;
        }
    }
    assert!(stopping, "STOPPING=1 at shutdown");
    assert!(d.wait(PATIENCE).success());
}

#[test]
fn locking_the_host_tier_reports_progress_and_extends_the_start_timeout() {
    // Locking takes minutes for hundreds of GiB: past TimeoutStartSec unless the daemon
    // extends it. 6 MiB fits the usual 8 MiB RLIMIT_MEMLOCK, so it runs unprivileged.
    let dir = tempfile::tempdir().unwrap();
    let notify_path = dir.path().join("notify");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    let d = harness()
        .set("host.capacity=\"6MiB\"")
        .set("host.lock_memory=true")
        .env("NOTIFY_SOCKET", notify_path.to_str().unwrap())
        .spawn();
    let before = wait_ready(&notify, d.path());
    let locking: Vec<&String> = before
        .iter()
        .filter(|m| m.contains("STATUS=locking the host tier in RAM"))
        .collect();
    assert!(
        locking
            .iter()
            .all(|m| has(m, "EXTEND_TIMEOUT_USEC=30000000")),
        "{locking:?}"
    );
    let first = locking.first().expect("progress while locking");
    assert!(
        has(first, "STATUS=locking the host tier in RAM: 0 of 6MiB (0%)"),
        "{first:?}"
    );
    let last = locking.last().unwrap();
    assert!(
        has(
            last,
            "STATUS=locking the host tier in RAM: 6MiB of 6MiB (100%)"
        ),
        "{last:?}"
    );
    let mut c = d.client();
    assert!(c
        .create_session(small_geometry(), policy(), "locked")
        .is_ok());
}

#[test]
fn a_frozen_daemon_stops_its_keepalives_and_resumes_when_thawed() {
    // An abstract notify address, as systemd may hand out.
    let name = format!("kvtier-ops-notify-{}", std::process::id());
    let notify = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(&name).unwrap()).unwrap();
    let mut d = spawn(&format!("@{name}"), 200_000, None);
    wait_ready(&notify, d.path());
    assert!(recv(&notify, Duration::from_secs(2)).is_some_and(|m| has(&m, "WATCHDOG=1")));

    d.signal(libc::SIGSTOP);
    // Drain a keep-alive that may already be in flight, then expect silence.
    std::thread::sleep(Duration::from_millis(50));
    while recv(&notify, Duration::from_millis(10)).is_some() {}
    assert_eq!(
        recv(&notify, Duration::from_millis(600)),
        None,
        "a stopped daemon must not look alive"
    );
    d.signal(libc::SIGCONT);
    assert!(recv(&notify, Duration::from_secs(2)).is_some_and(|m| has(&m, "WATCHDOG=1")));
    assert!(d.terminate().success());
}

#[test]
fn a_watchdog_meant_for_another_process_is_ignored() {
    let dir = tempfile::tempdir().unwrap();
    let notify_path = dir.path().join("notify");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    // WATCHDOG_PID=1: the watchdog belongs to someone else, READY=1 still comes.
    let mut d = spawn(notify_path.to_str().unwrap(), 100_000, Some(1));
    wait_ready(&notify, d.path());
    let t0 = Instant::now();
    while let Some(msg) = recv(&notify, Duration::from_millis(500)) {
        assert!(
            !has(&msg, "WATCHDOG=1"),
            "keep-alive sent for another pid's watchdog"
        );
        assert!(t0.elapsed() < Duration::from_secs(5));
    }
    assert!(d.terminate().success());
}

#[test]
fn without_notify_socket_tierd_runs_as_before() {
    // No NOTIFY_SOCKET at all: nothing is sent and nothing fails (the common harness).
    let d = Daemon::start(&[]);
    assert_eq!(d.client().stats().unwrap().get("ready"), Some(1));
}
