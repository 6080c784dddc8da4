//! Startup checks that fail fast naming the fix (memlock limit, socket directory), and log
//! output for the journal.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use kvtier_protocol::client::Client;

/// These tests are about the host tier, the socket and logs; the NVMe tier (on by default,
/// in a shared state directory) stays out of them.
const NO_NVME: [&str; 2] = ["--set", "nvme.enabled=false"];

/// Root runs the daemon as nobody, so it has neither CAP_IPC_LOCK nor DAC override, as under
/// the shipped unit's dedicated user.
fn as_unprivileged(cmd: &mut Command) -> &mut Command {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        cmd.uid(65534).gid(65534);
    }
    cmd
}

/// A tierd command with RLIMIT_MEMLOCK set to `memlock` bytes (soft and hard), then (under
/// root) dropped to nobody: the limit is set first, while raising it is still allowed.
fn tierd_with_memlock(memlock: u64) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tierd"));
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    // SAFETY: the closure only makes async-signal-safe syscalls (setrlimit, setgroups, setgid,
    // setuid) on stack values, as pre_exec requires.
    unsafe {
        cmd.pre_exec(move || {
            let r = libc::rlimit {
                rlim_cur: memlock,
                rlim_max: memlock,
            };
            let fail = || Err(std::io::Error::last_os_error());
            if libc::setrlimit(libc::RLIMIT_MEMLOCK, &r) != 0 {
                return fail();
            }
            if root
                && (libc::setgroups(0, std::ptr::null()) != 0
                    || libc::setgid(65534) != 0
                    || libc::setuid(65534) != 0)
            {
                return fail();
            }
            Ok(())
        });
    }
    cmd
}

fn open_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    dir
}

fn wait_for_socket(path: &std::path::Path, child: &mut std::process::Child) {
    let t0 = Instant::now();
    while Client::connect(path).is_err() {
        if let Some(s) = child.try_wait().unwrap() {
            panic!("tierd exited: {s}");
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "tierd did not come up"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn stop(child: &mut std::process::Child) -> std::process::ExitStatus {
    // SAFETY: kill has no memory-safety preconditions; the pid is our live child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    child.wait().unwrap()
}

#[test]
fn a_memlock_limit_below_the_host_tier_fails_fast_naming_the_fix() {
    let dir = open_dir();
    let out: Output = tierd_with_memlock(8 << 20)
        .arg("--socket")
        .arg(dir.path().join("s.sock"))
        .args(["--host-capacity", "64MiB", "--set", "host.lock_memory=true"])
        .args(NO_NVME)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("64MiB")
            && err.contains("8MiB")
            && err.contains(
                "raise LimitMEMLOCK (systemd) or ulimit -l, or set host.lock_memory = false"
            ),
        "{err}"
    );
    assert!(!dir.path().join("s.sock").exists(), "failed before binding");
}

#[test]
fn a_sufficient_memlock_limit_locks_the_host_tier_and_serves() {
    let dir = open_dir();
    let sock = dir.path().join("s.sock");
    // Below the 8 MiB hard limit containers commonly have (raising it needs CAP_SYS_RESOURCE).
    let mut child = tierd_with_memlock(6 << 20)
        .arg("--socket")
        .arg(&sock)
        .args(["--host-capacity", "4MiB", "--set", "host.lock_memory=true"])
        .args(NO_NVME)
        .args(["--log-level", "warn"])
        .stdin(Stdio::null())
        .spawn()
        .map(common::Reaped)
        .unwrap();
    wait_for_socket(&sock, &mut child);
    let status = std::fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap();
    let locked_kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmLck:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    assert!(
        locked_kb >= 4 << 10,
        "host tier locked: VmLck {locked_kb} kB"
    );
    assert!(stop(&mut child).success());
}

#[test]
fn an_unwritable_socket_directory_fails_fast_naming_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let ro = dir.path().join("ro");
    std::fs::create_dir(&ro).unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tierd"));
    let out = as_unprivileged(&mut cmd)
        .arg("--socket")
        .arg(ro.join("kvtier/tierd.sock"))
        .args(["--host-capacity", "64MiB"])
        .args(NO_NVME)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("cannot create the socket in {}", ro.display()))
            && err.contains("RuntimeDirectory=kvtier"),
        "{err}"
    );
}

/// Runs tierd until its socket accepts, stops it, and returns what it logged to stderr (a file,
/// so the test can give JOURNAL_STREAM its device and inode).
fn logs(extra: &[&str], journal_stream: bool) -> String {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let log = dir.path().join("stderr");
    let file = std::fs::File::create(&log).unwrap();
    let meta = file.metadata().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tierd"));
    cmd.arg("--socket")
        .arg(&sock)
        .args(["--host-capacity", "64MiB", "--log-level", "info"])
        .args(NO_NVME)
        .args(extra)
        .env_remove("JOURNAL_STREAM")
        .stdin(Stdio::null())
        .stderr(file);
    if journal_stream {
        cmd.env("JOURNAL_STREAM", format!("{}:{}", meta.dev(), meta.ino()));
    }
    let mut child = common::Reaped(cmd.spawn().unwrap());
    wait_for_socket(&sock, &mut child);
    assert!(stop(&mut child).success());
    std::fs::read_to_string(&log).unwrap()
}

#[test]
fn journal_lines_carry_syslog_priorities_and_no_timestamps() {
    for text in [
        logs(&["--set", "log.format=\"journald\""], false),
        logs(&[], true),
    ] {
        let lines: Vec<&str> = text.lines().collect();
        assert!(!lines.is_empty());
        for l in &lines {
            assert!(
                l.starts_with("<6>") || l.starts_with("<4>") || l.starts_with("<3>"),
                "{l:?}"
            );
            assert!(!l.contains("\x1b["), "no colour codes: {l:?}");
        }
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("<6>tierd ready") && l.contains("socket=")),
            "{text}"
        );
        assert!(
            lines.iter().any(|l| l.starts_with("<6>SIGTERM received")),
            "{text}"
        );
    }
    // Not the journal (auto): plain timestamped text.
    let text = logs(&[], false);
    assert!(text.lines().all(|l| !l.starts_with('<')), "{text}");
    assert!(
        text.contains("INFO") && text.contains("tierd ready"),
        "{text}"
    );
    let text = logs(&["--set", "log.format=\"json\""], true);
    assert!(
        text.lines().all(|l| l.starts_with('{')),
        "explicit json wins over auto-detection: {text}"
    );
}
