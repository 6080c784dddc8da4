//! Coalesced requests on the CPU backend: one step for many requests answers each exactly
//! as it would alone, and one request's error stays its own.

use kvtier_storage::testing::Rng;
use kvtier_storage::ArenaOptions;

use super::*;
use crate::service::testing::{self, GEO, PEER};

fn service() -> Service {
    let arena = HostArena::new(&ArenaOptions::new(16 << 20, 16 << 10)).unwrap();
    Service::new(arena, testing::limits(16, true))
}

/// `n` sessions of 40 + i tokens each, in two engines with identical contents.
fn twins(n: usize, rng: &mut Rng) -> (Service, Service, Vec<u64>) {
    let (a, b) = (service(), service());
    let (mut ida, mut idb) = (Vec::new(), Vec::new());
    for i in 0..n {
        let ids = testing::open(&[&a, &b], 40 + i as u32, rng);
        ida.push(ids[0]);
        idb.push(ids[1]);
    }
    (a, b, [ida, idb].concat())
}

struct Step {
    q: Vec<u8>,
    k: Vec<u8>,
    v: Vec<u8>,
}

fn step(rng: &mut Rng) -> Step {
    let row = (GEO.kv_heads * GEO.head_dim) as usize;
    Step {
        q: kvtier_protocol::f32_le_bytes(&rng.normals((GEO.q_heads * GEO.head_dim) as usize))
            .into_owned(),
        k: GEO.dtype.encode_vec(&rng.normals(row)),
        v: GEO.dtype.encode_vec(&rng.normals(row)),
    }
}

fn entry(session: u64, position: u64, s: &Step) -> DecodeEntryRef<'_> {
    DecodeEntryRef {
        session,
        position,
        q: &s.q,
        k: &s.k,
        v: &s.v,
    }
}

#[test]
fn coalesced_requests_are_answered_as_alone_and_an_error_stays_its_own() {
    let mut rng = Rng::new(21);
    let n = 4;
    let (a, b, ids) = twins(n, &mut rng);
    let (ida, idb) = ids.split_at(n);
    let steps: Vec<Step> = (0..n).map(|_| step(&mut rng)).collect();
    // Request 2 is wrong (position one past the end); the others are right.
    let pos = |i: usize| 40 + i as u64 + u64::from(i == 2);
    let jobs: Vec<Job<'_>> = (0..n)
        .map(|i| {
            a.prepare(&PEER, 0, true, &[entry(ida[i], pos(i), &steps[i])])
                .unwrap()
        })
        .collect();
    let coalesced = a.run_coalesced(jobs);
    for i in 0..n {
        let alone = b.decode(&PEER, 0, true, &[entry(idb[i], pos(i), &steps[i])]);
        match (&coalesced[i], &alone) {
            (Ok(c), Ok(s)) => assert_eq!(c, s, "request {i}: as alone"),
            (Err(c), Err(s)) => assert_eq!(c.code, s.code, "request {i}: its own error"),
            _ => panic!("request {i}: {:?} vs {:?}", coalesced[i], alone),
        }
    }
    assert!(coalesced[2].is_err() && coalesced.iter().filter(|r| r.is_ok()).count() == 3);
    assert_eq!(
        a.counters.decode_coalesced.load(Ordering::Relaxed),
        0,
        "each alone"
    );
    // All right, two at layer 0 and two at layer 1: one step for all four, each answered
    // as alone.
    let steps: Vec<Step> = (0..n).map(|_| step(&mut rng)).collect();
    let layer = |i: usize| (i % 2) as u32;
    // Layer 0 may be ahead of layer 1: the position of each request's layer.
    let pos = |e: &Service, id, l: u32| {
        let info = e.info(&PEER, id).unwrap();
        if l == 0 {
            info.tokens_max
        } else {
            info.tokens_min
        }
    };
    let jobs: Vec<Job<'_>> = (0..n)
        .map(|i| {
            let at = pos(&a, ida[i], layer(i));
            a.prepare(&PEER, layer(i), i % 2 == 0, &[entry(ida[i], at, &steps[i])])
                .unwrap()
        })
        .collect();
    let coalesced = a.run_coalesced(jobs);
    assert_eq!(
        a.counters.decode_coalesced.load(Ordering::Relaxed),
        n as u64
    );
    for i in 0..n {
        let at = pos(&b, idb[i], layer(i));
        let alone = b
            .decode(&PEER, layer(i), i % 2 == 0, &[entry(idb[i], at, &steps[i])])
            .unwrap();
        assert_eq!(
            coalesced[i].as_ref().unwrap(),
            &alone,
            "request {i}: as alone"
        );
    }
    // Every layer of every session where its twin's is: the failed request's session
    // moved on once (layer 0, second round), sessions 1 and 3 at each layer once, session
    // 0 twice at layer 0.
    for i in 0..n {
        for l in 0..2 {
            assert_eq!(
                pos(&a, ida[i], l),
                pos(&b, idb[i], l),
                "session {i} layer {l}"
            );
        }
    }
    let grown: Vec<u64> = (0..n).map(|i| pos(&a, ida[i], 0) - 40 - i as u64).collect();
    assert_eq!(grown, [2, 1, 1, 1]);
}

#[test]
fn two_requests_for_one_session_run_one_after_the_other() {
    let mut rng = Rng::new(22);
    let (a, b, ids) = twins(1, &mut rng);
    let (s1, s2) = (step(&mut rng), step(&mut rng));
    let jobs = vec![
        a.prepare(&PEER, 0, false, &[entry(ids[0], 40, &s1)])
            .unwrap(),
        a.prepare(&PEER, 0, false, &[entry(ids[0], 41, &s2)])
            .unwrap(),
    ];
    // Layer 0 twice: the second request continues where the first ended.
    let r = a.run_coalesced(jobs);
    let first = b
        .decode(&PEER, 0, false, &[entry(ids[1], 40, &s1)])
        .unwrap();
    let second = b
        .decode(&PEER, 0, false, &[entry(ids[1], 41, &s2)])
        .unwrap();
    assert_eq!(r[0].as_ref().unwrap(), &first);
    assert_eq!(r[1].as_ref().unwrap(), &second);
}
