//! The workspace's binaries, for tests in crates that do not build them (Cargo sets
//! `CARGO_BIN_EXE_<name>` only inside the binary's own package: tierd's tests pass
//! `env!("CARGO_BIN_EXE_tierd")` instead).
//!
//! Each binary is built once per test binary with `cargo build` (into `$CARGO_TARGET_DIR`,
//! else the workspace's `target/`, debug profile), unless `KVTIER_TEST_<NAME>` names a
//! prebuilt one.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The workspace root (this crate sits one level below it).
pub fn workspace_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ sits in the workspace root")
}

/// Where `cargo build` in the workspace root puts its output: `$CARGO_TARGET_DIR` (relative to
/// the root when relative), else `target/`.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => workspace_root().join(dir),
        None => workspace_root().join("target"),
    }
}

/// The binary `bin` of package `package`: `$env_var` when set, else built with
/// `cargo build -p <package> --bin <bin>` (not cached: see [`tierd`] and its siblings).
pub fn build(package: &str, bin: &str, env_var: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(env_var) {
        return PathBuf::from(p);
    }
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let st = Command::new(cargo)
        .args(["build", "--quiet", "-p", package, "--bin", bin])
        .current_dir(workspace_root())
        .status()
        .unwrap_or_else(|e| panic!("run cargo build -p {package}: {e}"));
    assert!(st.success(), "cargo build -p {package} --bin {bin} failed");
    let path = target_dir().join("debug").join(bin);
    assert!(path.is_file(), "{} missing after the build", path.display());
    path
}

/// `tierd` (or `$KVTIER_TEST_TIERD`), built once per test binary.
pub fn tierd() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| build("tierd", "tierd", "KVTIER_TEST_TIERD"))
}

/// `tierctl` (or `$KVTIER_TEST_TIERCTL`), built once per test binary.
pub fn tierctl() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| build("tierctl", "tierctl", "KVTIER_TEST_TIERCTL"))
}

/// `tierbench` (or `$KVTIER_TEST_TIERBENCH`), built once per test binary.
pub fn tierbench() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| build("kvtier-bench", "tierbench", "KVTIER_TEST_TIERBENCH"))
}
