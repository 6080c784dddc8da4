//! LEASE / RELEASE over real sockets, with a real engine process: it maps the daemon's shared
//! host arena and reads a session's block runs in place, which must equal the runs built from
//! what was appended (an independent oracle: the shadow's rows, laid out per the geometry).
//! While it holds the lease nothing may free those runs; killed with SIGKILL, its lease ends
//! and the daemon serves on; a restarted daemon is a typed error on the engine's connection.

mod common;

use std::io::{BufRead, BufReader};
use std::process::Child;
use std::time::{Duration, Instant};

use common::*;
use kvtier_protocol::client::ClientError;
use kvtier_protocol::lease::ArenaView;
use kvtier_protocol::ErrorCode;

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// The run of `(layer, block)` built from the shadow's rows: every KV head's K tile then V
/// tile, rows past the stored tokens zero.
fn expected_run(sh: &Shadow, layer: usize, block: usize) -> Vec<u8> {
    let g = sh.g;
    let (bt, hkv, d) = (
        g.block_tokens as usize,
        g.kv_heads as usize,
        g.head_dim as usize,
    );
    let mut run = vec![0u8; g.block_bytes()];
    let tokens = sh.tokens(layer) as usize;
    for slot in 0..bt {
        let t = block * bt + slot;
        if t >= tokens {
            break;
        }
        for h in 0..hkv {
            let row = (t * hkv + h) * d;
            let k = g.dtype.encode_vec(&sh.k[layer][row..row + d]);
            let v = g.dtype.encode_vec(&sh.v[layer][row..row + d]);
            let (ko, vo) = (g.k_row_offset(h, slot), g.v_row_offset(h, slot));
            run[ko..ko + k.len()].copy_from_slice(&k);
            run[vo..vo + v.len()].copy_from_slice(&v);
        }
    }
    run
}

/// The engine process's part (this test binary, re-run with `KVTIER_LEASE_ENGINE` set to
/// `<socket> <session>`): lease the session, map the arena, print `layer block hash` for each
/// run it reads in place, then `ready`, and hold the lease until stdin closes.
#[test]
#[ignore = "run as an engine process by the tests below"]
fn engine_process() {
    let Some(engine) = engine_lease("KVTIER_LEASE_ENGINE", "lease-engine") else {
        return;
    };
    let lease = &engine.lease;
    let view = ArenaView::map(engine.fd, lease).unwrap();
    for (l, layer) in lease.layers.iter().enumerate() {
        for b in 0..layer.offsets.len() {
            let run = view.run(lease, l, b).expect("a hot block");
            println!("run {l} {b} {:016x}", fnv1a(run));
        }
    }
    println!("ready {:016x}", lease.instance);
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

/// Starts the engine process on session `id` and reads its output up to `ready`: the run
/// hashes it read, and the daemon instance its lease named.
fn spawn_engine(d: &Daemon, id: u64) -> (Child, Vec<(usize, usize, u64)>, u64) {
    let mut child = spawn_engine_process(d, "KVTIER_LEASE_ENGINE", id);
    let mut runs = Vec::new();
    let out = BufReader::new(child.stdout.take().unwrap());
    for line in out.lines() {
        let line = line.unwrap();
        // The harness prints "test engine_process ... " before the first line of ours.
        let w: Vec<&str> = line.split_whitespace().collect();
        let ours = w.iter().position(|&t| t == "run" || t == "ready");
        match ours.map_or(&[][..], |i| &w[i..]) {
            ["run", l, b, h] => runs.push((
                l.parse().unwrap(),
                b.parse().unwrap(),
                u64::from_str_radix(h, 16).unwrap(),
            )),
            ["ready", inst] => return (child, runs, u64::from_str_radix(inst, 16).unwrap()),
            _ => {}
        }
    }
    panic!(
        "the engine process ended before it was ready: {:?}",
        child.wait()
    );
}

#[test]
fn lease_needs_the_shared_arena_and_release_needs_a_lease() {
    let d = Daemon::start(&[]);
    let mut c = d.client();
    let (id, _) = open(&mut c, "private", 40, 1);
    let e = c.lease(id).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::FailedPrecondition), "{e}");
    assert!(e.to_string().contains("host.shared"), "{e}");
    let d = shared_harness().start();
    let mut c = d.client();
    let (id, _) = open(&mut c, "shared", 40, 1);
    let e = c.release(id).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::FailedPrecondition), "{e}");
    assert_eq!(
        c.lease(id + 1000).unwrap_err().code(),
        Some(ErrorCode::NotFound)
    );
}

/// Only trusted engines may map the arena: a second uid, not an admin, is PERMISSION_DENIED
/// even for its own session.
#[test]
fn a_non_admin_uid_cannot_lease() {
    if !can_run_second_uid() {
        return;
    }
    let d = shared_harness().start();
    run_tenant("lease_as_nobody", &d, &[]);
}

/// The second-uid half of `a_non_admin_uid_cannot_lease`.
#[test]
#[ignore = "run as a second uid by a_non_admin_uid_cannot_lease"]
fn lease_as_nobody() {
    let Some(mut c) = tenant() else { return };
    let (id, _) = open(&mut c, "mine", 20, 5);
    let e = c.lease(id).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::PermissionDenied), "{e}");
    assert!(e.to_string().contains("admin"), "{e}");
    println!("tenant done");
}

#[test]
fn an_engine_reads_runs_in_place_and_holds_them_until_it_is_killed() {
    let d = shared_harness().start();
    let mut c = d.client();
    let (id, mut sh) = open(&mut c, "leased", 600, 7);
    let (mut engine, runs, _) = spawn_engine(&d, id);
    let g = sh.g;
    let blocks = g.blocks_for(600) as usize;
    assert_eq!(runs.len(), g.layers as usize * blocks, "every run is hot");
    for &(l, b, hash) in &runs {
        assert_eq!(
            hash,
            fnv1a(&expected_run(&sh, l, b)),
            "layer {l} block {b}: the engine read what was appended"
        );
    }

    // While it holds the lease, nothing frees the runs it reads; decoding goes on.
    for op in ["demote", "close"] {
        let e = match op {
            "demote" => c.demote(id).map(|_| ()).unwrap_err(),
            _ => c.close(id).unwrap_err(),
        };
        assert_eq!(e.code(), Some(ErrorCode::FailedPrecondition), "{op}: {e}");
        assert!(e.to_string().contains("leased"), "{e}");
    }
    sh.step(&mut c, id);

    // Killed mid-lease: the kernel closes its socket and the daemon reclaims the lease.
    engine.kill().unwrap();
    engine.wait().unwrap();
    let t0 = Instant::now();
    let freed = loop {
        match c.demote(id) {
            Ok(n) => break n,
            Err(e) if e.code() == Some(ErrorCode::FailedPrecondition) => {
                assert!(
                    t0.elapsed() < Duration::from_secs(10),
                    "lease never reclaimed"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("{e}"),
        }
    };
    assert!(freed > 0);
    assert_eq!(c.session_info(id).unwrap().host_bytes, 0);
    // The daemon serves on: the session decodes (from NVMe) against the oracle.
    sh.step(&mut c, id);
    c.close(id).unwrap();
}

#[test]
fn a_released_lease_frees_the_session_and_a_restart_is_a_typed_error() {
    let d = shared_harness().start();
    let mut c = d.client();
    let (id, sh) = open(&mut c, "restart", 100, 3);
    let mut engine = d.client_as("engine");
    let (first, _fd) = engine.lease(id).unwrap();
    // A second LEASE on the same connection refreshes the table; one RELEASE ends it.
    let (again, _fd2) = engine.lease(id).unwrap();
    assert_eq!(again, first);
    engine.release(id).unwrap();
    assert!(c.demote(id).unwrap() > 0, "released: demotable");
    c.promote(id).unwrap();
    // The refreshed table names where the promoted runs are now, wherever that is.
    let (before, fd) = engine.lease(id).unwrap();
    let view = ArenaView::map(fd, &before).unwrap();
    for (l, layer) in before.layers.iter().enumerate() {
        for b in 0..layer.offsets.len() {
            let run = view.run(&before, l, b).expect("promoted: hot");
            assert_eq!(run, &expected_run(&sh, l, b)[..], "layer {l} block {b}");
        }
    }
    drop(view);

    // The daemon restarts: the engine's connection fails with a typed error, never a hang or
    // a table of the old arena; a new lease names another instance.
    drop(c);
    engine.set_timeout(Some(Duration::from_secs(10))).unwrap();
    let d = shared_harness().dir(d.stop(false)).start();
    let e = engine.lease(id).unwrap_err();
    assert!(
        matches!(e, ClientError::Closed | ClientError::Io(_)),
        "a closed connection, got {e:?}"
    );
    let (after, _fd) = d.client_as("engine").lease(id).unwrap();
    assert_ne!(after.instance, before.instance);
    assert_eq!(after.layers.len(), before.layers.len());
}

#[test]
fn memory_pressure_passes_over_a_leased_session() {
    // 96 runs of 4 KiB; each session below holds 2 x 20 = 40 of them.
    let d = shared_harness().set("host.capacity=\"384KiB\"").start();
    let mut c = d.client();
    let (leased, mut sh) = open(&mut c, "leased", 320, 11);
    let mut engine = d.client_as("engine");
    let (table, fd) = engine.lease(leased).unwrap();
    let view = ArenaView::map(fd, &table).unwrap();
    let before: Vec<u64> = (0..2)
        .flat_map(|l| (0..20).map(move |b| (l, b)))
        .map(|(l, b)| fnv1a(view.run(&table, l, b).unwrap()))
        .collect();
    // Three more sessions overflow the tier: pressure demotes the others, never the leased one.
    let others: Vec<_> = (0..3).map(|i| open(&mut c, "", 320, 20 + i)).collect();
    let stats = c.stats().unwrap();
    assert!(stats.get("demotions_total").unwrap() >= 2, "{stats:?}");
    assert_eq!(c.session_info(leased).unwrap().host_bytes, 40 * 4096);
    let after: Vec<u64> = (0..2)
        .flat_map(|l| (0..20).map(move |b| (l, b)))
        .map(|(l, b)| fnv1a(view.run(&table, l, b).unwrap()))
        .collect();
    assert_eq!(after, before, "the runs the engine maps are untouched");
    // Released, it is the least recently used again: the next pressure may demote it.
    engine.release(leased).unwrap();
    sh.step(&mut c, leased);
    for (id, mut s) in others {
        s.step(&mut c, id);
    }
}

/// A table too large for one frame is RESOURCE_EXHAUSTED and takes no lease: nothing then
/// keeps the session from being demoted.
#[test]
fn a_lease_whose_table_exceeds_a_frame_takes_no_lease() {
    use std::os::fd::AsFd;

    let d = shared_harness()
        .set("server.max_frame_bytes=\"4KiB\"")
        .start();
    let mut c = d.client();
    let (id, mut sh) = create(&mut c, "long", 9);
    // 5000 tokens: 313 blocks in each of 2 layers, a 5 KB table. Through a memfd: the inline
    // payload would not fit a 4 KiB frame either.
    let p = sh.payload(5000);
    let f = kvtier_protocol::fdpass::sealed_memfd(c"lease-table", &p).unwrap();
    c.append_kv_fd(id, 0, 5000, f.as_fd(), 0, p.len() as u64)
        .unwrap();
    let e = c.lease(id).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::ResourceExhausted), "{e}");
    assert!(e.to_string().contains("max_frame_bytes"), "{e}");
    c.demote(id).unwrap();
    let e = c.release(id).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::FailedPrecondition), "{e}");
}
