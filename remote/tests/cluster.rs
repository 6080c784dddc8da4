//! The remote tier against a real Redis Cluster on loopback (3 masters, 3 replicas; see
//! `kvtier_tests::redis`). Skips, saying so, where redis-server is not installed.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvtier_remote::{Claim, ClusterConfig, ClusterStore, RemoteError, RemoteRun, RemoteStore};
use kvtier_storage::nvme::manifest::{GeometryRecord, PolicyRecord, SessionRecord};
use kvtier_storage::{DType, Geometry, Policy};
use kvtier_tests::kv::xorshift_bytes;
use kvtier_tests::redis::RedisCluster;

const LAYERS: u32 = 2;
const RUN: usize = 4096;

fn record(id: u64, blocks: u32) -> SessionRecord {
    let g = Geometry {
        layers: LAYERS,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 64,
        dtype: DType::F16,
        block_tokens: 8,
    };
    SessionRecord {
        id,
        owner_uid: 1000,
        label: format!("s{id}"),
        geometry: GeometryRecord::from(&g),
        policy: PolicyRecord::from(&Policy::sketch(1, 1, 2, 2)),
        layer_tokens: vec![blocks as u64 * 8; LAYERS as usize],
        pages: Vec::new(),
        pinned: false,
        created_unix_ms: 1,
    }
}

/// The bytes of (layer, block) at version `v`: different for every run and version.
fn payload(id: u64, layer: u32, block: u32, v: u32) -> Vec<u8> {
    let state = id
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(((layer as u64) << 40) ^ ((block as u64) << 20) ^ v as u64);
    xorshift_bytes(state, RUN)
}

fn runs_of(id: u64, blocks: impl Iterator<Item = u32> + Clone, v: u32) -> Vec<(u32, u32, Vec<u8>)> {
    (0..LAYERS)
        .flat_map(|l| blocks.clone().map(move |b| (l, b, payload(id, l, b, v))))
        .collect()
}

/// The summary stored beside a payload: its second half (so a page and its summary differ
/// in length, and a swapped pair cannot verify).
fn summary(bytes: &[u8]) -> &[u8] {
    &bytes[bytes.len() / 2..]
}

fn as_runs(owned: &[(u32, u32, Vec<u8>)]) -> Vec<RemoteRun<'_>> {
    owned
        .iter()
        .map(|(layer, block, bytes)| RemoteRun {
            layer: *layer,
            block: *block,
            bytes,
            summary: summary(bytes),
        })
        .collect()
}

fn config(cluster: &RedisCluster, ttl: Duration) -> ClusterConfig {
    ClusterConfig {
        seeds: cluster.seeds(),
        claim_ttl: ttl,
        replicas: 1,
        batch_bytes: 64 << 10,
        ..ClusterConfig::default()
    }
}

/// Writes version 0 of session `id`'s blocks `0..blocks` under `claim`; the generation.
fn put_v0(store: &ClusterStore, claim: &Claim, id: u64, blocks: u32) -> u64 {
    let runs = runs_of(id, 0..blocks, 0);
    store
        .put_session(claim, &record(id, blocks), &as_runs(&runs))
        .unwrap()
}

/// Reads every run of `blocks` back and compares with version `v`.
fn assert_holds(store: &ClusterStore, id: u64, blocks: u32, v: u32) {
    let rec = store.record(id).unwrap().expect("a record");
    assert_eq!(rec.session.layer_tokens, record(id, blocks).layer_tokens);
    let wanted: Vec<(u32, u32)> = (0..LAYERS)
        .flat_map(|l| (0..blocks).map(move |b| (l, b)))
        .collect();
    let got = store.read_runs(&rec, &wanted).unwrap();
    let summaries = store.read_summaries(&rec, &wanted).unwrap();
    assert!(rec.has_summaries());
    for ((&(l, b), bytes), sum) in wanted.iter().zip(&got).zip(&summaries) {
        let want = payload(id, l, b, v);
        assert!(*bytes == want, "session {id} layer {l} block {b}");
        assert!(
            sum == summary(&want),
            "session {id} layer {l} block {b}'s summary"
        );
    }
}

#[test]
fn a_session_round_trips_and_a_rewrite_replaces_only_its_runs() {
    let Some(cluster) = RedisCluster::start(3, 1) else {
        return;
    };
    let store = ClusterStore::connect(config(&cluster, Duration::from_secs(10))).unwrap();
    let claim = store.claim(7, "node-a").unwrap();
    put_v0(&store, &claim, 7, 12);
    assert_holds(&store, 7, 12, 0);
    let keys = cluster.keys();

    // Rewrite blocks 4..8 of both layers, then add blocks 12..14: the other runs stay.
    let second = runs_of(7, 4..8, 1);
    let g2 = store
        .put_session(&claim, &record(7, 12), &as_runs(&second))
        .unwrap();
    assert_eq!(cluster.keys(), keys, "the superseded pages were deleted");
    let rec = store.record(7).unwrap().unwrap();
    assert_eq!(rec.generation, g2);
    let wanted: Vec<(u32, u32)> = (0..LAYERS)
        .flat_map(|l| (0..12).map(move |b| (l, b)))
        .collect();
    let got = store.read_runs(&rec, &wanted).unwrap();
    for (&(l, b), bytes) in wanted.iter().zip(&got) {
        let v = if (4..8).contains(&b) { 1 } else { 0 };
        assert!(*bytes == payload(7, l, b, v), "layer {l} block {b}");
    }
    let third = runs_of(7, 12..14, 0);
    store
        .put_session(&claim, &record(7, 14), &as_runs(&third))
        .unwrap();
    assert_eq!(store.session_ids().unwrap(), vec![7]);
    assert_eq!(store.owner(7).unwrap().as_deref(), Some("node-a"));

    // Another store on the same cluster (another node) reads the same bytes.
    let other = ClusterStore::connect(config(&cluster, Duration::from_secs(10))).unwrap();
    let rec = other.record(7).unwrap().unwrap();
    assert_eq!(rec.pages.len(), 2 * 14);
    assert_eq!(
        other.read_runs(&rec, &[(1, 13), (0, 5)]).unwrap(),
        vec![payload(7, 1, 13, 0), payload(7, 0, 5, 1)]
    );
    let e = other.read_runs(&rec, &[(0, 14)]).unwrap_err();
    assert!(
        matches!(e, RemoteError::NoSuchRun { .. }) && e.is_data_loss(),
        "{e}"
    );

    // Deleting removes everything but the claim and the fence.
    store.delete_session(&claim).unwrap();
    assert!(store.record(7).unwrap().is_none());
    assert!(store.session_ids().unwrap().is_empty());
    store.give_up(&claim).unwrap();
    assert_eq!(store.owner(7).unwrap(), None);
    assert_eq!(
        cluster.keys(),
        2,
        "the fence and generation counters stay: tokens never repeat"
    );
}

#[test]
fn a_missing_or_corrupt_page_or_record_is_data_loss_never_data() {
    let Some(cluster) = RedisCluster::start(3, 1) else {
        return;
    };
    let store = ClusterStore::connect(config(&cluster, Duration::from_secs(10))).unwrap();
    let claim = store.claim(3, "node-a").unwrap();
    let g = put_v0(&store, &claim, 3, 4);
    let rec = store.record(3).unwrap().unwrap();

    // One byte of a page's payload changed in the store.
    let key = format!("kvtier:page:3:1:2:{g}");
    let master = cluster.master_of(&key);
    cluster
        .cli(master, &["setrange", &key, "100", "X"])
        .unwrap();
    let e = store.read_runs(&rec, &[(0, 0), (1, 2)]).unwrap_err();
    assert!(
        matches!(
            e,
            RemoteError::CorruptPage {
                layer: 1,
                block: 2,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.is_data_loss());
    // A summary's bytes changed, and a summary gone: data loss too.
    let skey = format!("kvtier:sum:3:0:1:{g}");
    cluster
        .cli(cluster.master_of(&skey), &["setrange", &skey, "40", "X"])
        .unwrap();
    let e = store.read_summaries(&rec, &[(0, 0), (0, 1)]).unwrap_err();
    assert!(
        matches!(
            e,
            RemoteError::CorruptPage {
                layer: 0,
                block: 1,
                ..
            }
        ) && e.is_data_loss(),
        "{e}"
    );
    let skey = format!("kvtier:sum:3:0:2:{g}");
    cluster
        .cli(cluster.master_of(&skey), &["del", &skey])
        .unwrap();
    let e = store.read_summaries(&rec, &[(0, 2)]).unwrap_err();
    assert!(
        matches!(
            e,
            RemoteError::MissingPage {
                layer: 0,
                block: 2,
                ..
            }
        ) && e.is_data_loss(),
        "{e}"
    );
    assert_eq!(
        store.read_summaries(&rec, &[(0, 3)]).unwrap(),
        vec![summary(&payload(3, 0, 3, 0)).to_vec()]
    );

    // A page gone from the store (a master lost without its replica, a manual delete).
    let other = format!("kvtier:page:3:1:3:{g}");
    cluster
        .cli(cluster.master_of(&other), &["del", &other])
        .unwrap();
    let e = store.read_runs(&rec, &[(1, 3)]).unwrap_err();
    assert!(
        matches!(
            e,
            RemoteError::MissingPage {
                layer: 1,
                block: 3,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.is_data_loss());

    // The record itself damaged.
    let rkey = "{kvtier:3}:record";
    cluster
        .cli(cluster.master_of(rkey), &["setrange", rkey, "20", "ZZZZ"])
        .unwrap();
    let e = store.record(3).unwrap_err();
    assert!(
        matches!(e, RemoteError::CorruptRecord { .. }) && e.is_data_loss(),
        "{e}"
    );
    // The runs that are intact still read (through the record as it was).
    assert_eq!(
        store.read_runs(&rec, &[(0, 1)]).unwrap(),
        vec![payload(3, 0, 1, 0)]
    );
}

#[test]
fn one_owner_at_a_time_and_a_stale_owner_is_fenced() {
    let Some(cluster) = RedisCluster::start(3, 1) else {
        return;
    };
    let ttl = Duration::from_millis(600);
    let a = ClusterStore::connect(config(&cluster, ttl)).unwrap();
    let b = ClusterStore::connect(config(&cluster, ttl)).unwrap();
    let mut ca = a.claim(11, "node-a").unwrap();
    put_v0(&a, &ca, 11, 3);

    // B is refused while A's claim is live, told who owns the session.
    match b.claim(11, "node-b") {
        Err(RemoteError::Owned {
            owner, expires_ms, ..
        }) => {
            assert_eq!(owner, "node-a");
            assert!(expires_ms > 0 && expires_ms <= 600, "{expires_ms}");
        }
        other => panic!("expected Owned, got {other:?}"),
    }
    // A renews and keeps it past the first TTL.
    std::thread::sleep(Duration::from_millis(400));
    a.renew(&mut ca).unwrap();
    std::thread::sleep(Duration::from_millis(400));
    assert!(matches!(
        b.claim(11, "node-b"),
        Err(RemoteError::Owned { .. })
    ));

    // A stops renewing (a pause): past its local validity it refuses to write by itself.
    std::thread::sleep(ttl);
    let late = runs_of(11, 0..1, 9);
    let e = a
        .put_session(&ca, &record(11, 3), &as_runs(&late))
        .unwrap_err();
    assert!(matches!(e, RemoteError::ClaimExpired { .. }), "{e}");

    // B takes the session with a larger token.
    let cb = b.claim(11, "node-b").unwrap();
    assert!(cb.token > ca.token);
    // A node that believes its claim still valid (its clock ran slow) is refused by the
    // store: nothing it sends is written.
    let stale = Claim {
        valid_until: Instant::now() + Duration::from_secs(60),
        ..ca.clone()
    };
    match a.put_session(&stale, &record(11, 3), &as_runs(&late)) {
        Err(RemoteError::Fenced { holder, token, .. }) => {
            assert_eq!(holder.as_deref(), Some("node-b"));
            assert_eq!(token, ca.token);
        }
        other => panic!("expected Fenced, got {other:?}"),
    }
    assert!(matches!(a.renew(&mut ca), Err(RemoteError::Fenced { .. })));
    assert!(matches!(
        a.delete_session(&stale),
        Err(RemoteError::Fenced { .. })
    ));
    a.give_up(&stale).unwrap();
    assert_eq!(
        b.owner(11).unwrap().as_deref(),
        Some("node-b"),
        "A's give_up left B's claim"
    );
    assert_holds(&b, 11, 3, 0);

    // B writes; A's data is B's to extend.
    let more = runs_of(11, 3..5, 0);
    b.put_session(&cb, &record(11, 5), &as_runs(&more)).unwrap();
    assert_holds(&a, 11, 5, 0);
}

/// A claim that lapsed while no other node claimed the session is taken back by its next
/// renewal (same token: nothing can have been written meanwhile); one claimed by another node
/// since, or given up, is not.
#[test]
fn a_lapsed_claim_nobody_took_is_renewed_but_not_one_taken_or_given_up() {
    let Some(cluster) = RedisCluster::start(3, 1) else {
        return;
    };
    // Long enough for a write under load (300 ms lapsed mid-write under CI), short enough to
    // wait out twice.
    let ttl = Duration::from_millis(1500);
    let a = ClusterStore::connect(config(&cluster, ttl)).unwrap();
    let b = ClusterStore::connect(config(&cluster, ttl)).unwrap();
    let mut ca = a.claim(21, "node-a").unwrap();
    put_v0(&a, &ca, 21, 2);
    std::thread::sleep(ttl * 2);
    assert_eq!(a.owner(21).unwrap(), None, "the claim lapsed");
    let token = ca.token;
    a.renew(&mut ca).unwrap();
    assert_eq!(
        (ca.token, a.owner(21).unwrap().as_deref()),
        (token, Some("node-a"))
    );
    let more = runs_of(21, 2..3, 0);
    a.put_session(&ca, &record(21, 3), &as_runs(&more)).unwrap();
    assert_holds(&a, 21, 3, 0);

    // Lapsed again; B claims and gives up meanwhile: A's renewal is fenced, naming no one.
    std::thread::sleep(ttl * 2);
    let cb = b.claim(21, "node-b").unwrap();
    b.give_up(&cb).unwrap();
    assert!(matches!(
        a.renew(&mut ca),
        Err(RemoteError::Fenced { holder: None, .. })
    ));
    // A renewal still in flight when its claim is given up does not take it back.
    let cb = b.claim(21, "node-b").unwrap();
    let mut late = cb.clone();
    b.give_up(&cb).unwrap();
    assert!(matches!(
        b.renew(&mut late),
        Err(RemoteError::Fenced { .. })
    ));
    assert_eq!(b.owner(21).unwrap(), None);
}

/// A master left without its replica stops only the sessions it holds: a claim, renewal or
/// commit waits for the replicas of its own session's master, not of every master.
#[test]
fn a_master_without_replicas_stops_only_the_sessions_it_holds() {
    let Some(cluster) = RedisCluster::start(3, 1) else {
        return;
    };
    let cfg = ClusterConfig {
        replica_timeout: Duration::from_millis(300),
        ..config(&cluster, Duration::from_secs(10))
    };
    let claim_key = |id: u64| format!("{{{}:{id}}}:claim", cfg.key_prefix);
    let lonely = cluster.master_of(&claim_key(1));
    let elsewhere = (2..)
        .find(|&id| cluster.master_of(&claim_key(id)) != lonely)
        .expect("a session on another master");
    let store = ClusterStore::connect(cfg.clone()).unwrap();
    let replicas = cluster.replicas_of(lonely);
    assert_eq!(replicas.len(), 1, "master {lonely}: {replicas:?}");
    cluster.kill(replicas[0]);

    // The other master's session is claimed, renewed and committed as before (pages, spread
    // over every slot, still wait for every master).
    let mut claim = store.claim(elsewhere, "node-a").unwrap();
    store.renew(&mut claim).unwrap();
    put_v0(&store, &claim, elsewhere, 0);
    assert!(store.record(elsewhere).unwrap().is_some());
    // The lonely master's session cannot be claimed durably: said so, not pretended.
    match store.claim(1, "node-a") {
        Err(RemoteError::NotReplicated { wanted: 1, got: 0 }) => {}
        other => panic!("expected NotReplicated, got {other:?}"),
    }
}

/// The child half of the crash test: writes session 21 forever under node "crashing".
#[test]
#[ignore = "run by an_interrupted_write_is_removed_by_the_next_owner in a child process"]
fn crash_child_writes_until_killed() {
    let Ok(seeds) = std::env::var("KVTIER_REMOTE_CHILD_SEEDS") else {
        return;
    };
    let store = ClusterStore::connect(ClusterConfig {
        seeds: seeds.split(',').map(String::from).collect(),
        claim_ttl: Duration::from_secs(2),
        batch_bytes: 16 << 10,
        ..ClusterConfig::default()
    })
    .unwrap();
    let mut claim = store.claim(21, "crashing").unwrap();
    let runs = runs_of(21, 0..64, 1);
    loop {
        store.renew(&mut claim).unwrap();
        store
            .put_session(&claim, &record(21, 64), &as_runs(&runs))
            .unwrap();
    }
}

#[test]
fn an_interrupted_write_is_removed_by_the_next_owner() {
    let Some(cluster) = RedisCluster::start(3, 1) else {
        return;
    };
    let store = ClusterStore::connect(config(&cluster, Duration::from_secs(2))).unwrap();
    // The committed state the crash must not touch: blocks 0..64 at version 0.
    let claim = store.claim(21, "crashing").unwrap();
    put_v0(&store, &claim, 21, 64);
    let committed_keys = cluster.keys();

    // A real process rewriting the session, SIGKILLed while a write is in flight (its
    // pending note present).
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "crash_child_writes_until_killed",
            "--ignored",
            "--nocapture",
        ])
        .env("KVTIER_REMOTE_CHILD_SEEDS", cluster.seeds().join(","))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let master = cluster.master_of("{kvtier:21}:pending");
    let t = Instant::now();
    let mut in_flight = 0;
    while t.elapsed() < Duration::from_secs(30) && in_flight < 3 {
        let n: u64 = cluster
            .cli(master, &["hlen", "{kvtier:21}:pending"])
            .unwrap()
            .trim()
            .parse()
            .unwrap_or(0);
        in_flight += (n > 0) as u32;
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(in_flight >= 3, "the child never had a write in flight");
    child.kill().unwrap();
    child.wait().unwrap();

    // The next owner (after the claim expires) finds the session whole at whatever version
    // was last committed, and no page left over.
    let t = Instant::now();
    let claim = loop {
        match store.claim(21, "next") {
            Ok(l) => break l,
            Err(RemoteError::Owned { .. }) if t.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(100))
            }
            Err(e) => panic!("{e}"),
        }
    };
    let rec = store.record(21).unwrap().unwrap();
    let v = if rec.generation == 1 { 0 } else { 1 };
    assert_holds(&store, 21, 64, v);
    assert_eq!(
        cluster.keys(),
        committed_keys,
        "pages of the interrupted write, or superseded ones, were left behind"
    );
    let pending = cluster
        .cli(master, &["hlen", "{kvtier:21}:pending"])
        .unwrap();
    assert_eq!(pending.trim(), "0");
    store.give_up(&claim).unwrap();
}

#[test]
fn a_master_killed_mid_write_loses_no_acknowledged_write() {
    let Some(cluster) = RedisCluster::start(3, 1) else {
        return;
    };
    let mut cfg = config(&cluster, Duration::from_secs(60));
    cfg.response_timeout = Duration::from_secs(2);
    let store = ClusterStore::connect(cfg).unwrap();
    let sessions: Vec<u64> = (100..112).collect();
    let claims: Vec<Claim> = sessions
        .iter()
        .map(|&s| store.claim(s, "node-a").unwrap())
        .collect();
    // The master of the first session's record dies while writes stream (each write is 16
    // pages in several pipelines, so the kill lands inside one); once its replica has taken
    // over, it comes back as that master's replica (until then the new master has none, and
    // writes are refused as not replicated). A master without persistence restarted before
    // the failover would come back empty: docs/operations.md.
    let victim = cluster.master_of("{kvtier:100}:record");
    let mut acknowledged: Vec<(u64, u32)> = Vec::new();
    let mut failed = 0;
    let t = Instant::now();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            cluster.kill(victim);
            cluster.wait_failover(victim, Duration::from_secs(30));
            cluster.restart(victim);
        });
        let mut round = 0u32;
        while t.elapsed() < Duration::from_secs(3) || round < 3 {
            for (&s, claim) in sessions.iter().zip(&claims) {
                let runs = runs_of(s, 0..8, round);
                // Retried until the cluster serves every slot again.
                loop {
                    match store.put_session(claim, &record(s, 8), &as_runs(&runs)) {
                        Ok(_) => break,
                        Err(RemoteError::Unavailable(_) | RemoteError::NotReplicated { .. })
                            if t.elapsed() < Duration::from_secs(90) =>
                        {
                            failed += 1;
                            std::thread::sleep(Duration::from_millis(100));
                        }
                        Err(e) => panic!("session {s} round {round}: {e}"),
                    }
                }
                acknowledged.retain(|&(x, _)| x != s);
                acknowledged.push((s, round));
            }
            round += 1;
        }
    });
    assert!(failed > 0, "the kill did not interrupt any write");
    cluster.wait_replicas(1, Duration::from_secs(30));
    assert!(
        !cluster.masters().contains(&victim),
        "the killed master is back as a replica"
    );
    for &(s, round) in &acknowledged {
        assert_holds(&store, s, 8, round);
    }
}

#[test]
fn a_write_is_committed_only_once_every_begun_run_is_stored() {
    let Some(cluster) = RedisCluster::start(3, 1) else {
        return;
    };
    let store = ClusterStore::connect(config(&cluster, Duration::from_secs(10))).unwrap();
    let claim = store.claim(31, "node-a").unwrap();
    let runs = runs_of(31, 0..6, 0);
    let listed: Vec<(u32, u32)> = runs.iter().map(|(l, b, _)| (*l, *b)).collect();
    // Batch by batch, as a node writes a session too large for memory.
    let mut w = store.begin(&claim, &record(31, 6), &listed).unwrap();
    for batch in runs.chunks(5) {
        store.write(&mut w, &as_runs(batch)).unwrap();
    }
    let e = store.write(&mut w, &as_runs(&runs[..1])).unwrap_err();
    assert!(
        matches!(e, RemoteError::Invalid(_)),
        "a run written twice: {e}"
    );
    store.commit(w).unwrap();
    assert_holds(&store, 31, 6, 0);

    // A refused write stores none of its runs: the commit after it is refused too.
    let mut w = store.begin(&claim, &record(31, 6), &listed).unwrap();
    store.write(&mut w, &as_runs(&runs[1..])).unwrap();
    let twice = [runs[0].clone(), runs[1].clone()];
    assert!(store.write(&mut w, &as_runs(&twice)).is_err());
    assert!(matches!(store.commit(w), Err(RemoteError::Invalid(_))));
    assert_holds(&store, 31, 6, 0);

    // A write missing a run is refused at commit, and the record stays as it was.
    let mut w = store.begin(&claim, &record(31, 6), &listed).unwrap();
    let newer = runs_of(31, 0..6, 1);
    store.write(&mut w, &as_runs(&newer[1..])).unwrap();
    let e = store.commit(w).unwrap_err();
    assert!(matches!(e, RemoteError::Invalid(_)), "{e}");
    assert_holds(&store, 31, 6, 0);
    // Its pages are the next owner's to remove.
    store.give_up(&claim).unwrap();
    let keys = cluster.keys();
    let next = store.claim(31, "node-b").unwrap();
    assert_eq!(
        cluster.keys(),
        keys - 2 * 22 - 1 + 1,
        "the 22 orphan pages (and their summaries) of the two refused writes and the emptied pending note removed, a claim added"
    );
    store.give_up(&next).unwrap();
}
