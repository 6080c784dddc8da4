//! `backend.coalesce`: concurrent DECODEs of one layer from different connections run as one
//! step. Real tierd processes, one client connection per session on its own thread; every output
//! is checked against the dense oracle, and STATS says how many requests shared a step.

mod common;

use common::{concurrent_steps as run, Daemon, Harness};

#[test]
fn concurrent_decodes_share_steps_and_each_answer_is_its_own() {
    let d = Daemon::start(&["--set", "backend.coalesce=\"always\""]);
    let (coalesced, requests) = run(&d, 8, 12);
    let layers = common::small_geometry().layers as u64;
    assert_eq!(requests, 8 * 12 * layers);
    let coalesced = coalesced.expect("STATS has decode_coalesced_total with coalescing on");
    // Eight connections stepping at once queue behind each other's steps.
    assert!(coalesced > 0, "no request shared a step in {requests}");
    eprintln!("{coalesced} of {requests} requests shared a step");
}

#[test]
fn without_coalescing_the_counter_is_absent_and_answers_are_the_same() {
    let d = Daemon::start(&["--set", "backend.coalesce=\"never\""]);
    let (coalesced, requests) = run(&d, 4, 4);
    assert_eq!(coalesced, None);
    assert_eq!(requests, 4 * 4 * common::small_geometry().layers as u64);
}
