//! The I/O drivers on real O_DIRECT files: io_uring and pread (ordering, short
//! transfers, errno failures, a shared ring), and the fault-injecting driver.

mod common;

use std::sync::Arc;

use kvtier_storage::nvme::io::{Fault, FaultRule, FaultyDriver, Trigger, UringConfig};
use kvtier_storage::nvme::{
    AlignedBuf, DirectFile, IoDriver, IoRequest, NvmeError, OpKind, PreadDriver, UringDriver,
};

use common::{pattern, test_dir};

fn drivers() -> Vec<Box<dyn IoDriver>> {
    vec![
        Box::new(UringDriver::new(UringConfig { queue_depth: 8 }).expect("io_uring on this host")),
        Box::new(PreadDriver::new()),
    ]
}

fn filled(file: &DirectFile, data: &[u8]) -> AlignedBuf {
    let mut b = AlignedBuf::for_file(file, data.len()).unwrap();
    b.copy_from_slice(data);
    b
}

/// Writes `n` blocks of `len` bytes through `driver`, block i (at i * len) the [`pattern`] of
/// i, so that reads can check what they get.
fn write_patterns(driver: &dyn IoDriver, f: &Arc<DirectFile>, n: u64, len: usize) {
    let writes = (0..n)
        .map(|i| {
            let buf = filled(f, &pattern(i, len));
            IoRequest::write(f.clone(), i * len as u64, buf).unwrap()
        })
        .collect();
    for c in driver.submit(writes).unwrap() {
        c.result.unwrap();
    }
}

#[test]
fn write_then_read_many_ops_more_than_queue_depth() {
    let dir = test_dir("rw");
    for (ei, driver) in drivers().iter().enumerate() {
        let f = Arc::new(DirectFile::open(&dir.join(format!("f{ei}"))).unwrap());
        f.ensure_len(100 * 8192).unwrap();
        write_patterns(driver.as_ref(), &f, 100, 8192);
        let reads = (0..100u64)
            .rev()
            .map(|i| {
                IoRequest::read(f.clone(), i * 8192, AlignedBuf::for_file(&f, 8192).unwrap())
                    .unwrap()
            })
            .collect();
        let done = driver.submit(reads).unwrap();
        for (k, c) in done.into_iter().enumerate() {
            let i = 99 - k as u64;
            assert_eq!(
                c.offset,
                i * 8192,
                "{}: completions in request order",
                driver.name()
            );
            c.result.unwrap();
            assert_eq!(
                &c.buf[..],
                &pattern(i, 8192)[..],
                "{} op {i}",
                driver.name()
            );
        }
    }
}

#[test]
fn short_read_at_eof_is_an_error_not_success() {
    let dir = test_dir("eof");
    let uring = UringDriver::new(UringConfig { queue_depth: 4 }).unwrap();
    let pread = PreadDriver::new();
    for (name, driver) in [("uring", &uring as &dyn IoDriver), ("pread", &pread)] {
        let f = Arc::new(DirectFile::open(&dir.join(name)).unwrap());
        f.ensure_len(8192).unwrap();
        let w = IoRequest::write(f.clone(), 0, filled(&f, &[7u8; 8192])).unwrap();
        driver.submit(vec![w]).unwrap()[0].result.as_ref().unwrap();
        // 16 KiB from offset 0 of an 8 KiB file: the kernel returns 8 KiB, the remainder is
        // resubmitted, hits EOF, and the whole op must fail with the byte count.
        let r = IoRequest::read(f.clone(), 0, AlignedBuf::for_file(&f, 16384).unwrap()).unwrap();
        let c = driver.submit(vec![r]).unwrap().pop().unwrap();
        match c.result {
            Err(NvmeError::ShortRead {
                offset: 0,
                expected: 16384,
                got: 8192,
            }) => {}
            other => panic!("{name}: {other:?}"),
        }
        // Entirely past EOF.
        let r = IoRequest::read(f.clone(), 65536, AlignedBuf::for_file(&f, 4096).unwrap()).unwrap();
        let c = driver.submit(vec![r]).unwrap().pop().unwrap();
        assert!(
            matches!(c.result, Err(NvmeError::ShortRead { got: 0, .. })),
            "{name}"
        );
    }
    assert!(uring.stats().resubmits_short >= 1, "{:?}", uring.stats());
    assert_eq!(uring.stats().cq_overflow, 0);
}

#[test]
fn errno_failures_are_typed() {
    let dir = test_dir("errno");
    for (i, driver) in drivers().iter().enumerate() {
        let f = Arc::new(DirectFile::open(&dir.join(format!("f{i}"))).unwrap());
        // Past ext4's maximum file size: the kernel answers EFBIG, a real errno completion.
        let w = IoRequest::write(f.clone(), 1 << 50, filled(&f, &[1u8; 4096])).unwrap();
        let c = driver.submit(vec![w]).unwrap().pop().unwrap();
        match &c.result {
            Err(NvmeError::Io {
                kind: OpKind::Write,
                offset,
                len: 4096,
                source,
            }) => {
                assert_eq!(*offset, 1 << 50);
                assert!(
                    source.raw_os_error().is_some(),
                    "{}: {source}",
                    driver.name()
                );
            }
            other => panic!("{}: {other:?}", driver.name()),
        }
        // Misaligned offsets never reach the driver.
        assert!(matches!(
            IoRequest::write(f.clone(), 512, AlignedBuf::for_file(&f, 4096).unwrap()),
            Err(NvmeError::Misaligned { .. })
        ));
    }
}

#[test]
fn concurrent_callers_share_one_ring() {
    let dir = test_dir("conc");
    let driver = Arc::new(UringDriver::new(UringConfig { queue_depth: 16 }).unwrap());
    let f = Arc::new(DirectFile::open(&dir.join("f")).unwrap());
    f.ensure_len(64 * 4096).unwrap();
    write_patterns(&*driver, &f, 64, 4096);
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let driver = driver.clone();
            let f = f.clone();
            s.spawn(move || {
                for round in 0..20u64 {
                    let ids: Vec<u64> = (0..8).map(|k| (t * 13 + round * 7 + k * 5) % 64).collect();
                    let reqs = ids
                        .iter()
                        .map(|&i| {
                            IoRequest::read(
                                f.clone(),
                                i * 4096,
                                AlignedBuf::for_file(&f, 4096).unwrap(),
                            )
                            .unwrap()
                        })
                        .collect();
                    for (c, &i) in driver.submit(reqs).unwrap().into_iter().zip(&ids) {
                        c.result.unwrap();
                        assert_eq!(&c.buf[..], &pattern(i, 4096)[..]);
                    }
                }
            });
        }
    });
    assert_eq!(driver.stats().ops, 64 + 4 * 20 * 8);
}

fn faulty(rules: Vec<FaultRule>, seed: u64) -> FaultyDriver<PreadDriver> {
    FaultyDriver::new(PreadDriver::new(), rules, seed).unwrap()
}

/// One rule: any op fails with EIO when `trigger` fires.
fn eio_when(trigger: Trigger) -> Vec<FaultRule> {
    vec![FaultRule {
        kind: None,
        fault: Fault::Eio,
        trigger,
    }]
}

#[test]
fn faulty_driver_injects_each_fault() {
    let dir = test_dir("faulty");
    let f = Arc::new(DirectFile::open(&dir.join("f")).unwrap());
    f.ensure_len(4 * 8192).unwrap();
    let clean = PreadDriver::new();
    let w = IoRequest::write(f.clone(), 0, filled(&f, &pattern(1, 8192))).unwrap();
    clean.submit(vec![w]).unwrap()[0].result.as_ref().unwrap();
    let read = |e: &dyn IoDriver| {
        let r = IoRequest::read(f.clone(), 0, AlignedBuf::for_file(&f, 8192).unwrap()).unwrap();
        e.submit(vec![r]).unwrap().pop().unwrap()
    };
    let always = |kind, fault| FaultRule {
        kind: Some(kind),
        fault,
        trigger: Trigger::Always,
    };

    let e = faulty(vec![always(OpKind::Read, Fault::Eio)], 1);
    let c = read(&e);
    assert!(
        matches!(&c.result, Err(NvmeError::Io { source, .. }) if source.raw_os_error() == Some(libc::EIO))
    );
    assert_eq!(e.injected(), 1);

    let e = faulty(vec![always(OpKind::Read, Fault::Enospc)], 1);
    assert!(matches!(read(&e).result, Err(NvmeError::NoSpace { .. })));

    let e = faulty(vec![always(OpKind::Read, Fault::ShortTransfer)], 1);
    assert!(matches!(
        read(&e).result,
        Err(NvmeError::ShortRead { expected: 8192, .. })
    ));

    let e = faulty(vec![always(OpKind::Read, Fault::BitFlip)], 1);
    let c = read(&e);
    c.result.as_ref().unwrap();
    let diff: u32 = c
        .buf
        .iter()
        .zip(pattern(1, 8192))
        .map(|(a, b)| (a ^ b).count_ones())
        .sum();
    assert_eq!(diff, 1, "exactly one bit flipped");

    // A rule for writes leaves reads alone.
    let e = faulty(vec![always(OpKind::Write, Fault::Eio)], 1);
    read(&e).result.unwrap();

    // Torn write: only an aligned prefix lands, and the op reports ShortWrite.
    let e = faulty(vec![always(OpKind::Write, Fault::ShortTransfer)], 3);
    let w = IoRequest::write(f.clone(), 8192, filled(&f, &[0xEE; 8192])).unwrap();
    let c = e.submit(vec![w]).unwrap().pop().unwrap();
    assert!(
        matches!(c.result, Err(NvmeError::ShortWrite { expected: 8192, .. })),
        "{:?}",
        c.result
    );
    assert_eq!(
        &c.buf[..],
        &[0xEE; 8192][..],
        "caller's buffer comes back intact"
    );

    // Silent write corruption: success, caller's buffer restored, one bit differs on disk.
    let e = faulty(vec![always(OpKind::Write, Fault::BitFlip)], 3);
    let w = IoRequest::write(f.clone(), 16384, filled(&f, &[0x11; 8192])).unwrap();
    let c = e.submit(vec![w]).unwrap().pop().unwrap();
    c.result.unwrap();
    assert_eq!(&c.buf[..], &[0x11; 8192][..]);
    let r = IoRequest::read(f.clone(), 16384, AlignedBuf::for_file(&f, 8192).unwrap()).unwrap();
    let c = clean.submit(vec![r]).unwrap().pop().unwrap();
    let diff: u32 = c.buf.iter().map(|&a| (a ^ 0x11).count_ones()).sum();
    assert_eq!(diff, 1);
}

#[test]
fn faulty_driver_triggers_are_deterministic() {
    let dir = test_dir("faulty-det");
    let f = Arc::new(DirectFile::open(&dir.join("f")).unwrap());
    f.ensure_len(8192).unwrap();
    let outcomes = |rules: Vec<FaultRule>, seed| {
        let e = faulty(rules, seed);
        (0..200)
            .map(|_| {
                let r =
                    IoRequest::read(f.clone(), 0, AlignedBuf::for_file(&f, 4096).unwrap()).unwrap();
                e.submit(vec![r]).unwrap().pop().unwrap().result.is_err()
            })
            .collect::<Vec<bool>>()
    };
    let p = eio_when(Trigger::Probability(0.3));
    let a = outcomes(p.clone(), 42);
    assert_eq!(a, outcomes(p.clone(), 42), "same seed, same faults");
    assert_ne!(a, outcomes(p, 43), "another seed, other faults");
    let fails = a.iter().filter(|&&x| x).count();
    assert!((30..90).contains(&fails), "about 30% of 200: {fails}");

    let nth = outcomes(eio_when(Trigger::Nth(5)), 0);
    assert_eq!(nth.iter().position(|&x| x), Some(4));
    assert_eq!(nth.iter().filter(|&&x| x).count(), 1);
    let every = outcomes(eio_when(Trigger::EveryNth(10)), 0);
    assert_eq!(every.iter().filter(|&&x| x).count(), 20);

    for bad in [Trigger::Probability(1.5), Trigger::Nth(0)] {
        assert!(
            FaultyDriver::new(PreadDriver::new(), eio_when(bad), 0).is_err(),
            "{bad:?}"
        );
    }
}
