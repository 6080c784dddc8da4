//! A randomized campaign across two tierd nodes and a real Redis Cluster (3 masters, 3
//! replicas), reproducible from its seed: each cycle is one of APPEND_KV, a DECODE step over
//! every layer, OFFLOAD, CLOSE and a new session, a node SIGKILLed and restarted on its state,
//! or a Redis master SIGKILLed (its replica takes over; it rejoins as a replica), sent to a
//! random node. Both nodes run with `remote.write_through`, so every acknowledged token must
//! survive whichever node or master dies. The oracle is each session's acknowledged tokens
//! ([`Shadow`]):
//! - an append at the acknowledged length succeeds (a node holding fewer tokens refuses it:
//!   counted as lost);
//! - every decode output matches the f64 dense oracle over exactly the acknowledged tokens;
//! - no tierd exits by itself (a panic exits 101) or answers INTERNAL.
//!
//! A request refused because the other node owns the session goes to that node; one refused
//! while a claim lapses or a failover runs (UNAVAILABLE) is retried; FAILED_PRECONDITION never
//! is. CI runs a short campaign; the long one is a benchmark:
//! `KVTIER_REMOTE_CYCLES=500 cargo test --release -p tierd --test remote_campaign -- --nocapture`
//! (`KVTIER_REMOTE_SEED` picks the seed; a failure prints it).

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvtier_protocol::client::{Client, ClientError};
use kvtier_protocol::ErrorCode;
use kvtier_storage::testing::Rng;
use kvtier_tests::redis::RedisCluster;

const CLAIM_TTL_MS: u64 = 1000;
const NAMES: [&str; 2] = ["node-a", "node-b"];

struct Node {
    name: &'static str,
    tierd: Option<Tierd>,
    client: Option<Client>,
}

impl Node {
    fn client(&mut self) -> &mut Client {
        let d = self.tierd.as_ref().expect("running");
        self.client.get_or_insert_with(|| d.client())
    }
}

struct Sess {
    id: u64,
    sh: Shadow,
}

#[derive(Default, Debug)]
struct Tally {
    appends: u64,
    steps: u64,
    offloads: u64,
    closes: u64,
    node_kills: u64,
    master_kills: u64,
    moved_to_owner: u64,
    retries: u64,
}

struct Campaign {
    seed: u64,
    cycle: u64,
    rng: Rng,
    cluster: RedisCluster,
    nodes: Vec<Node>,
    sessions: Vec<Sess>,
    tally: Tally,
}

/// What became of a request after the retries.
enum Sent<T> {
    Done(T),
    /// Refused with this code and message, not to be retried.
    Refused(ErrorCode, String),
}

impl Campaign {
    fn fail(&self, what: &str) -> ! {
        panic!(
            "seed {} cycle {}: {what}\ntally: {:?}",
            self.seed, self.cycle, self.tally
        )
    }

    fn start_node(&mut self, i: usize, dir: Option<tempfile::TempDir>) {
        let t = remote_node(
            &self.cluster,
            self.nodes[i].name,
            CLAIM_TTL_MS,
            dir,
            &["remote.write_through=true", "remote.replica_timeout_ms=500"],
        );
        self.nodes[i].tierd = Some(t);
        self.nodes[i].client = None;
    }

    /// Sends `f` to node `i`; a session another live node owns goes there, and what is
    /// transient (a claim lapsing, a failover, a restarted node) is retried for up to 60 s.
    fn send<T>(
        &mut self,
        mut i: usize,
        mut f: impl FnMut(&mut Client) -> Result<T, ClientError>,
    ) -> Sent<T> {
        let t = Instant::now();
        loop {
            if let Some(code) = self.nodes[i].tierd.as_mut().and_then(|d| d.status()) {
                self.fail(&format!("{} exited by itself: {code}", self.nodes[i].name));
            }
            let r = f(self.nodes[i].client());
            let (code, message) = match r {
                Ok(v) => return Sent::Done(v),
                Err(ClientError::Server { code, message }) => (code, message),
                Err(e) => {
                    // The connection broke (a node restarted under it): reconnect.
                    self.nodes[i].client = None;
                    (ErrorCode::Unavailable, e.to_string())
                }
            };
            if code == ErrorCode::Internal {
                self.fail(&format!("INTERNAL from {}: {message}", self.nodes[i].name));
            }
            // OWNED_ELSEWHERE names the owner: go there.
            let owner = NAMES.iter().position(|n| message == *n);
            let transient = match (code, owner) {
                (ErrorCode::OwnedElsewhere, Some(o)) if o != i => {
                    self.tally.moved_to_owner += 1;
                    i = o;
                    true
                }
                // This node's own earlier incarnation, or a claim that has not lapsed.
                (ErrorCode::OwnedElsewhere, Some(_)) => true,
                (ErrorCode::Unavailable, _) => true,
                _ => false,
            };
            if !transient {
                return Sent::Refused(code, message);
            }
            if t.elapsed() > Duration::from_secs(60) {
                self.fail(&format!("still refused after 60 s: {code:?} {message}"));
            }
            self.tally.retries += 1;
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn pick_node(&mut self) -> usize {
        self.rng.below(2) as usize
    }

    fn append(&mut self, s: usize) {
        let n = 1 + self.rng.below(4) as u32;
        let id = self.sessions[s].id;
        let at = self.sessions[s].sh.tokens(0);
        let p = self.sessions[s].sh.payload(n as usize);
        let i = self.pick_node();
        match self.send(i, |c| c.append_kv(id, at, n, &p)) {
            Sent::Done(len) if len == at + n as u64 => self.tally.appends += 1,
            Sent::Done(len) => self.fail(&format!("session {id}: append at {at} of {n} gave length {len}")),
            Sent::Refused(code, m) => self.fail(&format!(
                "session {id}: append at its acknowledged length {at} refused: {code:?} {m} (tokens lost?)"
            )),
        }
    }

    fn step(&mut self, s: usize) {
        let id = self.sessions[s].id;
        let i = self.pick_node();
        for layer in 0..small_geometry().layers as usize {
            let sh = &mut self.sessions[s].sh;
            let pos = sh.tokens(layer);
            let (q, k, v) = sh.step_input(layer);
            let qb = f32_bytes(&q);
            let out = match self.send(i, |c| {
                c.decode(layer as u32, entry(id, pos, &qb, &k, &v), true)
            }) {
                Sent::Done(out) => out,
                Sent::Refused(code, m) => self.fail(&format!(
                    "session {id}: decode of layer {layer} at {pos}: {code:?} {m}"
                )),
            };
            let sh = &self.sessions[s].sh;
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sh.check(layer, &q, &out)))
                .is_err()
            {
                self.fail(&format!(
                    "session {id}: a wrong decode output at layer {layer}"
                ));
            }
        }
        self.tally.steps += 1;
    }

    fn offload(&mut self, s: usize) {
        let id = self.sessions[s].id;
        let i = self.pick_node();
        match self.send(i, |c| c.offload(id)) {
            Sent::Done(_) => self.tally.offloads += 1,
            Sent::Refused(code, m) => self.fail(&format!("session {id}: OFFLOAD: {code:?} {m}")),
        }
    }

    fn replace(&mut self, s: usize) {
        let id = self.sessions[s].id;
        let i = self.pick_node();
        match self.send(i, |c| c.close(id)) {
            Sent::Done(()) => self.tally.closes += 1,
            Sent::Refused(code, m) => self.fail(&format!("session {id}: CLOSE: {code:?} {m}")),
        }
        let seed = self.rng.next_u64();
        self.sessions[s] = self.new_session(seed);
    }

    fn new_session(&mut self, seed: u64) -> Sess {
        let i = self.pick_node();
        let id = match self.send(i, |c| {
            c.create_session(small_geometry(), policy(), "campaign")
        }) {
            Sent::Done(id) => id,
            Sent::Refused(code, m) => self.fail(&format!("CREATE: {code:?} {m}")),
        };
        let mut sess = Sess {
            id,
            sh: Shadow::new(small_geometry(), seed),
        };
        let p = sess.sh.payload(40);
        match self.send(i, |c| c.append_kv(id, 0, 40, &p)) {
            Sent::Done(_) => {}
            Sent::Refused(code, m) => {
                self.fail(&format!("session {id}: first append: {code:?} {m}"))
            }
        }
        sess
    }

    fn kill_node(&mut self) {
        let i = self.pick_node();
        let d = self.nodes[i].tierd.take().expect("running");
        let dir = d.stop(true);
        self.start_node(i, Some(dir));
        self.tally.node_kills += 1;
    }

    fn kill_master(&mut self) {
        let masters = self.cluster.masters();
        let victim = masters[self.rng.below(masters.len() as u64) as usize];
        self.cluster.kill(victim);
        self.cluster.wait_failover(victim, Duration::from_secs(30));
        self.cluster.restart(victim);
        self.cluster.wait_replicas(1, Duration::from_secs(30));
        self.tally.master_kills += 1;
    }

    fn cycle(&mut self) {
        let s = self.rng.below(self.sessions.len() as u64) as usize;
        match self.rng.below(100) {
            0..=39 => self.append(s),
            40..=69 => self.step(s),
            70..=81 => self.offload(s),
            82..=87 => self.replace(s),
            88..=95 => self.kill_node(),
            _ => self.kill_master(),
        }
    }
}

fn run(seed: u64, cycles: u64) {
    let Some(cluster) = RedisCluster::start(3, 1) else {
        return;
    };
    let mut c = Campaign {
        seed,
        cycle: 0,
        rng: Rng::new(seed),
        cluster,
        nodes: NAMES
            .iter()
            .map(|&name| Node {
                name,
                tierd: None,
                client: None,
            })
            .collect(),
        sessions: Vec::new(),
        tally: Tally::default(),
    };
    c.start_node(0, None);
    c.start_node(1, None);
    for k in 0..4 {
        let s = c.new_session(seed ^ k);
        c.sessions.push(s);
    }
    let t = Instant::now();
    for cycle in 0..cycles {
        c.cycle = cycle;
        c.cycle();
    }
    // Every session still holds exactly its acknowledged tokens, correct to the oracle.
    for s in 0..c.sessions.len() {
        c.step(s);
    }
    eprintln!(
        "seed {seed}: {cycles} cycles in {:.1} s, 0 lost, 0 wrong, 0 panics: {:?}",
        t.elapsed().as_secs_f64(),
        c.tally
    );
}

#[test]
fn a_randomized_campaign_across_two_nodes_and_the_cluster_loses_nothing() {
    let seed = std::env::var("KVTIER_REMOTE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let cycles = std::env::var("KVTIER_REMOTE_CYCLES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40);
    run(seed, cycles);
}
