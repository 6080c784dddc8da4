//! A tierd the benchmark binaries start themselves: on a private socket in a temporary
//! directory, stopped with SIGTERM and reaped when dropped, so an early error leaks no daemon.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The error of the benchmark binaries.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A tierd child process with its private directory.
pub struct Daemon {
    child: Option<Child>,
    socket: PathBuf,
    /// The private directory, removed on drop.
    _dir: tempfile::TempDir,
}

impl Daemon {
    /// Starts `bin` with `--socket` in a new temporary directory (named from `prefix`), the
    /// arguments `configure` adds (given that directory, for anything else private), and
    /// `--log-level warn`; returns once the socket accepts connections (within 30 s).
    pub fn spawn(
        bin: &Path,
        prefix: &str,
        configure: impl FnOnce(&mut Command, &Path),
    ) -> Result<Self, BoxError> {
        let dir = tempfile::Builder::new().prefix(prefix).tempdir()?;
        let socket = dir.path().join("tierd.sock");
        let mut cmd = Command::new(bin);
        cmd.arg("--socket").arg(&socket);
        configure(&mut cmd, dir.path());
        cmd.args(["--log-level", "warn"]).stdin(Stdio::null());
        let child = cmd.spawn().map_err(|e| {
            format!(
                "starting {}: {e} (build it: cargo build --release -p tierd)",
                bin.display()
            )
        })?;
        let mut d = Daemon {
            child: Some(child),
            socket,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::os::unix::net::UnixStream::connect(&d.socket).is_err() {
            if let Some(st) = d.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                // Already reaped: nothing left for Drop to stop.
                d.child = None;
                return Err(format!("tierd exited during startup: {st}").into());
            }
            if Instant::now() > deadline {
                return Err("tierd did not open its socket within 30 s".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(d)
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// SIGTERM, then wait; returns how it exited.
    pub fn stop(&mut self) -> Result<ExitStatus, BoxError> {
        let mut child = self.child.take().ok_or("tierd already stopped")?;
        let pid = libc::pid_t::try_from(child.id())?;
        // SAFETY: kill has no memory-safety preconditions; `pid` is our own unreaped child,
        // so the id cannot have been recycled for another process.
        if unsafe { libc::kill(pid, libc::SIGTERM) } != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        Ok(child.wait()?)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.child.is_some() {
            if let Err(e) = self.stop() {
                eprintln!("stopping tierd: {e}");
            }
        }
    }
}

/// The tierd binary: `explicit`, else the one next to the running executable, else `tierd`
/// on the PATH.
pub fn find_tierd(explicit: Option<&Path>) -> PathBuf {
    if let Some(p) = explicit {
        return p.to_owned();
    }
    std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join("tierd")))
        .filter(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from("tierd"))
}
