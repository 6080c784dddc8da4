//! The page store on real O_DIRECT files: pages and their verification (identity,
//! checksums), bad input and allocation, striping by bandwidth, and the tracked read
//! rates that set the stripe weights and the bulk batches.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvtier_storage::nvme::io::{Fault, FaultRule, FaultyDriver, Trigger, UringConfig};
use kvtier_storage::nvme::store::{PageRead, PageWrite};
use kvtier_storage::nvme::{
    CorruptReason, IoDriver, IoRequest, NvmeError, PageAddr, PageStore, PreadDriver, UringDriver,
};

use common::{
    id, layer0_runs, one_layer_record, pattern, reads_of, store_cfg, test_dir, writes_of,
};

/// A `Full` refusal's (requested, page_bytes, free_bytes, largest_free_bytes), to compare whole.
fn full(e: &NvmeError) -> (usize, u64, u64, u64) {
    match *e {
        NvmeError::Full {
            requested,
            page_bytes,
            free_bytes,
            largest_free_bytes,
        } => (requested, page_bytes, free_bytes, largest_free_bytes),
        _ => panic!("not Full: {e:?}"),
    }
}

#[test]
fn page_store_roundtrip_and_verification() {
    let dir = test_dir("store");
    for driver in [
        Arc::new(UringDriver::new(UringConfig::default()).unwrap()) as Arc<dyn IoDriver>,
        Arc::new(PreadDriver::new()),
    ] {
        let store = PageStore::open(&store_cfg(&dir, &[1.0, 1.0], 1 << 20), driver).unwrap();
        assert_eq!(store.unit(), 4096);
        let payloads: Vec<Vec<u8>> = (0..20)
            .map(|i| pattern(i, 1000 + i as usize * 400))
            .collect();
        // Each page just the units its payload needs (1 to 3 here).
        let addrs: Vec<PageAddr> = payloads
            .iter()
            .map(|p| store.alloc(9, 1, p.len()).unwrap()[0])
            .collect();
        for (a, p) in addrs.iter().zip(&payloads) {
            assert_eq!(a.units, (64 + p.len()).div_ceil(4096) as u32);
        }
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
        let fresh = store.alloc(9, 1, 10_000).unwrap()[0];
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
        let u = store.usage();
        assert!(u
            .devices
            .iter()
            .all(|d| (d.pages, d.units_used, d.bytes_used) == (0, 0, 0)));
        assert_eq!(
            u.devices.iter().map(|d| d.bytes_total).sum::<u64>(),
            store.free_bytes()
        );
        assert!(store.usage().corrupt_pages >= 3);
    }
}

#[test]
fn page_store_bad_input_is_typed() {
    let dir = test_dir("store-bad");
    let driver: Arc<dyn IoDriver> = Arc::new(PreadDriver::new());
    // 30 units; the largest page (10_000 bytes of payload) takes 3.
    let store = PageStore::open(&store_cfg(&dir, &[1.0], 10 * 12288), driver.clone()).unwrap();
    assert_eq!((store.page_units(10_000), store.page_units(100)), (3, 1));
    let a = store.alloc(1, 1, 10_000).unwrap()[0];
    assert_eq!(
        a,
        PageAddr {
            device: 0,
            page: 0,
            units: 3
        }
    );
    assert!(
        matches!(
            store.alloc(1, 1, 10_001),
            Err(NvmeError::InvalidArgument { .. })
        ),
        "over max_payload"
    );
    let big = vec![0u8; 10_001];
    assert!(matches!(
        store.write_pages(&[PageWrite {
            addr: a,
            id: id(0, 1),
            payload: &big
        }]),
        Err(NvmeError::InvalidArgument { .. })
    ));
    // A payload within max_payload but bigger than its page.
    let small = store.alloc(1, 1, 100).unwrap()[0];
    assert_eq!(
        small,
        PageAddr {
            device: 0,
            page: 3,
            units: 1
        }
    );
    assert!(matches!(
        store.write_pages(&[PageWrite {
            addr: small,
            id: id(0, 1),
            payload: &[7; 5000]
        }]),
        Err(NvmeError::InvalidArgument { .. })
    ));
    store.free(&[small]).unwrap();
    // Not exactly an allocated page: free units, the start of a page, the end of one.
    for addr in [
        PageAddr {
            device: 0,
            page: 3,
            units: 3,
        },
        PageAddr {
            device: 0,
            page: 0,
            units: 1,
        },
        PageAddr {
            device: 0,
            page: 1,
            units: 2,
        },
    ] {
        assert!(
            matches!(
                store.write_pages(&[PageWrite {
                    addr,
                    id: id(0, 1),
                    payload: &[1]
                }]),
                Err(NvmeError::InvalidArgument { .. })
            ),
            "write to {addr:?}"
        );
        assert!(
            matches!(store.free(&[addr]), Err(NvmeError::InvalidArgument { .. })),
            "free of {addr:?}"
        );
    }
    let other = store.alloc(1, 1, 100).unwrap()[0];
    assert!(
        matches!(
            store.free(&[PageAddr { units: 4, ..a }]),
            Err(NvmeError::InvalidArgument { .. })
        ),
        "a page and its neighbour are not one page"
    );
    store.free(&[other]).unwrap();
    let out = PageAddr {
        device: 3,
        page: 0,
        units: 1,
    };
    assert!(store
        .read_pages(&[PageRead {
            addr: out,
            id: id(0, 1),
            expected_crc: None
        }])
        .is_err());
    for bad in [
        PageAddr {
            device: 0,
            page: 30,
            units: 1,
        },
        PageAddr {
            device: 0,
            page: 28,
            units: 3,
        },
        PageAddr {
            device: 0,
            page: 0,
            units: 0,
        },
        PageAddr {
            device: 0,
            page: u64::MAX,
            units: 2,
        },
    ] {
        assert!(
            matches!(store.free(&[bad]), Err(NvmeError::InvalidArgument { .. })),
            "{bad:?}"
        );
        assert!(store
            .read_pages(&[PageRead {
                addr: bad,
                id: id(0, 1),
                expected_crc: None
            }])
            .is_err());
    }
    store.free(&[a]).unwrap();
    assert!(
        matches!(store.free(&[a]), Err(NvmeError::InvalidArgument { .. })),
        "double free"
    );
    // Full: all or nothing.
    let all = store.alloc(1, 10, 10_000).unwrap();
    let e = store.alloc(1, 1, 10_000).unwrap_err();
    assert_eq!(full(&e), (1, 12288, 0, 0));
    store.free(&all[..3]).unwrap();
    let e = store.alloc(1, 4, 10_000).unwrap_err();
    assert_eq!(full(&e), (4, 12288, 36864, 36864));
    assert!(e.to_string().contains("4 pages of 12288 bytes"), "{e}");
    assert_eq!(store.free_bytes(), 9 * 4096, "a failed alloc takes nothing");
    // Recovery marks.
    store.mark_allocated(all[0]).unwrap();
    assert!(matches!(
        store.mark_allocated(all[0]),
        Err(NvmeError::ManifestMismatch { .. })
    ));
    assert!(
        matches!(
            store.mark_allocated(PageAddr {
                page: 2,
                units: 2,
                ..all[0]
            }),
            Err(NvmeError::ManifestMismatch { .. })
        ),
        "overlaps a marked page"
    );
    assert!(matches!(
        store.mark_allocated(PageAddr {
            device: 1,
            page: 0,
            units: 1
        }),
        Err(NvmeError::ManifestMismatch { .. })
    ));
    // Config errors.
    let mut cfg = store_cfg(&dir, &[1.0], 8192);
    assert!(
        matches!(
            PageStore::open(&cfg, driver.clone()),
            Err(NvmeError::InvalidArgument { .. })
        ),
        "no room for the largest page"
    );
    cfg.devices.clear();
    assert!(PageStore::open(&cfg, driver.clone()).is_err());
    let cfg = store_cfg(&dir, &[0.0], 1 << 20);
    assert!(PageStore::open(&cfg, driver.clone()).is_err());
    let mut cfg = store_cfg(&dir, &[1.0], 1 << 20);
    cfg.max_payload = 0;
    assert!(PageStore::open(&cfg, driver).is_err());
}

#[test]
fn striping_follows_bandwidth() {
    let dir = test_dir("stripe");
    let store = PageStore::open(
        &store_cfg(&dir, &[3.0e9, 1.0e9, 2.0e9], 1 << 22),
        Arc::new(PreadDriver::new()),
    )
    .unwrap();
    let mut per_dev = [0usize; 3];
    // Many small allocations of one session still interleave (the cursor persists).
    for _ in 0..60 {
        for a in store.alloc(5, 1, 10_000).unwrap() {
            per_dev[a.device as usize] += 1;
        }
    }
    assert_eq!(per_dev, [30, 10, 20]);
    // Smooth: within any window of 6 consecutive pages the split is exactly 3:1:2.
    let addrs = store.alloc(6, 12, 10_000).unwrap();
    for w in addrs.chunks(6) {
        let mut c = [0; 3];
        for a in w {
            c[a.device as usize] += 1;
        }
        assert_eq!(c, [3, 1, 2]);
    }
    // A full device is skipped, the rest still serve: every unit ends up used (3-unit pages
    // on devices of 1024 units, a unit short of a whole number of them, then 1-unit pages).
    let mut total = 72 * 3;
    while let Ok(a) = store.alloc(7, 1, 10_000) {
        total += a[0].units as u64;
    }
    while let Ok(a) = store.alloc(7, 1, 100) {
        total += a[0].units as u64;
    }
    assert_eq!(total, store.device_units().iter().sum::<u64>());
    assert_eq!(store.free_bytes(), 0);
}

/// An driver for a store of two devices whose first is slow: its operations go through a
/// stalling [`FaultyDriver`], the other device's straight to pread.
struct SlowFirstDevice {
    slow: PathBuf,
    stalled: FaultyDriver<PreadDriver>,
    fast: PreadDriver,
}

impl IoDriver for SlowFirstDevice {
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
    let driver = SlowFirstDevice {
        slow: cfg.devices[0].path.clone(),
        stalled: FaultyDriver::new(
            PreadDriver::new(),
            vec![FaultRule {
                kind: None,
                fault: Fault::Stall(std::time::Duration::from_millis(5)),
                trigger: Trigger::Always,
            }],
            0,
        )
        .unwrap(),
        fast: PreadDriver::new(),
    };
    let store = PageStore::open(&cfg, Arc::new(driver)).unwrap();
    assert!(store.usage().devices.iter().all(|d| d.read_link.is_none()));
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
        .all(|d| d.write_samples == 1 && d.write_link.is_some()));

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
        u.devices[0].read_link.unwrap(),
        u.devices[1].read_link.unwrap(),
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
    let page = tier.store().page_bytes(9000);
    assert_eq!(page, 12288);
    for r in &batches {
        let slow_pages = s.pages[r.clone()].iter().filter(|p| p.device == 0).count() as u64;
        assert!(
            r.len() == 1 || slow.time(slow_pages * page) <= BULK_BATCH_SECONDS,
            "{r:?}"
        );
    }
    assert_eq!(batches.last().unwrap().end, 100);
}

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// Pages of three sizes in one store (a small model's 20 KiB runs, Llama-3-8B's 512 KiB, a
/// 3 MiB run) written in one batch and read back in one, each page exactly its extent; freed
/// space is reused by pages of another size.
#[test]
fn pages_of_different_sizes_share_a_store_and_reuse_freed_space() {
    let dir = test_dir("store-mixed");
    let driver: Arc<dyn IoDriver> = Arc::new(UringDriver::new(UringConfig::default()).unwrap());
    let mut cfg = store_cfg(&dir, &[1.0, 1.0], 16 * MIB as u64);
    cfg.max_payload = 3 * MIB;
    let store = PageStore::open(&cfg, driver).unwrap();
    store.set_workers(4).unwrap();
    let sizes = [(20 * KIB, 12), (512 * KIB, 6), (3 * MIB, 3)];
    let mut addrs = Vec::new();
    let mut payloads = Vec::new();
    for (k, &(len, n)) in sizes.iter().enumerate() {
        let got = store.alloc(k as u64, n, len).unwrap();
        assert!(got.iter().all(|a| a.units == store.page_units(len)));
        assert_eq!(
            store.page_bytes(len),
            (64 + len).div_ceil(4096) as u64 * 4096
        );
        for a in got {
            addrs.push(a);
            payloads.push(pattern(addrs.len() as u64, len));
        }
    }
    // No two extents overlap, and usage counts exactly their units.
    let mut sorted = addrs.clone();
    sorted.sort();
    for w in sorted.windows(2) {
        assert!(
            w[0].device != w[1].device || w[0].page + w[0].units as u64 <= w[1].page,
            "{w:?}"
        );
    }
    let units: u64 = addrs.iter().map(|a| a.units as u64).sum();
    let u = store.usage();
    assert_eq!(u.unit, 4096);
    assert_eq!(u.devices.iter().map(|d| d.units_used).sum::<u64>(), units);
    assert_eq!(
        u.devices.iter().map(|d| d.bytes_used).sum::<u64>(),
        units * 4096
    );
    assert_eq!(
        u.devices.iter().map(|d| d.pages).sum::<u64>(),
        addrs.len() as u64
    );

    // Striped over both devices whatever the size.
    assert!(addrs.iter().any(|a| a.device == 0) && addrs.iter().any(|a| a.device == 1));
    let all: Vec<usize> = (0..addrs.len()).collect();
    let crcs = store
        .write_pages(&writes_of(&addrs, &payloads, &all))
        .unwrap();
    store.sync().unwrap();
    assert_eq!(
        store.usage().bytes_written,
        units * 4096,
        "each write is its extent"
    );
    let got = store
        .read_pages(&reads_of(&addrs, Some(&crcs), &all))
        .unwrap();
    for (i, r) in got.into_iter().enumerate() {
        assert_eq!(r.unwrap().payload(), &payloads[i][..], "page {i}");
    }
    assert_eq!(
        store.usage().bytes_read,
        units * 4096,
        "each read is its extent"
    );

    // Free the 512 KiB pages: their space takes 20 KiB pages (best fit puts them in the
    // holes, the smallest free ranges that hold them), and a 3 MiB page still fits after.
    let mid: Vec<usize> = (12..18).collect();
    let freed: Vec<PageAddr> = mid.iter().map(|&i| addrs[i]).collect();
    let free_before = store.free_bytes();
    store.free(&freed).unwrap();
    assert_eq!(
        store.free_bytes(),
        free_before + freed.iter().map(|a| a.units as u64 * 4096).sum::<u64>()
    );
    let small = store.alloc(7, 20, 20 * KIB).unwrap();
    let in_holes = small
        .iter()
        .filter(|s| {
            freed.iter().any(|f| {
                f.device == s.device
                    && f.page <= s.page
                    && s.page + s.units as u64 <= f.page + f.units as u64
            })
        })
        .count();
    assert!(
        in_holes >= 18,
        "{in_holes} of 20 new pages in the freed space"
    );
    let small_payloads: Vec<Vec<u8>> = (0..20).map(|i| pattern(1000 + i, 20 * KIB)).collect();
    let idx: Vec<usize> = (0..20).collect();
    let small_crcs = store
        .write_pages(&writes_of(&small, &small_payloads, &idx))
        .unwrap();
    // The pages around them are intact.
    let rest: Vec<usize> = (0..addrs.len()).filter(|i| !mid.contains(i)).collect();
    for (r, &i) in store
        .read_pages(&reads_of(&addrs, Some(&crcs), &rest))
        .unwrap()
        .into_iter()
        .zip(&rest)
    {
        assert_eq!(r.unwrap().payload(), &payloads[i][..], "page {i}");
    }
    for (i, r) in store
        .read_pages(&reads_of(&small, Some(&small_crcs), &idx))
        .unwrap()
        .into_iter()
        .enumerate()
    {
        assert_eq!(r.unwrap().payload(), &small_payloads[i][..]);
    }
    let big = store.alloc(8, 1, 3 * MIB).unwrap();
    // Everything back: the whole space is one free extent per device again.
    store.free(&big).unwrap();
    store.free(&small).unwrap();
    let rest_addrs: Vec<PageAddr> = rest.iter().map(|&i| addrs[i]).collect();
    store.free(&rest_addrs).unwrap();
    let u = store.usage();
    assert!(u.devices.iter().all(|d| d.units_used == 0 && d.pages == 0));
    assert_eq!(store.largest_free_bytes(), 16 * MIB as u64);
}

/// A store of devices of `units` 4 KiB units, one a bandwidth of `bws`, for payloads of up to
/// 100 KiB.
fn large_page_store(dir: &Path, bws: &[f64], units: u64, driver: Arc<dyn IoDriver>) -> PageStore {
    let mut cfg = store_cfg(dir, bws, units * 4096);
    cfg.max_payload = 100 * KIB;
    PageStore::open(&cfg, driver).unwrap()
}

/// Allocating `pages` pages of 100 KiB for `session` is refused and allocates nothing
/// (`why`): the refusal.
fn refused_large(store: &PageStore, session: u64, pages: usize, why: &str) -> NvmeError {
    let before = store.usage();
    let e = store.alloc(session, pages, 100 * KIB).unwrap_err();
    assert_eq!(store.usage(), before, "{why}");
    e
}

/// A store with room for small pages but no extent long enough for a large one: `Full`,
/// typed, with nothing allocated, on one device and across two (all or nothing).
#[test]
fn full_for_a_large_page_while_small_ones_still_fit() {
    let dir = test_dir("store-full-large");
    let driver: Arc<dyn IoDriver> = Arc::new(UringDriver::new(UringConfig::default()).unwrap());
    // 64 units; a 100 KiB page takes 26.
    let store = large_page_store(&dir, &[1.0], 64, driver.clone());
    assert_eq!(store.page_units(100 * KIB), 26);
    let small = store.alloc(1, 64, 1000).unwrap();
    // Every other page freed: 32 free units, none next to another.
    let odd: Vec<PageAddr> = small.iter().skip(1).step_by(2).copied().collect();
    store.free(&odd).unwrap();
    let e = refused_large(&store, 1, 1, "nothing allocated");
    assert_eq!(full(&e), (1, 106_496, 131_072, 4096));
    assert!(
        e.to_string().contains("largest free extent 4096 bytes"),
        "{e}"
    );
    // Small pages still fit, in every hole.
    store.alloc(1, 32, 1000).unwrap();
    assert_eq!(store.free_bytes(), 0);

    // Two devices, room for one large page each: three are refused as a whole.
    let dir = test_dir("store-full-large-2");
    let store = large_page_store(&dir, &[1.0, 1.0], 40, driver);
    let e = refused_large(&store, 2, 3, "the two that fitted were given back");
    let (requested, _, free_bytes, _) = full(&e);
    assert_eq!((requested, free_bytes), (3, 327_680));
    let two = store.alloc(2, 2, 100 * KIB).unwrap();
    assert_ne!(two[0].device, two[1].device);
    // And the 14 units left on each still take small pages.
    assert_eq!(store.alloc(2, 28, 1000).unwrap().len(), 28);
}
