//! Making room in a full host tier while another thread holds the session that would free it.

use kvtier_storage::testing::Rng;
use kvtier_storage::ArenaOptions;

use super::*;
use crate::service::testing::{self, open};

/// One block run of [`testing::GEO`]: one extent.
const RUN: usize = 4096;

/// A host tier of 64 extents over an NVMe tier in `dir`; no prefetch, and no demotion by
/// the pressure pass after an append (high water at 100%).
fn service(dir: &std::path::Path) -> Service {
    let mut cfg = crate::config::Config::default();
    cfg.nvme.dir = dir.to_path_buf();
    cfg.nvme.capacity = crate::config::ByteSize(8 << 20);
    cfg.host.max_run_bytes = crate::config::ByteSize(RUN as u64);
    cfg.nvme.prefetch_blocks = 0;
    cfg.nvme.high_water = 1.0;
    cfg.nvme.low_water = 1.0;
    let tier = crate::open_tier(&cfg).unwrap();
    let arena = HostArena::new(&ArenaOptions::new(64 * RUN, RUN)).unwrap();
    Service::with_tier(arena, testing::limits(16, false), tier, None)
}

/// Holds `id`'s lock on another thread (as the prefetcher does while it reads the session's
/// blocks) for `hold`, and runs `f` meanwhile.
fn while_held<T>(svc: &Service, id: u64, hold: Duration, f: impl FnOnce() -> T) -> T {
    let s = svc.sessions.read()[&id].clone();
    std::thread::scope(|scope| {
        let (locked, wait) = std::sync::mpsc::channel();
        scope.spawn(move || {
            let _st = s.state.lock();
            locked.send(()).unwrap();
            std::thread::sleep(hold);
        });
        wait.recv().unwrap();
        f()
    })
}

#[test]
fn a_request_waits_for_a_busy_session_to_make_room_and_is_refused_past_the_wait() {
    let dir = tempfile::tempdir().unwrap();
    let svc = service(dir.path());
    let mut rng = Rng::new(1);
    // 25 blocks in each of 2 layers, then 7: 64 extents, the whole tier.
    let big = open(&[&svc], 400, &mut rng)[0];
    let small = open(&[&svc], 100, &mut rng)[0];
    let extents = |id: u64| svc.sessions.read()[&id].state.lock().kv.extents();
    assert_eq!((extents(big), extents(small)), (50, 14));
    assert_eq!(svc.arena.usage().bytes_used, 64 * RUN);

    // Held past the wait: refused, and nothing demoted.
    let past = BUSY_WAIT + Duration::from_millis(500);
    let made = while_held(&svc, big, past, || {
        svc.make_room(&[small], 5 * RUN, 5 * RUN)
    });
    assert!(!made);
    assert_eq!(extents(big), 50);

    // Held briefly: the request waits for it, and the big session is demoted to make room.
    let brief = Duration::from_millis(20);
    let made = while_held(&svc, big, brief, || {
        svc.make_room(&[small], 5 * RUN, 5 * RUN)
    });
    assert!(made, "room made once the session was free");
    assert!(extents(big) < 50);
    assert!(svc.arena.usage().bytes_used <= 59 * RUN);
}
