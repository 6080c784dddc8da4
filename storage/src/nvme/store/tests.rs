//! Unit tests of the page store's internals.

use std::time::Instant;

use super::links::union_seconds;
use super::{chunk_ranges, page_units, PageStore, CHUNK_BYTES, CHUNK_MAX_PAGES};

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
fn pages_take_whole_units_of_header_and_payload() {
    assert_eq!(page_units(0, 4096), 1);
    assert_eq!(page_units(4096 - 64, 4096), 1);
    assert_eq!(page_units(4096 - 63, 4096), 2);
    assert_eq!(page_units(512 << 10, 4096), 129);
    assert_eq!(page_units(20 << 10, 8192), 3);
    assert_eq!(page_units(1, 0), 0, "no unit, no page");
    assert_eq!(page_units(u64::MAX, 4096), u32::MAX, "saturates");
}

#[test]
fn chunks_are_cut_by_the_bytes_of_their_pages() {
    let lens = |bytes: &[u64]| -> Vec<usize> {
        chunk_ranges(bytes.iter().copied())
            .iter()
            .map(|r| r.len())
            .collect()
    };
    let mib = 1u64 << 20;
    assert_eq!(lens(&[]), Vec::<usize>::new());
    // Small pages: at most CHUNK_MAX_PAGES per chunk.
    assert_eq!(lens(&[4096; 130]), [CHUNK_MAX_PAGES, CHUNK_MAX_PAGES, 2]);
    // 1 MiB pages: four to a 4 MiB chunk; an 8 MiB page alone; mixed sizes by their sum.
    assert_eq!(CHUNK_BYTES as u64, 4 * mib);
    assert_eq!(lens(&[mib; 9]), [4, 4, 1]);
    assert_eq!(lens(&[8 * mib, mib, 8 * mib]), [1, 1, 1]);
    assert_eq!(lens(&[3 * mib, mib, mib, 2 * mib, 2 * mib]), [2, 2, 1]);
    // Ranges are consecutive and cover the batch.
    let r = chunk_ranges([mib; 9].into_iter());
    assert_eq!((r[0].start, r[2].end), (0, 9));
    assert!(r.windows(2).all(|w| w[0].end == w[1].start));
    // The per-size figure matches the cut of a batch of that size.
    for bytes in [4096, 12288, 516 << 10, 3 * mib, 8 * mib] {
        assert_eq!(
            lens(&vec![bytes; 200])[0],
            PageStore::chunk_pages(bytes),
            "{bytes}"
        );
    }
}
