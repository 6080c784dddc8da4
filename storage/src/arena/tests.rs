use super::*;
use proptest::prelude::*;
use std::collections::HashSet;

const U: usize = EXTENT_ALIGN;

fn arena(units: usize, max_run_units: usize) -> HostArena {
    HostArena::new(&ArenaOptions::new(units * U, max_run_units * U)).unwrap()
}

/// This process's locked memory (VmLck), in bytes.
fn locked_bytes() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmLck:")).unwrap();
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<usize>()
        .unwrap()
        * 1024
}

#[test]
fn a_locked_arena_is_resident_and_locked_in_every_range_and_unlocked_when_dropped() {
    // 3 huge pages: three 2 MiB ranges, on several threads where there are cores. Under
    // the usual 8 MiB RLIMIT_MEMLOCK, so it runs unprivileged too.
    let bytes = 6 << 20;
    for shared in [false, true] {
        let before = locked_bytes();
        let mut opts = ArenaOptions::new(bytes, 64 * U);
        (opts.lock, opts.shared) = (true, shared);
        let reports = Mutex::new(vec![]);
        let a = HostArena::with_progress(&opts, &|done, total| reports.lock().push((done, total)))
            .unwrap();
        assert_eq!(locked_bytes() - before, bytes, "shared: {shared}");
        let mut reports = reports.into_inner();
        reports.sort();
        assert_eq!(
            reports.len(),
            4,
            "one report at the start, one per 2 MiB range"
        );
        assert_eq!(reports[0], (0, bytes));
        assert_eq!(reports.last(), Some(&(bytes, bytes)));
        assert!(reports.windows(2).all(|w| w[0].0 < w[1].0));
        let mut resident = vec![0u8; bytes / 4096];
        // SAFETY: the range is the arena's own mapping, alive while `a` is.
        let rc = unsafe { libc::mincore(a.inner.base.cast(), bytes, resident.as_mut_ptr()) };
        assert_eq!(rc, 0);
        assert!(resident.iter().all(|r| r & 1 == 1), "every page resident");
        drop(a);
        assert_eq!(locked_bytes(), before);
    }
}

#[test]
fn a_capacity_extents_cannot_address_is_refused_before_mapping() {
    let too_big = (u32::MAX as usize + 1) * U;
    let e = HostArena::new(&ArenaOptions::new(too_big, U)).unwrap_err();
    assert!(
        matches!(&e, StorageError::InvalidArena { reason } if reason.contains("address")),
        "{e}"
    );
}

#[test]
fn full_arena_is_a_typed_error_and_freed_extents_are_reused() {
    let a = arena(3, 1);
    let f: Vec<_> = (0..3).map(|_| a.alloc(U).unwrap()).collect();
    let e = a.alloc(U).unwrap_err();
    assert!(
        matches!(
            e,
            StorageError::ArenaFull {
                wanted: 1,
                run_bytes: U,
                bytes_free: 0,
                bytes_total,
                ..
            } if bytes_total == 3 * U
        ),
        "{e}"
    );
    drop(f);
    assert_eq!(a.usage().bytes_used, 0);
    assert!(a.alloc(U).unwrap().offset() < 3 * U);
}

#[test]
fn extents_take_their_run_size_rounded_to_a_page_and_are_zeroed_and_disjoint() {
    let a = arena(64, 16);
    let mut small = a.alloc(100).unwrap();
    let mut big = a.alloc(9 * U + 1).unwrap();
    assert_eq!((small.len(), big.len()), (U, 10 * U));
    small.as_mut_slice().fill(0xAB);
    big.as_mut_slice().fill(0xCD);
    assert!(small.as_slice().iter().all(|&b| b == 0xAB));
    assert!(big.as_slice().iter().all(|&b| b == 0xCD));
    let u = a.usage();
    assert_eq!((u.bytes_used, u.extents_used), (11 * U, 2));
    let at = small.offset();
    drop(small);
    let again = a.alloc(U).unwrap();
    assert_eq!(again.offset(), at, "best fit reuses the hole");
    assert!(
        again.as_slice().iter().all(|&b| b == 0),
        "reused extent is zeroed"
    );
}

#[test]
fn runs_over_max_run_bytes_are_refused_and_extents_stay_inside_segments() {
    const MIB: usize = 1 << 20;
    let a = HostArena::new(&ArenaOptions::new(2 * SEGMENT_BYTES, 8 * MIB)).unwrap();
    assert_eq!(a.segment_bytes(), SEGMENT_BYTES);
    assert!(matches!(
        a.alloc(8 * MIB + 1),
        Err(StorageError::BlockTooLarge { max_run_bytes, .. }) if max_run_bytes == 8 * MIB
    ));
    assert!(a.alloc(0).is_err());
    // 341 runs of 3 MiB fill the first segment but its last 1 MiB; the next run starts
    // the second segment rather than straddling the boundary (unzeroed: nothing touched).
    let run = 3 * MIB;
    let _first = a.alloc_many_unzeroed(341, run).unwrap();
    let second = a.alloc_many_unzeroed(341, run).unwrap();
    assert_eq!(second[0].offset(), SEGMENT_BYTES);
    // 2 MiB are free (1 + 1) but in no piece of 3, and the error says so.
    assert!(matches!(
        a.alloc(run),
        Err(StorageError::ArenaFull { bytes_free, largest_free, .. })
            if bytes_free == 2 * MIB && largest_free == MIB
    ));
}

#[test]
fn alloc_many_is_all_or_nothing() {
    let a = arena(4, 1);
    let _one = a.alloc(U).unwrap();
    assert!(matches!(
        a.alloc_many(4, U),
        Err(StorageError::ArenaFull { wanted: 4, .. })
    ));
    assert_eq!(
        a.usage().extents_used,
        1,
        "a failed alloc_many takes nothing"
    );
    assert_eq!(a.fits(U, 10), 3);
    let three = a.alloc_many(3, U).unwrap();
    assert_eq!(three.len(), 3);
    assert_eq!(a.usage().bytes_used, 4 * U);
}

#[test]
fn a_quota_caps_one_owners_bytes_and_is_refunded_on_drop() {
    let a = arena(16, 2);
    let q = HostQuota::new(4 * U);
    let mine = a.with_quota(q.clone());
    let two = mine.alloc(2 * U).unwrap();
    let one = mine.alloc_many(2, U).unwrap();
    assert!(matches!(
        mine.alloc(U),
        Err(StorageError::QuotaExceeded { bytes_used, limit, .. })
            if bytes_used == 4 * U && limit == 4 * U
    ));
    assert_eq!(q.used(), 4 * U);
    // Others are not charged and not limited by it.
    let theirs = a.alloc_many(10, U).unwrap();
    drop(one);
    assert_eq!(q.used(), 2 * U);
    let last = a.alloc_many(4, U).unwrap();
    // A full arena refunds what the quota had charged.
    assert!(matches!(mine.alloc(U), Err(StorageError::ArenaFull { .. })));
    assert_eq!(q.used(), 2 * U);
    drop((two, theirs, last));
    assert_eq!((q.used(), a.usage().bytes_used), (0, 0));
}

#[test]
fn a_shared_arena_is_one_memfd_that_a_second_mapping_sees() {
    let mut opts = ArenaOptions::new(16 * U, 4 * U);
    opts.shared = true;
    let a = HostArena::new(&opts).unwrap();
    let mut f = a.alloc(2 * U).unwrap();
    f.as_mut_slice()[..3].copy_from_slice(&[7, 8, 9]);
    let fd = a.shared_fd().expect("shared").try_clone_to_owned().unwrap();
    let file = File::from(fd);
    assert_eq!(file.metadata().unwrap().len(), 16 * U as u64);
    // SAFETY: a read-only view of a sealed memfd that outlives it.
    let view = unsafe { memmap2::Mmap::map(&file) }.unwrap();
    assert_eq!(&view[f.offset()..f.offset() + 3], &[7, 8, 9]);
    assert!(file.set_len(U as u64).is_err(), "sealed against shrinking");
    assert!(HostArena::new(&ArenaOptions::new(16 * U, 4 * U))
        .unwrap()
        .shared_fd()
        .is_none());
}

#[test]
fn bad_options_are_rejected() {
    assert!(HostArena::new(&ArenaOptions::new(1 << 20, 1000)).is_err());
    assert!(HostArena::new(&ArenaOptions::new(100, EXTENT_ALIGN)).is_err());
    assert!(HostArena::new(&ArenaOptions::new(8 * U, 16 * U)).is_err());
}

proptest! {
    /// Random alloc/free sequences of mixed sizes: the accounting equals a model, extents
    /// never overlap, and a failed allocation takes nothing.
    #[test]
    fn accounting_matches_a_model(ops in proptest::collection::vec((any::<bool>(), 1usize..5, any::<u8>()), 1..200)) {
        let a = arena(32, 8);
        let mut held: Vec<Extent> = Vec::new();
        for (alloc, units, pick) in ops {
            if alloc {
                let before = a.usage();
                match a.alloc(units * U - pick as usize % U) {
                    Ok(f) => held.push(f),
                    Err(StorageError::ArenaFull { .. }) => prop_assert_eq!(a.usage(), before),
                    Err(e) => return Err(TestCaseError::fail(e.to_string())),
                }
            } else if !held.is_empty() {
                let i = pick as usize % held.len();
                held.swap_remove(i);
            }
            let u = a.usage();
            prop_assert_eq!(u.extents_used, held.len());
            prop_assert_eq!(u.bytes_used, held.iter().map(Extent::len).sum::<usize>());
            let mut ranges: Vec<(usize, usize)> = held.iter().map(|f| (f.offset(), f.len())).collect();
            ranges.sort_unstable();
            for w in ranges.windows(2) {
                prop_assert!(w[0].0 + w[0].1 <= w[1].0, "overlap");
            }
        }
    }
}

/// A run refused for fragmentation is placed once the movable runs of one window move: they
/// keep their bytes and their owner's quota, and the fixed ones stay where they are.
#[test]
fn relocation_places_a_run_where_the_free_units_are_in_pieces() {
    let quota = HostQuota::new(64 * U);
    let a = arena(32, 8).with_quota(quota.clone());
    // 32 one-unit runs, each holding its index; every other one freed: 16 one-unit holes.
    let mut runs: Vec<Option<Extent>> = (0..32)
        .map(|i| {
            let mut f = a.alloc(U).unwrap();
            f.as_mut_slice().fill(i as u8);
            Some(f)
        })
        .collect();
    for r in runs.iter_mut().step_by(2) {
        *r = None;
    }
    assert!(matches!(
        a.alloc(4 * U),
        Err(StorageError::ArenaFull { .. })
    ));
    assert_eq!(quota.used(), 16 * U);
    // Runs 1, 3, 5 and 7 are fixed (a reader holds their addresses); the rest may move.
    let fixed: Vec<usize> = [1, 3, 5, 7]
        .iter()
        .map(|&i| runs[i].as_ref().unwrap().offset())
        .collect();
    let movable: HashSet<usize> = runs
        .iter()
        .flatten()
        .map(Extent::offset)
        .filter(|o| !fixed.contains(o))
        .collect();
    let plan = a
        .plan_relocation(4 * U, &movable)
        .expect("a window of movable runs");
    assert_eq!(
        plan.moves.len(),
        2,
        "a 4-unit window holds two one-unit runs"
    );
    for (from, to) in plan.moves {
        assert!(movable.contains(&from));
        let run = runs
            .iter_mut()
            .flatten()
            .find(|f| f.offset() == from)
            .unwrap();
        run.move_to(to);
        assert_ne!(run.offset(), from);
    }
    let placed = a.alloc(4 * U).expect("the window holds the run now");
    for (i, r) in runs.iter().enumerate() {
        if let Some(f) = r {
            assert!(
                f.as_slice().iter().all(|&b| b == i as u8),
                "run {i} kept its bytes"
            );
        }
    }
    for (i, off) in [1, 3, 5, 7].iter().zip(&fixed) {
        assert_eq!(
            runs[*i].as_ref().unwrap().offset(),
            *off,
            "fixed run {i} moved"
        );
    }
    assert_eq!(
        quota.used(),
        16 * U + 4 * U,
        "moves charge nothing and refund nothing"
    );
    drop(placed);
    drop(runs);
    assert_eq!(quota.used(), 0);
    assert_eq!(a.usage().bytes_used, 0, "every extent freed once");
    // Nothing to plan where a free range already holds the run, or nothing may move.
    assert!(a.plan_relocation(4 * U, &HashSet::new()).is_none());
}
