//! Processes, `/proc`, and directories for tests.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};

/// A child process killed (and reaped) when dropped, so a failing test never leaves a process
/// behind holding the test harness's output pipes open.
pub struct Reaped(pub Child);

impl std::ops::Deref for Reaped {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Reaped {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Sends `sig` to `pid`, asserting that it was delivered.
pub fn signal(pid: i32, sig: i32) {
    // SAFETY: kill has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill({pid}, {sig})");
}

/// A `kB` field of `/proc/<pid>/status` (`VmRSS`, `VmLck`, ...), in kB.
pub fn proc_status_kb(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// A fresh, empty directory `<base>/nvme-<name>-<pid>` (pass `env!("CARGO_TARGET_TMPDIR")`:
/// on the build's disk, where O_DIRECT works, unlike on a tmpfs /tmp), removed with everything
/// in it when dropped (page files are hundreds of MB; runs must not pile them up).
pub fn scratch_dir(base: impl AsRef<Path>, name: &str) -> ScratchDir {
    let d = base
        .as_ref()
        .join(format!("nvme-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    ScratchDir(d)
}

/// See [`scratch_dir`].
#[derive(Debug)]
pub struct ScratchDir(PathBuf);

impl std::ops::Deref for ScratchDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for ScratchDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<std::ffi::OsStr> for ScratchDir {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.as_os_str()
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The entries of `dir` whose file name passes `keep`, sorted by path.
pub fn entries(dir: &Path, keep: impl Fn(&str) -> bool) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(&keep))
        .collect();
    found.sort();
    found
}

/// A tmpfs of `bytes` mounted at a fresh directory (root only), unmounted when dropped.
pub struct SmallFs {
    pub dir: tempfile::TempDir,
}

impl SmallFs {
    pub fn mount(bytes: u64) -> Option<SmallFs> {
        let dir = tempfile::tempdir().ok()?;
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(dir.path())
            .status()
            .is_ok_and(|s| s.success());
        ok.then_some(SmallFs { dir })
    }

    /// Fills the filesystem with one file; returns its path.
    pub fn fill(&self) -> PathBuf {
        let p = self.dir.path().join("filler");
        let mut f = std::fs::File::create(&p).unwrap();
        use std::io::Write;
        let chunk = vec![0xA5u8; 4096];
        while f.write_all(&chunk).is_ok() {}
        let _ = f.sync_all();
        p
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

/// A command that runs test binary `exe` again with only its `#[ignore]`d test `name` (a child
/// half of a multi-process test), output not captured.
pub fn rerun_test(exe: &Path, name: &str) -> Command {
    let mut c = Command::new(exe);
    c.args([
        "--exact",
        name,
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ]);
    c
}

/// Spawns `cmd` with its stdout piped (stderr to /dev/null) and a thread forwarding each line
/// of it: the child (killed if the caller fails), the lines, and the thread, which ends with
/// the child's stdout.
pub fn spawn_lines(
    cmd: &mut std::process::Command,
) -> (
    Reaped,
    std::sync::mpsc::Receiver<String>,
    std::thread::JoinHandle<()>,
) {
    use std::io::BufRead;
    let mut child = Reaped(
        cmd.stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx, reader)
}
