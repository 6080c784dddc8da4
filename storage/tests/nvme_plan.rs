//! Fetch planner: decision tables, properties, the online tracker and the device probe.

use std::sync::Arc;

use kvtier_storage::nvme::io::UringConfig;
use kvtier_storage::nvme::plan::{
    evaluate, plan, probe_device, proportional_split, uniform, BlockCopies, Lane, LaneTracker,
    ProbeConfig,
};
use kvtier_storage::nvme::{open_best_engine, AlignedBuf, DirectFile, IoRequest, NvmeError};
use proptest::prelude::*;

const GB: f64 = 1e9;
const KIB: u64 = 1024;

fn lane(gbps: f64, lat_us: f64) -> Lane {
    Lane::new(gbps * GB, lat_us * 1e-6).unwrap()
}

fn blk(bytes: u64, lanes: &[usize]) -> BlockCopies {
    BlockCopies {
        bytes,
        lanes: lanes.to_vec(),
    }
}

/// A decision-table row: lanes as (GB/s, latency us), blocks as (bytes, holders), and what
/// the plan must be: exact bytes per lane, and its makespan relative to uniform.
struct Case {
    name: &'static str,
    lanes: &'static [(f64, f64)],
    blocks: &'static [(u64, &'static [usize])],
    lane_bytes: &'static [u64],
    /// plan makespan / uniform makespan must be <= this.
    max_ratio_to_uniform: f64,
}

const K256: u64 = 256 * KIB;

const CASES: &[Case] = &[
    Case {
        name: "single lane takes everything",
        lanes: &[(10.0, 5.0)],
        blocks: &[(K256, &[0]), (K256, &[0])],
        lane_bytes: &[2 * K256],
        max_ratio_to_uniform: 1.0,
    },
    Case {
        name: "single-copy blocks are fixed regardless of speed",
        lanes: &[(50.0, 0.0), (1.0, 0.0)],
        blocks: &[(K256, &[1]), (K256, &[1]), (K256, &[0])],
        lane_bytes: &[K256, 2 * K256],
        max_ratio_to_uniform: 1.0,
    },
    Case {
        name: "3:1 bandwidth gets a 3:1 split of shared blocks",
        lanes: &[(3.0, 0.0), (1.0, 0.0)],
        blocks: &[
            (K256, &[0, 1]),
            (K256, &[0, 1]),
            (K256, &[0, 1]),
            (K256, &[0, 1]),
            (K256, &[0, 1]),
            (K256, &[0, 1]),
            (K256, &[0, 1]),
            (K256, &[0, 1]),
        ],
        lane_bytes: &[6 * K256, 2 * K256],
        max_ratio_to_uniform: 0.76,
    },
    Case {
        name: "RAM 50 GB/s vs NVMe 2 GB/s: everything shared comes from RAM",
        lanes: &[(50.0, 2.0), (2.0, 80.0)],
        blocks: &[
            (K256, &[0, 1]),
            (K256, &[0, 1]),
            (K256, &[0, 1]),
            (K256, &[0, 1]),
        ],
        lane_bytes: &[4 * K256, 0],
        max_ratio_to_uniform: 0.2,
    },
    Case {
        name: "fixed NVMe backlog: shared blocks fill the other lane first",
        lanes: &[(2.0, 0.0), (2.0, 0.0)],
        blocks: &[
            (K256, &[0]),
            (K256, &[0]),
            (K256, &[0]),
            (K256, &[0]),
            (K256, &[0, 1]),
            (K256, &[0, 1]),
            (K256, &[0, 1]),
            (K256, &[0, 1]),
        ],
        lane_bytes: &[4 * K256, 4 * K256],
        max_ratio_to_uniform: 1.0,
    },
    Case {
        name: "latency keeps a tiny transfer off a slow-to-start lane",
        lanes: &[(1.0, 0.0), (100.0, 1000.0)],
        blocks: &[(4 * KIB, &[0, 1])],
        lane_bytes: &[4 * KIB, 0],
        max_ratio_to_uniform: 1.0,
    },
    Case {
        name: "mixed sizes, two equal lanes: LPT balances exactly",
        lanes: &[(1.0, 0.0), (1.0, 0.0)],
        blocks: &[
            (300 * KIB, &[0, 1]),
            (200 * KIB, &[0, 1]),
            (100 * KIB, &[0, 1]),
            (100 * KIB, &[0, 1]),
            (100 * KIB, &[0, 1]),
            (200 * KIB, &[0, 1]),
        ],
        lane_bytes: &[500 * KIB, 500 * KIB],
        max_ratio_to_uniform: 1.0,
    },
    Case {
        name: "three lanes, restricted copies",
        lanes: &[(4.0, 0.0), (2.0, 0.0), (2.0, 0.0)],
        blocks: &[
            (K256, &[0, 1]),
            (K256, &[0, 1]),
            (K256, &[0, 2]),
            (K256, &[0, 2]),
            (K256, &[1, 2]),
            (K256, &[1, 2]),
            (K256, &[0, 1, 2]),
            (K256, &[0, 1, 2]),
        ],
        lane_bytes: &[4 * K256, 2 * K256, 2 * K256],
        max_ratio_to_uniform: 1.0,
    },
    Case {
        name: "no blocks: empty plan",
        lanes: &[(1.0, 10.0), (2.0, 10.0)],
        blocks: &[],
        lane_bytes: &[0, 0],
        max_ratio_to_uniform: 1.0,
    },
];

#[test]
fn decision_table() {
    for c in CASES {
        let lanes: Vec<Lane> = c.lanes.iter().map(|&(g, l)| lane(g, l)).collect();
        let blocks: Vec<BlockCopies> = c.blocks.iter().map(|&(b, ls)| blk(b, ls)).collect();
        let p = plan(&lanes, &blocks).unwrap();
        let u = uniform(&lanes, &blocks).unwrap();
        assert_eq!(p.lane_bytes, c.lane_bytes, "{}", c.name);
        assert_eq!(
            evaluate(&lanes, &blocks, &p.assignment).unwrap(),
            p,
            "{}",
            c.name
        );
        if u.makespan_s > 0.0 {
            let ratio = p.makespan_s / u.makespan_s;
            assert!(
                ratio <= c.max_ratio_to_uniform + 1e-9,
                "{}: ratio {ratio}",
                c.name
            );
        }
    }
}

#[test]
fn bad_inputs_are_typed() {
    let ok = [lane(1.0, 0.0)];
    let cases: Vec<(&str, Vec<Lane>, Vec<BlockCopies>)> = vec![
        ("no lanes", vec![], vec![]),
        ("block without copies", ok.to_vec(), vec![blk(1, &[])]),
        ("lane out of range", ok.to_vec(), vec![blk(1, &[1])]),
        (
            "zero bandwidth",
            vec![Lane {
                bandwidth_bytes_per_s: 0.0,
                latency_s: 0.0,
            }],
            vec![],
        ),
        (
            "negative latency",
            vec![Lane {
                bandwidth_bytes_per_s: 1.0,
                latency_s: -1.0,
            }],
            vec![],
        ),
        (
            "NaN bandwidth",
            vec![Lane {
                bandwidth_bytes_per_s: f64::NAN,
                latency_s: 0.0,
            }],
            vec![],
        ),
    ];
    for (name, lanes, blocks) in cases {
        assert!(
            matches!(
                plan(&lanes, &blocks),
                Err(NvmeError::InvalidArgument { .. })
            ),
            "{name}"
        );
        assert!(
            matches!(
                uniform(&lanes, &blocks),
                Err(NvmeError::InvalidArgument { .. })
            ),
            "{name}"
        );
    }
    let lanes = [lane(1.0, 0.0), lane(1.0, 0.0)];
    let blocks = [blk(10, &[0])];
    assert!(
        evaluate(&lanes, &blocks, &[1]).is_err(),
        "assigned to a non-holder"
    );
    assert!(evaluate(&lanes, &blocks, &[]).is_err(), "wrong length");
    assert!(Lane::new(1.0, f64::INFINITY).is_err());
}

#[test]
fn proportional_split_sums_and_follows_bandwidth() {
    let lanes = [lane(3.0, 0.0), lane(1.0, 0.0), lane(2.0, 0.0)];
    assert_eq!(proportional_split(&lanes, 60).unwrap(), vec![30, 10, 20]);
    let s = proportional_split(&lanes, 7).unwrap();
    assert_eq!(s.iter().sum::<u64>(), 7);
    assert_eq!(s, vec![4, 1, 2]);
    assert_eq!(proportional_split(&lanes, 0).unwrap(), vec![0, 0, 0]);
}

#[test]
fn tracker_recovers_latency_and_bandwidth_and_follows_change() {
    let truth = lane(2.0, 100.0);
    let mut t = LaneTracker::new(lane(1.0, 0.0), 0.05).unwrap();
    assert_eq!(t.estimate(), lane(1.0, 0.0), "prior before data");
    let sizes = [4 * KIB, 64 * KIB, 256 * KIB, 1024 * KIB];
    for i in 0..400 {
        let b = sizes[i % 4];
        assert!(t.observe(b, truth.time(b)));
    }
    let e = t.estimate();
    assert!(
        (e.bandwidth_bytes_per_s / truth.bandwidth_bytes_per_s - 1.0).abs() < 0.01,
        "{e:?}"
    );
    assert!((e.latency_s - truth.latency_s).abs() < 2e-6, "{e:?}");
    // The device slows to 1 GB/s: the estimate follows within a few hundred transfers.
    let slow = lane(1.0, 100.0);
    for i in 0..400 {
        let b = sizes[i % 4];
        t.observe(b, slow.time(b));
    }
    let e = t.estimate();
    assert!(
        (e.bandwidth_bytes_per_s / slow.bandwidth_bytes_per_s - 1.0).abs() < 0.02,
        "{e:?}"
    );
    // One transfer size only: latency stays, bandwidth absorbs the rest.
    let mut t = LaneTracker::new(lane(1.0, 100.0), 0.1).unwrap();
    for _ in 0..50 {
        t.observe(256 * KIB, truth.time(256 * KIB));
    }
    let e = t.estimate();
    assert!(
        (e.bandwidth_bytes_per_s / truth.bandwidth_bytes_per_s - 1.0).abs() < 0.01,
        "{e:?}"
    );
    // Garbage is refused.
    assert!(!t.observe(0, 1.0));
    assert!(!t.observe(10, 0.0));
    assert!(!t.observe(10, f64::NAN));
    assert!(LaneTracker::new(lane(1.0, 0.0), 0.0).is_err());
    assert!(LaneTracker::new(lane(1.0, 0.0), 1.5).is_err());
}

#[test]
fn probe_measures_a_real_file() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("nvme-probe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let engine = open_best_engine(UringConfig::default());
    let f = Arc::new(DirectFile::open(&dir.join("dev")).unwrap());
    let span = 16u64 << 20;
    f.ensure_len(span).unwrap();
    // Write real data so reads hit allocated blocks rather than unwritten extents.
    let reqs = (0..16u64)
        .map(|i| {
            IoRequest::write(f.clone(), i << 20, AlignedBuf::new(1 << 20, 4096).unwrap()).unwrap()
        })
        .collect();
    for c in engine.submit(reqs).unwrap() {
        c.result.unwrap();
    }
    let cfg = ProbeConfig {
        latency_reads: 8,
        block_bytes: 256 << 10,
        depth: 8,
        batches: 4,
    };
    let l = probe_device(engine.as_ref(), &f, span, cfg).unwrap();
    assert!(
        l.bandwidth_bytes_per_s > 1e6 && l.bandwidth_bytes_per_s < 1e12,
        "{l:?}"
    );
    assert!(l.latency_s > 0.0 && l.latency_s < 1.0, "{l:?}");
    assert!(
        probe_device(engine.as_ref(), &f, 1000, cfg).is_err(),
        "span too small"
    );
    let bad = ProbeConfig {
        block_bytes: 1000,
        ..cfg
    };
    assert!(matches!(
        probe_device(engine.as_ref(), &f, span, bad),
        Err(NvmeError::Misaligned { .. })
    ));
    std::fs::remove_dir_all(dir).unwrap();
}

fn arb_case() -> impl Strategy<Value = (Vec<Lane>, Vec<BlockCopies>)> {
    (1usize..6).prop_flat_map(|nl| {
        let lanes = prop::collection::vec((0.1f64..60.0, 0.0f64..500.0), nl)
            .prop_map(|v| v.into_iter().map(|(g, l)| lane(g, l)).collect::<Vec<_>>());
        let block = (
            prop_oneof![
                Just(64 * KIB),
                Just(128 * KIB),
                Just(256 * KIB),
                1u64..(1 << 20)
            ],
            prop::collection::vec(0..nl, 1..=nl),
        )
            .prop_map(|(bytes, mut lanes)| {
                lanes.sort();
                lanes.dedup();
                BlockCopies { bytes, lanes }
            });
        (lanes, prop::collection::vec(block, 0..150))
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn plan_is_valid_and_never_worse_than_uniform((lanes, blocks) in arb_case()) {
        let p = plan(&lanes, &blocks).unwrap();
        let u = uniform(&lanes, &blocks).unwrap();
        prop_assert_eq!(p.assignment.len(), blocks.len());
        for (b, &l) in blocks.iter().zip(&p.assignment) {
            prop_assert!(b.lanes.contains(&l), "assigned to a lane without a copy");
        }
        prop_assert!(p.makespan_s <= u.makespan_s * (1.0 + 1e-12));
        // The reported timing is the real timing of the assignment.
        let e = evaluate(&lanes, &blocks, &p.assignment).unwrap();
        prop_assert_eq!(&e, &p);
        // Lower bound: no plan beats moving every block at the combined bandwidth of the
        // lanes, nor the largest single-copy load.
        let total: u64 = blocks.iter().map(|b| b.bytes).sum();
        let bw: f64 = lanes.iter().map(|l| l.bandwidth_bytes_per_s).sum();
        prop_assert!(p.makespan_s >= total as f64 / bw * (1.0 - 1e-9));
    }
}
