//! RESERVE / COMMIT over real sockets: an engine appends by writing rows in place, through its
//! own mapping of the daemon's shared arena (what a GPU's DMA into the registered arena does).
//! The committed session must hold exactly what APPEND_KV of the same rows gives (a twin
//! session, compared run by run) and decode like the dense oracle; every wrong request is a
//! typed error that changes nothing; an engine killed mid-append leaves the session as it was.

mod common;

use std::io::{BufRead, BufReader};
use std::os::fd::OwnedFd;

use common::*;
use kvtier_protocol::client::Client;
use kvtier_protocol::{ErrorCode, Geometry, LeaseReply, ReserveReply};

/// The arena descriptor of a LEASE mapped writable, as an engine that DMAs into it maps it.
fn map_writable(fd: OwnedFd, lease: &LeaseReply) -> memmap2::MmapMut {
    let file = std::fs::File::from(fd);
    // SAFETY: the daemon's memfd is sealed against shrinking; the map lives for the test.
    unsafe {
        memmap2::MmapOptions::new()
            .len(lease.arena_bytes as usize)
            .map_mut(&file)
    }
    .unwrap()
}

/// Writes an APPEND_KV payload of `n` tokens (`[layer][k|v][n][kv_heads][head_dim]`) where
/// RESERVE's reply says each row goes.
fn write_rows(map: &mut [u8], g: &Geometry, r: &ReserveReply, payload: &[u8], n: usize) {
    let (row, hkv, tb) = (g.row_bytes(), g.kv_heads as usize, g.token_bytes());
    for (l, offsets) in r.layers.iter().enumerate() {
        let k = &payload[2 * l * n * tb..(2 * l + 1) * n * tb];
        let v = &payload[(2 * l + 1) * n * tb..(2 * l + 2) * n * tb];
        for i in 0..n {
            for h in 0..hkv {
                let (ko, vo) = kvtier_storage::in_place_row(g, offsets, r.start, i as u64, h);
                let src = (i * hkv + h) * row;
                map[ko as usize..ko as usize + row].copy_from_slice(&k[src..src + row]);
                map[vo as usize..vo as usize + row].copy_from_slice(&v[src..src + row]);
            }
        }
    }
}

/// Every run of a session, read through a fresh lease (released after).
fn runs(c: &mut Client, id: u64) -> Vec<Vec<u8>> {
    let (lease, fd) = c.lease(id).unwrap();
    let map = map_writable(fd, &lease);
    let rb = lease.run_bytes as usize;
    let out = lease
        .layers
        .iter()
        .flat_map(|l| l.offsets.iter())
        .map(|&o| map[o as usize..o as usize + rb].to_vec())
        .collect();
    c.release(id).unwrap();
    out
}

#[test]
fn rows_written_in_place_equal_an_append_of_them_and_decode_like_the_oracle() {
    // Committed at once, and layer 1 first (then the rest): the same session either way.
    for by_layer in [false, true] {
        let d = shared_harness().start();
        let mut c = d.client();
        // Twin sessions with the same rows: one appended through APPEND_KV, one in place. 40
        // tokens then 25: the append starts inside a block and opens two.
        let (twin, mut tsh) = open(&mut c, "append", 40, 7);
        let (id, mut sh) = open(&mut c, "in place", 40, 7);
        let g = sh.g;
        let payload = tsh.payload(25);
        assert_eq!(sh.payload(25), payload);
        c.append_kv(twin, 40, 25, &payload).unwrap();

        let (lease, fd) = c.lease(id).unwrap();
        let mut map = map_writable(fd, &lease);
        let r = c.reserve(id, 25).unwrap();
        assert_eq!((r.start, r.tokens), (40, 25));
        assert_eq!(r.layers.len(), g.layers as usize);
        // Block 2 (the partial tail, rows 32..48) and the two it opens.
        assert!(r.layers.iter().all(|o| o.len() == 3), "{:?}", r.layers);
        assert_eq!(r.layers[0][0], lease.layers[0].offsets[2], "the tail run");
        write_rows(&mut map, &g, &r, &payload, 25);
        // Until COMMIT the session still holds 40 tokens.
        assert_eq!(c.session_info(id).unwrap().tokens_max, 40);
        if by_layer {
            // Layer 1 is checked and summarized, but every layer still holds 40 tokens and
            // the session takes no decode until the last layer is committed.
            assert_eq!(c.commit_layers(id, 25, 1, 1).unwrap(), 40);
            let info = c.session_info(id).unwrap();
            assert_eq!((info.tokens_min, info.tokens_max), (40, 40));
            let (q, k, v) = sh.step_input(0);
            let e = c
                .decode(0, entry(id, 40, &f32_bytes(&q), &k, &v), false)
                .unwrap_err();
            assert!(e.to_string().contains("RESERVE"), "{e}");
            sh.truncate(65); // the shadow keeps the 25 rows, not the refused step's
        }
        // A COMMIT without layers takes every layer not yet committed.
        assert_eq!(c.commit(id, 25).unwrap(), 65);
        c.release(id).unwrap();

        assert_eq!(
            runs(&mut c, id),
            runs(&mut c, twin),
            "in place == APPEND_KV (by layer: {by_layer})"
        );
        for _ in 0..3 {
            sh.step(&mut c, id);
            tsh.step(&mut c, twin);
        }
        let stats = c.stats().unwrap();
        assert_eq!(stats.get("append_tokens_total"), Some(2 * (40 + 25)));
    }
}

#[test]
fn a_wrong_commit_of_some_layers_ends_the_append_with_nothing_appended() {
    let d = shared_harness().start();
    let mut c = d.client();
    let code = |e: kvtier_protocol::client::ClientError| e.code().unwrap();
    let (id, mut sh) = open(&mut c, "s", 40, 5);
    let (lease, fd) = c.lease(id).unwrap();
    let mut map = map_writable(fd, &lease);
    let more = sh.payload(8);
    // A layer committed twice, no layer, other token counts, a layer past the last.
    for bad in [
        [(0, 1, 8), (0, 1, 8)],
        [(0, 1, 8), (1, 0, 8)],
        [(1, 1, 8), (0, 1, 7)],
        [(0, 1, 8), (1, 2, 8)],
    ] {
        let r = c.reserve(id, 8).unwrap();
        write_rows(&mut map, &sh.g, &r, &more, 8);
        let (first, count, tokens) = bad[0];
        assert_eq!(c.commit_layers(id, tokens, first, count).unwrap(), 40);
        let (first, count, tokens) = bad[1];
        let e = c.commit_layers(id, tokens, first, count).unwrap_err();
        assert_eq!(code(e), ErrorCode::InvalidArgument, "{bad:?}");
        // The append is over.
        assert_eq!(
            code(c.commit(id, 8).unwrap_err()),
            ErrorCode::FailedPrecondition
        );
        assert_eq!(c.session_info(id).unwrap().tokens_max, 40);
    }
    drop(map);
    c.release(id).unwrap();
    // Nothing of them landed: the rows go in through APPEND_KV and decode like the oracle.
    c.append_kv(id, 40, 8, &more).unwrap();
    sh.step(&mut c, id);
}

#[test]
fn wrong_in_place_requests_are_typed_errors_and_change_nothing() {
    let d = shared_harness().start();
    let mut c = d.client();
    let (id, mut sh) = open(&mut c, "s", 40, 3);
    let g = sh.g;
    let code = |e: kvtier_protocol::client::ClientError| e.code().unwrap();

    // No lease on this connection.
    assert_eq!(
        code(c.reserve(id, 4).unwrap_err()),
        ErrorCode::FailedPrecondition
    );
    let (lease, fd) = c.lease(id).unwrap();
    let mut map = map_writable(fd, &lease);
    assert_eq!(
        code(c.reserve(id, 0).unwrap_err()),
        ErrorCode::InvalidArgument
    );
    assert_eq!(
        code(c.commit(id, 1).unwrap_err()),
        ErrorCode::FailedPrecondition
    );
    // Not a session this connection leases (nor any session at all).
    assert_eq!(
        code(c.reserve(id + 99, 4).unwrap_err()),
        ErrorCode::FailedPrecondition
    );
    // A block table over max_frame_bytes (1 MiB): refused before anything is taken.
    assert_eq!(
        code(c.reserve(id, 16 * 70_000).unwrap_err()),
        ErrorCode::ResourceExhausted
    );

    let r = c.reserve(id, 8).unwrap();
    assert_eq!(
        code(c.reserve(id, 8).unwrap_err()),
        ErrorCode::FailedPrecondition
    );
    // The session takes no other append or decode while an engine writes it.
    let more = sh.payload(1);
    let e = c.append_kv(id, 40, 1, &more).unwrap_err();
    assert_eq!(code(e), ErrorCode::FailedPrecondition);
    sh.truncate(40);
    let (q, k, v) = sh.step_input(0);
    let e = c
        .decode(0, entry(id, 40, &f32_bytes(&q), &k, &v), false)
        .unwrap_err();
    assert!(e.to_string().contains("RESERVE"), "{e}");
    sh.truncate(40);
    // Another connection, even with its own lease, cannot commit this one's append.
    let mut other = d.client();
    let _lease2 = other.lease(id).unwrap();
    assert_eq!(
        code(other.commit(id, 8).unwrap_err()),
        ErrorCode::FailedPrecondition
    );

    // More than reserved, or a NaN in a row: refused, and the append is dropped.
    let payload = sh.payload(8);
    write_rows(&mut map, &g, &r, &payload, 8);
    assert_eq!(
        code(c.commit(id, 9).unwrap_err()),
        ErrorCode::InvalidArgument
    );
    assert_eq!(
        code(c.commit(id, 8).unwrap_err()),
        ErrorCode::FailedPrecondition
    );
    let r = c.reserve(id, 8).unwrap();
    write_rows(&mut map, &g, &r, &payload, 8);
    let (ko, _) = kvtier_storage::in_place_row(&g, &r.layers[1], r.start, 5, 1);
    map[ko as usize..ko as usize + 2].copy_from_slice(&[0xc0, 0x7f]); // bf16 NaN
    let e = c.commit(id, 8).unwrap_err();
    assert_eq!(code(e), ErrorCode::InvalidArgument);
    assert_eq!(c.session_info(id).unwrap().tokens_max, 40);

    // Nothing changed: the 8 rows go in through APPEND_KV and decode like the oracle.
    c.append_kv(id, 40, 8, &payload).unwrap();
    sh.step(&mut c, id);
}

#[test]
fn releasing_the_lease_drops_the_in_place_append() {
    let d = shared_harness().start();
    let mut c = d.client();
    let (id, mut sh) = open(&mut c, "s", 20, 5);
    let g = sh.g;
    let (lease, fd) = c.lease(id).unwrap();
    let mut map = map_writable(fd, &lease);
    let r = c.reserve(id, 30).unwrap();
    let junk = Shadow::new(g, 99).payload(30);
    write_rows(&mut map, &g, &r, &junk, 30);
    c.release(id).unwrap();
    assert_eq!(
        c.commit(id, 30).unwrap_err().code(),
        Some(ErrorCode::FailedPrecondition)
    );
    // As before: the tail's rows past 20 read zero again, appends and decodes go on.
    let tail = runs(&mut c, id).remove(1);
    for h in 0..g.kv_heads as usize {
        let rows = g.v_row_offset(h, 0) - g.k_row_offset(h, 4);
        for o in [g.k_row_offset(h, 4), g.v_row_offset(h, 4)] {
            assert!(tail[o..o + rows].iter().all(|&b| b == 0), "head {h}");
        }
    }
    let more = sh.payload(3);
    c.append_kv(id, 20, 3, &more).unwrap();
    sh.step(&mut c, id);
}

/// The engine process's part (this test binary, re-run with `KVTIER_IN_PLACE_ENGINE` set to
/// `<socket> <session>`): lease, reserve 40 tokens, write random rows in place, print `ready`,
/// then wait (the test kills it with SIGKILL before any COMMIT).
#[test]
#[ignore = "run as an engine process by the test below"]
fn engine_process() {
    let Some(mut engine) = engine_lease("KVTIER_IN_PLACE_ENGINE", "in-place-engine") else {
        return;
    };
    let mut map = map_writable(engine.fd, &engine.lease);
    let r = engine.client.reserve(engine.session, 40).unwrap();
    let g = small_geometry();
    write_rows(&mut map, &g, &r, &Shadow::new(g, 1234).payload(40), 40);
    println!("ready");
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

#[test]
fn an_engine_killed_mid_append_leaves_the_session_as_it_was() {
    let d = shared_harness().start();
    let mut c = d.client();
    let (id, mut sh) = open(&mut c, "s", 24, 11);
    let before = runs(&mut c, id);
    let mut engine = spawn_engine_process(&d, "KVTIER_IN_PLACE_ENGINE", id);
    let out = BufReader::new(engine.stdout.take().unwrap());
    let ready = out
        .lines()
        .map_while(Result::ok)
        .any(|l| l.split_whitespace().any(|w| w == "ready"));
    assert!(ready, "the engine process ended before it was ready");
    // Meanwhile the session is being written: no append.
    let one = Shadow::new(sh.g, 5).payload(1);
    assert_eq!(
        c.append_kv(id, 24, 1, &one).unwrap_err().code(),
        Some(ErrorCode::FailedPrecondition)
    );
    engine.kill().unwrap();
    engine.wait().unwrap();
    // The daemon drops the append when the connection closes: poll until it has.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let more = sh.payload(2);
    loop {
        match c.append_kv(id, 24, 2, &more) {
            Ok(n) => {
                assert_eq!(n, 26);
                break;
            }
            Err(e) if std::time::Instant::now() < deadline => {
                assert_eq!(e.code(), Some(ErrorCode::FailedPrecondition), "{e}");
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(e) => panic!("the killed engine's append was not dropped: {e}"),
        }
    }
    // Its rows are gone: the runs are what 24 + these 2 tokens give.
    let after = runs(&mut c, id);
    assert_eq!(after.len(), before.len());
    let (twin, mut tsh) = open(&mut c, "twin", 24, 11);
    assert_eq!(tsh.payload(2), more);
    c.append_kv(twin, 24, 2, &more).unwrap();
    assert_eq!(after, runs(&mut c, twin));
    sh.step(&mut c, id);
}
