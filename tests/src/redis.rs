//! A real Redis Cluster on loopback for the remote tier's tests: `redis-server` processes in
//! cluster mode (3 masters, one replica each by default) joined by `redis-cli --cluster
//! create`, each in its own directory under one temporary folder, all killed on drop.
//!
//! Needs `redis-server` and `redis-cli` on PATH (Debian: `apt-get install redis-server`;
//! `.ci/run` installs it). [`RedisCluster::start`] returns `None`, saying why, where they are
//! missing, so a test can skip rather than fail on a machine without them.

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One redis-server of the cluster.
pub struct RedisNode {
    pub port: u16,
    child: Mutex<Option<Child>>,
}

impl RedisNode {
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn alive(&self) -> bool {
        self.child.lock().expect("node lock").is_some()
    }
}

/// A running cluster; every node is killed (SIGKILL) and its files removed on drop.
pub struct RedisCluster {
    pub nodes: Vec<RedisNode>,
    dir: tempfile::TempDir,
}

/// Whether `redis-server` and `redis-cli` can be run here.
pub fn available() -> Result<(), String> {
    for bin in ["redis-server", "redis-cli"] {
        let ok = Command::new(bin)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if !ok {
            return Err(format!(
                "{bin} is not installed (apt-get install redis-server): the Redis Cluster tests skip"
            ));
        }
    }
    Ok(())
}

/// A loopback port that is free, and whose cluster bus port (+10000) is free too, and that
/// this process has not handed out before: the kernel may give a port just released by one
/// test's probe to another's, and two clusters whose nodes share a port merge into one.
fn free_port() -> u16 {
    static GIVEN: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    loop {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let port = l.local_addr().expect("local addr").port();
        if port < 55_000
            && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok()
            && GIVEN.lock().expect("port lock").insert(port)
        {
            return port;
        }
    }
}

/// The pid of the redis-server answering on `port`.
fn pid_on(port: u16) -> Option<u32> {
    let info = cli(port, &["info", "server"]).ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("process_id:"))
        .and_then(|p| p.trim().parse().ok())
}

/// Spawns a redis-server on `port` and waits until it answers. `None` if it exited (another
/// process holds the port or its bus port) or if the server answering there is not this one.
fn start_on(dir: &Path, port: u16) -> Option<Child> {
    let mut child = spawn(dir, port);
    let up = wait_for(Duration::from_secs(10), || {
        matches!(child.try_wait(), Ok(Some(_))) || pid_on(port).is_some()
    });
    if up.is_some() && pid_on(port) == Some(child.id()) {
        return Some(child);
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

fn cli(port: u16, args: &[&str]) -> Result<String, String> {
    let out = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .map_err(|e| format!("redis-cli: {e}"))?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn spawn(dir: &Path, port: u16) -> Child {
    let d = dir.join(port.to_string());
    std::fs::create_dir_all(&d).expect("node dir");
    Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args([
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
        ])
        // A failed master is noticed and its replica promoted within a few seconds.
        .args(["--cluster-node-timeout", "1000"])
        .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
        // A (re)joining replica syncs at once, not after the default 5 s.
        .args(["--repl-diskless-sync-delay", "0"])
        .arg("--dir")
        .arg(&d)
        // Relative to --dir: what a failed wait prints (`RedisCluster::state`).
        .args(["--logfile", "redis.log"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn redis-server")
}

impl RedisCluster {
    /// Starts `masters` masters with `replicas` replicas each and waits until the cluster
    /// reports `cluster_state:ok` on every node. `None` (with the reason printed) where Redis
    /// is not installed.
    pub fn start(masters: usize, replicas: usize) -> Option<Self> {
        if let Err(why) = available() {
            eprintln!("{why}");
            return None;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        // Held by the cluster from the first node on, so that a panic below kills the nodes
        // started so far (Drop) rather than leaving them running.
        let mut c = RedisCluster {
            nodes: Vec::new(),
            dir,
        };
        for _ in 0..masters * (1 + replicas) {
            let node = (0..20)
                .find_map(|_| {
                    let port = free_port();
                    start_on(c.dir.path(), port).map(|child| RedisNode {
                        port,
                        child: Mutex::new(Some(child)),
                    })
                })
                .expect("no free port where a redis-server would start");
            c.nodes.push(node);
        }
        let mut create = vec!["--cluster".to_string(), "create".to_string()];
        create.extend(c.nodes.iter().map(RedisNode::addr));
        create.extend(["--cluster-replicas".into(), replicas.to_string()]);
        create.push("--cluster-yes".into());
        let args: Vec<&str> = create.iter().map(String::as_str).collect();
        cli(c.nodes[0].port, &args).expect("redis-cli --cluster create");
        c.wait_ok(Duration::from_secs(30));
        c.wait_replicas(replicas, Duration::from_secs(30));
        Some(c)
    }

    /// The seed addresses, `redis://127.0.0.1:port` each.
    pub fn seeds(&self) -> Vec<String> {
        self.nodes
            .iter()
            .filter(|n| n.alive())
            .map(|n| format!("redis://{}", n.addr()))
            .collect()
    }

    /// tierd's `--set` of these seeds: `remote.seeds=["redis://...", ...]`.
    pub fn seeds_setting(&self) -> String {
        let quoted: Vec<String> = self.seeds().iter().map(|s| format!("\"{s}\"")).collect();
        format!("remote.seeds=[{}]", quoted.join(","))
    }

    /// The ports of the nodes that are masters now.
    pub fn masters(&self) -> Vec<u16> {
        self.nodes
            .iter()
            .filter(|n| n.alive())
            .filter(|n| {
                cli(n.port, &["role"])
                    .map(|r| r.starts_with("master"))
                    .unwrap_or(false)
            })
            .map(|n| n.port)
            .collect()
    }

    /// The live replicas of the master on `port` now.
    pub fn replicas_of(&self, port: u16) -> Vec<u16> {
        // A replica's ROLE: "slave", its master's host, then its master's port.
        let master = port.to_string();
        self.nodes
            .iter()
            .filter(|n| n.alive())
            .filter(|n| {
                cli(n.port, &["role"])
                    .map(|r| {
                        let f: Vec<&str> = r.lines().map(str::trim).collect();
                        f.first() == Some(&"slave") && f.get(2) == Some(&master.as_str())
                    })
                    .unwrap_or(false)
            })
            .map(|n| n.port)
            .collect()
    }

    /// The master that holds `key`'s hash slot now.
    pub fn master_of(&self, key: &str) -> u16 {
        let any = self.nodes.iter().find(|n| n.alive()).expect("a live node");
        let slot: u16 = cli(any.port, &["cluster", "keyslot", key])
            .expect("cluster keyslot")
            .trim()
            .parse()
            .expect("a slot");
        let table = cli(any.port, &["cluster", "nodes"]).expect("cluster nodes");
        for (port, ranges) in masters_in(&table) {
            if ranges.iter().any(|&(a, b)| (a..=b).contains(&slot)) {
                return port;
            }
        }
        panic!("no master serves slot {slot}")
    }

    /// SIGKILLs the node on `port` (its replica, if it was a master, is promoted once the
    /// others agree it failed: [`Self::wait_ok`]).
    pub fn kill(&self, port: u16) {
        let node = self
            .nodes
            .iter()
            .find(|n| n.port == port)
            .expect("a node of this cluster");
        if let Some(mut c) = node.child.lock().expect("node lock").take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the node on `port` again after [`Self::kill`], with its cluster state: it
    /// rejoins, as a replica if its replica took over meanwhile.
    pub fn restart(&self, port: u16) {
        let dir = self.dir.path().to_path_buf();
        let node = self
            .nodes
            .iter()
            .find(|n| n.port == port)
            .expect("a node of this cluster");
        let mut child = node.child.lock().expect("node lock");
        assert!(child.is_none(), "node {port} is running");
        *child = Some(
            start_on(&dir, port)
                .unwrap_or_else(|| panic!("redis-server on {port} did not come back")),
        );
    }

    /// Waits until the killed master on `port` has been replaced: in every live node's view,
    /// masters other than `port`, none suspected of failure, serve all 16384 slots. (Restarted
    /// before that, a master without persistence would come back empty and keep its slots.)
    pub fn wait_failover(&self, port: u16, within: Duration) {
        let ok = wait_for(within, || {
            self.nodes.iter().filter(|n| n.alive()).all(|n| {
                let Ok(table) = cli(n.port, &["cluster", "nodes"]) else {
                    return false;
                };
                let served: u32 = masters_in(&table)
                    .filter(|(p, _)| *p != port)
                    .flat_map(|(_, ranges)| ranges)
                    .map(|(a, b)| (b - a) as u32 + 1)
                    .sum();
                served == 16384
            })
        });
        assert!(ok.is_some(), "no replica took over from {port}");
    }

    /// Waits until every live node reports `cluster_state:ok` (all slots served).
    pub fn wait_ok(&self, within: Duration) {
        let ok = wait_for(within, || {
            self.nodes.iter().filter(|n| n.alive()).all(|n| {
                cli(n.port, &["cluster", "info"])
                    .map(|i| i.contains("cluster_state:ok"))
                    .unwrap_or(false)
            })
        });
        assert!(
            ok.is_some(),
            "the cluster did not reach cluster_state:ok\n{}",
            self.state()
        );
    }

    /// Waits until every master has `replicas` replicas in sync (`state=online`).
    pub fn wait_replicas(&self, replicas: usize, within: Duration) {
        let ok = wait_for(within, || {
            self.masters().iter().all(|&p| {
                cli(p, &["info", "replication"])
                    .map(|i| i.matches("state=online").count() == replicas)
                    .unwrap_or(false)
            })
        });
        assert!(ok.is_some(), "replicas did not connect\n{}", self.state());
    }

    /// Every node's role, replication and cluster view, and the end of its log: what a
    /// failed wait prints.
    pub fn state(&self) -> String {
        let mut out = String::new();
        for n in self.nodes.iter().filter(|n| n.alive()) {
            let ask = |args: &[&str]| cli(n.port, args).unwrap_or_else(|e| format!("({e})"));
            let log =
                std::fs::read_to_string(self.dir.path().join(n.port.to_string()).join("redis.log"))
                    .unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(15).collect();
            out += &format!(
                "--- node {}\n{}{}{}log:\n{}\n",
                n.port,
                ask(&["info", "replication"]),
                ask(&["cluster", "nodes"]),
                ask(&["cluster", "info"])
                    .lines()
                    .take(3)
                    .collect::<Vec<_>>()
                    .join("\n")
                    + "\n",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        out
    }

    /// Keys of the whole cluster (DBSIZE summed over the masters).
    pub fn keys(&self) -> u64 {
        self.masters()
            .iter()
            .map(|&p| {
                cli(p, &["dbsize"])
                    .ok()
                    .and_then(|s| s.trim().parse::<u64>().ok())
                    .unwrap_or(0)
            })
            .sum()
    }

    /// Runs `redis-cli` against `port` (for tests that corrupt or remove keys).
    pub fn cli(&self, port: u16, args: &[&str]) -> Result<String, String> {
        cli(port, args)
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            if let Some(mut c) = n.child.lock().expect("node lock").take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// The masters of a CLUSTER NODES table that no node suspects of failure, with their slot
/// ranges. A line: `<id> <ip:port@bus> <flags> <master> <ping> <pong> <epoch> <link> <slots>...`.
fn masters_in(table: &str) -> impl Iterator<Item = (u16, Vec<(u16, u16)>)> + '_ {
    table.lines().filter_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 8 || !f[2].contains("master") || f[2].contains("fail") {
            return None;
        }
        let port: u16 = f[1].split(['@', ':']).nth(1)?.parse().ok()?;
        let ranges = f[8..]
            .iter()
            .filter_map(|r| {
                let (a, b) = r.split_once('-').unwrap_or((r, r));
                Some((a.parse().ok()?, b.parse().ok()?))
            })
            .collect();
        Some((port, ranges))
    })
}

fn wait_for(within: Duration, mut ok: impl FnMut() -> bool) -> Option<()> {
    let t = Instant::now();
    while t.elapsed() < within {
        if ok() {
            return Some(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}
