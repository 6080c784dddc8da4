//! A real tierd process: a full session lifecycle checked against the dense oracle, many
//! concurrent clients, and graceful shutdown under load.

mod common;

use std::sync::{Arc, Barrier};
use std::time::Duration;

use common::*;
use kvtier_protocol::client::Client;
use kvtier_protocol::{stats_keys, ErrorCode};

#[test]
fn full_session_lifecycle_matches_the_dense_oracle() {
    let d = Daemon::start(&[]);
    let mut c = d.client();
    let (id, mut sh) = create(&mut c, "lifecycle", 1);
    // Inline append, then a shared-memory append continuing it.
    let p = sh.payload(100);
    assert_eq!(c.append_kv(id, 0, 100, &p).unwrap(), 100);
    let p = sh.payload(57);
    assert_eq!(c.append_kv_shm(id, 100, 57, &p).unwrap(), 157);
    for step in 0..40 {
        for layer in 0..small_geometry().layers as usize {
            let stats = sh.decode(&mut c, id, layer).stats.unwrap();
            assert!(
                stats.bytes_touched > 0 && stats.blocks_ram == stats.blocks_selected,
                "step {step}"
            );
        }
    }
    let info = c.session_info(id).unwrap();
    assert_eq!((info.tokens_min, info.tokens_max), (197, 197));
    assert_eq!(info.label, "lifecycle");
    assert_eq!(info.blocks, 2 * 13, "13 blocks of 16 tokens per layer");
    assert_eq!(info.host_bytes, 26 * 4096);
    let stats = c.stats().unwrap();
    assert_eq!(stats.get(stats_keys::SESSIONS), Some(1));
    assert_eq!(stats.get(stats_keys::HOST_EXTENTS_USED), Some(26));
    assert_eq!(stats.get(stats_keys::DECODE_ENTRIES_TOTAL), Some(80));
    assert_eq!(stats.get(stats_keys::APPEND_TOKENS_TOTAL), Some(157));
    assert_eq!(c.list_sessions().unwrap().len(), 1);
    c.close(id).unwrap();
    let e = c.session_info(id).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::NotFound));
    assert_eq!(
        c.stats().unwrap().get(stats_keys::HOST_EXTENTS_USED),
        Some(0),
        "extents freed"
    );
}

#[test]
fn batch_decode_of_several_sessions_matches_single_decodes() {
    let d = Daemon::start(&[]);
    let mut c = d.client();
    let mut shadows: Vec<(u64, Shadow)> = (0..3)
        .map(|i| open(&mut c, "", 70 + 20 * i as u32, 10 + i))
        .collect();
    for layer in 0..2usize {
        let inputs: Vec<_> = shadows
            .iter_mut()
            .map(|(id, sh)| {
                let pos = sh.tokens(layer);
                let (q, k, v) = sh.step_input(layer);
                (*id, pos, q, k, v)
            })
            .collect();
        let qbs: Vec<Vec<u8>> = inputs.iter().map(|i| f32_bytes(&i.2)).collect();
        let entries: Vec<_> = inputs
            .iter()
            .zip(&qbs)
            .map(|(i, qb)| entry(i.0, i.1, qb, &i.3, &i.4))
            .collect();
        let outs = c.decode_batch(layer as u32, &entries, true).unwrap();
        assert_eq!(outs.len(), 3);
        for ((_, sh), (out, i)) in shadows.iter().zip(outs.iter().zip(&inputs)) {
            sh.check(layer, &i.2, out);
        }
    }
}

#[test]
fn sixty_four_concurrent_clients_all_get_correct_answers() {
    let d = Daemon::with(&["admission.max_concurrent_requests=8"]);
    let rss_before = d.rss();
    let barrier = Arc::new(Barrier::new(64));
    let threads: Vec<_> = (0..64)
        .map(|i| {
            let path = d.path().to_path_buf();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                let mut c = Client::connect(&path).unwrap();
                let (id, mut sh) = open(&mut c, &format!("client-{i}"), 50 + i as u32, 1000 + i);
                barrier.wait();
                for _ in 0..10 {
                    sh.step(&mut c, id);
                }
                id
            })
        })
        .collect();
    let ids: Vec<u64> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let mut sorted = ids.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), 64, "every client got its own session");
    let mut c = d.client();
    let s = c.stats().unwrap();
    assert_eq!(s.get(stats_keys::DECODE_ENTRIES_TOTAL), Some(64 * 20));
    // Memory is bounded by what the sessions hold: extents in use match the tokens stored.
    let extents: u64 = (0..64u64).map(|i| 2 * (50 + i + 10).div_ceil(16)).sum();
    assert_eq!(s.get(stats_keys::HOST_EXTENTS_USED), Some(extents));
    let grown = d.rss().saturating_sub(rss_before);
    assert!(
        grown < 64 << 20,
        "daemon RSS grew by {grown} bytes for {extents} extents"
    );
}

#[test]
fn sigterm_under_load_finishes_in_flight_requests_and_exits_cleanly() {
    let mut d = Daemon::start(&[]);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let workers: Vec<_> = (0..4)
        .map(|i| {
            let path = d.path().to_path_buf();
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut c = Client::connect(&path).unwrap();
                let (id, mut sh) = open(&mut c, "", 300, 77 + i);
                let mut ok = 0u32;
                loop {
                    let pos = sh.tokens(0);
                    let (q, k, v) = sh.step_input(0);
                    let qb = f32_bytes(&q);
                    match c.decode(0, entry(id, pos, &qb, &k, &v), true) {
                        // Every answer that arrives is a correct one.
                        Ok(out) => {
                            sh.check(0, &q, &out);
                            ok += 1;
                        }
                        Err(e) => {
                            assert!(
                                stop.load(std::sync::atomic::Ordering::SeqCst),
                                "error before shutdown: {e}"
                            );
                            return ok;
                        }
                    }
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    d.signal(libc::SIGTERM);
    let status = d.wait(Duration::from_secs(15));
    assert_eq!(status.code(), Some(0), "clean exit");
    assert!(!d.path().exists(), "socket removed");
    for w in workers {
        assert!(
            w.join().unwrap() > 0,
            "each client completed requests before shutdown"
        );
    }
}

/// Only appends and decodes count as use: looking at a session (SESSION_INFO, LIST, PIN and
/// UNPIN) leaves its last access alone, since memory pressure demotes the least recently
/// used sessions first and an operator's `tierctl session info` must not reorder them.
#[test]
fn looking_at_a_session_does_not_make_it_recently_used() {
    let d = Daemon::start(&[]);
    let mut c = d.client();
    let (id, mut sh) = open(&mut c, "", 40, 5);
    let last = |c: &mut Client| c.session_info(id).unwrap().last_access_unix_ms;
    let appended = last(&mut c);
    std::thread::sleep(Duration::from_millis(20));
    c.list_sessions().unwrap();
    c.pin(id, true).unwrap();
    c.pin(id, false).unwrap();
    assert_eq!(last(&mut c), appended, "looking changed the last access");
    sh.step(&mut c, id);
    assert!(last(&mut c) >= appended + 20, "a decode is a use");
}
