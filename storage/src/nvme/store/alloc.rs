//! Page allocation: an extent per page from each device's [`Extents`], and new pages striped
//! over the devices by their stripe weights (smooth weighted round robin per session).

use std::collections::HashSet;

use super::{NvmeError, PageAddr, PageStore};
use crate::space::Occupant;

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
        let occupant = |soon: &HashSet<u64>, fixed: &HashSet<u64>, page: u64| {
            if soon.contains(&page) {
                Occupant::FreedSoon
            } else if fixed.contains(&page) {
                Occupant::Fixed
            } else {
                Occupant::Movable
            }
        };
        for (d, dev) in self.devices.iter().enumerate() {
            let (soon, fixed) = sets(d);
            let space = dev.alloc.lock();
            if let Some(w) = space.window(units, |p| occupant(&soon, &fixed, p)) {
                windows.push((w.cost, d));
            }
        }
        windows.sort_unstable();
        for (_, d) in windows {
            let (soon, fixed) = sets(d);
            let mut space = self.devices[d].alloc.lock();
            // Planned again under this lock: the space may have changed since.
            let Some(w) = space.window(units, |p| occupant(&soon, &fixed, p)) else {
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
