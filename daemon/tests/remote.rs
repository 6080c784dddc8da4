//! Two tierd nodes (separate processes and state directories) over a real Redis Cluster on
//! loopback (3 masters, 3 replicas): a session built on one decodes on the other, ownership is
//! one node's at a time, and nothing acknowledged is lost when a node dies. Outputs are checked
//! against the dense oracle ([`Shadow`]). Skips, saying so, where redis-server is not
//! installed.

mod common;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use common::*;
use kvtier_protocol::client::Client;
use kvtier_protocol::{ErrorCode, Request, Response};
use kvtier_tests::redis::RedisCluster;
use kvtier_tests::wire::{frame, hello_frame, read_reply, server_error};

const CLAIM_TTL_MS: u64 = 1500;

/// A node named `name` on `cluster`, with `extra` settings.
fn node(cluster: &RedisCluster, name: &str, extra: &[&str]) -> Tierd {
    remote_node(cluster, name, CLAIM_TTL_MS, None, extra)
}

/// Nodes "node-a" (with `extra` settings) and "node-b" on `cluster`.
fn two_nodes(cluster: &RedisCluster, extra: &[&str]) -> (Tierd, Tierd) {
    (node(cluster, "node-a", extra), node(cluster, "node-b", &[]))
}

/// Retries `f` while it fails with `code` (a claim not yet lapsed), for up to 10 s.
fn until_not<T: std::fmt::Debug>(
    code: ErrorCode,
    mut f: impl FnMut() -> Result<T, kvtier_protocol::client::ClientError>,
) -> Result<T, kvtier_protocol::client::ClientError> {
    let t = Instant::now();
    loop {
        match f() {
            Err(e) if e.code() == Some(code) && t.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(100))
            }
            r => return r,
        }
    }
}

/// A session with the tokens of `sh` (a twin of it) on node `c`, written to the cluster and
/// dropped there; its shadow.
fn offloaded_twin(c: &mut Client, sh: &Shadow, n: u32, seed: u64) -> (u64, Shadow) {
    let id = c
        .create_session(small_geometry(), policy(), "moved")
        .unwrap();
    let payload = Shadow::new(small_geometry(), seed).payload(n as usize);
    c.append_kv(id, 0, n, &payload).unwrap();
    assert_eq!(
        c.offload(id).unwrap(),
        2 * 10,
        "every block of both layers written"
    );
    (id, sh.clone())
}

/// Blocks read from the cluster on node `c` so far: (on demand, streamed, bytes).
fn arrived(c: &mut Client) -> (u64, u64, u64) {
    let s = c.stats().unwrap();
    let get = |k: &str| s.get(k).unwrap_or_else(|| panic!("STATS has no {k}"));
    (
        get("remote_blocks_fetched_total"),
        get("remote_blocks_streamed_total"),
        get("remote_read_bytes_total"),
    )
}

/// A session resumes from its block summaries: its first step runs with only the blocks it
/// keeps read from the cluster, outputs bit-identical to a twin that never moved (and to the
/// dense oracle); the rest is read when a step keeps it, or streams in behind.
#[test]
fn a_session_resumes_from_its_summaries_before_its_blocks_arrive() {
    let Some(cluster) = RedisCluster::start(3, 1) else {
        return;
    };
    let g = small_geometry();
    let (bb, sb) = (
        g.block_bytes() as u64,
        kvtier_storage::summary_bytes(&g, true) as u64,
    );
    // B streams nothing (its host tier counts as past a low-water mark of 0.1%): every block
    // it reads from the cluster is one a step kept. C streams.
    let a = node(&cluster, "node-a", &[]);
    let b = node(&cluster, "node-b", &["nvme.low_water=0.001"]);
    let c = node(&cluster, "node-c", &[]);
    let (mut ca, mut cb, mut cc) = (a.client(), b.client(), c.client());
    let (stay, mut sh) = open(&mut ca, "stay", 150, 7);
    let (moved, mut sh_moved) = offloaded_twin(&mut ca, &sh, 150, 7);

    // B's first step of layer 0: the summaries of all 20 blocks, the runs of its keep-set.
    let out_a = sh.decode(&mut ca, stay, 0);
    let out_b = sh_moved.decode(&mut cb, moved, 0);
    assert_eq!(out_a.out, out_b.out);
    let mut kept: Vec<u32> = out_b.stats.unwrap().selected.concat();
    kept.sort_unstable();
    kept.dedup();
    let kept = kept.len() as u64;
    let (fetched, streamed, bytes) = arrived(&mut cb);
    assert!(
        fetched > 0 && fetched < 10,
        "{fetched} of layer 0's 10 blocks read on demand"
    );
    assert!(
        fetched <= kept,
        "only kept blocks are read ({fetched} read, {kept} kept)"
    );
    assert_eq!(streamed, 0);
    assert_eq!(
        bytes,
        20 * sb + fetched * bb,
        "summaries, then the kept runs"
    );
    // Where its bytes are (protocol version 4): all in the cluster, the kept ones here too.
    let info = cb.session_info(moved).unwrap();
    assert_eq!(info.remote_bytes, 20 * bb);
    assert!(info.host_bytes > 0 && info.host_bytes < 20 * bb);
    assert_eq!(
        ca.session_info(stay).unwrap().remote_bytes,
        0,
        "never written there"
    );
    for step in 0..3 {
        for layer in (step == 0) as usize..2 {
            let out_a = sh.decode(&mut ca, stay, layer);
            let out_b = sh_moved.decode(&mut cb, moved, layer);
            assert_eq!(out_a.out, out_b.out, "step {step} layer {layer}");
        }
    }
    // PROMOTE reads the rest: each block once.
    cb.promote(moved).unwrap();
    let (fetched, streamed, bytes) = arrived(&mut cb);
    assert_eq!((fetched, streamed, bytes), (20, 0, 20 * sb + 20 * bb));

    // On to C (B's new tokens written first): its first step is served at once, and the
    // blocks no step kept stream in behind.
    assert_eq!(
        cb.offload(moved).unwrap(),
        2,
        "the tail block of each layer"
    );
    let out_a = sh.decode(&mut ca, stay, 0);
    let out_c = sh_moved.decode(&mut cc, moved, 0);
    assert_eq!(out_a.out, out_c.out);
    let t = Instant::now();
    while arrived(&mut cc).0 + arrived(&mut cc).1 < 20 && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let (fetched, streamed, bytes) = arrived(&mut cc);
    assert_eq!(fetched + streamed, 20, "every block arrived once");
    assert_eq!(bytes, 20 * sb + 20 * bb);
    for layer in 1..2 {
        let out_a = sh.decode(&mut ca, stay, layer);
        let out_c = sh_moved.decode(&mut cc, moved, layer);
        assert_eq!(out_a.out, out_c.out, "layer {layer}");
    }
    assert_eq!(cc.session_info(moved).unwrap().tokens_max, 154);
}

/// The session's stored tokens as node `c` sees it after a PROMOTE (which resumes it there if
/// the node does not hold it).
fn tokens_on(c: &mut Client, id: u64) -> u64 {
    c.promote(id).unwrap();
    c.session_info(id).unwrap().tokens_max
}

#[test]
fn a_session_built_on_one_node_decodes_on_another_with_identical_outputs() {
    let Some(cluster) = RedisCluster::start(3, 1) else {
        return;
    };
    let a = node(&cluster, "node-a", &[]);
    let port = free_port();
    // B reads every page before serving (the resume from summaries: the next test).
    let b = node(
        &cluster,
        "node-b",
        &[
            &format!("metrics.listen=\"127.0.0.1:{port}\""),
            "remote.resume_from_summaries=false",
        ],
    );
    let (mut ca, mut cb) = (a.client(), b.client());

    // Two sessions with the same tokens on A: one stays, one moves to the cluster.
    let (stay, mut sh) = open(&mut ca, "stay", 150, 7);
    let moved = ca
        .create_session(small_geometry(), policy(), "moved")
        .unwrap();
    let mut sh_moved = sh.clone();
    let payload: Vec<u8> = {
        let mut again = Shadow::new(small_geometry(), 7);
        again.payload(150)
    };
    ca.append_kv(moved, 0, 150, &payload).unwrap();
    sh.step(&mut ca, stay);
    sh_moved.step(&mut ca, moved);
    let blocks = ca.offload(moved).unwrap();
    assert_eq!(
        blocks,
        2 * 10,
        "every block of both layers written (151 tokens)"
    );
    assert_eq!(
        ca.session_info(moved).unwrap_err().code(),
        Some(ErrorCode::NotFound),
        "A dropped its copy"
    );

    // B resumes it on first use. The two shadows draw the same step inputs: the session that
    // moved gives the same output, bit for bit, as the one that stayed, and both match the
    // dense oracle.
    for step in 0..3 {
        for layer in 0..2 {
            let out_a = sh.decode(&mut ca, stay, layer);
            let out_b = sh_moved.decode(&mut cb, moved, layer);
            assert_eq!(out_a.out, out_b.out, "step {step} layer {layer}");
            assert_eq!(out_a.stats.unwrap().selected, out_b.stats.unwrap().selected);
        }
    }
    assert_eq!(cb.session_info(moved).unwrap().tokens_max, 154);
    let (sa, sb) = (ca.stats().unwrap(), cb.stats().unwrap());
    assert_eq!(sa.get("remote_offloads_total"), Some(1));
    assert_eq!(sa.get("remote_blocks_written_total"), Some(20));
    assert_eq!(sb.get("remote_resumes_total"), Some(1));
    assert_eq!(sb.get("remote_claims"), Some(1));
    assert_eq!(
        sb.get("remote_read_bytes_total"),
        Some(20 * small_geometry().block_bytes() as u64)
    );
    let m = scrape(port);
    assert_eq!(m["kvtier_remote_resumes_total"], 1.0);
    assert_eq!(m["kvtier_remote_claims"], 1.0);
    assert_eq!(
        m["kvtier_link_moved_bytes_total{link=\"remote_to_host\"}"],
        sb.get("remote_read_bytes_total").unwrap() as f64
    );

    // A asking for it is told which node owns it now: the node's name (protocol version 3),
    // or a sentence naming it to a version 2 client.
    let (code, message) = server_error(ca.promote(moved));
    assert_eq!(
        (code, message.as_str()),
        (ErrorCode::OwnedElsewhere, "node-b")
    );
    let mut v2 = UnixStream::connect(a.path()).unwrap();
    v2.write_all(&hello_frame(1, 2, 2, "v2")).unwrap();
    match read_reply(&mut v2) {
        Some((_, Response::Hello(h))) => assert_eq!(h.version, 2),
        other => panic!("expected a HELLO reply, got {other:?}"),
    }
    v2.write_all(&frame(&Request::Promote { session: moved }, 2))
        .unwrap();
    match read_reply(&mut v2) {
        Some((_, Response::Error(e))) => {
            assert_eq!(e.code, ErrorCode::FailedPrecondition);
            assert_eq!(e.message, "the session is owned by node node-b");
        }
        other => panic!("expected FAILED_PRECONDITION, got {other:?}"),
    }

    // B gives it back to the cluster; A resumes it with B's tokens.
    cb.offload(moved).unwrap();
    assert_eq!(tokens_on(&mut ca, moved), 154);
    sh_moved.step(&mut ca, moved);

    // CLOSE deletes it from the cluster too: no node finds it any more.
    ca.close(moved).unwrap();
    assert_eq!(code_of(cb.promote(moved)), ErrorCode::NotFound);
}

fn code_of<T: std::fmt::Debug>(r: Result<T, kvtier_protocol::client::ClientError>) -> ErrorCode {
    server_error(r).0
}

#[test]
fn a_node_killed_mid_append_under_write_through_loses_no_acknowledged_token() {
    let Some(cluster) = RedisCluster::start(3, 1) else {
        return;
    };
    let a = node(&cluster, "node-a", &["remote.write_through=true"]);
    let (id, mut sh) = {
        let mut ca = a.client();
        open(&mut ca, "appends", 40, 3)
    };
    // Appends of 1 to 3 tokens from a client thread until A is SIGKILLed under it.
    let socket = a.path().to_path_buf();
    let appender = std::thread::spawn(move || {
        let mut c = Client::connect(&socket).unwrap();
        let mut acknowledged = sh.tokens(0);
        for i in 0.. {
            let n = 1 + i % 3;
            let p = sh.payload(n as usize);
            match c.append_kv(id, acknowledged, n as u32, &p) {
                Ok(len) => acknowledged = len,
                Err(_) => return (acknowledged, sh),
            }
        }
        unreachable!()
    });
    std::thread::sleep(Duration::from_millis(700));
    a.signal(libc::SIGKILL);
    let (acknowledged, mut sh) = appender.join().unwrap();
    assert!(
        acknowledged > 40,
        "no append was acknowledged before the kill"
    );

    // B takes the session once A's claim lapses, with every acknowledged token (and perhaps
    // the one append in flight, written to the cluster before its reply was lost).
    let b = node(&cluster, "node-b", &[]);
    let mut cb = b.client();
    until_not(ErrorCode::OwnedElsewhere, || cb.promote(id)).unwrap();
    let held = cb.session_info(id).unwrap().tokens_max;
    assert!(
        held >= acknowledged && held <= acknowledged + 3,
        "B holds {held} tokens; {acknowledged} were acknowledged"
    );
    sh.truncate(held);
    sh.step(&mut cb, id);
}

#[test]
fn a_paused_owner_is_fenced_and_a_cut_off_one_refuses_appends() {
    let Some(cluster) = RedisCluster::start(3, 1) else {
        return;
    };
    let (a, b) = two_nodes(&cluster, &["remote.write_through=true"]);
    let (mut ca, mut cb) = (a.client(), b.client());
    let (id, mut sh) = open(&mut ca, "paused", 40, 5);

    // A pauses past its claim (a stop-the-world pause, a partition that heals): B takes the
    // session meanwhile and extends it.
    a.signal(libc::SIGSTOP);
    std::thread::sleep(Duration::from_millis(CLAIM_TTL_MS + 300));
    until_not(ErrorCode::OwnedElsewhere, || cb.promote(id)).unwrap();
    sh.step(&mut cb, id);
    a.signal(libc::SIGCONT);

    // A's late append is refused (its claim is fenced; A learns B owns the session) and
    // nothing of it reaches B's copy.
    let late = sh.clone().payload(1);
    let (code, message) = server_error(ca.append_kv(id, 40, 1, &late));
    assert!(
        (code == ErrorCode::OwnedElsewhere && message == "node-b")
            || (code == ErrorCode::Unavailable && message.contains("claim")),
        "{code:?}: {message}"
    );
    assert_eq!(cb.session_info(id).unwrap().tokens_max, 41);
    sh.step(&mut cb, id);

    // B cut off from the cluster (every Redis node gone): once its claim lapses, its appends
    // are refused with a typed error, not run where a new owner might also run them.
    for n in cluster.nodes.iter().map(|n| n.port).collect::<Vec<_>>() {
        cluster.kill(n);
    }
    std::thread::sleep(Duration::from_millis(CLAIM_TTL_MS + 300));
    let p = sh.clone().payload(1);
    let (code, message) = server_error(cb.append_kv(id, 42, 1, &p));
    assert_eq!(code, ErrorCode::Unavailable, "{message}");
    assert!(message.contains("claim"), "{message}");
}

#[test]
fn without_write_through_a_dead_node_loses_at_most_a_flush_interval() {
    let Some(cluster) = RedisCluster::start(3, 1) else {
        return;
    };
    // Claims renewed every 500 ms; sessions written to the cluster at each renewal.
    let a = node(&cluster, "node-a", &["remote.flush_interval_ms=300"]);
    let (id, mut sh) = {
        let mut ca = a.client();
        let (id, mut sh) = open(&mut ca, "flushed", 40, 9);
        ca.append_kv(id, 40, 10, &sh.payload(10)).unwrap();
        (id, sh)
    };
    std::thread::sleep(Duration::from_millis(1500));
    a.signal(libc::SIGKILL);

    let b = node(&cluster, "node-b", &[]);
    let mut cb = b.client();
    until_not(ErrorCode::OwnedElsewhere, || cb.promote(id)).unwrap();
    assert_eq!(cb.session_info(id).unwrap().tokens_max, 50);
    sh.step(&mut cb, id);
}

#[test]
fn a_clean_shutdown_hands_every_unpinned_session_to_the_cluster() {
    let Some(cluster) = RedisCluster::start(3, 1) else {
        return;
    };
    let mut a = node(&cluster, "node-a", &[]);
    let mut ca = a.client();
    let (moved, mut sh) = open(&mut ca, "moved", 70, 4);
    let (pinned, _) = open(&mut ca, "pinned", 20, 5);
    ca.pin(pinned, true).unwrap();
    drop(ca);
    assert_eq!(a.terminate().code(), Some(0), "clean exit");

    // B takes it at once (A gave its claim up) with every token; the pinned one stayed on A.
    let b = node(&cluster, "node-b", &[]);
    let mut cb = b.client();
    assert_eq!(tokens_on(&mut cb, moved), 70);
    sh.step(&mut cb, moved);
    assert_eq!(code_of(cb.promote(pinned)), ErrorCode::NotFound);
}

#[test]
fn a_damaged_page_fails_the_resume_with_data_loss_and_leaves_the_session_unclaimed() {
    let Some(cluster) = RedisCluster::start(3, 1) else {
        return;
    };
    // A and B read every page before serving; C resumes from summaries.
    let a = node(&cluster, "node-a", &["remote.resume_from_summaries=false"]);
    let b = node(&cluster, "node-b", &["remote.resume_from_summaries=false"]);
    let c = node(&cluster, "node-c", &[]);
    let (mut ca, mut cb, mut cc) = (a.client(), b.client(), c.client());
    let (id, _) = open(&mut ca, "damaged", 600, 6);
    ca.offload(id).unwrap();
    // One byte of a key (`what`: page or sum) of layer 1, block `block` changed in the cluster.
    let damage = |what: &str, block: u32| {
        let pattern = format!("kvtier:{what}:{id}:1:{block}:*");
        let (port, key) = cluster
            .masters()
            .into_iter()
            .find_map(|p| {
                let keys = cluster.cli(p, &["--scan", "--pattern", &pattern]).ok()?;
                Some((p, keys.lines().next()?.to_string()))
            })
            .expect("the key");
        cluster.cli(port, &["setrange", &key, "200", "X"]).unwrap();
    };
    // The page of layer 1, block 30: late in the pull.
    damage("page", 30);

    let (code, message) = server_error(cb.promote(id));
    assert_eq!(code, ErrorCode::DataLoss, "{message}");
    assert!(message.contains("layer 1 block 30"), "{message}");
    assert_eq!(cb.stats().unwrap().get("remote_claims"), Some(0));
    assert_eq!(
        cb.list_sessions().unwrap().len(),
        0,
        "nothing half-restored is served"
    );
    // The claim was given up: the other node gets the same answer, not "owned by".
    assert_eq!(code_of(ca.promote(id)), ErrorCode::DataLoss);

    // From summaries, the session is served; the damaged block answers DATA_LOSS when it is
    // read (here by PROMOTE), never wrong data, and the rest stays readable.
    let (code, message) = server_error(cc.promote(id));
    assert_eq!(code, ErrorCode::DataLoss, "{message}");
    assert!(message.contains("layer 1 block 30"), "{message}");
    assert_eq!(cc.list_sessions().unwrap().len(), 1);
    assert_eq!(cc.session_info(id).unwrap().tokens_max, 600);
    // A damaged summary fails the resume itself, and leaves the session unclaimed.
    assert_eq!(cc.offload(id).unwrap(), 0, "nothing new to write");
    damage("sum", 2);
    let (code, message) = server_error(cc.promote(id));
    assert_eq!(code, ErrorCode::DataLoss, "{message}");
    assert!(message.contains("layer 1 block 2"), "{message}");
    assert_eq!(cc.stats().unwrap().get("remote_claims"), Some(0));
    assert_eq!(cc.list_sessions().unwrap().len(), 0);
}

#[test]
fn a_session_demoted_to_nvme_is_offloaded_from_its_pages() {
    let Some(cluster) = RedisCluster::start(3, 1) else {
        return;
    };
    let (a, b) = two_nodes(&cluster, &[]);
    let (mut ca, mut cb) = (a.client(), b.client());
    // 3,000 tokens: 188 blocks a layer, read back from NVMe in batches for the offload.
    let (id, mut sh) = open(&mut ca, "cold", 3000, 8);
    assert!(ca.demote(id).unwrap() > 0);
    assert_eq!(
        ca.session_info(id).unwrap().host_bytes,
        0,
        "every block on NVMe"
    );
    assert_eq!(ca.offload(id).unwrap(), 2 * 188);
    sh.step(&mut cb, id);
    assert_eq!(cb.session_info(id).unwrap().tokens_max, 3001);
}

/// A full NVMe tier moves idle sessions to the cluster: the write that found it full goes
/// through, the moved session stays on its node and decodes as before (its blocks read from
/// the cluster when a step keeps them), and a pinned session is never moved.
#[test]
fn a_full_nvme_tier_moves_idle_sessions_to_the_cluster() {
    let Some(cluster) = RedisCluster::start(3, 1) else {
        return;
    };
    // 12 pages of 8 KiB; a session of 64 tokens takes 8 (4 blocks in each of 2 layers).
    let a = node(&cluster, "node-a", &["nvme.capacity=\"96KiB\""]);
    let mut c = a.client();
    let (idle, mut idle_sh) = open(&mut c, "idle", 64, 3);
    let (twin, mut twin_sh) = open(&mut c, "twin", 64, 3);
    c.demote(idle).unwrap();
    assert!(c.session_info(idle).unwrap().nvme_bytes > 0);
    // The twin's DEMOTE finds the page store full: the idle session moves to the cluster.
    c.demote(twin).unwrap();
    let s = c.stats().unwrap();
    assert_eq!(s.get("remote_demotions_total"), Some(1));
    let info = c.session_info(idle).unwrap();
    assert_eq!(
        (info.nvme_bytes, info.host_bytes),
        (0, 0),
        "only in the cluster now"
    );
    // Both decode as before, bit for bit alike (and against the oracle).
    for layer in 0..2 {
        let a = idle_sh.decode(&mut c, idle, layer);
        let b = twin_sh.decode(&mut c, twin, layer);
        assert_eq!(a.out, b.out, "layer {layer}");
    }
    assert!(
        c.stats()
            .unwrap()
            .get("remote_blocks_fetched_total")
            .unwrap()
            > 0
    );
    assert_eq!(
        c.stats().unwrap().get("remote_blocks_streamed_total"),
        Some(0),
        "not streamed back"
    );

    // A pinned session stays: with nothing else to move, the page store stays full.
    let b = node(&cluster, "node-b", &["nvme.capacity=\"96KiB\""]);
    let mut cb = b.client();
    let (pinned, _) = open(&mut cb, "pinned", 64, 4);
    let (other, _) = open(&mut cb, "other", 64, 5);
    cb.demote(pinned).unwrap();
    cb.pin(pinned, true).unwrap();
    assert_eq!(code_of(cb.demote(other)), ErrorCode::ResourceExhausted);
    assert!(cb.session_info(pinned).unwrap().nvme_bytes > 0);
    assert_eq!(cb.stats().unwrap().get("remote_demotions_total"), Some(0));
}

/// A session still arriving from the cluster is written to NVMe whole: an append under
/// `nvme.write_through` reads its blocks that are only in the cluster, so the NVMe copy alone
/// brings the session back (here after SIGKILL, on a node without the remote tier).
#[test]
fn an_arriving_session_is_written_to_nvme_whole() {
    let Some(cluster) = RedisCluster::start(3, 1) else {
        return;
    };
    let a = node(&cluster, "node-a", &[]);
    let mut ca = a.client();
    // 150 blocks a layer: more than one batch of the NVMe write (256 blocks).
    let (id, mut sh) = open(&mut ca, "arriving", 2400, 7);
    ca.offload(id).unwrap();
    // B streams nothing: the blocks no step keeps stay only in the cluster.
    let b = node(
        &cluster,
        "node-b",
        &["nvme.write_through=true", "nvme.low_water=0.001"],
    );
    let mut cb = b.client();
    sh.decode(&mut cb, id, 0);
    sh.decode(&mut cb, id, 1);
    // An append, durable on NVMe before it is acknowledged.
    let payload = sh.payload(1);
    assert_eq!(cb.append_kv(id, 2401, 1, &payload).unwrap(), 2402);
    let s = cb.stats().unwrap();
    let fetched = s.get("remote_blocks_fetched_total").unwrap();
    assert!(fetched < 20, "{fetched} blocks read for the steps");
    let blocks = 2 * 151;
    assert_eq!(s.get("remote_blocks_streamed_total"), Some(0));
    assert_eq!(
        s.get("remote_read_bytes_total").unwrap()
            - 2 * 150 * kvtier_storage::summary_bytes(&small_geometry(), true) as u64,
        (blocks - 2) * small_geometry().block_bytes() as u64,
        "every run read once: the kept ones for the step, the rest for the NVMe write"
    );
    drop(cb);
    let dir = b.stop(true);
    let c = harness().dir(dir).start();
    let mut cc = c.client();
    assert_eq!(cc.session_info(id).unwrap().tokens_max, 2402);
    for layer in [0, 1] {
        sh.decode(&mut cc, id, layer);
    }
}
