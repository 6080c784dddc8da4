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

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use super::buf::{round_up, AlignedBuf, BufPool, DirectFile};
use super::io::{IoCompletion, IoEngine, IoRequest, OpKind};
use super::page::{self, PageId, HEADER_LEN};
use super::plan::{Lane, LaneTracker};
use super::NvmeError;
use crate::par;

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

/// A verified page, payload in an aligned buffer (no copy after the read). The buffer goes
/// back to the store's pool on drop.
#[derive(Debug)]
pub struct PageData {
    buf: Option<AlignedBuf>,
    pool: Arc<BufPool>,
    len: usize,
    crc: u32,
}

impl PageData {
    pub fn payload(&self) -> &[u8] {
        let buf = self.buf.as_ref().expect("present until drop");
        &buf[HEADER_LEN..HEADER_LEN + self.len]
    }

    pub fn crc(&self) -> u32 {
        self.crc
    }

    /// Takes the whole page buffer out of the pool's cycle.
    pub fn into_buf(mut self) -> AlignedBuf {
        self.buf.take().expect("present until drop")
    }
}

impl Drop for PageData {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.put(b);
        }
    }
}

/// One result per page of a read batch.
pub type PageResults = Vec<Result<PageData, NvmeError>>;

/// Usage of one device.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceUsage {
    pub path: PathBuf,
    pub pages_total: u64,
    pub pages_used: u64,
    pub bytes_total: u64,
    pub bytes_used: u64,
    /// The stripe weight new pages get now: the tracked read throughput once every device has
    /// [`STRIPE_MIN_SAMPLES`] timed reads, else the configured bandwidth.
    pub bandwidth_bytes_per_s: f64,
    /// Online estimate from this device's timed page reads (None before the first).
    pub read_lane: Option<Lane>,
    /// Tracked read rate at the typical transfer ([`LaneTracker::throughput`]).
    pub read_throughput: Option<f64>,
    pub read_samples: u64,
    /// Online estimate from this device's timed page writes (None before the first).
    pub write_lane: Option<Lane>,
    pub write_samples: u64,
}

/// Usage and traffic of the store.
#[derive(Debug, Clone, PartialEq)]
pub struct StoreUsage {
    pub page_size: usize,
    pub devices: Vec<DeviceUsage>,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Pages that failed verification (checksum, header or identity).
    pub corrupt_pages: u64,
    /// Page reads and writes that failed (an errno, or a short transfer that retries could
    /// not finish), and failed fdatasyncs.
    pub io_errors: u64,
}

/// What the lane trackers need of one finished operation (its buffer is already recycled).
struct OpTiming {
    device: u16,
    bytes: u64,
    started: Instant,
    finished: Instant,
    ok: bool,
}

impl OpTiming {
    fn of(c: &IoCompletion, device: u16) -> Self {
        Self {
            device,
            bytes: c.buf.len() as u64,
            started: c.started,
            finished: c.finished,
            ok: c.result.is_ok(),
        }
    }
}

/// One written chunk: its pages' checksums, timings and first failure.
struct ChunkWritten {
    crcs: Vec<u32>,
    timings: Vec<OpTiming>,
    first_err: Option<NvmeError>,
}

struct Bitmap {
    words: Vec<u64>,
    pages: u64,
    used: u64,
    cursor: usize,
}

impl Bitmap {
    fn new(pages: u64) -> Self {
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

    fn free(&self) -> u64 {
        self.pages - self.used
    }

    fn alloc(&mut self) -> Option<u64> {
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

    fn is_set(&self, page: u64) -> bool {
        self.words[(page / 64) as usize] & (1 << (page % 64)) != 0
    }

    fn set(&mut self, page: u64) -> bool {
        if self.is_set(page) {
            return false;
        }
        self.words[(page / 64) as usize] |= 1 << (page % 64);
        self.used += 1;
        true
    }

    fn clear(&mut self, page: u64) -> bool {
        if !self.is_set(page) {
            return false;
        }
        self.words[(page / 64) as usize] &= !(1 << (page % 64));
        self.used -= 1;
        true
    }
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

fn measured(t: &LaneTracker) -> Option<Lane> {
    (t.samples() > 0).then(|| t.estimate())
}

/// Total time covered by a set of intervals (overlaps counted once), seconds.
fn union_seconds(spans: &mut [(Instant, Instant)]) -> f64 {
    spans.sort_unstable_by_key(|s| s.0);
    let mut total = 0.0;
    let mut cur: Option<(Instant, Instant)> = None;
    for &(a, b) in spans.iter() {
        match &mut cur {
            Some((_, end)) if a <= *end => *end = (*end).max(b),
            _ => {
                if let Some((s, e)) = cur {
                    total += (e - s).as_secs_f64();
                }
                cur = Some((a, b));
            }
        }
    }
    if let Some((s, e)) = cur {
        total += (e - s).as_secs_f64();
    }
    total
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

    pub fn free_pages(&self) -> u64 {
        self.devices.iter().map(|d| d.alloc.lock().free()).sum()
    }

    /// The stripe weight of every device: the tracked read throughput once every device has
    /// [`STRIPE_MIN_SAMPLES`] timed reads (so measured and configured figures, which may be
    /// in different units, are never mixed), else the configured bandwidth. Throughput, not
    /// the fitted bandwidth: decode-step batches are of similar sizes, where the fit can give
    /// a lane a near-infinite bandwidth and all but every new page.
    pub fn stripe_weights(&self) -> Vec<f64> {
        let tracked: Option<Vec<f64>> = self
            .devices
            .iter()
            .map(|d| {
                let t = d.read.lock();
                (t.samples() >= STRIPE_MIN_SAMPLES)
                    .then(|| t.throughput())
                    .flatten()
            })
            .collect();
        tracked.unwrap_or_else(|| self.devices.iter().map(|d| d.bandwidth).collect())
    }

    /// Every device's tracked read lane, when each has at least one timed read.
    pub fn read_lanes(&self) -> Option<Vec<Lane>> {
        self.devices
            .iter()
            .map(|d| measured(&d.read.lock()))
            .collect()
    }

    /// Folds a finished batch's timings into the devices' trackers and counts its failures:
    /// per device, the bytes of its successful operations over the time any of them was in
    /// flight.
    fn account(&self, kind: OpKind, ops: &[OpTiming]) {
        let mut per: Vec<(u64, Vec<(Instant, Instant)>)> =
            vec![(0, Vec::new()); self.devices.len()];
        for op in ops {
            if op.ok {
                let p = &mut per[op.device as usize];
                p.0 += op.bytes;
                p.1.push((op.started, op.finished));
            } else {
                self.io_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        for (dev, (bytes, mut spans)) in self.devices.iter().zip(per) {
            if bytes > 0 {
                let secs = union_seconds(&mut spans);
                dev.tracker(kind).lock().observe(bytes, secs);
            }
        }
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

    /// Writes pages (to allocated addresses) in one batch. Returns each page's checksum, for
    /// the manifest. Not durable until [`PageStore::sync`] returns. On error, pages of the
    /// batch may be partially written: the caller must not reference them. Every page is
    /// attempted; the error is that of the first page (in batch order) that failed.
    pub fn write_pages(&self, writes: &[PageWrite<'_>]) -> Result<Vec<u32>, NvmeError> {
        // Arguments first: a bad one fails the batch before any I/O.
        for w in writes {
            let dev = self.device(w.addr)?;
            if !dev.alloc.lock().is_set(w.addr.page) {
                return Err(NvmeError::invalid(format!(
                    "write to unallocated page {:?}",
                    w.addr
                )));
            }
            if w.payload.len() > self.max_payload {
                return Err(NvmeError::invalid(format!(
                    "payload of {} bytes exceeds the page's {}",
                    w.payload.len(),
                    self.max_payload
                )));
            }
        }
        let parts = self.per_chunk(writes.len(), |r| self.write_chunk(&writes[r]));
        let mut crcs = Vec::with_capacity(writes.len());
        let mut timings = Vec::with_capacity(writes.len());
        let mut first_err = None;
        for part in parts {
            match part {
                Ok(p) => {
                    crcs.extend(p.crcs);
                    timings.extend(p.timings);
                    if let Some(e) = p.first_err {
                        first_err.get_or_insert(e);
                    }
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        self.account(OpKind::Write, &timings);
        match first_err {
            None => Ok(crcs),
            Some(e) => Err(e),
        }
    }

    /// Encodes one chunk of validated writes into pooled buffers and submits it. The outer
    /// error is a dead engine.
    fn write_chunk(&self, writes: &[PageWrite<'_>]) -> Result<ChunkWritten, NvmeError> {
        let mut reqs = Vec::with_capacity(writes.len());
        let mut crcs = Vec::with_capacity(writes.len());
        for w in writes {
            let file = &self.devices[w.addr.device as usize].file;
            let mut buf = self.pool.get();
            crcs.push(page::encode(&mut buf, w.id, w.payload));
            reqs.push(IoRequest::write(file.clone(), self.offset(w.addr), buf)?);
        }
        let done = self.engine.submit(reqs)?;
        let mut timings = Vec::with_capacity(done.len());
        let mut first_err = None;
        for (c, w) in done.into_iter().zip(writes) {
            timings.push(OpTiming::of(&c, w.addr.device));
            match c.result {
                Ok(()) => {
                    self.bytes_written
                        .fetch_add(c.buf.len() as u64, Ordering::Relaxed);
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
            self.pool.put(c.buf);
        }
        Ok(ChunkWritten {
            crcs,
            timings,
            first_err,
        })
    }

    /// Reads and verifies pages in one batch. The outer error is for bad arguments or a dead
    /// engine; each page has its own result. A page that fails verification is
    /// `NvmeError::Corrupt`, never data.
    pub fn read_pages(&self, reads: &[PageRead]) -> Result<PageResults, NvmeError> {
        for r in reads {
            self.device(r.addr)?;
        }
        let parts = self.per_chunk(reads.len(), |r| self.read_chunk(&reads[r]));
        let mut out = Vec::with_capacity(reads.len());
        let mut timings = Vec::with_capacity(reads.len());
        let mut outer = None;
        for part in parts {
            match part {
                Ok((pages, t)) => {
                    out.extend(pages);
                    timings.extend(t);
                }
                Err(e) => {
                    outer.get_or_insert(e);
                }
            }
        }
        self.account(OpKind::Read, &timings);
        match outer {
            None => Ok(out),
            Some(e) => Err(e),
        }
    }

    /// Reads and verifies one chunk. The outer error is a dead engine.
    fn read_chunk(&self, reads: &[PageRead]) -> Result<(PageResults, Vec<OpTiming>), NvmeError> {
        let mut reqs = Vec::with_capacity(reads.len());
        for r in reads {
            let file = &self.devices[r.addr.device as usize].file;
            reqs.push(IoRequest::read(
                file.clone(),
                self.offset(r.addr),
                self.pool.get(),
            )?);
        }
        let done = self.engine.submit(reqs)?;
        let timings = done
            .iter()
            .zip(reads)
            .map(|(c, r)| OpTiming::of(c, r.addr.device))
            .collect();
        let pages = done
            .into_iter()
            .zip(reads)
            .map(|(c, r)| self.verify(c, r))
            .collect();
        Ok((pages, timings))
    }

    /// Turns a read completion into verified page data (or the typed error), recycling the
    /// buffer of a failed one.
    fn verify(&self, c: IoCompletion, r: &PageRead) -> Result<PageData, NvmeError> {
        if let Err(e) = c.result {
            self.pool.put(c.buf);
            return Err(e);
        }
        self.bytes_read
            .fetch_add(c.buf.len() as u64, Ordering::Relaxed);
        let checked = page::verify(&c.buf, r.id).and_then(|(len, crc)| match r.expected_crc {
            Some(expected) if expected != crc => Err(super::CorruptReason::UnexpectedChecksum {
                expected,
                found: crc,
            }),
            _ => Ok((len, crc)),
        });
        match checked {
            Ok((len, crc)) => Ok(PageData {
                buf: Some(c.buf),
                pool: self.pool.clone(),
                len,
                crc,
            }),
            Err(reason) => {
                self.pool.put(c.buf);
                self.corrupt_pages.fetch_add(1, Ordering::Relaxed);
                Err(NvmeError::Corrupt {
                    device: r.addr.device,
                    page: r.addr.page,
                    reason,
                })
            }
        }
    }

    /// fdatasync every device: after this, completed page writes survive power loss.
    pub fn sync(&self) -> Result<(), NvmeError> {
        for d in &self.devices {
            // A failed fdatasync means written pages may not be on the device: a write error.
            d.file.sync_data().inspect_err(|_| {
                self.io_errors.fetch_add(1, Ordering::Relaxed);
            })?;
        }
        Ok(())
    }

    /// The files backing the devices (for probing).
    pub fn device_files(&self) -> Vec<Arc<DirectFile>> {
        self.devices.iter().map(|d| d.file.clone()).collect()
    }

    pub fn usage(&self) -> StoreUsage {
        let weights = self.stripe_weights();
        StoreUsage {
            page_size: self.page_size,
            devices: self
                .devices
                .iter()
                .zip(weights)
                .map(|(d, weight)| {
                    let used = d.alloc.lock().used;
                    let (read, write) = (d.read.lock(), d.write.lock());
                    DeviceUsage {
                        path: d.file.path().to_path_buf(),
                        pages_total: d.pages,
                        pages_used: used,
                        bytes_total: d.pages * self.page_size as u64,
                        bytes_used: used * self.page_size as u64,
                        bandwidth_bytes_per_s: weight,
                        read_lane: measured(&read),
                        read_throughput: read.throughput(),
                        read_samples: read.samples(),
                        write_lane: measured(&write),
                        write_samples: write.samples(),
                    }
                })
                .collect(),
            bytes_read: self.bytes_read.load(Ordering::Relaxed),
            bytes_written: self.bytes_written.load(Ordering::Relaxed),
            corrupt_pages: self.corrupt_pages.load(Ordering::Relaxed),
            io_errors: self.io_errors.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_time_counts_overlapping_operations_once() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + std::time::Duration::from_millis(ms);
        let cases: [(&[(u64, u64)], f64); 5] = [
            (&[], 0.0),
            (&[(0, 5)], 0.005),
            // All in flight together (io_uring): the span from first start to last finish.
            (&[(0, 4), (0, 7), (1, 6)], 0.007),
            // One after another (pread): the sum.
            (&[(4, 6), (0, 3), (10, 11)], 0.006),
            // Touching and nested.
            (&[(0, 3), (3, 5), (1, 2)], 0.005),
        ];
        for (spans, want) in cases {
            let mut v: Vec<(Instant, Instant)> =
                spans.iter().map(|&(a, b)| (at(a), at(b))).collect();
            let got = union_seconds(&mut v);
            assert!((got - want).abs() < 1e-9, "{spans:?}: {got} vs {want}");
        }
    }

    #[test]
    fn bitmap_alloc_free_and_tail() {
        let mut b = Bitmap::new(70);
        let got: Vec<u64> = (0..70).map(|_| b.alloc().unwrap()).collect();
        let mut sorted = got.clone();
        sorted.sort();
        assert_eq!(sorted, (0..70).collect::<Vec<_>>());
        assert_eq!(b.alloc(), None);
        assert!(b.clear(65));
        assert!(!b.clear(65));
        assert_eq!(b.alloc(), Some(65));
        assert!(!b.set(3));
    }
}
