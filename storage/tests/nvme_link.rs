//! Links: the online tracker, batch splitting by tracked rates and the device probe.

use std::sync::Arc;

use kvtier_storage::nvme::io::UringConfig;
use kvtier_storage::nvme::link::{
    probe_device, probe_path, split_batches, Link, LinkTracker, Observed, ProbeConfig,
    TRACKER_OUTLIER_FACTOR, TRACKER_WARMUP,
};
use kvtier_storage::nvme::{open_best_driver, AlignedBuf, DirectFile, IoRequest, NvmeError};
use proptest::prelude::*;

const GB: f64 = 1e9;
const KIB: u64 = 1024;

fn link(gbps: f64, lat_us: f64) -> Link {
    Link::new(gbps * GB, lat_us * 1e-6).unwrap()
}

#[test]
fn bad_links_are_typed() {
    for (name, bw, lat) in [
        ("zero bandwidth", 0.0, 0.0),
        ("negative latency", 1.0, -1.0),
        ("NaN bandwidth", f64::NAN, 0.0),
        ("infinite latency", 1.0, f64::INFINITY),
    ] {
        assert!(
            matches!(Link::new(bw, lat), Err(NvmeError::InvalidArgument { .. })),
            "{name}"
        );
    }
    assert!(matches!(
        split_batches(&[], &[], 1.0, 1),
        Err(NvmeError::InvalidArgument { .. })
    ));
}

/// A tracker decision-table row: a prior, the device's true link, the transfer sizes fed (in
/// rotation), and how close the estimate must be after `n` transfers.
struct TrackCase {
    name: &'static str,
    prior: (f64, f64),
    alpha: f64,
    truth: (f64, f64),
    sizes: &'static [u64],
    n: usize,
    bw_rel_tol: f64,
    /// None: the latency is not identifiable from these sizes; it must stay at the prior's.
    lat_tol_us: Option<f64>,
}

const TRACK_CASES: &[TrackCase] = &[
    TrackCase {
        name: "mixed sizes recover bandwidth and latency",
        prior: (1.0, 0.0),
        alpha: 0.05,
        truth: (2.0, 100.0),
        sizes: &[4 * KIB, 64 * KIB, 256 * KIB, 1024 * KIB],
        n: 400,
        bw_rel_tol: 0.01,
        lat_tol_us: Some(2.0),
    },
    TrackCase {
        name: "one size only: latency stays at the prior, bandwidth absorbs the rest",
        prior: (1.0, 100.0),
        alpha: 0.1,
        truth: (2.0, 100.0),
        sizes: &[256 * KIB],
        n: 50,
        bw_rel_tol: 0.01,
        lat_tol_us: None,
    },
    TrackCase {
        name: "a relative-weight prior (1 B/s) is replaced by the first transfer",
        prior: (1e-9, 0.0),
        alpha: 0.1,
        truth: (1.3, 80.0),
        sizes: &[8 * KIB, 256 * KIB, 2048 * KIB],
        n: 300,
        bw_rel_tol: 0.01,
        lat_tol_us: Some(2.0),
    },
    TrackCase {
        name: "a fast device (7 GB/s, 20 us) in store-sized batches",
        prior: (2.0, 0.0),
        alpha: 0.1,
        truth: (7.0, 20.0),
        sizes: &[8 * KIB, 64 * KIB, 512 * KIB, 16 << 20],
        n: 300,
        bw_rel_tol: 0.01,
        lat_tol_us: Some(1.0),
    },
    TrackCase {
        name: "a slow device (200 MB/s, 2 ms) with latency-dominated small transfers",
        prior: (2.0, 0.0),
        alpha: 0.1,
        truth: (0.2, 2000.0),
        sizes: &[4 * KIB, 8 * KIB, 1024 * KIB],
        n: 300,
        bw_rel_tol: 0.01,
        lat_tol_us: Some(20.0),
    },
];

#[test]
fn tracker_decision_table_converges() {
    for c in TRACK_CASES {
        let prior = link(c.prior.0, c.prior.1);
        let truth = link(c.truth.0, c.truth.1);
        let mut t = LinkTracker::new(prior, c.alpha).unwrap();
        assert_eq!(t.estimate(), prior, "{}: prior before data", c.name);
        for i in 0..c.n {
            let b = c.sizes[i % c.sizes.len()];
            assert!(t.observe(b, truth.time(b)).used(), "{}", c.name);
        }
        assert_eq!(t.samples(), c.n as u64);
        let e = t.estimate();
        let rel = e.bandwidth_bytes_per_s / truth.bandwidth_bytes_per_s - 1.0;
        assert!(rel.abs() < c.bw_rel_tol, "{}: {e:?} vs {truth:?}", c.name);
        match c.lat_tol_us {
            Some(tol) => assert!(
                (e.latency_s - truth.latency_s).abs() < tol * 1e-6,
                "{}: {e:?}",
                c.name
            ),
            None => assert_eq!(e.latency_s, prior.latency_s, "{}", c.name),
        }
    }
}

/// Transfers of nearly one size with a little timing noise: the least-squares fit puts almost
/// all of the time into the latency and reads a near-infinite bandwidth (a decode step's
/// batches look like this). The throughput, mean bytes over mean seconds, stays the rate the
/// link delivers at those sizes, which is what stripe weights need.
#[test]
fn tracker_throughput_is_the_rate_at_the_observed_sizes_when_the_fit_is_ill_conditioned() {
    let mut t = LinkTracker::new(link(1.0, 0.0), 0.1).unwrap();
    for i in 0..200 {
        // 1.00 or 1.01 MB; 1.0000 or 1.0001 ms: ~1 GB/s, with the size and time barely related.
        let (b, s) = if i % 2 == 0 {
            (1_000_000, 1.0e-3)
        } else {
            (1_010_000, 1.0001e-3)
        };
        t.observe(b, s);
    }
    let e = t.estimate();
    assert!(
        e.bandwidth_bytes_per_s > 50e9,
        "the fit extrapolates wildly here: {e:?}"
    );
    let tp = t.throughput().unwrap();
    assert!((tp / 1.005e9 - 1.0).abs() < 0.01, "throughput {tp}");
    // Where the fit is well conditioned, the throughput is the true link's rate at a size
    // within the observed ones (an EWMA of them).
    let truth = link(2e9, 50e-6);
    let tp = settled(truth).throughput().unwrap();
    let rate = |b: u64| b as f64 / truth.time(b);
    assert!(rate(64 * KIB) < tp && tp < rate(1024 * KIB), "{tp}");
    assert_eq!(
        LinkTracker::new(link(1.0, 0.0), 0.1).unwrap().throughput(),
        None
    );
}

/// A tracker settled on `truth` with mixed sizes.
fn settled(truth: Link) -> LinkTracker {
    let mut t = LinkTracker::new(link(1.0, 0.0), 0.1).unwrap();
    let sizes = [64 * KIB, 256 * KIB, 1024 * KIB];
    for i in 0..300 {
        let b = sizes[i % 3];
        t.observe(b, truth.time(b));
    }
    t
}

#[test]
fn tracker_follows_a_lasting_change() {
    let sizes = [64 * KIB, 256 * KIB, 1024 * KIB];
    // 2 GB/s -> 1 GB/s (within the outlier bound) and 2 GB/s -> 0.1 GB/s (each transfer
    // 20x slower than predicted at first, so clamped until the estimate catches up).
    for (after, within) in [(link(1.0, 100.0), 100), (link(0.1, 100.0), 150)] {
        let mut t = settled(link(2.0, 100.0));
        for i in 0..within {
            let b = sizes[i % 3];
            t.observe(b, after.time(b));
        }
        let e = t.estimate();
        assert!(
            (e.bandwidth_bytes_per_s / after.bandwidth_bytes_per_s - 1.0).abs() < 0.03,
            "after {within} transfers at {after:?}: {e:?}"
        );
    }
}

#[test]
fn tracker_clamps_outliers() {
    let truth = link(2.0, 100.0);
    let b = 256 * KIB;
    // A 1000x stall: clamped, and the estimate moves by a bounded step.
    let mut t = settled(truth);
    assert_eq!(t.observe(b, truth.time(b) * 1000.0), Observed::Clamped);
    let e = t.estimate();
    let drop = 1.0 - e.bandwidth_bytes_per_s / truth.bandwidth_bytes_per_s;
    assert!(drop < 0.35, "one stall cut the estimate by {drop}: {e:?}");
    // What the clamp prevents: the same stall folded in as measured (as a first transfer
    // is) wrecks the estimate.
    let mut raw = LinkTracker::new(truth, 0.1).unwrap();
    raw.observe(b, truth.time(b) * 1000.0);
    assert!(raw.estimate().bandwidth_bytes_per_s < 0.01 * truth.bandwidth_bytes_per_s);
    // A few normal transfers put it back.
    let sizes = [64 * KIB, 256 * KIB, 1024 * KIB];
    for i in 0..40 {
        let s = sizes[i % 3];
        assert_eq!(t.observe(s, truth.time(s)), Observed::Folded);
    }
    let e = t.estimate();
    assert!(
        (e.bandwidth_bytes_per_s / truth.bandwidth_bytes_per_s - 1.0).abs() < 0.03,
        "{e:?}"
    );
    // Implausibly fast (a cache hit, a timer glitch): clamped too.
    let mut t = settled(truth);
    assert_eq!(t.observe(b, truth.time(b) / 1000.0), Observed::Clamped);
    let rise = t.estimate().bandwidth_bytes_per_s / truth.bandwidth_bytes_per_s - 1.0;
    assert!(rise < 0.5, "one fast outlier raised the estimate by {rise}");
    // Within the bound is folded as measured.
    let mut t = settled(truth);
    assert_eq!(
        t.observe(b, truth.time(b) * TRACKER_OUTLIER_FACTOR * 0.99),
        Observed::Folded
    );
    // Before warm-up nothing is an outlier: the first transfers define the estimate.
    let mut t = LinkTracker::new(link(1.0, 0.0), 0.1).unwrap();
    for i in 0..TRACKER_WARMUP {
        let secs = if i % 2 == 0 { 1e-3 } else { 1.0 };
        assert_eq!(t.observe(b, secs), Observed::Folded);
    }
}

#[test]
fn tracker_ignores_zero_and_nonsense_durations() {
    let truth = link(2.0, 100.0);
    let mut t = settled(truth);
    let (before, n) = (t.estimate(), t.samples());
    for (bytes, secs) in [
        (0, 1.0),
        (4096, 0.0),
        (4096, -1e-3),
        (4096, f64::NAN),
        (4096, f64::INFINITY),
    ] {
        assert_eq!(
            t.observe(bytes, secs),
            Observed::Ignored,
            "{bytes} B in {secs} s"
        );
        assert!(!t.observe(bytes, secs).used());
    }
    assert_eq!((t.estimate(), t.samples()), (before, n), "nothing moved");
    // A fresh tracker given only nonsense keeps its prior.
    let mut t = LinkTracker::new(link(1.0, 5.0), 0.5).unwrap();
    t.observe(4096, 0.0);
    assert_eq!((t.estimate(), t.samples()), (link(1.0, 5.0), 0));
    assert!(LinkTracker::new(link(1.0, 0.0), 0.0).is_err());
    assert!(LinkTracker::new(link(1.0, 0.0), 1.5).is_err());
    assert!(LinkTracker::new(link(1.0, 0.0), f64::NAN).is_err());
}

const MB: u64 = 1_000_000;

/// A batch-split decision-table row: links (GB/s, latency us), reads as link indices (each
/// `MB` bytes), target ms, cap, and the expected batch lengths.
struct SplitCase {
    name: &'static str,
    links: &'static [(f64, f64)],
    reads: &'static [usize],
    target_ms: f64,
    max_reads: usize,
    batches: &'static [usize],
}

const SPLIT_CASES: &[SplitCase] = &[
    SplitCase {
        name:
            "1:3 links, pages striped 1:3: each batch takes 2 from the slow link, 6 from the fast",
        links: &[(1.0, 0.0), (3.0, 0.0)],
        reads: &[0, 1, 1, 1, 0, 1, 1, 1, 0, 1, 1, 1, 0, 1, 1, 1, 0],
        target_ms: 2.0,
        max_reads: 100,
        batches: &[8, 8, 1],
    },
    SplitCase {
        name: "the same pages at equal rates: at most 2 MB per link per batch",
        links: &[(1.0, 0.0), (1.0, 0.0)],
        reads: &[0, 1, 1, 1, 0, 1, 1, 1, 0, 1, 1, 1, 0, 1, 1, 1, 0],
        target_ms: 2.0,
        max_reads: 100,
        batches: &[3, 3, 3, 2, 3, 3],
    },
    SplitCase {
        name: "the cap bounds a batch the rates would allow",
        links: &[(100.0, 0.0)],
        reads: &[0, 0, 0, 0, 0, 0, 0],
        target_ms: 1000.0,
        max_reads: 3,
        batches: &[3, 3, 1],
    },
    SplitCase {
        name: "latency counts: a read that cannot fit the target alone still goes, alone",
        links: &[(1.0, 1500.0)],
        reads: &[0, 0, 0],
        target_ms: 2.0,
        max_reads: 100,
        batches: &[1, 1, 1],
    },
    SplitCase {
        name: "a read past the target alone closes its batch at once",
        links: &[(0.25, 0.0), (10.0, 0.0)],
        reads: &[0, 1, 1, 0],
        target_ms: 2.0,
        max_reads: 100,
        batches: &[1, 2, 1],
    },
    SplitCase {
        name: "a link that is idle in a batch costs nothing",
        links: &[(0.001, 0.0), (10.0, 0.0)],
        reads: &[1, 1, 1, 1, 1],
        target_ms: 1.0,
        max_reads: 100,
        batches: &[5],
    },
    SplitCase {
        name: "no reads: no batches",
        links: &[(1.0, 0.0)],
        reads: &[],
        target_ms: 1.0,
        max_reads: 1,
        batches: &[],
    },
];

#[test]
fn split_batches_decision_table() {
    for c in SPLIT_CASES {
        let links: Vec<Link> = c.links.iter().map(|&(g, l)| link(g, l)).collect();
        let reads: Vec<(usize, u64)> = c.reads.iter().map(|&l| (l, MB)).collect();
        let got = split_batches(&links, &reads, c.target_ms * 1e-3, c.max_reads).unwrap();
        let lens: Vec<usize> = got.iter().map(|r| r.len()).collect();
        assert_eq!(lens, c.batches, "{}", c.name);
    }
}

#[test]
fn split_batches_rejects_bad_input() {
    let ok = [link(1.0, 0.0)];
    let r = [(0usize, MB)];
    for (name, links, reads, target, max) in [
        ("no links", &[][..], &r[..], 1.0, 1),
        ("link out of range", &ok[..], &[(1usize, MB)][..], 1.0, 1),
        ("zero target", &ok[..], &r[..], 0.0, 1),
        ("NaN target", &ok[..], &r[..], f64::NAN, 1),
        ("zero cap", &ok[..], &r[..], 1.0, 0),
    ] {
        assert!(
            matches!(
                split_batches(links, reads, target, max),
                Err(NvmeError::InvalidArgument { .. })
            ),
            "{name}"
        );
    }
}

#[test]
fn probe_measures_a_real_file() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("nvme-probe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let driver = open_best_driver(UringConfig::default());
    let f = Arc::new(DirectFile::open(&dir.join("dev")).unwrap());
    let span = 16u64 << 20;
    f.ensure_len(span).unwrap();
    // Write real data so reads hit allocated blocks rather than unwritten extents.
    let reqs = (0..16u64)
        .map(|i| {
            IoRequest::write(f.clone(), i << 20, AlignedBuf::new(1 << 20, 4096).unwrap()).unwrap()
        })
        .collect();
    for c in driver.submit(reqs).unwrap() {
        c.result.unwrap();
    }
    let cfg = ProbeConfig {
        latency_reads: 8,
        block_bytes: 256 << 10,
        depth: 8,
        batches: 4,
    };
    let l = probe_device(driver.as_ref(), &f, span, cfg).unwrap();
    assert!(
        l.bandwidth_bytes_per_s > 1e6 && l.bandwidth_bytes_per_s < 1e12,
        "{l:?}"
    );
    assert!(l.latency_s > 0.0 && l.latency_s < 1.0, "{l:?}");
    assert!(
        probe_device(driver.as_ref(), &f, 1000, cfg).is_err(),
        "span too small"
    );
    let bad = ProbeConfig {
        block_bytes: 1000,
        ..cfg
    };
    assert!(matches!(
        probe_device(driver.as_ref(), &f, span, bad),
        Err(NvmeError::Misaligned { .. })
    ));
    std::fs::remove_dir_all(dir).unwrap();
}

/// The startup probe of a device file reads a scratch file it wrote beside it (a fresh device
/// file's unwritten extents would read back as zeros without I/O), leaves the device file's
/// bytes alone and removes the scratch file, also when the probe fails.
#[test]
fn probe_path_measures_written_bytes_beside_the_device_and_cleans_up() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("nvme-probe-path-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let driver = open_best_driver(UringConfig::default());
    let dev = dir.join("pages-0");
    let f = Arc::new(DirectFile::open(&dev).unwrap());
    f.ensure_len(8 << 20).unwrap();
    let mut buf = AlignedBuf::new(1 << 20, 4096).unwrap();
    buf.fill(0xC3);
    for c in driver
        .submit(vec![IoRequest::write(f.clone(), 3 << 20, buf).unwrap()])
        .unwrap()
    {
        c.result.unwrap();
    }
    let before = std::fs::read(&dev).unwrap();
    let cfg = ProbeConfig {
        latency_reads: 8,
        block_bytes: 256 << 10,
        depth: 8,
        batches: 4,
    };
    let l = probe_path(driver.as_ref(), &dev, cfg).unwrap();
    assert!(
        l.bandwidth_bytes_per_s > 1e6 && l.bandwidth_bytes_per_s < 1e12,
        "{l:?}"
    );
    assert!(l.latency_s > 0.0 && l.latency_s < 1.0, "{l:?}");
    let scratch = dir.join("pages-0.probe");
    assert!(!scratch.exists(), "scratch file removed");
    assert_eq!(
        std::fs::read(&dev).unwrap(),
        before,
        "device file untouched"
    );
    let bad = ProbeConfig {
        block_bytes: 1000,
        ..cfg
    };
    assert!(matches!(
        probe_path(driver.as_ref(), &dev, bad),
        Err(NvmeError::Misaligned { .. })
    ));
    assert!(
        !scratch.exists(),
        "scratch file removed after a failed probe"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn split_batches_cover_in_order_and_are_maximal(
        (links, reads, target_ms, max) in (1usize..5).prop_flat_map(|nl| (
            prop::collection::vec((0.1f64..20.0, 0.0f64..300.0), nl)
                .prop_map(|v| v.into_iter().map(|(g, l)| link(g, l)).collect::<Vec<_>>()),
            prop::collection::vec((0..nl, 1u64..(4 << 20)), 0..200),
            0.01f64..20.0,
            1usize..80,
        ))
    ) {
        let target = target_ms * 1e-3;
        let got = split_batches(&links, &reads, target, max).unwrap();
        let mut next = 0;
        for r in &got {
            prop_assert_eq!(r.start, next, "contiguous, in order");
            prop_assert!(!r.is_empty() && r.len() <= max);
            next = r.end;
            let makespan = |r: std::ops::Range<usize>| {
                let mut by = vec![0u64; links.len()];
                for &(l, b) in &reads[r] {
                    by[l] += b;
                }
                links.iter().zip(&by).map(|(l, &b)| l.time(b)).fold(0.0, f64::max)
            };
            // Within the target unless it is a single read.
            prop_assert!(r.len() == 1 || makespan(r.clone()) <= target);
            // Maximal: one more read would break the target or the cap.
            if r.end < reads.len() {
                prop_assert!(r.len() == max || makespan(r.start..r.end + 1) > target);
            }
        }
        prop_assert_eq!(next, reads.len());
    }
}
