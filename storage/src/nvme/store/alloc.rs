//! Page allocation: an extent per page from each device's [`Extents`], and new pages striped
//! over the devices by their stripe weights (smooth weighted round robin per session).

use std::collections::{HashMap, HashSet};

use super::{NvmeError, PageAddr, PageStore};
use crate::extents::Extents;

/// A device's space: its free extents and every allocated page, by first unit. The page index
/// makes free, mark and write exact: [`Extents`] knows which units are in use but not where
/// one page ends and the next begins, so without it a free of the wrong length (a
/// bookkeeping bug) could release a neighbour's units to a new owner.
pub(super) struct Space {
    free: Extents,
    pages: HashMap<u64, u32>,
}

impl Space {
    pub(super) fn new(units: u64) -> Self {
        Self {
            free: Extents::new(units, 0),
            pages: HashMap::new(),
        }
    }

    /// Units allocated.
    pub(super) fn used(&self) -> u64 {
        self.free.used()
    }

    /// Units not allocated.
    pub(super) fn free(&self) -> u64 {
        self.free.free()
    }

    /// Pages allocated.
    pub(super) fn pages(&self) -> u64 {
        self.pages.len() as u64
    }

    /// Units of the longest page that could be allocated now.
    pub(super) fn largest_free(&self) -> u64 {
        self.free.largest_free()
    }

    /// Free ranges of the device.
    pub(super) fn free_ranges(&self) -> u64 {
        self.free.free_ranges()
    }

    pub(super) fn alloc(&mut self, units: u32) -> Option<u64> {
        let start = self.free.alloc(u64::from(units))?;
        self.pages.insert(start, units);
        Some(start)
    }

    /// The window of `units` units to empty for a page when no free range holds one: of the
    /// windows that start or end where a page or a free range does, the one whose pages
    /// (each moved whole, also one that only overlaps it) hold the fewest units. Pages whose
    /// start is in `soon` are about to be freed and need no move; a window holding a page
    /// whose start is in `fixed`, or one of `units` or more (it would need such a window
    /// itself), is no use. Its cost in units, its start and the pages to move; None if there
    /// is no such window.
    fn window(&self, units: u64, soon: &HashSet<u64>, fixed: &HashSet<u64>) -> Option<Window> {
        let stays_free = |s: u64| soon.contains(&s);
        let total = self.free.total();
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
            let unusable = fixed.contains(&s) || (moved && u64::from(u) >= units);
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
    fn place_outside(&mut self, units: u64, w: &Window) -> Option<Vec<u64>> {
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
    pub(super) fn is_page(&self, start: u64, units: u32) -> bool {
        self.pages.get(&start) == Some(&units)
    }

    /// Frees a page; false (nothing changes) unless it is exactly an allocated page.
    pub(super) fn release(&mut self, start: u64, units: u32) -> bool {
        if !self.is_page(start, units) {
            return false;
        }
        let released = self.free.release(start, u64::from(units));
        debug_assert!(released, "the page index and the extents agree");
        self.pages.remove(&start);
        released
    }

    /// Marks a known page allocated; false (nothing changes) unless all of it is free.
    pub(super) fn mark(&mut self, start: u64, units: u32) -> bool {
        if !self.free.mark(start, u64::from(units)) {
            return false;
        }
        self.pages.insert(start, units);
        true
    }
}

/// A window of one device to empty: what moving its pages costs, where it starts, and the
/// pages `(start, units)` to move.
struct Window {
    cost: u64,
    start: u64,
    moves: Vec<(u64, u32)>,
}

/// Pages to move so that a page of a given size fits where the free space is in pieces:
/// each `(from, to)`, `to` allocated already. The mover writes them, commits a manifest that
/// references `to`, and frees `from` once no manifest references it; or, giving up, frees
/// every `to`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evacuation {
    pub moves: Vec<(PageAddr, PageAddr)>,
}

impl PageStore {
    /// Plans room for a page of `units` units when no device has a free range that long but
    /// the free units are there in pieces (compaction): on the device where it costs least,
    /// the window of `units` units whose pages hold the fewest units, each moved to a free
    /// range outside the window. Pages in `freed_soon` (retired by the last commit, freed at
    /// the next) are not moved; no window holds a page of `fixed` (allocated for a write in
    /// progress). None when no device has a window whose pages fit elsewhere.
    pub fn plan_evacuation(
        &self,
        units: u32,
        freed_soon: &HashSet<PageAddr>,
        fixed: &[PageAddr],
    ) -> Option<Evacuation> {
        let units = u64::from(units);
        let mut windows: Vec<(u64, usize)> = Vec::new();
        let on = |d: usize, addrs: &mut dyn Iterator<Item = &PageAddr>| -> HashSet<u64> {
            addrs
                .filter(|a| usize::from(a.device) == d)
                .map(|a| a.page)
                .collect()
        };
        let sets = |d: usize| (on(d, &mut freed_soon.iter()), on(d, &mut fixed.iter()));
        for (d, dev) in self.devices.iter().enumerate() {
            let (soon, fixed) = sets(d);
            let space = dev.alloc.lock();
            if let Some(w) = space.window(units, &soon, &fixed) {
                windows.push((w.cost, d));
            }
        }
        windows.sort_unstable();
        for (_, d) in windows {
            let (soon, fixed) = sets(d);
            let mut space = self.devices[d].alloc.lock();
            // Planned again under this lock: the space may have changed since.
            let Some(w) = space.window(units, &soon, &fixed) else {
                continue;
            };
            if let Some(to) = space.place_outside(units, &w) {
                let addr = |page: u64, units: u32| PageAddr {
                    device: d as u16,
                    page,
                    units,
                };
                return Some(Evacuation {
                    moves: w
                        .moves
                        .iter()
                        .zip(to)
                        .map(|(&(from, u), to)| (addr(from, u), addr(to, u)))
                        .collect(),
                });
            }
        }
        None
    }

    /// Bytes not allocated, over all devices (possibly in pieces too small for a page).
    pub fn free_bytes(&self) -> u64 {
        self.devices
            .iter()
            .map(|d| d.alloc.lock().free())
            .sum::<u64>()
            * self.unit as u64
    }

    /// Bytes of the longest extent any device could allocate now: the largest page that fits.
    pub fn largest_free_bytes(&self) -> u64 {
        self.devices
            .iter()
            .map(|d| d.alloc.lock().largest_free())
            .max()
            .unwrap_or(0)
            * self.unit as u64
    }

    /// Allocates `n` pages for runs of `payload_len` bytes for `session`, each an extent of
    /// [`PageStore::page_units`]`(payload_len)` units, striped over devices in proportion to
    /// bandwidth (smooth weighted round robin, continuing where this session's last
    /// allocation left off); a device with no room for the extent drops out. All or nothing:
    /// `Full` allocates nothing. A payload over [`PageStore::max_payload`] is
    /// `InvalidArgument`.
    pub fn alloc(
        &self,
        session: u64,
        n: usize,
        payload_len: usize,
    ) -> Result<Vec<PageAddr>, NvmeError> {
        if payload_len > self.max_payload {
            return Err(NvmeError::invalid(format!(
                "payload of {payload_len} bytes exceeds the largest page payload {}",
                self.max_payload
            )));
        }
        let units = self.page_units(payload_len);
        let mut stripe = self.stripe.lock();
        let nd = self.devices.len();
        let cur = stripe.entry(session).or_insert_with(|| vec![0.0; nd]);
        let weight = self.stripe_weights();
        let mut eligible: Vec<bool> = self
            .devices
            .iter()
            .map(|d| d.alloc.lock().largest_free() >= u64::from(units))
            .collect();
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let total: f64 = (0..nd).filter(|&i| eligible[i]).map(|i| weight[i]).sum();
            if total == 0.0 {
                drop(stripe);
                self.free(&out)?;
                return Err(NvmeError::Full {
                    requested: n,
                    page_bytes: self.page_bytes(payload_len),
                    free_bytes: self.free_bytes(),
                    largest_free_bytes: self.largest_free_bytes(),
                });
            }
            let mut best = usize::MAX;
            for i in (0..nd).filter(|&i| eligible[i]) {
                cur[i] += weight[i];
                if best == usize::MAX || cur[i] > cur[best] {
                    best = i;
                }
            }
            cur[best] -= total;
            match self.devices[best].alloc.lock().alloc(units) {
                Some(page) => out.push(PageAddr {
                    device: best as u16,
                    page,
                    units,
                }),
                None => eligible[best] = false,
            }
        }
        Ok(out)
    }

    /// Returns pages to the free space. Freeing an extent that is not wholly allocated is an
    /// error (a double free would let two owners share the space); the pages before it in
    /// `addrs` are freed.
    pub fn free(&self, addrs: &[PageAddr]) -> Result<(), NvmeError> {
        for a in addrs {
            let dev = self.device(*a)?;
            if !dev.alloc.lock().release(a.page, a.units) {
                return Err(NvmeError::invalid(format!(
                    "double free of {a:?} (or it is not exactly an allocated page)"
                )));
            }
        }
        Ok(())
    }

    /// Marks a page's extent as in use (recovery from the manifest). An extent that overlaps
    /// one already marked, or lies outside the devices, means the manifest does not belong to
    /// these devices.
    pub fn mark_allocated(&self, addr: PageAddr) -> Result<(), NvmeError> {
        let dev = self.device(addr).map_err(|_| NvmeError::ManifestMismatch {
            what: format!("{addr:?} is outside the devices"),
        })?;
        if !dev.alloc.lock().mark(addr.page, addr.units) {
            return Err(NvmeError::ManifestMismatch {
                what: format!("{addr:?} overlaps another page (or is referenced twice)"),
            });
        }
        Ok(())
    }

    /// Drops a session's striping position (after it is deleted).
    pub fn forget_session(&self, session: u64) {
        self.stripe.lock().remove(&session);
    }
}
