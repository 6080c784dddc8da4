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
