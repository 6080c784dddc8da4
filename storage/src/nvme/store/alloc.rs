//! Page allocation: a bitmap per device, and new pages striped over the devices by their
//! stripe weights (smooth weighted round robin per session).

use super::{NvmeError, PageAddr, PageStore};

pub(super) struct Bitmap {
    words: Vec<u64>,
    pages: u64,
    pub(super) used: u64,
    cursor: usize,
}

impl Bitmap {
    pub(super) fn new(pages: u64) -> Self {
        let mut words = vec![0u64; pages.div_ceil(64) as usize];
        // Bits past the end are permanently "used".
        let tail = pages % 64;
        if tail != 0 {
            *words.last_mut().expect("pages > 0") |= !0u64 << tail;
        }
        Self {
            words,
            pages,
            used: 0,
            cursor: 0,
        }
    }

    pub(super) fn free(&self) -> u64 {
        self.pages - self.used
    }

    pub(super) fn alloc(&mut self) -> Option<u64> {
        if self.used == self.pages {
            return None;
        }
        let n = self.words.len();
        for k in 0..n {
            let w = (self.cursor + k) % n;
            if self.words[w] != !0 {
                let bit = self.words[w].trailing_ones() as u64;
                self.words[w] |= 1 << bit;
                self.used += 1;
                self.cursor = w;
                return Some(w as u64 * 64 + bit);
            }
        }
        None
    }

    pub(super) fn is_set(&self, page: u64) -> bool {
        self.words[(page / 64) as usize] & (1 << (page % 64)) != 0
    }

    pub(super) fn set(&mut self, page: u64) -> bool {
        if self.is_set(page) {
            return false;
        }
        self.words[(page / 64) as usize] |= 1 << (page % 64);
        self.used += 1;
        true
    }

    pub(super) fn clear(&mut self, page: u64) -> bool {
        if !self.is_set(page) {
            return false;
        }
        self.words[(page / 64) as usize] &= !(1 << (page % 64));
        self.used -= 1;
        true
    }
}

impl PageStore {
    pub fn free_pages(&self) -> u64 {
        self.devices.iter().map(|d| d.alloc.lock().free()).sum()
    }

    /// Allocates `n` pages for `session`, striped over devices in proportion to bandwidth
    /// (smooth weighted round robin, continuing where this session's last allocation left
    /// off). All or nothing: `Full` allocates nothing.
    pub fn alloc(&self, session: u64, n: usize) -> Result<Vec<PageAddr>, NvmeError> {
        let mut stripe = self.stripe.lock();
        let nd = self.devices.len();
        let cur = stripe.entry(session).or_insert_with(|| vec![0.0; nd]);
        let weight = self.stripe_weights();
        let mut eligible: Vec<bool> = self
            .devices
            .iter()
            .map(|d| d.alloc.lock().free() > 0)
            .collect();
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let total: f64 = (0..nd).filter(|&i| eligible[i]).map(|i| weight[i]).sum();
            if total == 0.0 {
                drop(stripe);
                let requested = n;
                self.free(&out)?;
                return Err(NvmeError::Full {
                    requested,
                    free: self.free_pages(),
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
            match self.devices[best].alloc.lock().alloc() {
                Some(page) => out.push(PageAddr {
                    device: best as u16,
                    page,
                }),
                None => eligible[best] = false,
            }
        }
        Ok(out)
    }

    /// Returns pages to the free pool. Freeing a page that is not allocated is an error
    /// (a double free would let two owners share a page).
    pub fn free(&self, addrs: &[PageAddr]) -> Result<(), NvmeError> {
        for a in addrs {
            let dev = self.device(*a)?;
            if !dev.alloc.lock().clear(a.page) {
                return Err(NvmeError::invalid(format!("double free of {a:?}")));
            }
        }
        Ok(())
    }

    /// Marks a page as in use (recovery from the manifest). A page referenced twice or out
    /// of range means the manifest does not belong to these devices.
    pub fn mark_allocated(&self, addr: PageAddr) -> Result<(), NvmeError> {
        let dev = self.device(addr).map_err(|_| NvmeError::ManifestMismatch {
            what: format!("{addr:?} is outside the devices"),
        })?;
        if !dev.alloc.lock().set(addr.page) {
            return Err(NvmeError::ManifestMismatch {
                what: format!("{addr:?} referenced twice"),
            });
        }
        Ok(())
    }

    /// Drops a session's striping position (after it is deleted).
    pub fn forget_session(&self, session: u64) {
        self.stripe.lock().remove(&session);
    }
}
