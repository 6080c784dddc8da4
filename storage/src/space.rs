//! Allocated space that can be compacted: [`Extents`] (the free ranges) plus an index of every
//! allocated extent, and the plan for making room for an extent when the free units are there
//! but in pieces (a window to empty, and where its extents go). Both tiers use it: the host
//! arena (4 KiB units, 1 GiB segments) and each NVMe device (direct-I/O units).

use std::collections::HashMap;

use crate::extents::Extents;

/// What an allocated extent is to a compaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Occupant {
    /// Its owner lets it move.
    Movable,
    /// About to be freed: a window may hold it and nothing moves it.
    FreedSoon,
    /// It must stay where it is (a reader or writer outside the allocator holds its address).
    Fixed,
}

/// Free extents and every allocated extent, by first unit. The index makes free and mark
/// exact: [`Extents`] knows which units are in use but not where one extent ends and the
/// next begins, so without it a free of the wrong length (a bookkeeping bug) could release a
/// neighbour's units to a new owner.
pub(crate) struct Space {
    free: Extents,
    pages: HashMap<u64, u32>,
}

impl Space {
    /// All of `[0, units)` free, in segments of `segment` units (0: one segment); no extent
    /// crosses a segment boundary.
    pub(crate) fn new(units: u64, segment: u64) -> Self {
        Self {
            free: Extents::new(units, segment),
            pages: HashMap::new(),
        }
    }

    /// The free ranges.
    pub(crate) fn extents(&self) -> &Extents {
        &self.free
    }

    /// Units allocated.
    pub(crate) fn used(&self) -> u64 {
        self.free.used()
    }

    /// Units not allocated.
    pub(crate) fn free(&self) -> u64 {
        self.free.free()
    }

    /// Extents allocated.
    pub(crate) fn pages(&self) -> u64 {
        self.pages.len() as u64
    }

    /// Units of the longest extent that could be allocated now.
    pub(crate) fn largest_free(&self) -> u64 {
        self.free.largest_free()
    }

    /// Free ranges.
    pub(crate) fn free_ranges(&self) -> u64 {
        self.free.free_ranges()
    }

    pub(crate) fn alloc(&mut self, units: u32) -> Option<u64> {
        let start = self.free.alloc(u64::from(units))?;
        self.pages.insert(start, units);
        Some(start)
    }

    /// The window of `units` units to empty for an extent when no free range holds one: of
    /// the windows that start or end where an extent or a free range does, the one whose
    /// extents (each moved whole, also one that only overlaps it) hold the fewest units.
    /// `occupant` says which extents may move: a [`Occupant::FreedSoon`] one needs no move;
    /// a window holding a [`Occupant::Fixed`] one, or a movable one of `units` or more (it
    /// would need such a window itself), or crossing a segment boundary is no use. None if
    /// there is no such window.
    pub(crate) fn window(&self, units: u64, occupant: impl Fn(u64) -> Occupant) -> Option<Window> {
        let stays_free = |s: u64| occupant(s) == Occupant::FreedSoon;
        let total = self.free.total();
        let segment = self.free.segment();
        if units > total {
            return None;
        }
        // Non-overlapping, so sorted by start they are sorted by end too.
        let mut pages: Vec<(u64, u32)> = self.pages.iter().map(|(&s, &u)| (s, u)).collect();
        pages.sort_unstable();
        let mut prefix = Vec::with_capacity(pages.len() + 1);
        let mut unusable_before = Vec::with_capacity(pages.len() + 1);
        prefix.push(0u64);
        unusable_before.push(0u32);
        for &(s, u) in &pages {
            let moved = !stays_free(s);
            prefix.push(prefix[prefix.len() - 1] + if moved { u64::from(u) } else { 0 });
            let unusable = occupant(s) == Occupant::Fixed || (moved && u64::from(u) >= units);
            unusable_before.push(unusable_before[unusable_before.len() - 1] + u32::from(unusable));
        }
        let mut starts: Vec<u64> =
            Vec::with_capacity(2 * pages.len() + 2 * self.free.free_ranges() as usize);
        let mut edge = |at: u64, end: u64| {
            starts.push(at);
            starts.push(end.saturating_sub(units));
        };
        for &(s, u) in &pages {
            edge(s, s + u64::from(u));
        }
        for (s, l) in self.free.free_list() {
            edge(s, s + l);
        }
        starts.sort_unstable();
        starts.dedup();
        let (mut lo, mut hi) = (0, 0);
        let mut best: Option<(u64, u64, usize, usize)> = None;
        for s in starts {
            if s + units > total {
                break;
            }
            if s / segment != (s + units - 1) / segment {
                continue;
            }
            // The pages overlapping [s, s + units): from the first that ends after s to the
            // last that starts before its end.
            while lo < pages.len() && pages[lo].0 + u64::from(pages[lo].1) <= s {
                lo += 1;
            }
            hi = hi.max(lo);
            while hi < pages.len() && pages[hi].0 < s + units {
                hi += 1;
            }
            if unusable_before[hi] != unusable_before[lo] {
                continue;
            }
            let cost = prefix[hi] - prefix[lo];
            if best.is_none_or(|b| cost < b.0) {
                best = Some((cost, s, lo, hi));
            }
        }
        let (cost, start, lo, hi) = best?;
        Some(Window {
            cost,
            start,
            moves: pages[lo..hi]
                .iter()
                .copied()
                .filter(|&(s, _)| !stays_free(s))
                .collect(),
        })
    }

    /// Allocates new places for `w`'s pages outside its window (each free range inside the
    /// window is held while they are placed). All or nothing: None leaves the space as it was.
    pub(crate) fn place_outside(&mut self, units: u64, w: &Window) -> Option<Vec<u64>> {
        let end = w.start + units;
        let held: Vec<(u64, u64)> = self
            .free
            .free_list()
            .filter(|&(s, l)| s < end && s + l > w.start)
            .map(|(s, l)| (s.max(w.start), (s + l).min(end) - s.max(w.start)))
            .collect();
        for &(s, l) in &held {
            let marked = self.free.mark(s, l);
            debug_assert!(marked, "a free range inside the window");
        }
        let mut placed = Vec::with_capacity(w.moves.len());
        for &(_, u) in &w.moves {
            match self.alloc(u) {
                Some(at) => placed.push(at),
                None => break,
            }
        }
        let all = placed.len() == w.moves.len();
        if !all {
            for (&at, &(_, u)) in placed.iter().zip(&w.moves) {
                self.release(at, u);
            }
        }
        for &(s, l) in &held {
            let released = self.free.release(s, l);
            debug_assert!(released, "the window's held range");
        }
        all.then_some(placed)
    }

    /// Whether `[start, start + units)` is exactly one allocated page.
    pub(crate) fn is_page(&self, start: u64, units: u32) -> bool {
        self.pages.get(&start) == Some(&units)
    }

    /// Frees a page; false (nothing changes) unless it is exactly an allocated page.
    pub(crate) fn release(&mut self, start: u64, units: u32) -> bool {
        if !self.is_page(start, units) {
            return false;
        }
        let released = self.free.release(start, u64::from(units));
        debug_assert!(released, "the page index and the extents agree");
        self.pages.remove(&start);
        released
    }

    /// Marks a known page allocated; false (nothing changes) unless all of it is free.
    pub(crate) fn mark(&mut self, start: u64, units: u32) -> bool {
        if !self.free.mark(start, u64::from(units)) {
            return false;
        }
        self.pages.insert(start, units);
        true
    }
}

/// A window to empty: what moving its extents costs (units), where it starts, and the
/// extents `(start, units)` to move.
pub(crate) struct Window {
    pub(crate) cost: u64,
    pub(crate) start: u64,
    pub(crate) moves: Vec<(u64, u32)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two segments of 8 units, each with one-unit extents at every other unit: the window
    /// for 4 units lies inside one segment, and its extents are placed outside it.
    #[test]
    fn a_window_never_crosses_a_segment_and_its_extents_go_elsewhere() {
        let mut s = Space::new(16, 8);
        let starts: Vec<u64> = (0..16).map(|_| s.alloc(1).unwrap()).collect();
        for &u in starts.iter().step_by(2) {
            assert!(s.release(u, 1));
        }
        assert_eq!((s.free(), s.largest_free()), (8, 1));
        // Units 1 and 5 fixed: of the cheapest windows, [6, 10) would come first but crosses
        // into the second segment; [8, 12) is the one.
        let w = s
            .window(4, |u| {
                if u == 1 || u == 5 {
                    Occupant::Fixed
                } else {
                    Occupant::Movable
                }
            })
            .unwrap();
        assert_eq!(w.start / 8, (w.start + 3) / 8, "inside one segment");
        assert_eq!(w.start, 8);
        assert_eq!(w.cost, 2);
        let to = s.place_outside(4, &w).unwrap();
        assert!(to.iter().all(|&t| t < w.start || t >= w.start + 4));
        // Nothing may move: no window.
        assert!(s.window(4, |_| Occupant::Fixed).is_none());
    }
}
