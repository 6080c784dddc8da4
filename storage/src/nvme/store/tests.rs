//! Unit tests of the page store's internals.

use std::time::Instant;

use super::alloc::Bitmap;
use super::lanes::union_seconds;

#[test]
fn busy_time_counts_overlapping_operations_once() {
    let t0 = Instant::now();
    let at = |ms: u64| t0 + std::time::Duration::from_millis(ms);
    let cases: [(&[(u64, u64)], f64); 5] = [
        (&[], 0.0),
        (&[(0, 5)], 0.005),
        // All in flight together (io_uring): the span from first start to last finish.
        (&[(0, 4), (0, 7), (1, 6)], 0.007),
        // One after another (pread): the sum.
        (&[(4, 6), (0, 3), (10, 11)], 0.006),
        // Touching and nested.
        (&[(0, 3), (3, 5), (1, 2)], 0.005),
    ];
    for (spans, want) in cases {
        let mut v: Vec<(Instant, Instant)> = spans.iter().map(|&(a, b)| (at(a), at(b))).collect();
        let got = union_seconds(&mut v);
        assert!((got - want).abs() < 1e-9, "{spans:?}: {got} vs {want}");
    }
}

#[test]
fn bitmap_alloc_free_and_tail() {
    let mut b = Bitmap::new(70);
    let got: Vec<u64> = (0..70).map(|_| b.alloc().unwrap()).collect();
    let mut sorted = got.clone();
    sorted.sort();
    assert_eq!(sorted, (0..70).collect::<Vec<_>>());
    assert_eq!(b.alloc(), None);
    assert!(b.clear(65));
    assert!(!b.clear(65));
    assert_eq!(b.alloc(), Some(65));
    assert!(!b.set(3));
}
