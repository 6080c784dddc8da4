//! Tests that need a second uid: only root can run one (as CI does); other runs say the test
//! is not applicable.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The uid (and gid) of `nobody`, the second user these tests run as.
pub const NOBODY: u32 = 65534;

/// The effective uid of this process.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

pub fn is_root() -> bool {
    euid() == 0
}

/// Runs `cmd` as uid/gid [`NOBODY`] (it must be started by root).
pub fn as_nobody(cmd: &mut Command) -> &mut Command {
    cmd.uid(NOBODY).gid(NOBODY)
}

/// A copy of an executable in a fresh directory every uid may enter and execute from, for
/// running it as another uid wherever the checkout sits (a 0700 home or mktemp dir). The
/// directory goes when this is dropped: every test run makes one per call, and a kept copy
/// (tens of MB) per call fills /tmp within a few hundred runs.
pub struct ReachableCopy {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

impl ReachableCopy {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Copies `exe` to a [`ReachableCopy`].
pub fn reachable_copy(exe: &Path) -> ReachableCopy {
    let dir = tempfile::Builder::new()
        .prefix("kvtier-exe")
        .tempdir_in("/tmp")
        .unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = dir.path().join(exe.file_name().unwrap());
    // Copied by another process: a file this one held open for writing could be inherited
    // by a child another test thread forks meanwhile, and exec would fail with ETXTBSY.
    let copied = std::process::Command::new("cp")
        .arg(exe)
        .arg(&path)
        .status()
        .unwrap();
    assert!(copied.success(), "cp {} {}", exe.display(), path.display());
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    ReachableCopy { _dir: dir, path }
}

/// Runs the ignored test `name` of the calling test binary as [`NOBODY`], with `env`, from a
/// copy every uid can reach; returns its output once it has passed and printed `done` (so a
/// child that skipped its checks fails the caller too).
pub fn run_as_nobody(name: &str, env: &[(&str, &str)], done: &str) -> String {
    let exe = reachable_copy(&std::env::current_exe().unwrap());
    let out = as_nobody(&mut crate::sys::rerun_test(exe.path(), name))
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{name} as nobody failed:\n{text}");
    assert!(
        text.contains(done),
        "{name} did not run its checks:\n{text}"
    );
    text
}
