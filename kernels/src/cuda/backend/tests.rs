//! Unit tests of the backend's host-side helpers (no device needed).

use super::sessions::{device_records, summary_order};
use crate::cuda::bf16_outward;

/// Every CPU value lands once, and the values a scoring thread reads (16-byte vectors
/// u * 8 + j of its record) are lane j's (max, min) pairs for dims j, j + 8, ... in order.
#[test]
fn summary_order_gives_each_lane_its_dims_in_order() {
    for (d, bf16) in [
        (32, true),
        (32, false),
        (64, true),
        (128, true),
        (128, false),
        (256, false),
    ] {
        let order = summary_order(d, bf16);
        let mut seen = order.clone();
        seen.sort_unstable();
        assert_eq!(
            seen,
            (0..2 * d).collect::<Vec<_>>(),
            "d {d}: not a permutation"
        );
        let per_vec = if bf16 { 8 } else { 4 };
        let vecs = 2 * d / per_vec / 8;
        for j in 0..8 {
            let lane: Vec<usize> = (0..vecs)
                .flat_map(|u| {
                    let v = u * 8 + j;
                    order[v * per_vec..(v + 1) * per_vec].to_vec()
                })
                .collect();
            let want: Vec<usize> = (0..d / 8)
                .flat_map(|s| [j + 8 * s, d + j + 8 * s])
                .collect();
            assert_eq!(lane, want, "d {d} bf16 {bf16} lane {j}");
        }
    }
}

/// Each record is permuted on its own, and the conversion sees the CPU index (bf16: max
/// rounded up, min rounded down).
#[test]
fn device_records_permute_each_record_and_round_outward() {
    let d = 32;
    let order = summary_order(d, true);
    let cpu: Vec<f32> = (0..3 * 2 * d).map(|i| 1.0 + i as f32 * 1e-3).collect();
    let dev = device_records(&cpu, &order, |x, o| bf16_outward(x, o < d));
    for r in 0..3 {
        for (e, &o) in order.iter().enumerate() {
            assert_eq!(dev[r * 2 * d + e], bf16_outward(cpu[r * 2 * d + o], o < d));
        }
    }
    let same = device_records(&cpu, &summary_order(d, false), |x, _| x);
    assert_eq!(same.len(), cpu.len());
    assert_eq!(same[1], cpu[d], "entry 1 is lane 0's first min");
}
