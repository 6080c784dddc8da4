//! Startup checks that fail fast naming the fix (memlock limit, socket directory), and log
//! output for the journal.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::process::Command;

use common::*;
use kvtier_tests::uid::as_nobody;

/// Root runs the daemon as nobody, so it has neither CAP_IPC_LOCK nor DAC override, as under
/// the shipped unit's dedicated user.
fn as_unprivileged(cmd: &mut Command) {
    if is_root() {
        as_nobody(cmd);
    }
}

/// Sets RLIMIT_MEMLOCK to `memlock` bytes (soft and hard) in the daemon, then (under root)
/// drops it to nobody: the limit is set first, while raising it is still allowed.
fn with_memlock(memlock: u64) -> impl FnOnce(&mut Command) {
    let root = is_root();
    move |cmd| {
        // SAFETY: the closure only makes async-signal-safe syscalls (setrlimit, setgroups,
        // setgid, setuid) on stack values, as pre_exec requires.
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
    }
}

/// A directory every uid may write to (the daemon runs as nobody).
fn open_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    dir
}

/// tierd with the host tier locked, as nobody with RLIMIT_MEMLOCK at `memlock`. These tests
/// are about the host tier, the socket and logs; the NVMe tier (on by default, in a shared
/// state directory) stays out of them.
fn locked(host: &str, memlock: u64) -> TierdBuilder {
    tierd()
        .host_capacity(host)
        .set("host.lock_memory=true")
        .set("host.max_run_bytes=\"1MiB\"")
        .no_nvme()
        .configure(with_memlock(memlock))
}

#[test]
fn a_memlock_limit_below_the_host_tier_fails_fast_naming_the_fix() {
    let dir = open_dir();
    let out = locked("64MiB", 8 << 20)
        .socket(dir.path().join("s.sock"))
        .output();
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
    // Below the 8 MiB hard limit containers commonly have (raising it needs CAP_SYS_RESOURCE).
    let mut d = locked("4MiB", 6 << 20).dir(open_dir()).start();
    let locked_kb = d.proc_status_kb("VmLck");
    assert!(
        locked_kb >= 4 << 10,
        "host tier locked: VmLck {locked_kb} kB"
    );
    assert!(d.terminate().success());
}

#[test]
fn an_unwritable_socket_directory_fails_fast_naming_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let ro = dir.path().join("ro");
    std::fs::create_dir(&ro).unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
    let out = tierd()
        .socket(ro.join("kvtier/tierd.sock"))
        .no_nvme()
        .configure(as_unprivileged)
        .output();
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
    let log = dir.path().join("stderr");
    let file = std::fs::File::create(&log).unwrap();
    let meta = file.metadata().unwrap();
    let mut daemon = tierd()
        .log_level("info")
        .no_nvme()
        .args(extra)
        .env_remove("JOURNAL_STREAM")
        .inherit_stderr()
        .configure(|cmd| {
            cmd.stderr(file);
        });
    if journal_stream {
        daemon = daemon.env("JOURNAL_STREAM", format!("{}:{}", meta.dev(), meta.ino()));
    }
    let mut d = daemon.start();
    assert!(d.terminate().success());
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
