//! The real `tierbench` binary on bad command lines (its runs against a real `tierd` are in
//! the workspace's end-to-end tests, tests/tests/tierbench.rs).

use std::process::{Command, Output};

/// tierbench with `args`, pointed at a socket nobody serves.
fn tierbench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tierbench"))
        .args(args)
        .args(["--socket", "/nonexistent/tierd.sock"])
        .output()
        .unwrap()
}

#[test]
fn bad_options_fail_cleanly() {
    for args in [
        &["--sessions", "0"][..],
        &["--steps", "0"],
        &["--contexts", "0"],
        &["--prefill-chunk", "0"],
    ] {
        let o = tierbench(args);
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        assert!(String::from_utf8_lossy(&o.stderr).contains("must be positive"));
    }
    let o = tierbench(&["--small"]);
    assert_eq!(o.status.code(), Some(1));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("connecting to tierd at /nonexistent/tierd.sock"),
        "{e}"
    );
}
