//! Which blocks a device page table must point somewhere else: the rule of the device mirror
//! (`cuda::LayerMirror`), which keeps per session layer the host offset each block is mapped to
//! and uploads only what changed.

use std::ops::Range;

/// Maximal runs of blocks whose wanted mapping differs from the current one (`have` is shorter
/// than `want` when blocks are new).
pub fn stale_runs(have: &[u64], want: &[u64]) -> Vec<Range<usize>> {
    let mut runs = Vec::new();
    let mut b = 0;
    while b < want.len() {
        if have.get(b) == Some(&want[b]) {
            b += 1;
            continue;
        }
        let start = b;
        while b < want.len() && have.get(b) != Some(&want[b]) {
            b += 1;
        }
        runs.push(start..b);
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_of_changed_and_new_blocks() {
        assert_eq!(stale_runs(&[], &[1, 2, 3]), vec![0..3]);
        assert!(stale_runs(&[1, 2, 3], &[1, 2, 3]).is_empty());
        assert_eq!(stale_runs(&[1, 2, 3, 4], &[1, 9, 9, 4]), vec![1..3]);
        assert_eq!(stale_runs(&[1, 2], &[7, 2, 5, 6]), vec![0..1, 2..4]);
        assert!(
            stale_runs(&[1, 2, 3], &[1, 2]).is_empty(),
            "a shorter want: nothing to map"
        );
    }
}
