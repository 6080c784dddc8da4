//! The host-RAM tier: an arena of variable-size block-run extents in one anonymous mapping.
//!
//! One mapping (rather than one allocation per block) is what lets a GPU backend register the
//! whole tier with the driver once — pinned and mapped for zero-copy reads — and what keeps the
//! decode path free of heap traffic: an extent is carved when a block is opened and returned
//! when its owner drops it.
//!
//! Each block run takes an extent of exactly its size rounded up to [`EXTENT_ALIGN`] (see
//! [`crate::extents`]), so every geometry from a 270M model's 32 KiB runs to a 64-head f32
//! model's 8 MiB runs shares one arena without resizing anything and without wasting a
//! fixed-size slot per small run. Extents never cross a multiple of [`HostArena::segment_bytes`]
//! (1 GiB, or `max_run_bytes` if larger), so a GPU backend that registers the arena in chunks of
//! whole segments always finds a run inside one chunk; a segment that large wastes at most one
//! run's tail per GiB (a 16 MiB segment would waste 1/16 of the tier on 5 MiB runs).
//!
//! Extents are handed out as owned [`Extent`] handles. A handle is the only way to reach its
//! bytes, so two handles never alias and the extent is freed exactly once, in `Drop`.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use memmap2::{MmapMut, MmapOptions};
use parking_lot::Mutex;

use crate::error::{Result, StorageError};
use crate::extents::Extents;
use crate::par;
use crate::space::Space;

mod relocate;
pub use relocate::Relocation;

/// Extents are multiples of this (and start at multiples of it) so runs can be written to NVMe
/// with O_DIRECT and registered with CUDA without straddling pages.
pub const EXTENT_ALIGN: usize = 4096;

/// Extents never cross a multiple of this (or of `max_run_bytes`, if larger).
pub const SEGMENT_BYTES: usize = 1 << 30;

/// Default largest block run (`host.max_run_bytes`): a 64-KV-head, D=128 model in f32 at
/// 128-token blocks is 8 MiB; this leaves room for twice that.
pub const DEFAULT_MAX_RUN_BYTES: usize = 16 << 20;

/// How to build a [`HostArena`].
#[derive(Debug, Clone)]
pub struct ArenaOptions {
    /// Total bytes; rounded down to a multiple of [`EXTENT_ALIGN`].
    pub capacity_bytes: usize,
    /// Largest block run (extent) the arena hands out, a positive multiple of [`EXTENT_ALIGN`]
    /// and at most the capacity.
    pub max_run_bytes: usize,
    /// Advise transparent huge pages (fewer TLB misses and faster pinning).
    pub huge_pages: bool,
    /// mlock the whole arena up front (needs RLIMIT_MEMLOCK >= capacity).
    pub lock: bool,
    /// Back the arena with a memfd mapped shared, so engine processes can map the same bytes
    /// ([`HostArena::shared_fd`]). Shared memory gets transparent huge pages only where the
    /// kernel's `shmem_enabled` allows them.
    pub shared: bool,
}

impl ArenaOptions {
    pub fn new(capacity_bytes: usize, max_run_bytes: usize) -> Self {
        ArenaOptions {
            capacity_bytes,
            max_run_bytes,
            huge_pages: true,
            lock: false,
            shared: false,
        }
    }
}

/// A memfd of `bytes`, sealed against shrinking and growing (a second process may map it:
/// it can never be cut short under either mapping).
fn arena_memfd(bytes: usize) -> std::io::Result<File> {
    // SAFETY: a valid NUL-terminated name; the flags are plain bits.
    let fd = unsafe {
        libc::memfd_create(
            c"kvtier-arena".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: memfd_create returned a fresh descriptor that nothing else owns.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(bytes as u64)?;
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on a descriptor we own.
    if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, seals) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(file)
}

/// Usage counters of an arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaUsage {
    pub bytes_total: usize,
    pub bytes_used: usize,
    /// Extents (resident block runs) held.
    pub extents_used: usize,
    pub max_run_bytes: usize,
    /// The longest extent that could be taken now, and the free ranges: free bytes in many
    /// small ranges refuse runs they add up to.
    pub largest_free_bytes: usize,
    pub free_ranges: usize,
}

/// Bytes an extent holding `bytes` takes.
pub fn extent_bytes(bytes: usize) -> usize {
    bytes.div_ceil(EXTENT_ALIGN) * EXTENT_ALIGN
}

struct Inner {
    /// Keeps the mapping alive; its bytes are only reached through `base`.
    _map: MmapMut,
    /// The memfd behind a shared arena.
    memfd: Option<File>,
    base: *mut u8,
    bytes_total: usize,
    max_run_bytes: usize,
    segment_bytes: usize,
    /// Free space and every extent, in EXTENT_ALIGN units.
    space: Mutex<Space>,
}

// SAFETY: `base` points into `_map`, which lives as long as `Inner`. Distinct extents are
// disjoint byte ranges and each is reachable only through its unique `Extent` handle (or `&self`
// methods that read nothing but the pointer), so sharing `Inner` between threads creates no
// data race.
unsafe impl Send for Inner {}
// SAFETY: see `Send` above; all shared mutable state is behind `space`'s mutex.
unsafe impl Sync for Inner {}

impl Inner {
    fn release(&self, unit: u64, units: u64) {
        let ok = self.space.lock().release(unit, units as u32);
        debug_assert!(ok, "an extent is freed once, by its only handle");
    }
}

/// A per-owner cap on host bytes held at once: every extent taken through an arena handle that
/// carries it ([`HostArena::with_quota`]) counts until it is dropped.
#[derive(Debug)]
pub struct HostQuota {
    limit: usize,
    used: AtomicUsize,
}

impl HostQuota {
    pub fn new(limit_bytes: usize) -> Arc<Self> {
        Arc::new(HostQuota {
            limit: limit_bytes,
            used: AtomicUsize::new(0),
        })
    }

    /// Bytes held now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Charges `n` bytes, or fails without charging anything.
    fn charge(&self, n: usize) -> Result<()> {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                (u + n <= self.limit).then_some(u + n)
            })
            .map(|_| ())
            .map_err(|used| StorageError::QuotaExceeded {
                bytes_used: used,
                wanted: n,
                limit: self.limit,
            })
    }

    fn refund(&self, n: usize) {
        self.used.fetch_sub(n, Ordering::AcqRel);
    }
}

/// A pool of variable-size extents in one anonymous memory mapping. Cloning shares the pool.
#[derive(Clone)]
pub struct HostArena {
    inner: Arc<Inner>,
    /// Charged for every extent taken through this handle (see [`HostArena::with_quota`]).
    quota: Option<Arc<HostQuota>>,
}

impl std::fmt::Debug for HostArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostArena")
            .field("usage", &self.usage())
            .finish()
    }
}

/// Locks `map` in RAM, faulting it in from every core and calling `progress(locked, total)`
/// (bytes) after each range. The kernel faults a locked range in page by page, zeroing each:
/// ~1-1.5 GiB/s on one thread for 4 KiB shared pages, so a 471 GiB tier took 7.7 min (past the
/// unit's start timeout, with clients waiting in the backlog). One mlock2(MLOCK_ONFAULT) marks
/// the whole mapping, then threads fault ranges in with MADV_POPULATE_WRITE, which needs only
/// the mmap lock's read side: an mlock per range would take its write side each time and
/// serialise the threads. Kernels before 5.14 lack MADV_POPULATE_WRITE: mlock per range then.
fn lock_in_ram(map: &MmapMut, progress: &(dyn Fn(usize, usize) + Sync)) -> std::io::Result<()> {
    const HUGE_PAGE: usize = 2 << 20; // ranges of whole huge pages, where THP backs the map
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let len = map.len();
    let base = map.as_ptr() as usize;
    // SAFETY: the range is exactly `map`'s, alive for this call; locking changes only whether
    // pages stay resident, never what they hold.
    if unsafe { libc::syscall(libc::SYS_mlock2, base, len, libc::MLOCK_ONFAULT) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // A few ranges per thread, so threads whose ranges fault in slower do not hold the end,
    // and at most 256 MiB each, so progress comes every second or so.
    let chunk = len
        .div_ceil(threads * 4)
        .min(256 << 20)
        .next_multiple_of(HUGE_PAGE);
    let locked = AtomicUsize::new(0);
    progress(0, len);
    par::map_indexed(len.div_ceil(chunk), threads, "kvtier-lock", |i| {
        let (at, part) = (i * chunk, chunk.min(len - i * chunk));
        let ptr = (base + at) as *mut libc::c_void;
        // SAFETY: [ptr, ptr + part) lies inside `map`, alive for this call; populating faults
        // pages in without changing what they hold, and mlock changes only residency.
        let mut rc = unsafe { libc::madvise(ptr, part, libc::MADV_POPULATE_WRITE) };
        if rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
            // SAFETY: as above.
            rc = unsafe { libc::mlock(ptr, part) };
        }
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        progress(locked.fetch_add(part, Ordering::Relaxed) + part, len);
        Ok(())
    })
    .into_iter()
    .collect()
}

impl HostArena {
    pub fn new(opts: &ArenaOptions) -> Result<Self> {
        Self::with_progress(opts, &|_, _| {})
    }

    /// [`HostArena::new`], calling `progress(locked, total)` (bytes) from the locking threads
    /// while a `lock` arena is locked in RAM (minutes for hundreds of GiB).
    pub fn with_progress(
        opts: &ArenaOptions,
        progress: &(dyn Fn(usize, usize) + Sync),
    ) -> Result<Self> {
        let invalid = |reason: String| Err(StorageError::InvalidArena { reason });
        let bytes = opts.capacity_bytes / EXTENT_ALIGN * EXTENT_ALIGN;
        let max_run = opts.max_run_bytes;
        if max_run == 0 || !max_run.is_multiple_of(EXTENT_ALIGN) {
            return invalid(format!(
                "max_run_bytes must be a positive multiple of {EXTENT_ALIGN}, got {max_run}"
            ));
        }
        if bytes < max_run {
            return invalid(format!(
                "capacity of {} bytes is less than max_run_bytes {max_run}",
                opts.capacity_bytes
            ));
        }
        // Extents name their extent in u32 units of EXTENT_ALIGN.
        if bytes / EXTENT_ALIGN > u32::MAX as usize {
            return invalid(format!(
                "capacity of {} bytes exceeds the {} bytes extents can address",
                opts.capacity_bytes,
                (u32::MAX as usize) * EXTENT_ALIGN
            ));
        }
        let memfd = if opts.shared {
            Some(arena_memfd(bytes).map_err(|source| StorageError::Map { bytes, source })?)
        } else {
            None
        };
        let mut map = match &memfd {
            // SAFETY: the memfd is sealed against shrinking, so the mapping can never be cut
            // short; its bytes are reached only through `Extent` handles (see `Inner`), and
            // another process that maps it reads what extents hold (the lease rules of the
            // daemon say when).
            Some(f) => unsafe { MmapOptions::new().len(bytes).map_mut(f) },
            None => MmapOptions::new().len(bytes).map_anon(),
        }
        .map_err(|source| StorageError::Map { bytes, source })?;
        if opts.huge_pages {
            // Advisory only: kernels without THP just keep 4 KiB pages.
            let _ = map.advise(memmap2::Advice::HugePage);
        }
        if opts.lock {
            lock_in_ram(&map, progress).map_err(|source| StorageError::Lock { source })?;
        }
        let base = map.as_mut_ptr();
        let unit = EXTENT_ALIGN as u64;
        let segment = max_run.max(SEGMENT_BYTES);
        let space = Space::new(bytes as u64 / unit, segment as u64 / unit);
        Ok(HostArena {
            quota: None,
            inner: Arc::new(Inner {
                _map: map,
                memfd,
                base,
                bytes_total: bytes,
                max_run_bytes: max_run,
                segment_bytes: segment,
                space: Mutex::new(space),
            }),
        })
    }

    /// The largest extent (block run) the arena hands out.
    pub fn max_run_bytes(&self) -> usize {
        self.inner.max_run_bytes
    }

    /// The memfd behind a shared arena ([`ArenaOptions::shared`]), to pass to an engine process
    /// that maps the same bytes; None for a private arena.
    pub fn shared_fd(&self) -> Option<BorrowedFd<'_>> {
        self.inner.memfd.as_ref().map(AsFd::as_fd)
    }

    /// No extent crosses a multiple of this many bytes from the start of the region.
    pub fn segment_bytes(&self) -> usize {
        self.inner.segment_bytes
    }

    /// The same pool, with every extent taken through the returned handle charged to `quota`
    /// (and refunded when it is dropped): one owner's share of the tier. An extent the quota
    /// cannot take is [`StorageError::QuotaExceeded`], not [`StorageError::ArenaFull`].
    pub fn with_quota(&self, quota: Arc<HostQuota>) -> HostArena {
        HostArena {
            inner: self.inner.clone(),
            quota: Some(quota),
        }
    }

    /// The arena's size in bytes (fixed at creation; no lock, unlike [`Self::usage`]).
    pub fn bytes_total(&self) -> usize {
        self.inner.bytes_total
    }

    pub fn usage(&self) -> ArenaUsage {
        let space = self.inner.space.lock();
        ArenaUsage {
            bytes_total: self.inner.bytes_total,
            bytes_used: space.used() as usize * EXTENT_ALIGN,
            extents_used: space.pages() as usize,
            max_run_bytes: self.inner.max_run_bytes,
            largest_free_bytes: space.largest_free() as usize * EXTENT_ALIGN,
            free_ranges: space.free_ranges() as usize,
        }
    }

    /// How many extents of `bytes` could be taken now (at most `cap`), ignoring quotas.
    pub fn fits(&self, bytes: usize, cap: usize) -> usize {
        let units = (extent_bytes(bytes) / EXTENT_ALIGN) as u64;
        self.inner.space.lock().extents().fits(units, cap as u64) as usize
    }

    /// Takes a zeroed extent for a run of `bytes`, or fails with [`StorageError::ArenaFull`]
    /// (or [`StorageError::QuotaExceeded`], or [`StorageError::BlockTooLarge`]).
    pub fn alloc(&self, bytes: usize) -> Result<Extent> {
        Ok(self.alloc_many(1, bytes)?.pop().expect("one extent"))
    }

    /// Takes `n` zeroed extents for runs of `bytes`, or none: on failure the extents already
    /// taken go back to the pool.
    pub fn alloc_many(&self, n: usize, bytes: usize) -> Result<Vec<Extent>> {
        let mut extents = self.alloc_many_unzeroed(n, bytes)?;
        // Zeroed so a partially filled tail block has defined (zero) padding and identical
        // bytes however it was filled.
        for f in &mut extents {
            f.as_mut_slice().fill(0);
        }
        Ok(extents)
    }

    /// [`HostArena::alloc_many`] without zeroing: the extents hold whatever their last owner
    /// left. For callers that overwrite every byte before anyone reads the extent (a bulk
    /// restore or a promotion writes the run and zeroes the rest, [`Extent::put_run`], instead
    /// of zeroing the whole extent first and then copying over it).
    pub(crate) fn alloc_many_unzeroed(&self, n: usize, bytes: usize) -> Result<Vec<Extent>> {
        let max = self.inner.max_run_bytes;
        if bytes == 0 || bytes > max {
            return Err(StorageError::BlockTooLarge {
                block_bytes: bytes,
                max_run_bytes: max,
            });
        }
        let len = extent_bytes(bytes);
        let units = (len / EXTENT_ALIGN) as u64;
        let charged = n * len;
        if let Some(q) = &self.quota {
            q.charge(charged)?;
        }
        let starts = {
            let mut space = self.inner.space.lock();
            let mut starts = Vec::with_capacity(n);
            while starts.len() < n {
                match space.alloc(units as u32) {
                    Some(s) => starts.push(s),
                    None => break,
                }
            }
            if starts.len() < n {
                for &s in &starts {
                    space.release(s, units as u32);
                }
                drop(space);
                if let Some(q) = &self.quota {
                    q.refund(charged);
                }
                return Err(self.full(n, len));
            }
            starts
        };
        Ok(starts
            .into_iter()
            .map(|unit| Extent {
                arena: self.inner.clone(),
                quota: self.quota.clone(),
                unit: unit as u32,
                units: units as u32,
            })
            .collect())
    }

    /// The [`StorageError::ArenaFull`] of `wanted` runs of `bytes` not fitting now.
    pub(crate) fn full(&self, wanted: usize, bytes: usize) -> StorageError {
        self.full_in(self.inner.space.lock().extents(), wanted, bytes)
    }

    /// The [`StorageError::ArenaFull`] one more run of `bytes` would meet once `taken` runs of
    /// that size were allocated first, worked out on a copy of the free space: nothing is
    /// taken from the arena (which other sessions share).
    pub(crate) fn full_after(&self, taken: usize, bytes: usize) -> StorageError {
        let units = (extent_bytes(bytes) / EXTENT_ALIGN) as u64;
        let mut space = self.inner.space.lock().extents().clone();
        for _ in 0..taken {
            if space.alloc(units).is_none() {
                break;
            }
        }
        self.full_in(&space, 1, bytes)
    }

    fn full_in(&self, space: &Extents, wanted: usize, bytes: usize) -> StorageError {
        StorageError::ArenaFull {
            wanted,
            run_bytes: extent_bytes(bytes),
            bytes_free: space.free() as usize * EXTENT_ALIGN,
            largest_free: space.largest_free() as usize * EXTENT_ALIGN,
            bytes_total: self.inner.bytes_total,
        }
    }

    /// Start address and length of the whole mapping, for registering it with a device driver
    /// (cuMemHostRegister). The caller must not write through it.
    pub fn region(&self) -> (*const u8, usize) {
        (self.inner.base as *const u8, self.inner.bytes_total)
    }
}

/// Exclusive ownership of one arena extent (one block run); returns it to its arena (and
/// refunds its owner's quota) when dropped.
pub struct Extent {
    arena: Arc<Inner>,
    quota: Option<Arc<HostQuota>>,
    /// First EXTENT_ALIGN unit and length in units (u32: an arena of up to 16 TiB).
    unit: u32,
    units: u32,
}

impl Extent {
    /// Byte offset of the extent from the start of [`HostArena::region`].
    pub fn offset(&self) -> usize {
        self.unit as usize * EXTENT_ALIGN
    }

    /// Bytes of the extent (the run's size rounded up to [`EXTENT_ALIGN`]).
    pub fn len(&self) -> usize {
        self.units as usize * EXTENT_ALIGN
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    /// The extent's first byte: `[offset, offset + len)` lies inside the live mapping (the
    /// allocator only hands out ranges of it) and is reachable only through this handle.
    fn start(&self) -> *mut u8 {
        // SAFETY: offset + len <= bytes_total, so the offset stays inside the mapping.
        unsafe { self.arena.base.add(self.offset()) }
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the extent's range (see `start`), reachable only through this handle, which
        // we borrow shared.
        unsafe { std::slice::from_raw_parts(self.start(), self.len()) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes this the only live reference to the range.
        unsafe { std::slice::from_raw_parts_mut(self.start(), self.len()) }
    }

    /// Makes the extent hold exactly `run`: copied to the front, every byte after it zeroed
    /// (an extent from [`HostArena::alloc_many_unzeroed`] holds its last owner's bytes). Panics
    /// if `run` is longer than the extent.
    pub fn put_run(&mut self, run: &[u8]) {
        let f = self.as_mut_slice();
        f[..run.len()].copy_from_slice(run);
        f[run.len()..].fill(0);
    }
}

impl std::fmt::Debug for Extent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Extent({}+{})", self.offset(), self.len())
    }
}

impl Drop for Extent {
    fn drop(&mut self) {
        self.arena.release(self.unit as u64, self.units as u64);
        if let Some(q) = &self.quota {
            q.refund(self.len());
        }
    }
}

#[cfg(test)]
mod tests;
