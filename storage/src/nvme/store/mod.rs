//! The page store: fixed-size checksummed pages on one or more O_DIRECT devices.
//!
//! Each device is a file or block device divided into pages of `page_size` bytes (header +
//! largest payload, rounded up to the direct-I/O alignment). A bitmap allocator per device
//! hands out pages; a session's pages are striped over devices in proportion to their
//! bandwidth by smooth weighted round robin, so reading a session back keeps every device
//! busy for about the same time. Reads verify magic, identity and crc32c: a page that fails
//! is an error, never data.
//!
//! Every batch of reads and writes is timed per device (the union of the intervals its
//! operations were in flight) and folded into that device's read or write [`LaneTracker`].
//! Once every device has [`STRIPE_MIN_SAMPLES`] timed reads, new pages are striped by the
//! tracked read throughput ([`LaneTracker::throughput`]: the rate at the transfers the device
//! actually gets) instead of the configured bandwidth.
//!
//! # Batches, workers and buffers
//!
//! A batch is cut into chunks of about [`CHUNK_BYTES`]; up to [`PageStore::workers`] threads
//! (the caller is one) each take a chunk at a time, encode it into page buffers (or verify
//! what was read), submit it to the engine and wait. So checksums and copies run on several
//! cores while the engine has other chunks in flight, and a batch of one chunk runs inline
//! with no thread at all. Page buffers come from a pool of recycled aligned buffers (a fresh
//! one costs an allocation, page faults and zeroing) whose idle part is capped at
//! [`POOL_BYTES`]; a write batch holds at most `workers` chunks of buffers at once, whatever
//! its size. Results, errors and the per-device timing are exactly those of one batch: every
//! page is attempted, every failure counted, and a failed write batch returns the error of its
//! first failed page.
//!
//! # Files
//!
//! - `mod.rs`: configuration, addresses, opening the devices, chunking a batch over workers.
//! - `alloc.rs`: the per-device bitmap allocator and bandwidth-weighted striping.
//! - `write.rs` / `read.rs`: batches of page writes (and `sync`) / verified page reads.
//! - `lanes.rs`: per-device timing folded into the lane trackers, stripe weights, usage.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::buf::{round_up, BufPool, DirectFile};
use super::io::{IoEngine, OpKind};
use super::page::{PageId, HEADER_LEN};
use super::plan::{Lane, LaneTracker};
use super::NvmeError;
use crate::par;

mod alloc;
mod lanes;
mod read;
#[cfg(test)]
mod tests;
mod write;

use alloc::Bitmap;
pub use lanes::{DeviceUsage, StoreUsage};
pub use read::{PageData, PageResults};

/// Bytes of pages one worker encodes or verifies and hands the engine as one submission.
pub const CHUNK_BYTES: usize = 4 << 20;
/// Most pages in one chunk (small pages).
pub const CHUNK_MAX_PAGES: usize = 64;
/// Bytes of idle page buffers the pool keeps for the next batch (at least one buffer).
pub const POOL_BYTES: usize = 128 << 20;
/// Most threads [`PageStore::set_workers`] accepts.
pub const MAX_WORKERS: usize = 64;

/// Timed reads every device needs before the tracked read bandwidth replaces the configured
/// stripe weights (a few batches, so one early outlier cannot set the weights).
pub const STRIPE_MIN_SAMPLES: u64 = 8;
/// Weight of each new batch in the devices' EWMA lane estimates.
pub const TRACKER_ALPHA: f64 = 0.1;

/// One backing device.
#[derive(Debug, Clone)]
pub struct DeviceConfig {
    /// A regular file (created and preallocated if needed) or a block device.
    pub path: PathBuf,
    /// Bytes of the device the store may use (rounded down to whole pages).
    pub capacity_bytes: u64,
    /// Relative or measured read bandwidth, bytes/s; sets this device's share of pages until
    /// the online estimate takes over (see [`STRIPE_MIN_SAMPLES`]).
    pub bandwidth_bytes_per_s: f64,
}

/// Page store configuration.
#[derive(Debug, Clone)]
pub struct PageStoreConfig {
    pub devices: Vec<DeviceConfig>,
    /// Largest payload a page holds (one block run: Hkv * 2 * B * D * elem bytes).
    pub max_payload: usize,
}

/// Where a page lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageAddr {
    pub device: u16,
    pub page: u64,
}

/// A page to write.
#[derive(Debug, Clone, Copy)]
pub struct PageWrite<'a> {
    pub addr: PageAddr,
    pub id: PageId,
    pub payload: &'a [u8],
}

/// A page to read: where, what it must be, and (if the index recorded it) its checksum.
#[derive(Debug, Clone, Copy)]
pub struct PageRead {
    pub addr: PageAddr,
    pub id: PageId,
    pub expected_crc: Option<u32>,
}

struct Device {
    file: Arc<DirectFile>,
    pages: u64,
    /// Configured stripe weight.
    bandwidth: f64,
    alloc: Mutex<Bitmap>,
    read: Mutex<LaneTracker>,
    write: Mutex<LaneTracker>,
}

impl Device {
    fn tracker(&self, kind: OpKind) -> &Mutex<LaneTracker> {
        match kind {
            OpKind::Read => &self.read,
            OpKind::Write => &self.write,
        }
    }
}

/// The NVMe page store. Cheap to share (`Arc<PageStore>`); all methods take `&self`.
pub struct PageStore {
    engine: Arc<dyn IoEngine>,
    devices: Vec<Device>,
    page_size: usize,
    max_payload: usize,
    pool: Arc<BufPool>,
    workers: AtomicUsize,
    chunk_pages: usize,
    stripe: Mutex<HashMap<u64, Vec<f64>>>,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    corrupt_pages: AtomicU64,
    io_errors: AtomicU64,
}

impl std::fmt::Debug for PageStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageStore")
            .field("engine", &self.engine.name())
            .field("devices", &self.devices.len())
            .field("page_size", &self.page_size)
            .finish()
    }
}

impl PageStore {
    /// Opens (creating and preallocating regular files as needed) every device. All pages
    /// start free: after a restart, call [`PageStore::mark_allocated`] for every page the
    /// manifest references.
    pub fn open(cfg: &PageStoreConfig, engine: Arc<dyn IoEngine>) -> Result<Self, NvmeError> {
        if cfg.devices.is_empty() {
            return Err(NvmeError::invalid("page store needs at least one device"));
        }
        if cfg.devices.len() > u16::MAX as usize {
            return Err(NvmeError::invalid(format!(
                "{} devices; at most {}",
                cfg.devices.len(),
                u16::MAX
            )));
        }
        if cfg.max_payload == 0 || cfg.max_payload > u32::MAX as usize / 4 {
            return Err(NvmeError::invalid(format!(
                "max_payload {} must be in 1..={}",
                cfg.max_payload,
                u32::MAX / 4
            )));
        }
        let mut files = Vec::with_capacity(cfg.devices.len());
        for d in &cfg.devices {
            if !(d.bandwidth_bytes_per_s.is_finite() && d.bandwidth_bytes_per_s > 0.0) {
                return Err(NvmeError::invalid(format!(
                    "device {:?}: bandwidth {} must be positive",
                    d.path, d.bandwidth_bytes_per_s
                )));
            }
            files.push(Arc::new(DirectFile::open(&d.path)?));
        }
        let align = files.iter().map(|f| f.align()).max().expect("non-empty");
        let page_size = round_up(HEADER_LEN + cfg.max_payload, align);
        let mut devices = Vec::with_capacity(files.len());
        for (d, file) in cfg.devices.iter().zip(files) {
            let pages = d.capacity_bytes / page_size as u64;
            if pages == 0 {
                return Err(NvmeError::invalid(format!(
                    "device {:?}: capacity {} bytes holds no {page_size}-byte page",
                    d.path, d.capacity_bytes
                )));
            }
            file.ensure_len(pages * page_size as u64)?;
            // The prior only stands until the first timed transfer replaces it.
            let prior = Lane::new(d.bandwidth_bytes_per_s, 0.0)?;
            devices.push(Device {
                file,
                pages,
                bandwidth: d.bandwidth_bytes_per_s,
                alloc: Mutex::new(Bitmap::new(pages)),
                read: Mutex::new(LaneTracker::new(prior, TRACKER_ALPHA)?),
                write: Mutex::new(LaneTracker::new(prior, TRACKER_ALPHA)?),
            });
        }
        let mem_align = devices
            .iter()
            .map(|d| d.file.mem_align())
            .max()
            .expect("non-empty");
        let pool = Arc::new(BufPool::new(
            page_size,
            mem_align,
            (POOL_BYTES / page_size).max(1),
        )?);
        Ok(Self {
            engine,
            devices,
            page_size,
            max_payload: cfg.max_payload,
            pool,
            workers: AtomicUsize::new(par::default_workers()),
            chunk_pages: (CHUNK_BYTES / page_size).clamp(1, CHUNK_MAX_PAGES),
            stripe: Mutex::new(HashMap::new()),
            bytes_read: AtomicU64::new(0),
            bytes_written: AtomicU64::new(0),
            corrupt_pages: AtomicU64::new(0),
            io_errors: AtomicU64::new(0),
        })
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    pub fn max_payload(&self) -> usize {
        self.max_payload
    }

    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    pub fn engine_name(&self) -> &'static str {
        self.engine.name()
    }

    /// Pages per device.
    pub fn device_pages(&self) -> Vec<u64> {
        self.devices.iter().map(|d| d.pages).collect()
    }

    /// Threads a bulk batch may use (the caller's included).
    pub fn workers(&self) -> usize {
        self.workers.load(Ordering::Relaxed)
    }

    /// Sets the threads a bulk batch may use, the caller's included; 1 runs every batch on
    /// the calling thread. The default is one per core, at most 8.
    pub fn set_workers(&self, n: usize) -> Result<(), NvmeError> {
        if n == 0 || n > MAX_WORKERS {
            return Err(NvmeError::invalid(format!(
                "page store workers {n} must be in 1..={MAX_WORKERS}"
            )));
        }
        self.workers.store(n, Ordering::Relaxed);
        Ok(())
    }

    /// Pages per chunk: the unit one worker encodes or verifies and submits.
    pub fn chunk_pages(&self) -> usize {
        self.chunk_pages
    }

    /// Runs `f` over the chunks of a batch of `n` pages on the store's workers; results in
    /// chunk order.
    fn per_chunk<T: Send>(
        &self,
        n: usize,
        f: impl Fn(std::ops::Range<usize>) -> T + Sync,
    ) -> Vec<T> {
        let c = self.chunk_pages;
        par::map_indexed(n.div_ceil(c), self.workers(), "kvtier-pstore", |i| {
            f(i * c..((i + 1) * c).min(n))
        })
    }

    fn device(&self, a: PageAddr) -> Result<&Device, NvmeError> {
        let dev = self.devices.get(a.device as usize).ok_or_else(|| {
            NvmeError::invalid(format!(
                "device {} out of range ({} devices)",
                a.device,
                self.devices.len()
            ))
        })?;
        if a.page >= dev.pages {
            return Err(NvmeError::invalid(format!(
                "page {} out of range (device {} has {})",
                a.page, a.device, dev.pages
            )));
        }
        Ok(dev)
    }

    fn offset(&self, a: PageAddr) -> u64 {
        a.page * self.page_size as u64
    }

    /// The files backing the devices (for probing).
    pub fn device_files(&self) -> Vec<Arc<DirectFile>> {
        self.devices.iter().map(|d| d.file.clone()).collect()
    }
}
