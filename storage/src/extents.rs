//! Variable-size extents over a range of units: the allocator behind both tiers' space (host
//! arena bytes in 4 KiB units, NVMe device space in direct-I/O units).
//!
//! A block run's size depends on its session's geometry (32 KiB for Gemma 3 270M at 64-token
//! blocks, 512 KiB for Llama-3-8B in bf16, 8 MiB for a 64-head MHA model in f32), so each run
//! takes an extent of exactly its size rounded up to a unit, instead of a fixed-size slot that is
//! too small for large runs and mostly empty for small ones.
//!
//! Best fit over free ranges (smallest free range that holds the request, lowest address on a
//! tie), carved from the range's start, with frees coalesced with both neighbours: with one
//! run size in use this never fragments (every hole is a whole number of runs), and with a few
//! sizes it stays close to first-fit's well-known behaviour. Both indexes are B-trees, so
//! allocation and free are O(log free ranges).
//!
//! The space is cut into *segments*: an extent never crosses a segment boundary and free
//! ranges are never merged across one. The host arena uses this so that every run lies inside
//! one chunk of the GPU's registration (a chunk is a whole number of segments).

use std::collections::{BTreeMap, BTreeSet};

/// Free ranges of `[0, total)` in units; see the module docs.
#[derive(Debug, Clone)]
pub struct Extents {
    total: u64,
    segment: u64,
    /// start -> len of every free range.
    by_start: BTreeMap<u64, u64>,
    /// (len, start) of every free range: best fit is the first entry >= (want, 0).
    by_len: BTreeSet<(u64, u64)>,
    used: u64,
    extents: u64,
}

impl Extents {
    /// All of `[0, total)` free, cut into segments of `segment` units (the last may be
    /// shorter). `segment` 0 means one segment.
    pub fn new(total: u64, segment: u64) -> Self {
        let segment = if segment == 0 { total.max(1) } else { segment };
        let mut e = Extents {
            total,
            segment,
            by_start: BTreeMap::new(),
            by_len: BTreeSet::new(),
            used: 0,
            extents: 0,
        };
        let mut at = 0;
        while at < total {
            let len = segment.min(total - at);
            e.insert(at, len);
            at += len;
        }
        e
    }

    /// Units in the space.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Units of a segment (no extent crosses a multiple of it).
    pub fn segment(&self) -> u64 {
        self.segment
    }

    /// Units allocated now.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Units free now.
    pub fn free(&self) -> u64 {
        self.total - self.used
    }

    /// Extents allocated now.
    pub fn extents(&self) -> u64 {
        self.extents
    }

    /// The longest extent an `alloc` could return now.
    pub fn largest_free(&self) -> u64 {
        self.by_len.last().map_or(0, |&(len, _)| len)
    }

    /// Free ranges now (a free space in many pieces is fragmented).
    pub fn free_ranges(&self) -> u64 {
        self.by_start.len() as u64
    }

    /// The free ranges `(start, len)` in address order.
    pub fn free_list(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.by_start.iter().map(|(&s, &l)| (s, l))
    }

    /// How many extents of `len` units would fit now, without allocating (at most `cap`).
    pub fn fits(&self, len: u64, cap: u64) -> u64 {
        if len == 0 {
            return cap;
        }
        let mut n = 0;
        for &(l, _) in self.by_len.range((len, 0)..) {
            n += l / len;
            if n >= cap {
                return cap;
            }
        }
        n
    }

    fn insert(&mut self, start: u64, len: u64) {
        self.by_start.insert(start, len);
        self.by_len.insert((len, start));
    }

    fn remove(&mut self, start: u64, len: u64) {
        self.by_start.remove(&start);
        self.by_len.remove(&(len, start));
    }

    /// Takes an extent of `len` units; its start, or `None` when no free range holds it.
    pub fn alloc(&mut self, len: u64) -> Option<u64> {
        if len == 0 || len > self.segment {
            return None;
        }
        let &(flen, fstart) = self.by_len.range((len, 0)..).next()?;
        self.remove(fstart, flen);
        if flen > len {
            self.insert(fstart + len, flen - len);
        }
        self.used += len;
        self.extents += 1;
        Some(fstart)
    }

    /// Whether `[start, start + len)` is inside the space and overlaps no free range (it is
    /// allocated, as one extent or several).
    fn is_allocated(&self, start: u64, len: u64) -> bool {
        let Some(end) = start.checked_add(len) else {
            return false;
        };
        if len == 0 || end > self.total {
            return false;
        }
        // The free range starting at or before `start`, and any starting inside the extent.
        if let Some((&s, &l)) = self.by_start.range(..=start).next_back() {
            if s + l > start {
                return false;
            }
        }
        self.by_start.range(start..end).next().is_none()
    }

    /// Returns an extent. False (and nothing changes) if any of it is not allocated or it
    /// crosses a segment boundary: a double free would let two owners share the space.
    pub fn release(&mut self, start: u64, len: u64) -> bool {
        if !self.is_allocated(start, len) || !self.within_segment(start, len) {
            return false;
        }
        let (mut s, mut l) = (start, len);
        let seg_start = start - start % self.segment;
        let seg_end = (seg_start + self.segment).min(self.total);
        if let Some((&ps, &pl)) = self.by_start.range(seg_start..start).next_back() {
            if ps + pl == start {
                self.remove(ps, pl);
                s = ps;
                l += pl;
            }
        }
        let end = start + len;
        if end < seg_end {
            if let Some(&nl) = self.by_start.get(&end) {
                self.remove(end, nl);
                l += nl;
            }
        }
        self.insert(s, l);
        self.used -= len;
        self.extents -= 1;
        true
    }

    /// Marks a known extent allocated (recovery from an index). False (and nothing changes)
    /// unless all of it is free and inside one segment: an extent referenced twice or out of
    /// range means the index does not describe this space.
    pub fn mark(&mut self, start: u64, len: u64) -> bool {
        let Some(end) = start.checked_add(len) else {
            return false;
        };
        if len == 0 || end > self.total || !self.within_segment(start, len) {
            return false;
        }
        let Some((&fs, &fl)) = self.by_start.range(..=start).next_back() else {
            return false;
        };
        if fs + fl < end {
            return false;
        }
        self.remove(fs, fl);
        if start > fs {
            self.insert(fs, start - fs);
        }
        if fs + fl > end {
            self.insert(end, fs + fl - end);
        }
        self.used += len;
        self.extents += 1;
        true
    }

    fn within_segment(&self, start: u64, len: u64) -> bool {
        start / self.segment == (start + len - 1) / self.segment
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn best_fit_carves_from_the_front_and_coalesces() {
        let mut e = Extents::new(16, 0);
        let a = e.alloc(4).unwrap();
        let b = e.alloc(4).unwrap();
        let c = e.alloc(4).unwrap();
        assert_eq!((a, b, c), (0, 4, 8));
        assert!(e.release(a, 4));
        // Best fit: the 4-unit hole at 0, not the 4-unit tail at 12... both are 4: lowest wins.
        assert_eq!(e.alloc(2), Some(0));
        // A 3-unit request takes the tail (the 2-unit hole at 2 is too small).
        assert_eq!(e.alloc(3), Some(12));
        // Free: 2..4 and 15..16, two ranges.
        assert_eq!((e.free_ranges(), e.largest_free()), (2, 2));
        assert!(e.release(b, 4));
        // Hole 2..8 coalesced (2..4 with 4..8).
        assert_eq!((e.free_ranges(), e.largest_free()), (2, 6));
        assert_eq!(e.alloc(6), Some(2));
        assert_eq!((e.used(), e.free(), e.extents()), (15, 1, 4));
    }

    #[test]
    fn double_free_partial_free_and_bad_marks_are_refused() {
        let mut e = Extents::new(10, 0);
        let a = e.alloc(4).unwrap();
        assert!(e.release(a, 4));
        assert!(!e.release(a, 4), "double free");
        let a = e.alloc(4).unwrap();
        assert!(!e.release(a, 5), "longer than allocated");
        assert!(!e.release(9, 2), "past the end");
        assert!(!e.mark(2, 3), "overlaps an allocated extent");
        assert!(e.mark(5, 3));
        assert!(!e.mark(5, 1), "referenced twice");
        assert_eq!((e.used(), e.extents()), (7, 2));
        assert_eq!(e.alloc(3), None, "only 4..5 and 8..10 are free");
        assert_eq!(e.alloc(2), Some(8));
    }

    #[test]
    fn extents_never_cross_a_segment() {
        let mut e = Extents::new(10, 4);
        assert_eq!(e.alloc(5), None, "longer than a segment");
        assert_eq!(e.alloc(3), Some(0));
        assert_eq!(e.alloc(3), Some(4));
        assert_eq!(e.alloc(2), Some(8), "the short last segment");
        assert_eq!(
            e.alloc(2),
            None,
            "units 3 and 7 are free but in different segments"
        );
        assert_eq!(e.fits(1, 9), 2);
        assert!(e.release(0, 3));
        assert!(e.release(4, 3));
        assert_eq!(e.largest_free(), 4, "no merge across the boundary at 4");
        assert!(!e.mark(2, 4), "a mark across a boundary");
    }

    proptest! {
        /// Random alloc/free/mark sequences against a unit-by-unit model: no overlap, exact
        /// accounting, and alloc fails only when no segment-local run of free units is long
        /// enough.
        #[test]
        fn matches_a_unit_model(ops in proptest::collection::vec((0u8..3, 1u64..9, any::<u16>()), 1..300)) {
            const TOTAL: u64 = 64;
            const SEG: u64 = 16;
            let mut e = Extents::new(TOTAL, SEG);
            let mut owner = [false; TOTAL as usize];
            let mut held: Vec<(u64, u64)> = Vec::new();
            for (op, len, pick) in ops {
                match op {
                    0 => match e.alloc(len) {
                        Some(s) => {
                            prop_assert!(s / SEG == (s + len - 1) / SEG);
                            for u in s..s + len {
                                prop_assert!(!owner[u as usize], "overlap at {}", u);
                                owner[u as usize] = true;
                            }
                            held.push((s, len));
                        }
                        None => {
                            let mut run = 0;
                            for u in 0..TOTAL {
                                run = if u % SEG == 0 { 0 } else { run };
                                run = if owner[u as usize] { 0 } else { run + 1 };
                                prop_assert!(run < len, "a free run of {} existed", len);
                            }
                        }
                    },
                    1 if !held.is_empty() => {
                        let (s, l) = held.swap_remove(pick as usize % held.len());
                        prop_assert!(e.release(s, l));
                        for u in s..s + l {
                            owner[u as usize] = false;
                        }
                    }
                    _ => {
                        let s = pick as u64 % TOTAL;
                        let ok = s + len <= TOTAL
                            && s / SEG == (s + len - 1) / SEG
                            && (s..s + len).all(|u| !owner[u as usize]);
                        prop_assert_eq!(e.mark(s, len), ok);
                        if ok {
                            for u in s..s + len {
                                owner[u as usize] = true;
                            }
                            held.push((s, len));
                        }
                    }
                }
                let used = owner.iter().filter(|&&o| o).count() as u64;
                prop_assert_eq!(e.used(), used);
                prop_assert_eq!(e.extents(), held.len() as u64);
            }
        }
    }
}
