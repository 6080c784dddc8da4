//! The page store: variable-size checksummed pages on one or more O_DIRECT devices.
//!
//! Each device is a file or block device divided into *units* of the direct-I/O alignment
//! ([`PageStore::unit`], the largest of the devices', normally 4 KiB). A page holds one block
//! run and is one extent of exactly `round_up(HEADER_LEN + payload, unit)` bytes, so a store
//! serves sessions of any geometry (32 KiB runs of a small model beside 8 MiB runs of a large
//! one) without refusing big runs or wasting most of a fixed page on small ones. An extent
//! allocator per device ([`crate::extents::Extents`], best fit) hands out pages; a session's
//! pages are striped over devices in proportion to their bandwidth by smooth weighted round
//! robin, so reading a session back keeps every device busy for about the same time. Reads
//! verify magic, identity and crc32c: a page that fails is an error, never data.
//!
//! Every batch of reads and writes is timed per device (the union of the intervals its
//! operations were in flight) and folded into that device's read or write [`LinkTracker`].
//! Once every device has [`STRIPE_MIN_SAMPLES`] timed reads, new pages are striped by the
//! tracked read throughput ([`LinkTracker::throughput`]: the rate at the transfers the device
//! actually gets) instead of the configured bandwidth.
//!
//! # Batches, workers and buffers
//!
//! A batch is cut into chunks of about [`CHUNK_BYTES`] of pages (at most [`CHUNK_MAX_PAGES`]
//! pages, at least one whatever its size); up to [`PageStore::workers`] threads (the caller is
//! one) each take a chunk at a time, encode it into page buffers (or verify what was read),
//! submit it to the driver and wait. So checksums and copies run on several
//! cores while the driver has other chunks in flight, and a batch of one chunk runs inline
//! with no thread at all. Page buffers come from a pool of recycled aligned buffers, kept by
//! length (a fresh one costs an allocation, page faults and zeroing), whose idle part is capped
//! at [`POOL_BYTES`]; a write batch holds at most `workers` chunks of buffers at once, whatever
//! its size. Results, errors and the per-device timing are exactly those of one batch: every
//! page is attempted, every failure counted, and a failed write batch returns the error of its
//! first failed page.
//!
//! # Files
//!
//! - `mod.rs`: configuration, addresses, opening the devices, chunking a batch over workers.
//! - `alloc.rs`: extent allocation per device and bandwidth-weighted striping.
//! - `write.rs` / `read.rs`: batches of page writes (and `sync`) / verified page reads.
//! - `links.rs`: per-device timing folded into the link trackers, stripe weights, usage.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::buf::{BufPool, DirectFile};
use super::io::{IoDriver, OpKind};
use super::link::{Link, LinkTracker};
use super::page::{PageId, HEADER_LEN};
use super::NvmeError;
use crate::par;
use crate::space::Space;

mod alloc;
mod links;
mod read;
#[cfg(test)]
mod tests;
mod write;

pub use alloc::Evacuation;
pub use links::{DeviceUsage, StoreUsage};
pub use read::{PageData, PageResults};

/// Bytes of pages one worker encodes or verifies and hands the driver as one submission (a
/// page larger than this is a chunk of its own).
pub const CHUNK_BYTES: usize = 4 << 20;
/// Most pages in one chunk (small pages).
pub const CHUNK_MAX_PAGES: usize = 64;
/// Bytes of idle page buffers the pool keeps for the next batch.
pub const POOL_BYTES: usize = 128 << 20;
/// Most threads [`PageStore::set_workers`] accepts.
pub const MAX_WORKERS: usize = 64;

/// Timed reads every device needs before the tracked read bandwidth replaces the configured
/// stripe weights (a few batches, so one early outlier cannot set the weights).
pub const STRIPE_MIN_SAMPLES: u64 = 8;
/// Weight of each new batch in the devices' EWMA link estimates.
pub const TRACKER_ALPHA: f64 = 0.1;

/// One backing device.
#[derive(Debug, Clone)]
pub struct DeviceConfig {
    /// A regular file (created and preallocated if needed) or a block device.
    pub path: PathBuf,
    /// Bytes of the device the store may use (rounded down to whole units).
    pub capacity_bytes: u64,
    /// Relative or measured read bandwidth, bytes/s; sets this device's share of pages until
    /// the online estimate takes over (see [`STRIPE_MIN_SAMPLES`]).
    pub bandwidth_bytes_per_s: f64,
}

/// Page store configuration.
#[derive(Debug, Clone)]
pub struct PageStoreConfig {
    pub devices: Vec<DeviceConfig>,
    /// Largest payload a page may hold: the largest block run (Hkv * 2 * B * D * elem bytes)
    /// of any session. Every device must hold at least one page of it.
    pub max_payload: usize,
}

/// Where a page lives: an extent of `units` units starting at unit `page` of a device (byte
/// offset `page * unit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageAddr {
    pub device: u16,
    /// The extent's first unit.
    pub page: u64,
    /// The extent's length in units.
    pub units: u32,
}

/// Units of `unit` bytes that a page holding `payload_len` bytes takes (header, payload, zero
/// padding). Saturates at `u32::MAX` (far past any page a store accepts: `max_payload` is at
/// most 1 GiB); 0 for a unit of 0 (no store has one: such an address is refused).
pub fn page_units(payload_len: u64, unit: u64) -> u32 {
    if unit == 0 {
        return 0;
    }
    let bytes = payload_len.saturating_add(HEADER_LEN as u64);
    u32::try_from(bytes.div_ceil(unit)).unwrap_or(u32::MAX)
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
    units: u64,
    /// Configured stripe weight.
    bandwidth: f64,
    alloc: Mutex<Space>,
    read: Mutex<LinkTracker>,
    write: Mutex<LinkTracker>,
}

impl Device {
    fn tracker(&self, kind: OpKind) -> &Mutex<LinkTracker> {
        match kind {
            OpKind::Read => &self.read,
            OpKind::Write => &self.write,
        }
    }
}

/// The NVMe page store. Cheap to share (`Arc<PageStore>`); all methods take `&self`.
pub struct PageStore {
    driver: Arc<dyn IoDriver>,
    devices: Vec<Device>,
    unit: usize,
    max_payload: usize,
    pool: Arc<BufPool>,
    workers: AtomicUsize,
    stripe: Mutex<HashMap<u64, Vec<f64>>>,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    corrupt_pages: AtomicU64,
    io_errors: AtomicU64,
}

impl std::fmt::Debug for PageStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageStore")
            .field("driver", &self.driver.name())
            .field("devices", &self.devices.len())
            .field("unit", &self.unit)
            .finish()
    }
}

impl PageStore {
    /// Opens (creating and preallocating regular files as needed) every device. All space
    /// starts free: after a restart, call [`PageStore::mark_allocated`] for every page the
    /// manifest references.
    pub fn open(cfg: &PageStoreConfig, driver: Arc<dyn IoDriver>) -> Result<Self, NvmeError> {
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
        // Every offset and length is a whole number of units, so one unit fits every device.
        let unit = files.iter().map(|f| f.align()).max().expect("non-empty");
        let largest = u64::from(page_units(cfg.max_payload as u64, unit as u64));
        let mut devices = Vec::with_capacity(files.len());
        for (d, file) in cfg.devices.iter().zip(files) {
            let units = d.capacity_bytes / unit as u64;
            if units < largest {
                return Err(NvmeError::invalid(format!(
                    "device {:?}: capacity {} bytes holds no page of the largest payload ({} bytes)",
                    d.path,
                    d.capacity_bytes,
                    largest * unit as u64
                )));
            }
            file.ensure_len(units * unit as u64)?;
            // The prior only stands until the first timed transfer replaces it.
            let prior = Link::new(d.bandwidth_bytes_per_s, 0.0)?;
            devices.push(Device {
                file,
                units,
                bandwidth: d.bandwidth_bytes_per_s,
                alloc: Mutex::new(Space::new(units, 0)),
                read: Mutex::new(LinkTracker::new(prior, TRACKER_ALPHA)?),
                write: Mutex::new(LinkTracker::new(prior, TRACKER_ALPHA)?),
            });
        }
        let mem_align = devices
            .iter()
            .map(|d| d.file.mem_align())
            .max()
            .expect("non-empty");
        let pool = Arc::new(BufPool::new(mem_align, POOL_BYTES)?);
        Ok(Self {
            driver,
            devices,
            unit,
            max_payload: cfg.max_payload,
            pool,
            workers: AtomicUsize::new(par::default_workers()),
            stripe: Mutex::new(HashMap::new()),
            bytes_read: AtomicU64::new(0),
            bytes_written: AtomicU64::new(0),
            corrupt_pages: AtomicU64::new(0),
            io_errors: AtomicU64::new(0),
        })
    }

    /// Bytes of one unit: the direct-I/O alignment that page offsets and lengths are
    /// multiples of.
    pub fn unit(&self) -> usize {
        self.unit
    }

    /// Units of the page that holds a payload of `payload_len` bytes.
    pub fn page_units(&self, payload_len: usize) -> u32 {
        page_units(payload_len as u64, self.unit as u64)
    }

    /// Bytes of the page that holds a payload of `payload_len` bytes.
    pub fn page_bytes(&self, payload_len: usize) -> u64 {
        u64::from(self.page_units(payload_len)) * self.unit as u64
    }

    /// Bytes of the page at `addr` (the extent, header and padding included).
    pub fn addr_bytes(&self, addr: PageAddr) -> u64 {
        u64::from(addr.units) * self.unit as u64
    }

    /// The largest payload a page may hold.
    pub fn max_payload(&self) -> usize {
        self.max_payload
    }

    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    pub fn driver_name(&self) -> &'static str {
        self.driver.name()
    }

    /// Units per device.
    pub fn device_units(&self) -> Vec<u64> {
        self.devices.iter().map(|d| d.units).collect()
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

    /// Pages per chunk in a batch of pages of `page_bytes` bytes each: what one worker
    /// encodes or verifies and submits at a time.
    pub fn chunk_pages(page_bytes: u64) -> usize {
        let fit = CHUNK_BYTES as u64 / page_bytes.max(1);
        usize::try_from(fit).map_or(CHUNK_MAX_PAGES, |f| f.clamp(1, CHUNK_MAX_PAGES))
    }

    /// Runs `f` over the chunks of a batch of pages (cut by their bytes, [`chunk_ranges`]) on
    /// the store's workers; results in chunk order.
    fn per_chunk<T: Send>(
        &self,
        addrs: impl Iterator<Item = PageAddr>,
        f: impl Fn(std::ops::Range<usize>) -> T + Sync,
    ) -> Vec<T> {
        let chunks = chunk_ranges(addrs.map(|a| self.addr_bytes(a)));
        par::map_indexed(chunks.len(), self.workers(), "kvtier-pstore", |i| {
            f(chunks[i].clone())
        })
    }

    /// The device of `a`, after checking that the extent is non-empty and inside it.
    fn device(&self, a: PageAddr) -> Result<&Device, NvmeError> {
        let dev = self.devices.get(a.device as usize).ok_or_else(|| {
            NvmeError::invalid(format!(
                "device {} out of range ({} devices)",
                a.device,
                self.devices.len()
            ))
        })?;
        let end = a.page.checked_add(u64::from(a.units));
        if a.units == 0 || end.is_none_or(|e| e > dev.units) {
            return Err(NvmeError::invalid(format!(
                "{a:?} out of range (device {} has {} units)",
                a.device, dev.units
            )));
        }
        Ok(dev)
    }

    /// Byte offset of a page (in range once [`PageStore::device`] accepted it: no overflow).
    fn offset(&self, a: PageAddr) -> u64 {
        a.page * self.unit as u64
    }

    /// The files backing the devices (for probing).
    pub fn device_files(&self) -> Vec<Arc<DirectFile>> {
        self.devices.iter().map(|d| d.file.clone()).collect()
    }
}

/// Cuts a batch of pages of the given bytes into consecutive chunks: as many pages as fit in
/// [`CHUNK_BYTES`], at most [`CHUNK_MAX_PAGES`], at least one.
fn chunk_ranges(bytes: impl Iterator<Item = u64>) -> Vec<std::ops::Range<usize>> {
    cut_by_bytes(bytes, CHUNK_BYTES as u64, CHUNK_MAX_PAGES)
}

/// Cuts items of the given bytes into consecutive ranges of at most `most_bytes` and at most
/// `most_items` items each; an item larger than `most_bytes` is a range of its own.
pub(crate) fn cut_by_bytes(
    bytes: impl Iterator<Item = u64>,
    most_bytes: u64,
    most_items: usize,
) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut acc, mut n) = (0, 0u64, 0);
    for (i, b) in bytes.enumerate() {
        let count = i - start;
        if count > 0 && (count == most_items || acc + b > most_bytes) {
            out.push(start..i);
            start = i;
            acc = 0;
        }
        acc += b;
        n = i + 1;
    }
    if start < n {
        out.push(start..n);
    }
    out
}
