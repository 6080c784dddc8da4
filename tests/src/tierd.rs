//! A real `tierd` process for tests.
//!
//! ```no_run
//! # use kvtier_tests::{bins, Tierd};
//! let d = Tierd::builder(bins::tierd())
//!     .nvme_capacity("32MiB")
//!     .set("admission.max_sessions=3")
//!     .start();
//! let mut c = d.client();
//! # let _ = c.stats();
//! let state = d.stop(false); // SIGTERM, exit 0 asserted; restart with `.dir(state)`
//! ```

use std::ffi::{OsStr, OsString};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvtier_protocol::client::Client;

/// How long a daemon may take to open its socket, and to exit once stopped.
pub const PATIENCE: Duration = Duration::from_secs(20);

/// How long a dropped daemon gets to exit after SIGTERM before it is killed.
const DROP_GRACE: Duration = Duration::from_secs(5);

/// Where the NVMe tier's state goes.
enum Nvme {
    /// `<dir>/state`, the default: never the system's /var/lib/kvtier.
    InDir,
    At(PathBuf),
    Off,
}

type Hook = Box<dyn FnOnce(&mut Command)>;

/// A `tierd` command line: by default `--socket <dir>/tierd.sock --host-capacity 64MiB
/// --log-level warn --set nvme.dir="<dir>/state"` in a fresh private directory (mode 0755, so
/// other uids reach the socket), stdin from /dev/null, stderr captured; then the options, then
/// [`TierdBuilder::args`] in order (a later `--set` of a key wins).
pub struct TierdBuilder {
    bin: PathBuf,
    launcher: Vec<OsString>,
    dir: Option<tempfile::TempDir>,
    socket: Option<PathBuf>,
    host_capacity: String,
    log_level: String,
    nvme: Nvme,
    nvme_capacity: Option<String>,
    config: Option<String>,
    args: Vec<OsString>,
    env: Vec<(OsString, Option<OsString>)>,
    capture_stderr: bool,
    hooks: Vec<Hook>,
}

impl TierdBuilder {
    /// Starts in `dir` instead of a fresh directory: a restart on the socket path and NVMe
    /// state a daemon used before (see [`Tierd::stop`]), or a directory the test prepared.
    pub fn dir(mut self, dir: tempfile::TempDir) -> Self {
        self.dir = Some(dir);
        self
    }

    /// The socket at `path` instead of `<dir>/tierd.sock`.
    pub fn socket(mut self, path: impl Into<PathBuf>) -> Self {
        self.socket = Some(path.into());
        self
    }

    /// `--host-capacity` (64MiB unless set).
    pub fn host_capacity(mut self, size: &str) -> Self {
        self.host_capacity = size.to_owned();
        self
    }

    /// `--log-level` (warn unless set).
    pub fn log_level(mut self, level: &str) -> Self {
        self.log_level = level.to_owned();
        self
    }

    /// `--backend` (`cpu`, `cuda` or `auto`).
    pub fn backend(self, kind: &str) -> Self {
        self.args(["--backend", kind])
    }

    /// `nvme.capacity`.
    pub fn nvme_capacity(mut self, size: &str) -> Self {
        self.nvme_capacity = Some(size.to_owned());
        self
    }

    /// The NVMe tier's state (`nvme.dir`) at `dir` instead of `<dir>/state`.
    pub fn nvme_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.nvme = Nvme::At(dir.into());
        self
    }

    /// No NVMe tier (`nvme.enabled=false`).
    pub fn no_nvme(mut self) -> Self {
        self.nvme = Nvme::Off;
        self
    }

    /// A config file with `toml` in the daemon's directory, passed with `--config`.
    pub fn config_toml(mut self, toml: &str) -> Self {
        self.config = Some(toml.to_owned());
        self
    }

    /// `--set <key_value>` (`section.field=value`, the value in TOML syntax).
    pub fn set(self, key_value: &str) -> Self {
        self.args(["--set", key_value])
    }

    /// More arguments, after everything else.
    pub fn args<S: AsRef<OsStr>>(mut self, args: impl IntoIterator<Item = S>) -> Self {
        self.args
            .extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self
    }

    pub fn env(mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Self {
        self.env
            .push((key.as_ref().to_owned(), Some(value.as_ref().to_owned())));
        self
    }

    pub fn env_remove(mut self, key: impl AsRef<OsStr>) -> Self {
        self.env.push((key.as_ref().to_owned(), None));
        self
    }

    /// Runs tierd through `launcher` (`launcher... <tierd> <args>`), e.g. a shell that sets up
    /// its environment and `exec`s it, so the pid stays tierd's.
    pub fn via<S: AsRef<OsStr>>(mut self, launcher: impl IntoIterator<Item = S>) -> Self {
        self.launcher = launcher
            .into_iter()
            .map(|a| a.as_ref().to_owned())
            .collect();
        self
    }

    /// Lets the daemon's stderr through to the test's instead of capturing it.
    pub fn inherit_stderr(mut self) -> Self {
        self.capture_stderr = false;
        self
    }

    /// Adjusts the command last, just before it runs (credentials, limits, its own stderr).
    pub fn configure(mut self, f: impl FnOnce(&mut Command) + 'static) -> Self {
        self.hooks.push(Box::new(f));
        self
    }

    /// The command, the directory and the socket path; the stderr file, if captured.
    fn command(self) -> (Command, tempfile::TempDir, PathBuf, Option<PathBuf>) {
        let dir = match self.dir {
            Some(d) => d,
            None => {
                let d = tempfile::tempdir().unwrap();
                std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
                d
            }
        };
        let socket = self.socket.unwrap_or_else(|| dir.path().join("tierd.sock"));
        let mut cmd = match self.launcher.split_first() {
            Some((program, rest)) => {
                let mut c = Command::new(program);
                c.args(rest).arg(&self.bin);
                c
            }
            None => Command::new(&self.bin),
        };
        cmd.arg("--socket").arg(&socket);
        cmd.args(["--host-capacity", &self.host_capacity]);
        cmd.args(["--log-level", &self.log_level]);
        if let Some(toml) = &self.config {
            let path = dir.path().join("tierd.toml");
            std::fs::write(&path, toml).unwrap();
            cmd.arg("--config").arg(path);
        }
        let state = match self.nvme {
            Nvme::InDir => Some(dir.path().join("state")),
            Nvme::At(p) => Some(p),
            Nvme::Off => None,
        };
        match state {
            Some(state) => {
                let state = state.to_str().expect("a UTF-8 state path");
                cmd.arg("--set").arg(format!("nvme.dir={state:?}"));
                if let Some(size) = &self.nvme_capacity {
                    cmd.arg("--set").arg(format!("nvme.capacity={size:?}"));
                }
            }
            None => {
                cmd.args(["--set", "nvme.enabled=false"]);
            }
        }
        cmd.args(&self.args).stdin(Stdio::null());
        for (k, v) in &self.env {
            match v {
                Some(v) => cmd.env(k, v),
                None => cmd.env_remove(k),
            };
        }
        let stderr = self.capture_stderr.then(|| {
            static N: AtomicUsize = AtomicUsize::new(0);
            let n = N.fetch_add(1, Ordering::Relaxed);
            let path = dir.path().join(format!("tierd-{n}.stderr"));
            cmd.stderr(std::fs::File::create(&path).unwrap());
            path
        });
        for hook in self.hooks {
            hook(&mut cmd);
        }
        (cmd, dir, socket, stderr)
    }

    /// Runs tierd to its exit (a startup that must fail, `--print-config`): its status, stdout
    /// and stderr.
    pub fn output(self) -> Output {
        let (mut cmd, _dir, _, _) = self.inherit_stderr().command();
        cmd.output().expect("run tierd")
    }

    /// Starts tierd without waiting for its socket (see [`Tierd::wait_ready`]).
    pub fn spawn(self) -> Tierd {
        let (mut cmd, dir, socket, stderr) = self.command();
        let child = cmd.spawn().expect("spawn tierd");
        Tierd {
            child,
            socket,
            dir: Some(dir),
            stderr,
            status: None,
        }
    }

    /// Starts tierd and waits until its socket answers HELLO.
    pub fn start(self) -> Tierd {
        let mut d = self.spawn();
        d.wait_ready();
        d
    }
}

/// A running (or exited) tierd. Dropping it stops it: SIGTERM, then SIGKILL if it has not
/// exited after a few seconds; always reaped. When the test is failing, the drop also prints
/// what tierd wrote to its (captured) stderr.
pub struct Tierd {
    child: Child,
    socket: PathBuf,
    dir: Option<tempfile::TempDir>,
    stderr: Option<PathBuf>,
    status: Option<ExitStatus>,
}

impl Tierd {
    /// A command line for the tierd binary at `bin` (`env!("CARGO_BIN_EXE_tierd")` in tierd's
    /// own tests, [`crate::bins::tierd`] elsewhere).
    pub fn builder(bin: impl AsRef<Path>) -> TierdBuilder {
        TierdBuilder {
            bin: bin.as_ref().to_owned(),
            launcher: Vec::new(),
            dir: None,
            socket: None,
            host_capacity: "64MiB".into(),
            log_level: "warn".into(),
            nvme: Nvme::InDir,
            nvme_capacity: None,
            config: None,
            args: Vec::new(),
            env: Vec::new(),
            capture_stderr: true,
            hooks: Vec::new(),
        }
    }

    /// Waits until the socket answers HELLO; panics (with tierd's stderr) if tierd exits first
    /// or takes longer than [`PATIENCE`].
    pub fn wait_ready(&mut self) {
        let t0 = Instant::now();
        while Client::connect(&self.socket).is_err() {
            if let Some(status) = self.status() {
                panic!(
                    "tierd exited during startup: {status}{}",
                    self.stderr_note()
                );
            }
            assert!(
                t0.elapsed() < PATIENCE,
                "tierd did not come up at {}{}",
                self.socket.display(),
                self.stderr_note()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.socket
    }

    /// The daemon's private directory (its socket, NVMe state and stderr, unless set
    /// elsewhere).
    pub fn dir(&self) -> &Path {
        self.dir
            .as_ref()
            .expect("the directory is still held")
            .path()
    }

    /// The first NVMe page file of the default state directory.
    pub fn page_file(&self) -> PathBuf {
        self.dir().join("state").join("pages-0")
    }

    pub fn client(&self) -> Client {
        Client::connect(&self.socket).expect("connect")
    }

    pub fn client_as(&self, name: &str) -> Client {
        Client::connect_as(&self.socket, name).expect("connect")
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Sends `sig` to tierd.
    pub fn signal(&self, sig: i32) {
        crate::sys::signal(self.pid(), sig);
    }

    /// The exit status, once tierd has exited (reaped here).
    pub fn status(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().unwrap();
        }
        self.status
    }

    /// Waits for tierd to exit (at most `limit`).
    pub fn wait(&mut self, limit: Duration) -> ExitStatus {
        let t0 = Instant::now();
        loop {
            if let Some(s) = self.status() {
                return s;
            }
            assert!(t0.elapsed() < limit, "tierd did not exit within {limit:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGTERM, and the exit status.
    pub fn terminate(&mut self) -> ExitStatus {
        self.signal(libc::SIGTERM);
        self.wait(PATIENCE)
    }

    /// What tierd has written to its captured stderr so far ("" when not captured).
    pub fn stderr(&self) -> String {
        self.stderr
            .as_ref()
            .map(|p| std::fs::read_to_string(p).unwrap_or_default())
            .unwrap_or_default()
    }

    fn stderr_note(&self) -> String {
        let text = self.stderr();
        if text.is_empty() {
            String::new()
        } else {
            format!("\ntierd's stderr:\n{text}")
        }
    }

    /// Stops tierd (SIGTERM, asserting a clean exit; or SIGKILL with `kill9`) and hands back
    /// its directory, so a new daemon can start on the same socket path and state.
    pub fn stop(mut self, kill9: bool) -> tempfile::TempDir {
        if kill9 {
            self.signal(libc::SIGKILL);
            self.wait(PATIENCE);
        } else {
            let status = self.terminate();
            assert_eq!(status.code(), Some(0), "clean exit{}", self.stderr_note());
        }
        self.into_dir()
    }

    /// The directory, once tierd has exited (killed first if it has not), without its socket
    /// file.
    pub fn into_dir(mut self) -> tempfile::TempDir {
        if self.status().is_none() {
            let _ = self.child.kill();
            self.status = self.child.wait().ok();
        }
        let _ = std::fs::remove_file(&self.socket);
        self.dir.take().expect("the directory is still held")
    }

    /// Resident memory of the daemon in bytes.
    pub fn rss(&self) -> u64 {
        self.proc_status_kb("VmRSS") * 1024
    }

    /// A kB field of the daemon's `/proc/<pid>/status` (`VmRSS`, `VmLck`, ...).
    pub fn proc_status_kb(&self, field: &str) -> u64 {
        crate::sys::proc_status_kb(self.child.id(), field)
    }
}

impl Drop for Tierd {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            // SAFETY: kill has no memory-safety preconditions; the pid is our unreaped child.
            unsafe { libc::kill(self.pid(), libc::SIGTERM) };
            let t0 = Instant::now();
            while matches!(self.child.try_wait(), Ok(None)) && t0.elapsed() < DROP_GRACE {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let note = self.stderr_note();
        if std::thread::panicking() && !note.is_empty() {
            eprintln!("tierd at {}:{note}", self.socket.display());
        }
    }
}
