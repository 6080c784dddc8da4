//! I/O engines and the page store on real O_DIRECT files.

use std::path::PathBuf;
use std::sync::Arc;

use kvtier_storage::nvme::io::{Fault, FaultRule, FaultyEngine, Trigger, UringConfig};
use kvtier_storage::nvme::manifest::{GeometryRecord, PolicyRecord, SessionRecord};
use kvtier_storage::nvme::store::{PageRead, PageWrite};
use kvtier_storage::nvme::BlockRun;
use kvtier_storage::nvme::{
    AlignedBuf, CorruptReason, DeviceConfig, DirectFile, IoEngine, IoRequest, NvmeError, OpKind,
    PageAddr, PageId, PageStore, PageStoreConfig, PreadEngine, UringEngine,
};
use kvtier_tests::kv::xorshift_bytes;
use kvtier_tests::sys::scratch_dir;

fn test_dir(name: &str) -> PathBuf {
    scratch_dir(env!("CARGO_TARGET_TMPDIR"), name)
}

fn engines() -> Vec<Box<dyn IoEngine>> {
    vec![
        Box::new(UringEngine::new(UringConfig { queue_depth: 8 }).expect("io_uring on this host")),
        Box::new(PreadEngine::new()),
    ]
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    xorshift_bytes(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15), len)
}

fn filled(file: &DirectFile, data: &[u8]) -> AlignedBuf {
    let mut b = AlignedBuf::for_file(file, data.len()).unwrap();
    b.copy_from_slice(data);
    b
}

#[test]
fn write_then_read_many_ops_more_than_queue_depth() {
    let dir = test_dir("rw");
    for (ei, engine) in engines().iter().enumerate() {
        let f = Arc::new(DirectFile::open(&dir.join(format!("f{ei}"))).unwrap());
        f.ensure_len(100 * 8192).unwrap();
        let writes = (0..100u64)
            .map(|i| IoRequest::write(f.clone(), i * 8192, filled(&f, &pattern(i, 8192))).unwrap())
            .collect();
        for c in engine.submit(writes).unwrap() {
            c.result.unwrap();
        }
        let reads = (0..100u64)
            .rev()
            .map(|i| {
                IoRequest::read(f.clone(), i * 8192, AlignedBuf::for_file(&f, 8192).unwrap())
                    .unwrap()
            })
            .collect();
        let done = engine.submit(reads).unwrap();
        for (k, c) in done.into_iter().enumerate() {
            let i = 99 - k as u64;
            assert_eq!(
                c.offset,
                i * 8192,
                "{}: completions in request order",
                engine.name()
            );
            c.result.unwrap();
            assert_eq!(
                &c.buf[..],
                &pattern(i, 8192)[..],
                "{} op {i}",
                engine.name()
            );
        }
    }
}

#[test]
fn short_read_at_eof_is_an_error_not_success() {
    let dir = test_dir("eof");
    let uring = UringEngine::new(UringConfig { queue_depth: 4 }).unwrap();
    let pread = PreadEngine::new();
    for (name, engine) in [("uring", &uring as &dyn IoEngine), ("pread", &pread)] {
        let f = Arc::new(DirectFile::open(&dir.join(name)).unwrap());
        f.ensure_len(8192).unwrap();
        let w = IoRequest::write(f.clone(), 0, filled(&f, &[7u8; 8192])).unwrap();
        engine.submit(vec![w]).unwrap()[0].result.as_ref().unwrap();
        // 16 KiB from offset 0 of an 8 KiB file: the kernel returns 8 KiB, the remainder is
        // resubmitted, hits EOF, and the whole op must fail with the byte count.
        let r = IoRequest::read(f.clone(), 0, AlignedBuf::for_file(&f, 16384).unwrap()).unwrap();
        let c = engine.submit(vec![r]).unwrap().pop().unwrap();
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
        let c = engine.submit(vec![r]).unwrap().pop().unwrap();
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
    for (i, engine) in engines().iter().enumerate() {
        let f = Arc::new(DirectFile::open(&dir.join(format!("f{i}"))).unwrap());
        // Past ext4's maximum file size: the kernel answers EFBIG, a real errno completion.
        let w = IoRequest::write(f.clone(), 1 << 50, filled(&f, &[1u8; 4096])).unwrap();
        let c = engine.submit(vec![w]).unwrap().pop().unwrap();
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
                    engine.name()
                );
            }
            other => panic!("{}: {other:?}", engine.name()),
        }
        // Misaligned offsets never reach the engine.
        assert!(matches!(
            IoRequest::write(f.clone(), 512, AlignedBuf::for_file(&f, 4096).unwrap()),
            Err(NvmeError::Misaligned { .. })
        ));
    }
}

#[test]
fn concurrent_callers_share_one_ring() {
    let dir = test_dir("conc");
    let engine = Arc::new(UringEngine::new(UringConfig { queue_depth: 16 }).unwrap());
    let f = Arc::new(DirectFile::open(&dir.join("f")).unwrap());
    f.ensure_len(64 * 4096).unwrap();
    let w = (0..64u64)
        .map(|i| IoRequest::write(f.clone(), i * 4096, filled(&f, &pattern(i, 4096))).unwrap())
        .collect();
    for c in engine.submit(w).unwrap() {
        c.result.unwrap();
    }
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let engine = engine.clone();
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
                    for (c, &i) in engine.submit(reqs).unwrap().into_iter().zip(&ids) {
                        c.result.unwrap();
                        assert_eq!(&c.buf[..], &pattern(i, 4096)[..]);
                    }
                }
            });
        }
    });
    assert_eq!(engine.stats().ops, 64 + 4 * 20 * 8);
}

fn faulty(rules: Vec<FaultRule>, seed: u64) -> FaultyEngine<PreadEngine> {
    FaultyEngine::new(PreadEngine::new(), rules, seed).unwrap()
}

#[test]
fn faulty_engine_injects_each_fault() {
    let dir = test_dir("faulty");
    let f = Arc::new(DirectFile::open(&dir.join("f")).unwrap());
    f.ensure_len(4 * 8192).unwrap();
    let clean = PreadEngine::new();
    let w = IoRequest::write(f.clone(), 0, filled(&f, &pattern(1, 8192))).unwrap();
    clean.submit(vec![w]).unwrap()[0].result.as_ref().unwrap();
    let read = |e: &dyn IoEngine| {
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
fn faulty_engine_triggers_are_deterministic() {
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
    let p = vec![FaultRule {
        kind: None,
        fault: Fault::Eio,
        trigger: Trigger::Probability(0.3),
    }];
    let a = outcomes(p.clone(), 42);
    assert_eq!(a, outcomes(p.clone(), 42), "same seed, same faults");
    assert_ne!(a, outcomes(p, 43), "another seed, other faults");
    let fails = a.iter().filter(|&&x| x).count();
    assert!((30..90).contains(&fails), "about 30% of 200: {fails}");

    let nth = outcomes(
        vec![FaultRule {
            kind: None,
            fault: Fault::Eio,
            trigger: Trigger::Nth(5),
        }],
        0,
    );
    assert_eq!(nth.iter().position(|&x| x), Some(4));
    assert_eq!(nth.iter().filter(|&&x| x).count(), 1);
    let every = outcomes(
        vec![FaultRule {
            kind: None,
            fault: Fault::Eio,
            trigger: Trigger::EveryNth(10),
        }],
        0,
    );
    assert_eq!(every.iter().filter(|&&x| x).count(), 20);

    assert!(FaultyEngine::new(
        PreadEngine::new(),
        vec![FaultRule {
            kind: None,
            fault: Fault::Eio,
            trigger: Trigger::Probability(1.5)
        }],
        0
    )
    .is_err());
    assert!(FaultyEngine::new(
        PreadEngine::new(),
        vec![FaultRule {
            kind: None,
            fault: Fault::Eio,
            trigger: Trigger::Nth(0)
        }],
        0
    )
    .is_err());
}

/// A one-layer session record of `blocks` full 16-token blocks (head_dim 8), no pages yet.
fn one_layer_record(id: u64, blocks: u32) -> SessionRecord {
    SessionRecord {
        id,
        owner_uid: 0,
        label: String::new(),
        geometry: GeometryRecord {
            layers: 1,
            q_heads: 1,
            kv_heads: 1,
            head_dim: 8,
            dtype: 0,
            block_tokens: 16,
        },
        policy: PolicyRecord {
            sink_blocks: 1,
            local_blocks: 1,
            top_k: 1,
        },
        layer_tokens: vec![16 * blocks as u64],
        pages: Vec::new(),
        pinned: false,
    }
}

/// `payloads` as the runs of layer 0, block i = payload i.
fn layer0_runs(payloads: &[Vec<u8>]) -> Vec<BlockRun<'_>> {
    payloads
        .iter()
        .enumerate()
        .map(|(b, p)| BlockRun {
            layer: 0,
            block: b as u32,
            bytes: p,
        })
        .collect()
}

fn store_cfg(dir: &std::path::Path, bws: &[f64], capacity: u64) -> PageStoreConfig {
    PageStoreConfig {
        devices: bws
            .iter()
            .enumerate()
            .map(|(i, &bw)| DeviceConfig {
                path: dir.join(format!("dev{i}")),
                capacity_bytes: capacity,
                bandwidth_bytes_per_s: bw,
            })
            .collect(),
        max_payload: 10_000,
    }
}

fn id(block: u32, generation: u64) -> PageId {
    PageId {
        session: 9,
        layer: 2,
        block,
        generation,
    }
}

#[test]
fn page_store_roundtrip_and_verification() {
    let dir = test_dir("store");
    for engine in [
        Arc::new(UringEngine::new(UringConfig::default()).unwrap()) as Arc<dyn IoEngine>,
        Arc::new(PreadEngine::new()),
    ] {
        let store = PageStore::open(&store_cfg(&dir, &[1.0, 1.0], 1 << 20), engine).unwrap();
        assert_eq!(store.page_size(), 12288);
        let addrs = store.alloc(9, 20).unwrap();
        let payloads: Vec<Vec<u8>> = (0..20)
            .map(|i| pattern(i, 1000 + i as usize * 400))
            .collect();
        let all: Vec<usize> = (0..addrs.len()).collect();
        let crcs = store
            .write_pages(&writes_of(&addrs, &payloads, &all))
            .unwrap();
        store.sync().unwrap();
        let reads = reads_of(&addrs, Some(&crcs), &all);
        for (i, r) in store.read_pages(&reads).unwrap().into_iter().enumerate() {
            assert_eq!(r.unwrap().payload(), &payloads[i][..]);
        }
        // Asking for another generation or block: Corrupt(WrongIdentity), no data.
        let wrong = [PageRead {
            addr: addrs[0],
            id: id(0, 2),
            expected_crc: None,
        }];
        let r = store.read_pages(&wrong).unwrap().pop().unwrap();
        assert!(matches!(
            r,
            Err(NvmeError::Corrupt {
                reason: CorruptReason::WrongIdentity { .. },
                ..
            })
        ));
        // Wrong recorded checksum.
        let wrong = [PageRead {
            addr: addrs[0],
            id: id(0, 1),
            expected_crc: Some(crcs[0] ^ 1),
        }];
        let r = store.read_pages(&wrong).unwrap().pop().unwrap();
        assert!(matches!(
            r,
            Err(NvmeError::Corrupt {
                reason: CorruptReason::UnexpectedChecksum { .. },
                ..
            })
        ));
        // A never-written page.
        let fresh = store.alloc(9, 1).unwrap()[0];
        let r = store
            .read_pages(&[PageRead {
                addr: fresh,
                id: id(0, 1),
                expected_crc: None,
            }])
            .unwrap()
            .pop()
            .unwrap();
        assert!(matches!(r, Err(e @ NvmeError::Corrupt { .. }) if e.is_data_loss()));
        store.free(&[fresh]).unwrap();
        store.free(&addrs).unwrap();
        assert_eq!(
            store
                .usage()
                .devices
                .iter()
                .map(|d| d.pages_used)
                .sum::<u64>(),
            0
        );
        assert!(store.usage().corrupt_pages >= 3);
    }
}

#[test]
fn page_store_bad_input_is_typed() {
    let dir = test_dir("store-bad");
    let engine: Arc<dyn IoEngine> = Arc::new(PreadEngine::new());
    let store = PageStore::open(&store_cfg(&dir, &[1.0], 10 * 12288), engine.clone()).unwrap();
    let a = store.alloc(1, 1).unwrap()[0];
    let big = vec![0u8; 10_001];
    assert!(matches!(
        store.write_pages(&[PageWrite {
            addr: a,
            id: id(0, 1),
            payload: &big
        }]),
        Err(NvmeError::InvalidArgument { .. })
    ));
    let unalloc = PageAddr {
        device: 0,
        page: (a.page + 1) % 10,
    };
    assert!(matches!(
        store.write_pages(&[PageWrite {
            addr: unalloc,
            id: id(0, 1),
            payload: &[1]
        }]),
        Err(NvmeError::InvalidArgument { .. })
    ));
    let out = PageAddr { device: 3, page: 0 };
    assert!(store
        .read_pages(&[PageRead {
            addr: out,
            id: id(0, 1),
            expected_crc: None
        }])
        .is_err());
    assert!(matches!(
        store.free(&[PageAddr {
            device: 0,
            page: 10
        }]),
        Err(NvmeError::InvalidArgument { .. })
    ));
    store.free(&[a]).unwrap();
    assert!(
        matches!(store.free(&[a]), Err(NvmeError::InvalidArgument { .. })),
        "double free"
    );
    // Full: all or nothing.
    let all = store.alloc(1, 10).unwrap();
    assert!(matches!(
        store.alloc(1, 1),
        Err(NvmeError::Full {
            requested: 1,
            free: 0
        })
    ));
    store.free(&all[..3]).unwrap();
    assert!(matches!(
        store.alloc(1, 4),
        Err(NvmeError::Full {
            requested: 4,
            free: 3
        })
    ));
    assert_eq!(store.free_pages(), 3, "a failed alloc takes nothing");
    // Recovery marks.
    store.mark_allocated(all[0]).unwrap();
    assert!(matches!(
        store.mark_allocated(all[0]),
        Err(NvmeError::ManifestMismatch { .. })
    ));
    assert!(matches!(
        store.mark_allocated(PageAddr { device: 1, page: 0 }),
        Err(NvmeError::ManifestMismatch { .. })
    ));
    // Config errors.
    let mut cfg = store_cfg(&dir, &[1.0], 4096);
    assert!(
        matches!(
            PageStore::open(&cfg, engine.clone()),
            Err(NvmeError::InvalidArgument { .. })
        ),
        "no whole page"
    );
    cfg.devices.clear();
    assert!(PageStore::open(&cfg, engine.clone()).is_err());
    let cfg = store_cfg(&dir, &[0.0], 1 << 20);
    assert!(PageStore::open(&cfg, engine.clone()).is_err());
    let mut cfg = store_cfg(&dir, &[1.0], 1 << 20);
    cfg.max_payload = 0;
    assert!(PageStore::open(&cfg, engine).is_err());
}

#[test]
fn striping_follows_bandwidth() {
    let dir = test_dir("stripe");
    let store = PageStore::open(
        &store_cfg(&dir, &[3.0e9, 1.0e9, 2.0e9], 1 << 22),
        Arc::new(PreadEngine::new()),
    )
    .unwrap();
    let mut per_dev = [0usize; 3];
    // Many small allocations of one session still interleave (the cursor persists).
    for _ in 0..60 {
        for a in store.alloc(5, 1).unwrap() {
            per_dev[a.device as usize] += 1;
        }
    }
    assert_eq!(per_dev, [30, 10, 20]);
    // Smooth: within any window of 6 consecutive pages the split is exactly 3:1:2.
    let addrs = store.alloc(6, 12).unwrap();
    for w in addrs.chunks(6) {
        let mut c = [0; 3];
        for a in w {
            c[a.device as usize] += 1;
        }
        assert_eq!(c, [3, 1, 2]);
    }
    // A full device is skipped, the rest still serve.
    let pages = store.device_pages();
    let mut total = 72usize;
    while let Ok(a) = store.alloc(7, 1) {
        total += a.len();
    }
    assert_eq!(total as u64, pages.iter().sum::<u64>());
}

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
    let engine = Arc::new(
        FaultyEngine::new(UringEngine::new(UringConfig::default()).unwrap(), rules, 7).unwrap(),
    );
    let store = PageStore::open(&store_cfg(&dir, &[1.0, 2.0], 4 << 20), engine.clone()).unwrap();
    let addrs = store.alloc(9, 64).unwrap();
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
    assert!(engine.injected() > 100);
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
    let engine = Arc::new(FaultyEngine::new(PreadEngine::new(), rules, 11).unwrap());
    let store = PageStore::open(&store_cfg(&dir, &[1.0], 1 << 20), engine).unwrap();
    let addrs = store.alloc(9, 5).unwrap();
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
        let at = addrs[0].page * store.page_size() as u64 + 100;
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

/// An engine for a store of two devices whose first is slow: its operations go through a
/// stalling [`FaultyEngine`], the other device's straight to pread.
struct SlowFirstDevice {
    slow: PathBuf,
    stalled: FaultyEngine<PreadEngine>,
    fast: PreadEngine,
}

impl IoEngine for SlowFirstDevice {
    fn submit(
        &self,
        reqs: Vec<IoRequest>,
    ) -> Result<Vec<kvtier_storage::nvme::io::IoCompletion>, NvmeError> {
        let (mut slow, mut fast, mut order) = (Vec::new(), Vec::new(), Vec::new());
        for r in reqs {
            let is_slow = r.file().path() == self.slow;
            order.push(is_slow);
            if is_slow {
                slow.push(r)
            } else {
                fast.push(r)
            }
        }
        let mut slow = self.stalled.submit(slow)?.into_iter();
        let mut fast = self.fast.submit(fast)?.into_iter();
        Ok(order
            .into_iter()
            .map(|s| if s { slow.next() } else { fast.next() }.expect("one per request"))
            .collect())
    }

    fn name(&self) -> &'static str {
        "slow-first-device"
    }
}

#[test]
fn tracked_read_rates_set_the_stripe_weights_of_new_sessions_and_the_bulk_batches() {
    use kvtier_storage::nvme::store::STRIPE_MIN_SAMPLES;
    use kvtier_storage::nvme::tier::{BULK_BATCH_SECONDS, BULK_BATCH_UNMEASURED_PAGES};
    use kvtier_storage::nvme::NvmeTier;

    let dir = test_dir("store-tracked");
    // Configured as equals; device 0 really holds every operation 5 ms longer (a margin
    // that CPU contention on the fast device's reads cannot eat).
    let cfg = store_cfg(&dir, &[1.0, 1.0], 4 << 20);
    let engine = SlowFirstDevice {
        slow: cfg.devices[0].path.clone(),
        stalled: FaultyEngine::new(
            PreadEngine::new(),
            vec![FaultRule {
                kind: None,
                fault: Fault::Stall(std::time::Duration::from_millis(5)),
                trigger: Trigger::Always,
            }],
            0,
        )
        .unwrap(),
        fast: PreadEngine::new(),
    };
    let store = PageStore::open(&cfg, Arc::new(engine)).unwrap();
    assert!(store.usage().devices.iter().all(|d| d.read_lane.is_none()));
    let (tier, _) = NvmeTier::open(store, &dir.join("manifest")).unwrap();
    let record = |id: u64| one_layer_record(id, 100);
    let payloads: Vec<Vec<u8>> = (0..100).map(|i| pattern(i, 9000)).collect();
    let runs = layer0_runs(&payloads);
    let per_device = |id: u64| {
        let mut n = [0usize; 2];
        for p in tier.session(id).unwrap().pages {
            n[p.device as usize] += 1;
        }
        n
    };
    tier.put_session(&record(1), &runs).unwrap();
    assert_eq!(per_device(1), [50, 50], "configured weights: an even split");
    let wanted: Vec<(u32, u32)> = (0..100).map(|b| (0, b)).collect();
    let lens = |r: &[std::ops::Range<usize>]| r.iter().map(|r| r.len()).collect::<Vec<_>>();
    assert_eq!(
        lens(&tier.plan_batches(1, &wanted).unwrap()),
        [
            BULK_BATCH_UNMEASURED_PAGES,
            100 - BULK_BATCH_UNMEASURED_PAGES
        ],
        "by count before any rate is known"
    );
    // Writes were timed too.
    let u = tier.store().usage();
    assert!(u
        .devices
        .iter()
        .all(|d| d.write_samples == 1 && d.write_lane.is_some()));

    // Read the session back, one batch of 10 at a time.
    for k in 0..STRIPE_MIN_SAMPLES as u32 {
        let want: Vec<(u32, u32)> = (0..10).map(|b| (0, (k * 10 + b) % 100)).collect();
        for r in tier.read_runs(1, &want).unwrap() {
            r.unwrap();
        }
        if k + 1 < STRIPE_MIN_SAMPLES as u32 {
            assert_eq!(tier.store().stripe_weights(), [1.0, 1.0], "not settled yet");
        }
    }
    let u = tier.store().usage();
    let (slow, fast) = (
        u.devices[0].read_lane.unwrap(),
        u.devices[1].read_lane.unwrap(),
    );
    assert_eq!(u.devices[0].read_samples, STRIPE_MIN_SAMPLES);
    assert!(
        fast.bandwidth_bytes_per_s > 4.0 * slow.bandwidth_bytes_per_s,
        "slow {slow:?} fast {fast:?}"
    );
    // A 12 KiB page per 5 ms stall: the slow device's rate is at most ~2.5 MB/s.
    assert!(slow.bandwidth_bytes_per_s < 2.5e6, "{slow:?}");
    // Striping follows the tracked throughput (the rate at the transfers seen), which puts the
    // slow device below ~2.5 MB/s as well.
    let w = tier.store().stripe_weights();
    let tp = |d: usize| u.devices[d].read_throughput.unwrap();
    assert_eq!(w, [tp(0), tp(1)]);
    assert!(tp(0) < 2.5e6 && tp(1) > 4.0 * tp(0), "{w:?}");
    assert_eq!(u.devices[0].bandwidth_bytes_per_s, w[0]);

    // A session persisted now is striped by the tracked rates: most pages on the fast device.
    tier.put_session(&record(2), &runs).unwrap();
    let n = per_device(2);
    assert!(n[1] >= 80, "new session split {n:?}");
    assert_eq!(per_device(1), [50, 50], "the old one stays where it is");

    // A bulk read of the old session goes in batches of about BULK_BATCH_SECONDS at the
    // tracked rates: each batch holds the few slow-device pages that fit.
    let batches = tier.plan_batches(1, &wanted).unwrap();
    assert!(batches.len() > 2, "{:?}", lens(&batches));
    let s = tier.session(1).unwrap();
    let page = tier.store().page_size() as u64;
    for r in &batches {
        let slow_pages = s.pages[r.clone()].iter().filter(|p| p.device == 0).count() as u64;
        assert!(
            r.len() == 1 || slow.time(slow_pages * page) <= BULK_BATCH_SECONDS,
            "{r:?}"
        );
    }
    assert_eq!(batches.last().unwrap().end, 100);
}

// ---- Multi-threaded batches: faults pinned to chosen pages ----

/// A page whose payload fills it (3 x 4 KiB minus the header): the checksum covers every
/// byte, so a flipped bit anywhere is caught.
const FULL_PAYLOAD: usize = 3 * 4096 - 64;
/// Pages per test batch: several chunks (64 pages of 12 KiB each), so several workers.
const PAGES: usize = 300;

fn full_page_store(dir: &std::path::Path, engine: Arc<dyn IoEngine>, workers: usize) -> PageStore {
    let store = PageStore::open(
        &PageStoreConfig {
            devices: vec![DeviceConfig {
                path: dir.join("dev0"),
                capacity_bytes: (PAGES as u64 + 8) * 12288,
                bandwidth_bytes_per_s: 1.0,
            }],
            max_payload: FULL_PAYLOAD,
        },
        engine,
    )
    .unwrap();
    assert_eq!(store.page_size(), 12288);
    assert!(
        PAGES > 2 * store.chunk_pages(),
        "the batch spans several chunks"
    );
    store.set_workers(workers).unwrap();
    store
}

fn full_payloads() -> Vec<Vec<u8>> {
    (0..PAGES as u64)
        .map(|i| pattern(i + 100, FULL_PAYLOAD))
        .collect()
}

fn writes_of<'a>(
    addrs: &[PageAddr],
    payloads: &'a [Vec<u8>],
    only: &[usize],
) -> Vec<PageWrite<'a>> {
    only.iter()
        .map(|&i| PageWrite {
            addr: addrs[i],
            id: id(i as u32, 1),
            payload: &payloads[i],
        })
        .collect()
}

fn reads_of(addrs: &[PageAddr], crcs: Option<&[u32]>, only: &[usize]) -> Vec<PageRead> {
    only.iter()
        .map(|&i| PageRead {
            addr: addrs[i],
            id: id(i as u32, 1),
            expected_crc: crcs.map(|c| c[i]),
        })
        .collect()
}

fn pinned(kind: OpKind, fault: Fault, store_page: usize) -> FaultRule {
    FaultRule {
        kind: Some(kind),
        fault,
        trigger: Trigger::AtOffset(store_page as u64 * 12288),
    }
}

type MakeEngine = fn() -> Box<dyn IoEngine>;

fn both_engines() -> Vec<(&'static str, MakeEngine)> {
    vec![
        ("io_uring", || {
            Box::new(UringEngine::new(UringConfig { queue_depth: 16 }).unwrap())
        }),
        ("pread", || Box::new(PreadEngine::new())),
    ]
}

#[test]
fn eio_short_read_and_a_bit_flip_on_chosen_pages_through_the_multi_threaded_read_path() {
    let dir = test_dir("mt-read-faults");
    let payloads = full_payloads();
    let all: Vec<usize> = (0..PAGES).collect();
    // A fresh single-device store hands out pages 0, 1, 2, ... in order.
    let (eio, flip, short) = (10, 150, 299);
    for (name, inner) in both_engines() {
        for workers in [1, 2, 4] {
            let rules = vec![
                pinned(OpKind::Read, Fault::Eio, eio),
                pinned(OpKind::Read, Fault::BitFlip, flip),
                pinned(OpKind::Read, Fault::ShortTransfer, short),
            ];
            let engine = Arc::new(FaultyEngine::new(inner(), rules, 3).unwrap());
            let store = full_page_store(&dir, engine, workers);
            let addrs = store.alloc(9, PAGES).unwrap();
            assert!(addrs.iter().enumerate().all(|(i, a)| a.page == i as u64));
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
                        assert_eq!(offset, eio as u64 * 12288, "{ctx}");
                        assert_eq!(source.raw_os_error(), Some(libc::EIO), "{ctx}");
                    }
                    (i, Err(e @ NvmeError::Corrupt { page, .. })) if i == flip => {
                        assert_eq!(page, flip as u64, "{ctx}");
                        assert!(e.is_data_loss(), "{ctx}");
                    }
                    (i, Err(e @ NvmeError::ShortRead { offset, .. })) if i == short => {
                        assert_eq!(offset, short as u64 * 12288, "{ctx}");
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
    for (name, inner) in both_engines() {
        for workers in [1, 4] {
            let rules = vec![
                pinned(OpKind::Write, Fault::Enospc, enospc),
                pinned(OpKind::Write, Fault::BitFlip, flip),
                pinned(OpKind::Write, Fault::ShortTransfer, short),
                pinned(OpKind::Write, Fault::Eio, eio),
            ];
            let engine = Arc::new(FaultyEngine::new(inner(), rules, 5).unwrap());
            let store = full_page_store(&dir, engine, workers);
            let addrs = store.alloc(9, PAGES).unwrap();
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
                matches!(e, NvmeError::NoSpace { offset, .. } if offset == enospc as u64 * 12288),
                "{ctx}: {e:?}"
            );
            assert_eq!(store.usage().io_errors, 3, "{ctx}");
            let e = store
                .write_pages(&writes_of(&addrs, &payloads, &except(&[enospc])))
                .unwrap_err();
            assert!(
                matches!(e, NvmeError::ShortWrite { offset, expected: 12288, .. } if offset == short as u64 * 12288),
                "{ctx}: {e:?}"
            );
            let e = store
                .write_pages(&writes_of(&addrs, &payloads, &except(&[enospc, short])))
                .unwrap_err();
            assert!(
                matches!(&e, NvmeError::Io { kind: OpKind::Write, offset, source, .. }
                    if *offset == eio as u64 * 12288 && source.raw_os_error() == Some(libc::EIO)),
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
                        assert_eq!(page, flip as u64)
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

/// Records which threads submit to the engine.
struct Recording<E> {
    inner: E,
    threads: parking_lot::Mutex<Vec<std::thread::ThreadId>>,
}

impl<E: IoEngine> IoEngine for Recording<E> {
    fn submit(
        &self,
        reqs: Vec<IoRequest>,
    ) -> Result<Vec<kvtier_storage::nvme::io::IoCompletion>, NvmeError> {
        self.threads.lock().push(std::thread::current().id());
        self.inner.submit(reqs)
    }

    fn name(&self) -> &'static str {
        "recording"
    }
}

#[test]
fn one_worker_runs_every_batch_on_the_caller_with_the_same_bytes_as_several() {
    let payloads = full_payloads();
    let all: Vec<usize> = (0..PAGES).collect();
    let me = std::thread::current().id();
    let mut outcomes = Vec::new();
    for workers in [1, 4] {
        let dir = test_dir(&format!("workers-{workers}"));
        // Each operation holds the device 0.3 ms (a chunk about 20 ms), so while the caller
        // waits on its chunk the other workers take theirs.
        let stall = FaultRule {
            kind: None,
            fault: Fault::Stall(std::time::Duration::from_micros(300)),
            trigger: Trigger::Always,
        };
        let engine = Arc::new(Recording {
            inner: FaultyEngine::new(PreadEngine::new(), vec![stall], 0).unwrap(),
            threads: Default::default(),
        });
        let store = full_page_store(&dir, engine.clone(), workers);
        let chunks = PAGES.div_ceil(store.chunk_pages());
        let addrs = store.alloc(9, PAGES).unwrap();
        let crcs = store
            .write_pages(&writes_of(&addrs, &payloads, &all))
            .unwrap();
        let read: Vec<Vec<u8>> = store
            .read_pages(&reads_of(&addrs, Some(&crcs), &all))
            .unwrap()
            .into_iter()
            .map(|r| r.unwrap().payload().to_vec())
            .collect();
        assert_eq!(read, payloads);
        let threads = std::mem::take(&mut *engine.threads.lock());
        assert_eq!(threads.len(), 2 * chunks, "one submission per chunk");
        let distinct: std::collections::HashSet<_> = threads.iter().collect();
        if workers == 1 {
            assert!(
                threads.iter().all(|&t| t == me),
                "set_workers(1): all on the caller"
            );
        } else {
            assert!(
                distinct.len() > 1,
                "several workers: {} threads",
                distinct.len()
            );
        }
        // A batch of one chunk never fans out.
        store
            .read_pages(&reads_of(&addrs, Some(&crcs), &all[..store.chunk_pages()]))
            .unwrap();
        assert_eq!(*engine.threads.lock(), vec![me]);
        let u = store.usage();
        assert_eq!(
            (u.devices[0].read_samples, u.devices[0].write_samples),
            (2, 1),
            "one sample per batch"
        );
        drop(store);
        outcomes.push((crcs, std::fs::read(dir.join("dev0")).unwrap()));
    }
    assert!(
        outcomes[0] == outcomes[1],
        "the same checksums and the same bytes on the device"
    );
}

#[test]
fn workers_are_validated() {
    let dir = test_dir("workers-bad");
    let store = full_page_store(&dir, Arc::new(PreadEngine::new()), 1);
    use kvtier_storage::nvme::store::MAX_WORKERS;
    assert!((1..=8).contains(&kvtier_storage::default_workers()));
    for bad in [0, MAX_WORKERS + 1] {
        assert!(matches!(
            store.set_workers(bad),
            Err(NvmeError::InvalidArgument { .. })
        ));
    }
    assert_eq!(store.workers(), 1, "a rejected value changes nothing");
    store.set_workers(MAX_WORKERS).unwrap();
    assert_eq!(store.workers(), MAX_WORKERS);
}

#[test]
fn read_runs_pipelined_delivers_every_batch_in_order_and_stops_at_the_first_error() {
    use kvtier_storage::nvme::tier::BULK_BATCH_UNMEASURED_PAGES;
    use kvtier_storage::nvme::NvmeTier;

    let dir = test_dir("pipelined");
    let n = 200usize;
    let eio_run = 77;
    let engine = Arc::new(
        FaultyEngine::new(
            UringEngine::new(UringConfig::default()).unwrap(),
            vec![pinned(OpKind::Read, Fault::Eio, eio_run)],
            0,
        )
        .unwrap(),
    );
    let store = full_page_store(&dir, engine, 4);
    let (tier, _) = NvmeTier::open(store, &dir.join("manifest")).unwrap();
    let payloads: Vec<Vec<u8>> = (0..n as u64).map(|i| pattern(i, 9000)).collect();
    let runs = layer0_runs(&payloads);
    let record = one_layer_record(1, n as u32);
    tier.put_session(&record, &runs).unwrap();
    let s = tier.session(1).unwrap();
    assert_eq!(
        s.page(0, eio_run as u32).unwrap().page,
        eio_run as u64,
        "pages in order"
    );
    // Block n is not stored: its own error, the others unaffected.
    let wanted: Vec<(u32, u32)> = (0..=n as u32).map(|b| (0, b)).collect();

    // Before any read is timed, batches go by count: several of them. The consumer's error
    // stops the read; no later batch is consumed.
    assert!(tier.store().read_lanes().is_none());
    let mut calls = 0;
    let e = tier
        .read_runs_pipelined(1, &wanted, |_, _| {
            calls += 1;
            if calls == 2 {
                Err(NvmeError::ShortRead {
                    offset: 0,
                    expected: 1,
                    got: 0,
                })
            } else {
                Ok(())
            }
        })
        .unwrap_err();
    assert!(matches!(e, NvmeError::ShortRead { .. }), "{e:?}");
    assert_eq!(calls, 2, "batches of {BULK_BATCH_UNMEASURED_PAGES}");

    // Every run once, in order, in the batches the planner makes (by the tracked rates now).
    let expected = tier.plan_batches(1, &wanted).unwrap();
    let mut seen = Vec::new();
    tier.read_runs_pipelined(1, &wanted, |r, pages| {
        assert_eq!(pages.len(), r.len());
        for (i, p) in r.clone().zip(pages) {
            match p {
                Ok(d) => assert_eq!(d.payload(), &payloads[i][..], "run {i}"),
                Err(NvmeError::Io { source, .. }) if i == eio_run => {
                    assert_eq!(source.raw_os_error(), Some(libc::EIO))
                }
                Err(NvmeError::InvalidArgument { .. }) if i == n => {}
                Err(e) => panic!("run {i}: {e}"),
            }
        }
        seen.push(r);
        Ok::<(), NvmeError>(())
    })
    .unwrap();
    assert_eq!(seen, expected);
    assert_eq!((seen[0].start, seen.last().unwrap().end), (0, n + 1));

    // A whole-batch error (unknown session) comes back as such, nothing consumed.
    let e = tier
        .read_runs_pipelined(7, &wanted, |_, _| -> Result<(), NvmeError> {
            panic!("nothing to consume")
        })
        .unwrap_err();
    assert!(matches!(e, NvmeError::InvalidArgument { .. }), "{e:?}");

    // One batch: read inline, same results.
    let mut one = 0;
    tier.read_runs_pipelined(1, &wanted[..5], |r, pages| {
        one += 1;
        assert_eq!(r, 0..5);
        assert!(pages.iter().all(|p| p.is_ok()));
        Ok::<(), NvmeError>(())
    })
    .unwrap();
    assert_eq!(one, 1);
}
