//! Starting tierd: config errors, stale and live sockets, and paths it must not clobber.

mod common;

use std::process::Command;

use common::{Daemon, Harness};

/// tierd with the NVMe tier off, so these tests never touch a default state directory.
fn tierd(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tierd"))
        .args(["--set", "nvme.enabled=false"])
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn invalid_config_fails_with_exit_code_2_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let sock = sock.to_str().unwrap();
    let out = tierd(&["--socket", sock, "--set", "host.max_run_bytes=1000"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("host.max_run_bytes"), "{err}");
    // The old name still sets it.
    let out = tierd(&["--socket", sock, "--set", "host.frame_bytes=1000"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("host.max_run_bytes"), "{err}");
    let cfg = dir.path().join("bad.toml");
    std::fs::write(&cfg, "[server]\nsocket_mode = \"rw\"\n").unwrap();
    let out = tierd(&["--config", cfg.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("socket_mode"));
    let out = tierd(&["--config", "/nonexistent/tierd.toml"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/tierd.toml"));
}

#[test]
fn print_config_shows_the_effective_layered_config() {
    let out = Command::new(env!("CARGO_BIN_EXE_tierd"))
        .args(["--print-config", "--host-capacity", "3GiB"])
        .env("TIERD_ADMISSION_MAX_SESSIONS", "17")
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("capacity = \"3GiB\""), "{text}");
    assert!(text.contains("max_sessions = 17"), "{text}");
}

#[test]
fn a_stale_socket_is_replaced_and_a_live_one_is_not() {
    let d = Daemon::start(&[]);
    let sock = d.path().to_str().unwrap().to_string();
    // A second daemon on the same live socket refuses to start and leaves it alone.
    let out = tierd(&["--socket", &sock, "--host-capacity", "64MiB"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("already serving"));
    d.client().stats().expect("first daemon unaffected");
    drop(d);

    // A socket file nobody listens on (a crashed daemon's) is replaced.
    let dir = tempfile::tempdir().unwrap();
    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    assert!(stale.exists());
    // Fails unless tierd takes over the stale socket.
    let mut d = common::tierd()
        .socket(&stale)
        .no_nvme()
        .log_level("error")
        .start();
    assert!(d.terminate().success());

    // A regular file at the socket path is never deleted.
    let file = dir.path().join("precious");
    std::fs::write(&file, b"data").unwrap();
    let out = tierd(&[
        "--socket",
        file.to_str().unwrap(),
        "--host-capacity",
        "64MiB",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a socket"));
    assert_eq!(std::fs::read(&file).unwrap(), b"data");
}

/// A start that fails after binding its socket (here: an NVMe directory it cannot create)
/// removes the socket, so no client finds a dead one, and says why once.
#[test]
fn a_failed_start_removes_its_socket_and_says_why_once() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let out = Command::new(env!("CARGO_BIN_EXE_tierd"))
        .args([
            "--socket",
            sock.to_str().unwrap(),
            "--host-capacity",
            "64MiB",
        ])
        .args([
            "--set",
            "nvme.enabled=true",
            "--set",
            "nvme.dir=\"/proc/kvtier-nope\"",
        ])
        .args([
            "--set",
            "nvme.capacity=\"64MiB\"",
            "--set",
            "host.lock_memory=false",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    let said = err
        .lines()
        .filter(|l| l.contains("/proc/kvtier-nope"))
        .count();
    assert_eq!(said, 1, "{err}");
    assert!(!sock.exists(), "the failed start left its socket behind");
}
