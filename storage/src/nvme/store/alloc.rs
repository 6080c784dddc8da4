//! Page allocation: an extent per page from each device's [`Extents`], and new pages striped
//! over the devices by their stripe weights (smooth weighted round robin per session).

use std::collections::HashMap;

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

impl PageStore {
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
