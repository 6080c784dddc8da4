//! The real `tierctl` binary against sockets where no working daemon answers: missing path,
//! a stale socket file (connection refused), a peer that never replies, a peer that speaks
//! garbage.

use std::io::{Read, Write};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn tierctl(socket: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tierctl"))
        .arg("--socket")
        .arg(socket)
        .args(args)
        .env_remove("KVTIER_SOCKET")
        .output()
        .expect("run tierctl")
}

/// A socket path `name` in a fresh directory (removed when the directory is dropped).
fn socket_in_fresh_dir(name: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join(name);
    (dir, sock)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn missing_socket_is_not_running() {
    let (_dir, sock) = socket_in_fresh_dir("absent.sock");
    for cmd in [
        &["status"][..],
        &["sessions"],
        &["session", "info", "1"],
        &["close", "1"],
        &["evict", "1"],
        &["demote", "1"],
        &["promote", "1"],
        &["pin", "1"],
        &["unpin", "1"],
        &["stats"],
        &["tier"],
    ] {
        let o = tierctl(&sock, cmd);
        assert_eq!(o.status.code(), Some(3), "{cmd:?}: {}", stderr(&o));
        let msg = stderr(&o);
        assert!(
            msg.contains(&format!("tierd is not running at {}", sock.display()))
                && msg.contains("systemctl start tierd"),
            "{cmd:?}: {msg}"
        );
        assert!(o.stdout.is_empty(), "human mode prints nothing on stdout");
    }
}

#[test]
fn missing_socket_json_error_object() {
    let (_dir, sock) = socket_in_fresh_dir("absent.sock");
    let o = tierctl(&sock, &["--json", "status"]);
    assert_eq!(o.status.code(), Some(3));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON on stdout");
    assert_eq!(v["error"]["kind"], "not_running");
    assert_eq!(v["error"]["exit_code"], 3);
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("tierd is not running"));
}

#[test]
fn stale_socket_file_is_not_running() {
    let (_dir, sock) = socket_in_fresh_dir("stale.sock");
    // Bind then drop: the file stays, nobody listens, connect gets ECONNREFUSED.
    drop(UnixListener::bind(&sock).unwrap());
    assert!(sock.exists());
    let o = tierctl(&sock, &["status"]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(stderr(&o).contains("tierd is not running"));
}

#[test]
fn silent_peer_times_out() {
    let (_dir, sock) = socket_in_fresh_dir("silent.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    let t0 = Instant::now();
    let child = Command::new(env!("CARGO_BIN_EXE_tierctl"))
        .arg("--socket")
        .arg(&sock)
        .args(["--timeout", "300ms", "status"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Accept and read the HELLO, never answer; the connection stays open until tierctl exits.
    let (mut s, _) = listener.accept().unwrap();
    let mut buf = [0u8; 256];
    assert!(s.read(&mut buf).unwrap() > 0, "tierctl sent HELLO");
    let o = child.wait_with_output().unwrap();
    let took = t0.elapsed();
    drop(s);
    assert_eq!(o.status.code(), Some(7), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("did not answer within 300ms"),
        "{}",
        stderr(&o)
    );
    assert!(
        took < Duration::from_secs(3),
        "timeout not honoured: {took:?}"
    );
}

#[test]
fn garbage_reply_is_a_communication_error() {
    let (_dir, sock) = socket_in_fresh_dir("garbage.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    let peer = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut buf = [0u8; 256];
        let _ = s.read(&mut buf);
        // 24 bytes that are not a KVT1 header.
        let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\n");
    });
    let o = tierctl(&sock, &["stats"]);
    assert_eq!(o.status.code(), Some(7), "{}", stderr(&o));
    assert!(stderr(&o).contains("bad magic"), "{}", stderr(&o));
    peer.join().unwrap();
}

#[test]
fn bad_arguments_are_usage_errors() {
    let (_dir, sock) = socket_in_fresh_dir("absent.sock");
    for args in [
        &["close"][..],
        &["close", "abc"],
        &["session", "info", "-1"],
        &["--timeout", "0", "status"],
        &["--timeout", "5x", "status"],
        &["frobnicate"],
    ] {
        let o = tierctl(&sock, args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
    }
}

#[test]
fn socket_from_environment() {
    let (_dir, sock) = socket_in_fresh_dir("from-env.sock");
    let o = Command::new(env!("CARGO_BIN_EXE_tierctl"))
        .arg("status")
        .env("KVTIER_SOCKET", &sock)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(3));
    assert!(
        stderr(&o).contains(&sock.display().to_string()),
        "{}",
        stderr(&o)
    );
}
