//! `backend.coalesce`: concurrent DECODEs from different connections, at whatever layers they
//! are, run as one step. Real tierd processes, one client connection per session on its own thread; every output
//! is checked against the dense oracle, and STATS says how many requests shared a step.

mod common;

use common::{concurrent_steps as run, Daemon, Harness};

#[test]
fn concurrent_decodes_share_steps_and_each_answer_is_its_own() {
    // One decoder lane (the default, named because it matters) where a GPU makes the backend
    // CUDA: with four, two sessions per lane take turns (one's call runs while the other's
    // reply travels) and rarely queue together.
    let d = Daemon::start(&[
        "--set",
        "backend.coalesce=\"always\"",
        "--set",
        "backend.cuda.lanes=1",
    ]);
    let s = run(&d, 8, 12);
    let layers = common::small_geometry().layers as u64;
    assert_eq!(s.requests, 8 * 12 * layers);
    let coalesced = s
        .coalesced
        .expect("STATS has decode_coalesced_total with coalescing on");
    let steps = s.steps.expect("STATS has decode_steps_total");
    // Eight connections stepping at once queue behind each other's steps: fewer steps than
    // requests, by one less than each shared step's requests.
    assert!(coalesced > 0, "no request shared a step in {}", s.requests);
    assert!(
        steps < s.requests,
        "{steps} steps for {} requests",
        s.requests
    );
    assert!(
        s.requests - steps <= coalesced,
        "{steps} steps, {coalesced} coalesced"
    );
    eprintln!(
        "{coalesced} of {} requests shared a step; {steps} steps",
        s.requests
    );
}

#[test]
fn without_coalescing_the_counter_is_absent_and_answers_are_the_same() {
    let d = Daemon::start(&["--set", "backend.coalesce=\"never\""]);
    let s = run(&d, 4, 4);
    assert_eq!(s.coalesced, None);
    assert_eq!(s.steps, None);
    assert_eq!(s.requests, 4 * 4 * common::small_geometry().layers as u64);
}
