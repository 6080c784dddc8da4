//! The host-RAM tier: an arena of fixed-size block frames in one anonymous mapping.
//!
//! One mapping (rather than one allocation per block) is what lets a GPU backend register the
//! whole tier with the driver once — pinned and mapped for zero-copy reads — and what keeps the
//! decode path free of heap traffic: a frame is taken from a free list when a block is opened and
//! returned when its owner drops it.
//!
//! Frames are handed out as owned [`Frame`] handles. A handle is the only way to reach its bytes,
//! so two handles never alias and the frame is freed exactly once, in `Drop`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use memmap2::{MmapMut, MmapOptions};
use parking_lot::Mutex;

use crate::error::{Result, StorageError};

/// Frame sizes are multiples of this so frames can be written to NVMe with O_DIRECT and
/// registered with CUDA without straddling pages.
pub const FRAME_ALIGN: usize = 4096;

/// How to build a [`HostArena`].
#[derive(Debug, Clone)]
pub struct ArenaOptions {
    /// Total bytes of frames; rounded down to a whole number of frames.
    pub capacity_bytes: usize,
    /// Bytes per frame; one frame holds one (layer, block) run.
    pub frame_bytes: usize,
    /// Advise transparent huge pages (fewer TLB misses and faster pinning).
    pub huge_pages: bool,
    /// mlock the whole arena up front (needs RLIMIT_MEMLOCK >= capacity).
    pub lock: bool,
}

impl ArenaOptions {
    pub fn new(capacity_bytes: usize, frame_bytes: usize) -> Self {
        ArenaOptions {
            capacity_bytes,
            frame_bytes,
            huge_pages: true,
            lock: false,
        }
    }
}

/// Usage counters of an arena, read without locking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaUsage {
    pub frame_bytes: usize,
    pub frames_total: usize,
    pub frames_used: usize,
}

impl ArenaUsage {
    pub fn bytes_used(&self) -> usize {
        self.frames_used * self.frame_bytes
    }
    pub fn bytes_total(&self) -> usize {
        self.frames_total * self.frame_bytes
    }
}

struct Inner {
    /// Keeps the mapping alive; its bytes are only reached through `base`.
    _map: MmapMut,
    base: *mut u8,
    frame_bytes: usize,
    frames_total: usize,
    /// Free frame indices, used LIFO so recently freed (cache-warm) frames are reused first.
    free: Mutex<Vec<u32>>,
    used: AtomicUsize,
}

// SAFETY: `base` points into `_map`, which lives as long as `Inner`. Distinct frames are disjoint
// byte ranges and each is reachable only through its unique `Frame` handle (or `&self` methods
// that read nothing but the pointer), so sharing `Inner` between threads creates no data race.
unsafe impl Send for Inner {}
// SAFETY: see `Send` above; all shared mutable state is behind `free`'s mutex or atomics.
unsafe impl Sync for Inner {}

/// A per-owner cap on frames held at once: every frame taken through an arena handle that
/// carries it ([`HostArena::with_quota`]) counts until it is dropped.
#[derive(Debug)]
pub struct FrameQuota {
    limit: usize,
    used: AtomicUsize,
}

impl FrameQuota {
    pub fn new(limit_frames: usize) -> Arc<Self> {
        Arc::new(FrameQuota {
            limit: limit_frames,
            used: AtomicUsize::new(0),
        })
    }

    /// Frames held now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Charges `n` frames, or fails without charging anything.
    fn charge(&self, n: usize) -> Result<()> {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                (u + n <= self.limit).then_some(u + n)
            })
            .map(|_| ())
            .map_err(|used| StorageError::QuotaExceeded {
                frames_used: used,
                wanted: n,
                limit: self.limit,
            })
    }
}

/// A pool of fixed-size frames in one anonymous memory mapping. Cloning shares the pool.
#[derive(Clone)]
pub struct HostArena {
    inner: Arc<Inner>,
    /// Charged for every frame taken through this handle (see [`HostArena::with_quota`]).
    quota: Option<Arc<FrameQuota>>,
}

impl std::fmt::Debug for HostArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostArena")
            .field("usage", &self.usage())
            .finish()
    }
}

impl HostArena {
    pub fn new(opts: &ArenaOptions) -> Result<Self> {
        let invalid = |reason: String| Err(StorageError::InvalidArena { reason });
        if opts.frame_bytes == 0 || !opts.frame_bytes.is_multiple_of(FRAME_ALIGN) {
            return invalid(format!(
                "frame_bytes must be a positive multiple of {FRAME_ALIGN}, got {}",
                opts.frame_bytes
            ));
        }
        let frames_total = opts.capacity_bytes / opts.frame_bytes;
        if frames_total == 0 {
            return invalid(format!(
                "capacity of {} bytes holds no {}-byte frame",
                opts.capacity_bytes, opts.frame_bytes
            ));
        }
        if frames_total > u32::MAX as usize {
            return invalid(format!("{frames_total} frames exceed the u32 frame index"));
        }
        let bytes = frames_total * opts.frame_bytes;
        let mut map = MmapOptions::new()
            .len(bytes)
            .map_anon()
            .map_err(|source| StorageError::Map { bytes, source })?;
        if opts.huge_pages {
            // Advisory only: kernels without THP just keep 4 KiB pages.
            let _ = map.advise(memmap2::Advice::HugePage);
        }
        if opts.lock {
            map.lock().map_err(|source| StorageError::Lock { source })?;
        }
        let base = map.as_mut_ptr();
        // Highest index on top so the first allocations walk the mapping in address order.
        let free: Vec<u32> = (0..frames_total as u32).rev().collect();
        Ok(HostArena {
            quota: None,
            inner: Arc::new(Inner {
                _map: map,
                base,
                frame_bytes: opts.frame_bytes,
                frames_total,
                free: Mutex::new(free),
                used: AtomicUsize::new(0),
            }),
        })
    }

    pub fn frame_bytes(&self) -> usize {
        self.inner.frame_bytes
    }

    /// The same pool, with every frame taken through the returned handle charged to `quota`
    /// (and refunded when the frame is dropped): one owner's share of the tier. A frame the
    /// quota cannot take is [`StorageError::QuotaExceeded`], not [`StorageError::ArenaFull`].
    pub fn with_quota(&self, quota: Arc<FrameQuota>) -> HostArena {
        HostArena {
            inner: self.inner.clone(),
            quota: Some(quota),
        }
    }

    pub fn usage(&self) -> ArenaUsage {
        ArenaUsage {
            frame_bytes: self.inner.frame_bytes,
            frames_total: self.inner.frames_total,
            frames_used: self.inner.used.load(Ordering::Relaxed),
        }
    }

    /// Takes a free frame, zeroed, or fails with [`StorageError::ArenaFull`] (or
    /// [`StorageError::QuotaExceeded`]).
    pub fn alloc(&self) -> Result<Frame> {
        if let Some(q) = &self.quota {
            q.charge(1)?;
        }
        let Some(id) = self.inner.free.lock().pop() else {
            if let Some(q) = &self.quota {
                q.used.fetch_sub(1, Ordering::AcqRel);
            }
            return Err(StorageError::ArenaFull {
                frames: self.inner.frames_total,
                frame_bytes: self.inner.frame_bytes,
            });
        };
        self.inner.used.fetch_add(1, Ordering::Relaxed);
        let mut frame = Frame {
            arena: self.inner.clone(),
            quota: self.quota.clone(),
            id,
        };
        // Zeroed so a partially filled tail block has defined (zero) padding and identical
        // bytes however it was filled.
        frame.as_mut_slice().fill(0);
        Ok(frame)
    }

    /// Takes `n` frames or none: on failure the frames already taken go back to the pool.
    pub fn alloc_many(&self, n: usize) -> Result<Vec<Frame>> {
        let mut frames = self.alloc_many_unzeroed(n)?;
        for f in &mut frames {
            f.as_mut_slice().fill(0);
        }
        Ok(frames)
    }

    /// [`HostArena::alloc_many`] without zeroing: the frames hold whatever their last owner
    /// left. For callers that overwrite every byte before anyone reads the frame (a bulk
    /// restore or a promotion writes the run and zeroes the rest, [`Frame::put_run`], instead
    /// of zeroing the whole frame first and then copying over it).
    pub(crate) fn alloc_many_unzeroed(&self, n: usize) -> Result<Vec<Frame>> {
        if let Some(q) = &self.quota {
            q.charge(n)?;
        }
        let ids = {
            let mut free = self.inner.free.lock();
            if free.len() < n {
                if let Some(q) = &self.quota {
                    q.used.fetch_sub(n, Ordering::AcqRel);
                }
                return Err(StorageError::ArenaFull {
                    frames: self.inner.frames_total,
                    frame_bytes: self.inner.frame_bytes,
                });
            }
            let at = free.len() - n;
            free.split_off(at)
        };
        self.inner.used.fetch_add(n, Ordering::Relaxed);
        Ok(ids
            .into_iter()
            .rev()
            .map(|id| Frame {
                arena: self.inner.clone(),
                quota: self.quota.clone(),
                id,
            })
            .collect())
    }

    /// Frames free right now.
    pub fn free_frames(&self) -> usize {
        self.inner.free.lock().len()
    }

    /// Start address and length of the whole mapping, for registering it with a device driver
    /// (cuMemHostRegister). The caller must not write through it.
    pub fn region(&self) -> (*const u8, usize) {
        (
            self.inner.base as *const u8,
            self.inner.frames_total * self.inner.frame_bytes,
        )
    }

    /// Byte offset of frame `id` from the start of [`HostArena::region`].
    pub fn frame_offset(&self, id: u32) -> usize {
        id as usize * self.inner.frame_bytes
    }
}

/// Exclusive ownership of one arena frame; returns the frame to its arena (and refunds its
/// owner's quota) when dropped.
pub struct Frame {
    arena: Arc<Inner>,
    quota: Option<Arc<FrameQuota>>,
    id: u32,
}

impl Frame {
    /// Index of the frame in its arena (its byte offset is `id * frame_bytes`).
    pub fn id(&self) -> u32 {
        self.id
    }

    pub fn len(&self) -> usize {
        self.arena.frame_bytes
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    /// The frame's first byte: `[id*fb, (id+1)*fb)` lies inside the live mapping
    /// (id < frames_total) and is reachable only through this handle.
    fn start(&self) -> *mut u8 {
        // SAFETY: id < frames_total, so the offset stays inside the mapping.
        unsafe {
            self.arena
                .base
                .add(self.id as usize * self.arena.frame_bytes)
        }
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the frame's range (see `start`), reachable only through this handle, which
        // we borrow shared.
        unsafe { std::slice::from_raw_parts(self.start(), self.arena.frame_bytes) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes this the only live reference to the range.
        unsafe { std::slice::from_raw_parts_mut(self.start(), self.arena.frame_bytes) }
    }

    /// Makes the frame hold exactly `run`: copied to the front, every byte after it zeroed
    /// (a frame from [`HostArena::alloc_many_unzeroed`] holds its last owner's bytes). Panics
    /// if `run` is longer than the frame.
    pub fn put_run(&mut self, run: &[u8]) {
        let f = self.as_mut_slice();
        f[..run.len()].copy_from_slice(run);
        f[run.len()..].fill(0);
    }
}

impl std::fmt::Debug for Frame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Frame({})", self.id)
    }
}

impl Drop for Frame {
    fn drop(&mut self) {
        self.arena.free.lock().push(self.id);
        self.arena.used.fetch_sub(1, Ordering::Relaxed);
        if let Some(q) = &self.quota {
            q.used.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arena(frames: usize) -> HostArena {
        HostArena::new(&ArenaOptions::new(frames * FRAME_ALIGN, FRAME_ALIGN)).unwrap()
    }

    #[test]
    fn full_arena_is_a_typed_error_and_freed_frames_are_reused() {
        let a = arena(3);
        let f: Vec<_> = (0..3).map(|_| a.alloc().unwrap()).collect();
        assert!(matches!(
            a.alloc(),
            Err(StorageError::ArenaFull { frames: 3, .. })
        ));
        let freed = f[1].id();
        drop(f);
        assert_eq!(a.usage().frames_used, 0);
        let again = a.alloc().unwrap();
        assert!(again.id() < 3);
        let _ = freed;
    }

    #[test]
    fn frames_are_zeroed_and_disjoint() {
        let a = arena(4);
        let mut x = a.alloc().unwrap();
        let mut y = a.alloc().unwrap();
        x.as_mut_slice().fill(0xAB);
        y.as_mut_slice().fill(0xCD);
        assert!(x.as_slice().iter().all(|&b| b == 0xAB));
        assert!(y.as_slice().iter().all(|&b| b == 0xCD));
        let id = x.id();
        drop(x);
        let z = a.alloc().unwrap();
        assert_eq!(z.id(), id, "LIFO reuse");
        assert!(
            z.as_slice().iter().all(|&b| b == 0),
            "reused frame is zeroed"
        );
    }

    #[test]
    fn alloc_many_is_all_or_nothing() {
        let a = arena(4);
        let _one = a.alloc().unwrap();
        assert!(matches!(
            a.alloc_many(4),
            Err(StorageError::ArenaFull { .. })
        ));
        assert_eq!(
            a.usage().frames_used,
            1,
            "a failed alloc_many takes nothing"
        );
        let three = a.alloc_many(3).unwrap();
        assert_eq!(three.len(), 3);
        assert_eq!(a.usage().frames_used, 4);
    }

    #[test]
    fn a_quota_caps_one_owners_frames_and_is_refunded_on_drop() {
        let a = arena(8);
        let q = FrameQuota::new(3);
        let mine = a.with_quota(q.clone());
        let two = mine.alloc_many(2).unwrap();
        let one = mine.alloc().unwrap();
        assert!(matches!(
            mine.alloc(),
            Err(StorageError::QuotaExceeded {
                frames_used: 3,
                limit: 3,
                ..
            })
        ));
        assert!(mine.alloc_many(1).is_err());
        assert_eq!(q.used(), 3);
        // Others are not charged and not limited by it.
        let theirs = a.alloc_many(5).unwrap();
        drop(one);
        assert_eq!(q.used(), 2);
        let last = a.alloc().unwrap();
        // A full arena refunds what the quota had charged.
        assert!(matches!(mine.alloc(), Err(StorageError::ArenaFull { .. })));
        assert!(matches!(
            mine.alloc_many(1),
            Err(StorageError::ArenaFull { .. })
        ));
        assert_eq!(q.used(), 2);
        drop((two, theirs, last));
        assert_eq!((q.used(), a.usage().frames_used), (0, 0));
    }

    #[test]
    fn bad_options_are_rejected() {
        assert!(HostArena::new(&ArenaOptions::new(1 << 20, 1000)).is_err());
        assert!(HostArena::new(&ArenaOptions::new(100, FRAME_ALIGN)).is_err());
    }

    proptest! {
        /// Random alloc/free sequences: the accounting equals a model, ids are unique, and
        /// allocation fails exactly when the model says the arena is full.
        #[test]
        fn accounting_matches_a_model(ops in proptest::collection::vec(any::<(bool, u8)>(), 1..200)) {
            let a = arena(8);
            let mut held: Vec<Frame> = Vec::new();
            for (alloc, pick) in ops {
                if alloc {
                    match a.alloc() {
                        Ok(f) => held.push(f),
                        Err(StorageError::ArenaFull { .. }) => prop_assert_eq!(held.len(), 8),
                        Err(e) => return Err(TestCaseError::fail(e.to_string())),
                    }
                } else if !held.is_empty() {
                    let i = pick as usize % held.len();
                    held.swap_remove(i);
                }
                let u = a.usage();
                prop_assert_eq!(u.frames_used, held.len());
                prop_assert_eq!(u.bytes_used(), held.len() * FRAME_ALIGN);
                let mut ids: Vec<u32> = held.iter().map(Frame::id).collect();
                ids.sort_unstable();
                ids.dedup();
                prop_assert_eq!(ids.len(), held.len());
            }
        }
    }
}
