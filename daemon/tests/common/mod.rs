//! tierd's integration tests: the workspace's test-support crate (`kvtier_tests`, tests/)
//! with this package's tierd binary, and the harness daemon the tests start from.
#![allow(dead_code, unused_imports)]

pub use kvtier_tests::kv::f32_bytes;
pub use kvtier_tests::session::{create, entry, open, policy, small_geometry, Shadow};
pub use kvtier_tests::sys::{entries, Reaped, SmallFs};
pub use kvtier_tests::uid::{is_root, run_as_nobody};
pub use kvtier_tests::wire::code;
pub use kvtier_tests::{Tierd, TierdBuilder};

/// A command line for this package's tierd (or `$KVTIER_TEST_TIERD`, a prebuilt one: on a GPU
/// host without the build tree), in a fresh private directory (see [`TierdBuilder`] for its
/// defaults).
pub fn tierd() -> TierdBuilder {
    match std::env::var_os("KVTIER_TEST_TIERD") {
        Some(bin) => Tierd::builder(bin),
        None => Tierd::builder(env!("CARGO_BIN_EXE_tierd")),
    }
}

/// The harness daemon: a 64 MiB host tier taking block runs of at most 4 KiB (one
/// [`small_geometry`] run exactly), a 64 MiB NVMe tier in its private directory, a socket every uid may use (mode 0666
/// in a 0755 directory), warn logs.
pub fn harness() -> TierdBuilder {
    tierd()
        .set("host.max_run_bytes=\"4KiB\"")
        .set("server.socket_mode=0o666")
        .nvme_capacity("64MiB")
}

pub type Daemon = Tierd;

/// The [`harness`] daemon with its host arena shared with engines (LEASE, RESERVE).
pub fn shared_harness() -> TierdBuilder {
    harness().set("host.shared=true")
}

/// The [`harness`] daemon as a node named `name` of the remote tier on `cluster` (claims of
/// `claim_ttl_ms`), in `dir` (a restart) or a fresh directory, with `extra` settings.
pub fn remote_node(
    cluster: &kvtier_tests::redis::RedisCluster,
    name: &str,
    claim_ttl_ms: u64,
    dir: Option<tempfile::TempDir>,
    extra: &[&str],
) -> Tierd {
    let b = harness()
        .set("remote.enabled=true")
        .set(&cluster.seeds_setting())
        .set(&format!("remote.node=\"{name}\""))
        .set(&format!("remote.claim_ttl_ms={claim_ttl_ms}"));
    let b = match dir {
        Some(d) => b.dir(d),
        None => b,
    };
    extra.iter().fold(b, |b, s| b.set(s)).start()
}

/// `Daemon::start(extra)`, `Daemon::start_in(dir, extra)` and `Daemon::with(settings)`: the
/// [`harness`] daemon, plus `extra` arguments, up and answering.
pub trait Harness {
    /// In a fresh directory.
    fn start(extra: &[&str]) -> Tierd;
    /// In a fresh directory, with `--set` of each `section.field=value` of `settings`.
    fn with(settings: &[&str]) -> Tierd;
    /// On the socket and NVMe state of `dir` (a restart when a daemon ran there: see
    /// [`Tierd::stop`]).
    fn start_in(dir: tempfile::TempDir, extra: &[&str]) -> Tierd;
}

impl Harness for Tierd {
    fn start(extra: &[&str]) -> Tierd {
        harness().args(extra).start()
    }

    fn start_in(dir: tempfile::TempDir, extra: &[&str]) -> Tierd {
        harness().dir(dir).args(extra).start()
    }

    fn with(settings: &[&str]) -> Tierd {
        settings.iter().fold(harness(), |b, s| b.set(s)).start()
    }
}

/// What STATS says about how requests shared steps.
pub struct Shared {
    /// `decode_coalesced_total` (None when the key is absent: coalescing off).
    pub coalesced: Option<u64>,
    pub requests: u64,
    /// `decode_steps_total` (None when the key is absent).
    pub steps: Option<u64>,
}

/// `sessions` connections stepping `steps` tokens each, all at once; returns what STATS says
/// about sharing.
pub fn concurrent_steps(d: &Daemon, sessions: usize, steps: usize) -> Shared {
    let start = std::sync::Arc::new(std::sync::Barrier::new(sessions));
    let threads: Vec<_> = (0..sessions)
        .map(|i| {
            let mut c = d.client();
            let start = start.clone();
            std::thread::spawn(move || {
                let (id, mut shadow) = open(&mut c, &format!("s{i}"), 40 + i as u32, i as u64);
                start.wait();
                for _ in 0..steps {
                    shadow.step(&mut c, id);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("every output matched the oracle");
    }
    let stats = d.client().stats().unwrap();
    Shared {
        coalesced: stats.get("decode_coalesced_total"),
        requests: stats.get("decode_requests_total").unwrap(),
        steps: stats.get("decode_steps_total"),
    }
}

/// The session is there with exactly the shadow's tokens, and decodes correctly.
pub fn intact(c: &mut kvtier_protocol::client::Client, id: u64, sh: &mut Shadow) {
    let info = c.session_info(id).unwrap();
    assert!(!info.damaged, "session {id} damaged");
    assert_eq!(
        (info.tokens_min, info.tokens_max),
        (sh.tokens(0), sh.tokens(0)),
        "session {id}"
    );
    sh.step(c, id);
}

// Scraping the metrics endpoint (`metrics.listen`).

/// A free loopback port.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Raw HTTP exchange: (status line, body).
pub fn http(port: u16, request: &str) -> (String, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let (head, body) = resp.split_once("\r\n\r\n").expect("HTTP response");
    (head.lines().next().unwrap().to_string(), body.to_string())
}

/// One scrape as `series -> value` (series = name plus labels, as exposed).
pub fn scrape(port: u16) -> std::collections::BTreeMap<String, f64> {
    let (status, body) = http(port, "GET /metrics HTTP/1.1\r\nHost: tierd\r\n\r\n");
    assert_eq!(status, "HTTP/1.1 200 OK");
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (series, value) = l.rsplit_once(' ').expect("series value");
            (series.to_string(), value.parse().expect("numeric value"))
        })
        .collect()
}

// Tests in two processes: this test binary re-run for one of its ignored tests, the other half.

/// Whether this process can run a second uid (only root can, as CI runs); where it cannot, says
/// the calling test does not apply.
pub fn can_run_second_uid() -> bool {
    if !is_root() {
        eprintln!("not root: cannot run a second uid, test not applicable");
    }
    is_root()
}

/// Where a test passes its second uid's half (a tenant) the daemon's socket.
pub const TENANT_SOCKET: &str = "KVTIER_TENANT_SOCKET";

/// Runs the ignored test `name` as nobody against `d` (its socket in [`TENANT_SOCKET`]), with
/// `env` besides; it must pass and say `tenant done`.
pub fn run_tenant(name: &str, d: &Daemon, env: &[(&str, &str)]) {
    let socket = [(TENANT_SOCKET, d.path().to_str().unwrap())];
    run_as_nobody(name, &[&socket[..], env].concat(), "tenant done");
}

/// In a tenant (see [`run_tenant`]): the daemon's socket; None where the ignored test runs on
/// its own, with nothing to check.
pub fn tenant_socket() -> Option<String> {
    std::env::var(TENANT_SOCKET).ok()
}

/// In a tenant: a client of [`tenant_socket`].
pub fn tenant() -> Option<kvtier_protocol::client::Client> {
    tenant_socket().map(|path| kvtier_protocol::client::Client::connect(&path).unwrap())
}

/// A value a test passed its other half in environment variable `var`.
pub fn passed<T: std::str::FromStr>(var: &str) -> T
where
    T::Err: std::fmt::Debug,
{
    std::env::var(var).unwrap().parse().unwrap()
}

/// Starts this test binary's ignored `engine_process` test beside `d`, on session `id` (passed
/// in `var`, read back by [`engine_lease`]), its stdin and stdout piped.
pub fn spawn_engine_process(d: &Daemon, var: &str, id: u64) -> std::process::Child {
    use std::process::Stdio;
    kvtier_tests::sys::rerun_test(&std::env::current_exe().unwrap(), "engine_process")
        .env(var, format!("{} {id}", d.path().to_str().unwrap()))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

/// What an engine process holds (see [`engine_lease`]).
pub struct EngineLease {
    /// Its connection, which holds the lease.
    pub client: kvtier_protocol::client::Client,
    pub session: u64,
    pub lease: kvtier_protocol::LeaseReply,
    /// The shared arena's descriptor.
    pub fd: std::os::fd::OwnedFd,
}

/// In an engine process (see [`spawn_engine_process`]): a connection as `name` and the lease
/// it took on its session; None where the ignored test runs on its own.
pub fn engine_lease(var: &str, name: &str) -> Option<EngineLease> {
    let spec = std::env::var(var).ok()?;
    let (sock, session) = spec.split_once(' ').unwrap();
    let session = session.parse().unwrap();
    let mut client = kvtier_protocol::client::Client::connect_as(sock, name).unwrap();
    let (lease, fd) = client.lease(session).unwrap();
    Some(EngineLease {
        client,
        session,
        lease,
        fd,
    })
}
