//! A real tierd process on a real socket, for integration tests.
#![allow(dead_code)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use kvtier_kernels::dense::{max_rel_err, reference_attention};
use kvtier_protocol::client::Client;
use kvtier_protocol::{DType, DecodeEntryRef, DecodeOutput, Geometry, Policy};
use kvtier_storage::testing::Rng;

pub struct Daemon {
    pub child: Child,
    pub socket: PathBuf,
    pub dir: tempfile::TempDir,
}

impl Daemon {
    /// Starts tierd with a 64 MiB host tier of 4 KiB frames and a 64 MiB NVMe tier in a
    /// private state directory on a fresh socket, plus `extra` arguments, and waits until the
    /// socket accepts.
    pub fn start(extra: &[&str]) -> Daemon {
        let dir = tempfile::tempdir().unwrap();
        // Other uids (the permission tests) must reach the socket inside.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        Self::start_in(dir, extra)
    }

    /// Starts tierd on the socket and NVMe state of `dir` (a restart when a daemon ran there).
    pub fn start_in(dir: tempfile::TempDir, extra: &[&str]) -> Daemon {
        Self::start_env(dir, extra, &[])
    }

    /// [`Daemon::start_in`] with extra environment variables.
    pub fn start_env(dir: tempfile::TempDir, extra: &[&str], env: &[(&str, &str)]) -> Daemon {
        let socket = dir.path().join("tierd.sock");
        let state = dir.path().join("state");
        let child = Command::new(env!("CARGO_BIN_EXE_tierd"))
            .arg("--socket")
            .arg(&socket)
            .args([
                "--host-capacity",
                "64MiB",
                "--set",
                "host.frame_bytes=\"4KiB\"",
            ])
            .args(["--set", "server.socket_mode=0o666", "--log-level", "warn"])
            .arg("--set")
            .arg(format!("nvme.dir={:?}", state.to_str().unwrap()))
            .args(["--set", "nvme.capacity=\"64MiB\""])
            .args(extra)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn tierd");
        let mut d = Daemon { child, socket, dir };
        d.wait_ready();
        d
    }

    /// Stops the daemon (SIGTERM, or SIGKILL with `kill9`) and hands back its directory, so a
    /// new daemon can start on the same state.
    pub fn stop(mut self, kill9: bool) -> tempfile::TempDir {
        self.signal(if kill9 { libc::SIGKILL } else { libc::SIGTERM });
        let status = self.wait(Duration::from_secs(20));
        if !kill9 {
            assert_eq!(status.code(), Some(0), "clean exit");
        }
        let _ = std::fs::remove_file(&self.socket);
        std::mem::replace(&mut self.dir, tempfile::tempdir().unwrap())
    }

    /// The NVMe page file of this daemon.
    pub fn page_file(&self) -> PathBuf {
        self.dir.path().join("state").join("pages-0")
    }

    fn wait_ready(&mut self) {
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(20) {
            if Client::connect(&self.socket).is_ok() {
                return;
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("tierd exited during startup: {status}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("tierd did not come up at {}", self.socket.display());
    }

    pub fn client(&self) -> Client {
        Client::connect(&self.socket).expect("connect")
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill has no memory-safety preconditions; the pid is our live child.
        assert_eq!(unsafe { libc::kill(self.pid(), sig) }, 0);
    }

    /// Waits for the process to exit (at most `limit`).
    pub fn wait(&mut self, limit: Duration) -> ExitStatus {
        let t0 = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(t0.elapsed() < limit, "tierd did not exit within {limit:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Resident memory of the daemon in bytes.
    pub fn rss(&self) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let kb: u64 = s
            .lines()
            .find(|l| l.starts_with("VmRSS:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap();
        kb * 1024
    }

    pub fn path(&self) -> &Path {
        &self.socket
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A child process killed (and reaped) when dropped, so a failing test never leaves a daemon
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

/// A small GQA geometry whose (layer, block) run exactly fills a 4 KiB frame: 2 KV heads x
/// (K, V) x 16 tokens x 32 dims x 2 bytes.
pub fn small_geometry() -> Geometry {
    Geometry {
        layers: 2,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 32,
        dtype: DType::Bf16,
        block_tokens: 16,
    }
}

pub fn policy() -> Policy {
    Policy {
        sink_blocks: 1,
        local_blocks: 1,
        top_k: 2,
    }
}

/// The model side of a session: every layer's stored K/V (as f32 after dtype rounding), so
/// outputs can be checked against the dense oracle.
pub struct Shadow {
    pub g: Geometry,
    pub k: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
    pub rng: Rng,
}

impl Shadow {
    pub fn new(g: Geometry, seed: u64) -> Self {
        Shadow {
            g,
            k: vec![Vec::new(); g.layers as usize],
            v: vec![Vec::new(); g.layers as usize],
            rng: Rng::new(seed),
        }
    }

    fn row_elems(&self) -> usize {
        (self.g.kv_heads * self.g.head_dim) as usize
    }

    /// A random APPEND_KV payload of `n` tokens (recorded in the shadow).
    pub fn payload(&mut self, n: usize) -> Vec<u8> {
        let dt = self.g.dtype;
        let mut out = Vec::new();
        for l in 0..self.g.layers as usize {
            for kv in 0..2 {
                let vals = self.rng.normals(n * self.row_elems());
                let bytes = dt.encode_vec(&vals);
                let stored = dt.decode_vec(&bytes);
                if kv == 0 {
                    self.k[l].extend(stored)
                } else {
                    self.v[l].extend(stored)
                }
                out.extend(bytes);
            }
        }
        out
    }

    /// A random decode input for `layer` (recorded): (q f32 bytes, k, v).
    pub fn step_input(&mut self, layer: usize) -> (Vec<f32>, Vec<u8>, Vec<u8>) {
        let dt = self.g.dtype;
        let q = self
            .rng
            .normals((self.g.q_heads * self.g.head_dim) as usize);
        let n = self.row_elems();
        let k = dt.encode_vec(&self.rng.normals(n));
        let v = dt.encode_vec(&self.rng.normals(n));
        self.k[layer].extend(dt.decode_vec(&k));
        self.v[layer].extend(dt.decode_vec(&v));
        (q, k, v)
    }

    /// Forgets every token past `n` in every layer (what a server that lost them holds).
    pub fn truncate(&mut self, n: u64) {
        let keep = n as usize * self.row_elems();
        for l in 0..self.g.layers as usize {
            self.k[l].truncate(keep);
            self.v[l].truncate(keep);
        }
    }

    pub fn tokens(&self, layer: usize) -> u64 {
        (self.k[layer].len() / self.row_elems()) as u64
    }

    /// Checks a decode output against dense attention over exactly the reported keep-set.
    pub fn check(&self, layer: usize, q: &[f32], out: &DecodeOutput) {
        let stats = out.stats.as_ref().expect("stats requested");
        let g = kvtier_storage::Geometry {
            layers: self.g.layers,
            q_heads: self.g.q_heads,
            kv_heads: self.g.kv_heads,
            head_dim: self.g.head_dim,
            dtype: self.g.dtype,
            block_tokens: self.g.block_tokens,
        };
        let bt = self.g.block_tokens;
        let want = reference_attention(&g, q, &self.k[layer], &self.v[layer], |h, t| {
            stats.selected[h].binary_search(&(t as u32 / bt)).is_ok()
        });
        let err = max_rel_err(&out.out, &want);
        assert!(
            err <= 2e-3,
            "decode output differs from the dense oracle: rel err {err}"
        );
        let blocks = g.blocks_for(self.tokens(layer)) as u32;
        assert_eq!(stats.blocks_total, blocks);
        let p = policy();
        let budget = (p.sink_blocks + p.local_blocks + p.top_k).min(blocks);
        assert!(
            stats.selected.iter().all(|s| s.len() as u32 == budget),
            "keep-set size"
        );
    }
}

pub fn entry<'a>(
    session: u64,
    position: u64,
    q: &'a [u8],
    k: &'a [u8],
    v: &'a [u8],
) -> DecodeEntryRef<'a> {
    DecodeEntryRef {
        session,
        position,
        q,
        k,
        v,
    }
}

pub fn f32_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// A copy of the executable `exe` in a fresh directory every uid may enter and execute from,
/// for running it as another uid wherever the checkout sits (a 0700 home or mktemp dir).
pub fn reachable_copy(exe: &Path) -> PathBuf {
    let dir = tempfile::Builder::new()
        .prefix("kvtier-exe")
        .tempdir_in("/tmp")
        .unwrap()
        .keep();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let to = dir.join(exe.file_name().unwrap());
    std::fs::copy(exe, &to).unwrap();
    std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o755)).unwrap();
    to
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

/// Runs the ignored test `name` of the calling test binary as uid/gid 65534 (nobody), with
/// `env`, from a copy every uid can reach; returns its output once it has passed and printed
/// `done` (so a child that skipped its checks fails the caller too).
pub fn run_as_nobody(name: &str, env: &[(&str, &str)], done: &str) -> String {
    use std::os::unix::process::CommandExt;
    let exe = reachable_copy(&std::env::current_exe().unwrap());
    let out = Command::new(&exe)
        .args([
            "--exact",
            name,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .envs(env.iter().copied())
        .uid(65534)
        .gid(65534)
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
