//! Faults injected under the page store: failed and damaged pages never come back as
//! data, and every failure is counted once, as an I/O error or as corruption, through
//! the single- and the multi-threaded read and write paths.

mod common;

use std::sync::Arc;

use kvtier_storage::nvme::io::{Fault, FaultRule, FaultyDriver, Trigger, UringConfig};
use kvtier_storage::nvme::{
    CorruptReason, IoDriver, NvmeError, OpKind, PageAddr, PageStore, PreadDriver, UringDriver,
};

use common::{
    full_page_store, full_payloads, pattern, pinned, reads_of, store_cfg, test_dir, writes_of,
    FULL_PAGE, FULL_PAYLOAD, PAGES,
};

#[test]
fn page_store_under_injected_faults_never_returns_wrong_data() {
    let dir = test_dir("store-faults");
    let rules = vec![
        FaultRule {
            kind: Some(OpKind::Read),
            fault: Fault::BitFlip,
            trigger: Trigger::Probability(0.1),
        },
        FaultRule {
            kind: Some(OpKind::Read),
            fault: Fault::ShortTransfer,
            trigger: Trigger::Probability(0.05),
        },
        FaultRule {
            kind: Some(OpKind::Read),
            fault: Fault::Eio,
            trigger: Trigger::Probability(0.05),
        },
        FaultRule {
            kind: Some(OpKind::Write),
            fault: Fault::BitFlip,
            trigger: Trigger::Probability(0.05),
        },
    ];
    let driver = Arc::new(
        FaultyDriver::new(UringDriver::new(UringConfig::default()).unwrap(), rules, 7).unwrap(),
    );
    let store = PageStore::open(&store_cfg(&dir, &[1.0, 2.0], 4 << 20), driver.clone()).unwrap();
    let addrs = store.alloc(9, 64, 9000).unwrap();
    let payloads: Vec<Vec<u8>> = (0..64).map(|i| pattern(i, 9000)).collect();
    let all: Vec<usize> = (0..addrs.len()).collect();
    store
        .write_pages(&writes_of(&addrs, &payloads, &all))
        .unwrap();
    let (mut ok, mut corrupt, mut io) = (0, 0, 0);
    for _round in 0..20 {
        let reads = reads_of(&addrs, None, &all);
        for (i, r) in store.read_pages(&reads).unwrap().into_iter().enumerate() {
            match r {
                Ok(d) => {
                    assert_eq!(
                        d.payload(),
                        &payloads[i][..],
                        "wrong bytes returned as data"
                    );
                    ok += 1;
                }
                Err(NvmeError::Corrupt { .. }) => corrupt += 1,
                Err(NvmeError::ShortRead { .. } | NvmeError::Io { .. }) => io += 1,
                Err(e) => panic!("{e}"),
            }
        }
    }
    assert!(driver.injected() > 100);
    assert!(
        ok > 0 && corrupt > 0 && io > 0,
        "ok {ok} corrupt {corrupt} io {io}"
    );
    // Every failure was counted once, each in its own counter.
    let u = store.usage();
    assert_eq!((u.io_errors, u.corrupt_pages), (io, corrupt));
}

#[test]
fn io_errors_are_counted_per_failed_operation_apart_from_corruption() {
    let dir = test_dir("store-io-errors");
    let rule = |kind, fault, n| FaultRule {
        kind: Some(kind),
        fault,
        trigger: Trigger::Nth(n),
    };
    let rules = vec![
        rule(OpKind::Write, Fault::Eio, 2),
        rule(OpKind::Write, Fault::ShortTransfer, 4),
        rule(OpKind::Read, Fault::Eio, 1),
        rule(OpKind::Read, Fault::ShortTransfer, 3),
    ];
    let driver = Arc::new(FaultyDriver::new(PreadDriver::new(), rules, 11).unwrap());
    let store = PageStore::open(&store_cfg(&dir, &[1.0], 1 << 20), driver).unwrap();
    let addrs = store.alloc(9, 5, 4000).unwrap();
    let payloads: Vec<Vec<u8>> = (0..5).map(|i| pattern(i, 4000)).collect();
    let all: Vec<usize> = (0..addrs.len()).collect();
    let writes = writes_of(&addrs, &payloads, &all);
    // Writes 2 (EIO) and 4 (torn) fail: the batch fails, two errors counted.
    assert!(store.write_pages(&writes).is_err());
    let u = store.usage();
    assert_eq!((u.io_errors, u.corrupt_pages), (2, 0));
    // Rewritten cleanly (the rules fired already).
    store.write_pages(&writes).unwrap();
    store.sync().unwrap();
    assert_eq!(store.usage().io_errors, 2);
    let reads = reads_of(&addrs, None, &all);
    // Reads 1 (EIO) and 3 (short) fail as I/O errors; all others verify.
    let r = store.read_pages(&reads).unwrap();
    assert!(matches!(r[0], Err(NvmeError::Io { .. })));
    assert!(matches!(r[2], Err(NvmeError::ShortRead { .. })));
    assert!(r[1].is_ok() && r[3].is_ok() && r[4].is_ok());
    let u = store.usage();
    assert_eq!((u.io_errors, u.corrupt_pages), (4, 0));
    // Bytes damaged on the device: a checksum error, not an I/O error.
    {
        use std::io::{Seek, SeekFrom, Write};
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join("dev0"))
            .unwrap();
        let at = addrs[0].page * store.unit() as u64 + 100;
        f.seek(SeekFrom::Start(at)).unwrap();
        f.write_all(&[0xFF; 8]).unwrap();
        f.sync_all().unwrap();
    }
    let r = store.read_pages(&reads[..1]).unwrap();
    assert!(matches!(
        r[0],
        Err(NvmeError::Corrupt {
            reason: CorruptReason::Checksum { .. },
            ..
        })
    ));
    let u = store.usage();
    assert_eq!((u.io_errors, u.corrupt_pages), (4, 1));
}

// ---- Multi-threaded batches: faults pinned to chosen pages ----

type MakeDriver = fn() -> Box<dyn IoDriver>;

fn both_drivers() -> Vec<(&'static str, MakeDriver)> {
    vec![
        ("io_uring", || {
            Box::new(UringDriver::new(UringConfig { queue_depth: 16 }).unwrap())
        }),
        ("pread", || Box::new(PreadDriver::new())),
    ]
}

/// A [`full_page_store`] of `workers` workers over `inner`, each `(fault, page)` of `faults`
/// pinned to that page's `kind` ops, and its [`PAGES`] pages allocated (in order).
fn store_with_pinned_faults(
    dir: &std::path::Path,
    inner: MakeDriver,
    kind: OpKind,
    faults: &[(Fault, usize)],
    seed: u64,
    workers: usize,
) -> (PageStore, Vec<PageAddr>) {
    let rules = faults
        .iter()
        .map(|&(fault, page)| pinned(kind, fault, page))
        .collect();
    let driver = Arc::new(FaultyDriver::new(inner(), rules, seed).unwrap());
    let store = full_page_store(dir, driver, workers);
    let addrs = store.alloc(9, PAGES, FULL_PAYLOAD).unwrap();
    (store, addrs)
}

#[test]
fn eio_short_read_and_a_bit_flip_on_chosen_pages_through_the_multi_threaded_read_path() {
    let dir = test_dir("mt-read-faults");
    let payloads = full_payloads();
    let all: Vec<usize> = (0..PAGES).collect();
    // A fresh single-device store hands out pages 0, 1, 2, ... in order.
    let (eio, flip, short) = (10, 150, 299);
    for (name, inner) in both_drivers() {
        for workers in [1, 2, 4] {
            let faults = [
                (Fault::Eio, eio),
                (Fault::BitFlip, flip),
                (Fault::ShortTransfer, short),
            ];
            let (store, addrs) =
                store_with_pinned_faults(&dir, inner, OpKind::Read, &faults, 3, workers);
            assert!(addrs
                .iter()
                .enumerate()
                .all(|(i, a)| a.page == 3 * i as u64 && a.units == 3));
            let crcs = store
                .write_pages(&writes_of(&addrs, &payloads, &all))
                .unwrap();
            let got = store
                .read_pages(&reads_of(&addrs, Some(&crcs), &all))
                .unwrap();
            assert_eq!(got.len(), PAGES);
            for (i, r) in got.into_iter().enumerate() {
                let ctx = format!("{name}, {workers} workers, page {i}");
                match (i, r) {
                    (
                        i,
                        Err(NvmeError::Io {
                            kind: OpKind::Read,
                            offset,
                            source,
                            ..
                        }),
                    ) if i == eio => {
                        assert_eq!(offset, eio as u64 * FULL_PAGE, "{ctx}");
                        assert_eq!(source.raw_os_error(), Some(libc::EIO), "{ctx}");
                    }
                    (i, Err(e @ NvmeError::Corrupt { page, .. })) if i == flip => {
                        assert_eq!(page, 3 * flip as u64, "{ctx}");
                        assert!(e.is_data_loss(), "{ctx}");
                    }
                    (i, Err(e @ NvmeError::ShortRead { offset, .. })) if i == short => {
                        assert_eq!(offset, short as u64 * FULL_PAGE, "{ctx}");
                        assert!(e.is_data_loss(), "{ctx}");
                    }
                    (_, Ok(d)) => assert_eq!(d.payload(), &payloads[i][..], "{ctx}"),
                    (_, Err(e)) => panic!("{ctx}: {e}"),
                }
            }
            let u = store.usage();
            assert_eq!(
                (u.io_errors, u.corrupt_pages),
                (2, 1),
                "{name}, {workers} workers"
            );
        }
    }
}

#[test]
fn enospc_short_write_eio_and_a_bit_flip_on_chosen_pages_through_the_multi_threaded_write_path() {
    let dir = test_dir("mt-write-faults");
    let payloads = full_payloads();
    let (enospc, flip, short, eio) = (70, 130, 200, 250);
    for (name, inner) in both_drivers() {
        for workers in [1, 4] {
            let faults = [
                (Fault::Enospc, enospc),
                (Fault::BitFlip, flip),
                (Fault::ShortTransfer, short),
                (Fault::Eio, eio),
            ];
            let (store, addrs) =
                store_with_pinned_faults(&dir, inner, OpKind::Write, &faults, 5, workers);
            let ctx = format!("{name}, {workers} workers");
            let except = |skip: &[usize]| -> Vec<usize> {
                (0..PAGES).filter(|i| !skip.contains(i)).collect()
            };
            // Every failing page is attempted and counted; the error is the first in batch
            // order, whichever worker met it first.
            let e = store
                .write_pages(&writes_of(&addrs, &payloads, &except(&[])))
                .unwrap_err();
            assert!(
                matches!(e, NvmeError::NoSpace { offset, .. } if offset == enospc as u64 * FULL_PAGE),
                "{ctx}: {e:?}"
            );
            assert_eq!(store.usage().io_errors, 3, "{ctx}");
            let e = store
                .write_pages(&writes_of(&addrs, &payloads, &except(&[enospc])))
                .unwrap_err();
            assert!(
                matches!(e, NvmeError::ShortWrite { offset, expected: 12288, .. } if offset == short as u64 * FULL_PAGE),
                "{ctx}: {e:?}"
            );
            let e = store
                .write_pages(&writes_of(&addrs, &payloads, &except(&[enospc, short])))
                .unwrap_err();
            assert!(
                matches!(&e, NvmeError::Io { kind: OpKind::Write, offset, source, .. }
                    if *offset == eio as u64 * FULL_PAGE && source.raw_os_error() == Some(libc::EIO)),
                "{ctx}: {e:?}"
            );
            assert_eq!(store.usage().io_errors, 3 + 2 + 1, "{ctx}");
            // The rest writes "successfully", one page silently damaged on the way.
            let ok = except(&[enospc, short, eio]);
            let crcs = store
                .write_pages(&writes_of(&addrs, &payloads, &ok))
                .unwrap();
            store.sync().unwrap();
            let got = store.read_pages(&reads_of(&addrs, None, &ok)).unwrap();
            for ((&i, r), crc) in ok.iter().zip(got).zip(&crcs) {
                match r {
                    Err(NvmeError::Corrupt { page, .. }) if i == flip => {
                        assert_eq!(page, 3 * flip as u64)
                    }
                    Ok(d) => {
                        assert_ne!(i, flip, "{ctx}: damaged page returned as data");
                        assert_eq!(d.payload(), &payloads[i][..], "{ctx}");
                        assert_eq!(d.crc(), *crc, "{ctx}");
                    }
                    Err(e) => panic!("{ctx}, page {i}: {e}"),
                }
            }
            assert_eq!(store.usage().corrupt_pages, 1, "{ctx}");
        }
    }
}
