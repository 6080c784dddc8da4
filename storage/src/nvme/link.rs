//! Links: the paths blocks move over, each a bandwidth and a latency (pure logic; the device
//! probe at the bottom is the only I/O).
//!
//! A link is a path blocks can come from (one NVMe device; host RAM over PCIe) with a bandwidth
//! and a fixed per-transfer latency. Moving `b` bytes on a link takes `latency + b / bandwidth`
//! (0 if the link moves nothing). Each device's read and write links are tracked online
//! ([`LinkTracker`]); new pages are striped over devices by their tracked rates, and bulk reads
//! are cut into batches that keep every device busy for about the same time
//! ([`split_batches`]), so work is partitioned across devices in proportion to their
//! bandwidth.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use super::buf::{AlignedBuf, DirectFile};
use super::io::{IoDriver, IoRequest};
use super::NvmeError;

/// A transfer path: bandwidth in bytes/s and per-transfer latency in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    pub bandwidth_bytes_per_s: f64,
    pub latency_s: f64,
}

impl Link {
    /// A link; bandwidth must be positive and finite, latency finite and >= 0.
    pub fn new(bandwidth_bytes_per_s: f64, latency_s: f64) -> Result<Self, NvmeError> {
        let l = Self {
            bandwidth_bytes_per_s,
            latency_s,
        };
        l.validate()?;
        Ok(l)
    }

    fn validate(&self) -> Result<(), NvmeError> {
        if !(self.bandwidth_bytes_per_s.is_finite() && self.bandwidth_bytes_per_s > 0.0) {
            return Err(NvmeError::invalid(format!(
                "link bandwidth {} must be positive and finite",
                self.bandwidth_bytes_per_s
            )));
        }
        if !(self.latency_s.is_finite() && self.latency_s >= 0.0) {
            return Err(NvmeError::invalid(format!(
                "link latency {} must be finite and >= 0",
                self.latency_s
            )));
        }
        Ok(())
    }

    /// Time to move `bytes` on this link (0 when idle).
    pub fn time(&self, bytes: u64) -> f64 {
        if bytes == 0 {
            0.0
        } else {
            self.latency_s + bytes as f64 / self.bandwidth_bytes_per_s
        }
    }
}

fn validate(links: &[Link]) -> Result<(), NvmeError> {
    if links.is_empty() {
        return Err(NvmeError::invalid("at least one link is needed"));
    }
    links.iter().try_for_each(Link::validate)
}

/// Once a tracker has this many samples, observations far from its prediction are clamped.
pub const TRACKER_WARMUP: u64 = 4;
/// An observation more than this factor slower (or faster) than predicted is clamped to this
/// factor before it is folded in.
pub const TRACKER_OUTLIER_FACTOR: f64 = 4.0;

/// What [`LinkTracker::observe`] did with a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Observed {
    /// Folded in as measured.
    Folded,
    /// An outlier (a stall, or a transfer served from a cache): folded in clamped to
    /// [`TRACKER_OUTLIER_FACTOR`] times (or 1/that of) the predicted time.
    Clamped,
    /// Ignored: zero bytes, or a duration that is not positive and finite.
    Ignored,
}

impl Observed {
    /// Whether the transfer moved the estimate.
    pub fn used(self) -> bool {
        self != Observed::Ignored
    }
}

/// Online estimate of a link from observed transfers: an exponentially weighted least-squares
/// fit of `seconds = latency + bytes / bandwidth`. With transfers of one size only, the
/// latency stays at its last estimate and the bandwidth absorbs the rest.
///
/// Outliers: after [`TRACKER_WARMUP`] samples, a transfer taking more than
/// [`TRACKER_OUTLIER_FACTOR`] times the predicted time (or less than 1/that) is clamped to that
/// bound, so one stall moves the estimate by a bounded step, while a lasting change still
/// pulls it over within a few dozen transfers (each one moves the prediction, and with it the
/// bound).
#[derive(Debug, Clone)]
pub struct LinkTracker {
    alpha: f64,
    samples: u64,
    mx: f64,
    my: f64,
    mxx: f64,
    mxy: f64,
    estimate: Link,
}

impl LinkTracker {
    /// `prior` is used until the first observation; `alpha` in (0, 1] is the weight of each
    /// new observation.
    pub fn new(prior: Link, alpha: f64) -> Result<Self, NvmeError> {
        prior.validate()?;
        if !(alpha > 0.0 && alpha <= 1.0) {
            return Err(NvmeError::invalid(format!(
                "EWMA weight {alpha} must be in (0, 1]"
            )));
        }
        Ok(Self {
            alpha,
            samples: 0,
            mx: 0.0,
            my: 0.0,
            mxx: 0.0,
            mxy: 0.0,
            estimate: prior,
        })
    }

    pub fn estimate(&self) -> Link {
        self.estimate
    }

    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// The rate at the typical observed transfer: the weighted mean of the bytes over the
    /// weighted mean of the seconds (None before the first observation). Unlike the fitted
    /// bandwidth, which extrapolates to infinitely large transfers and is ill-conditioned when
    /// the transfers are of similar size (then noise can put almost all of the time into the
    /// latency and leave a near-infinite bandwidth), this is what the link delivers for the
    /// transfers it actually gets: the right weight for striping.
    pub fn throughput(&self) -> Option<f64> {
        (self.samples > 0 && self.my > 0.0).then(|| self.mx / self.my)
    }

    /// Folds in one transfer of `bytes` that took `seconds`.
    pub fn observe(&mut self, bytes: u64, seconds: f64) -> Observed {
        if bytes == 0 || !(seconds.is_finite() && seconds > 0.0) {
            return Observed::Ignored;
        }
        let mut y = seconds;
        let mut verdict = Observed::Folded;
        if self.samples >= TRACKER_WARMUP {
            let predicted = self.estimate.time(bytes);
            let (lo, hi) = (
                predicted / TRACKER_OUTLIER_FACTOR,
                predicted * TRACKER_OUTLIER_FACTOR,
            );
            if y > hi || y < lo {
                y = y.clamp(lo, hi);
                verdict = Observed::Clamped;
            }
        }
        let x = bytes as f64;
        let a = if self.samples == 0 { 1.0 } else { self.alpha };
        self.mx += a * (x - self.mx);
        self.my += a * (y - self.my);
        self.mxx += a * (x * x - self.mxx);
        self.mxy += a * (x * y - self.mxy);
        self.samples += 1;
        let var = self.mxx - self.mx * self.mx;
        let cov = self.mxy - self.mx * self.my;
        let spread_ok = var > (1e-3 * self.mx).powi(2);
        let (mut lat, mut slope) = (self.estimate.latency_s, 0.0);
        if spread_ok && cov > 0.0 {
            slope = cov / var;
            lat = self.my - slope * self.mx;
        } else if self.my > lat {
            slope = (self.my - lat) / self.mx;
        }
        if lat < 0.0 || slope <= 0.0 {
            lat = 0.0;
            slope = self.my / self.mx;
        }
        self.estimate = Link {
            bandwidth_bytes_per_s: 1.0 / slope,
            latency_s: lat,
        };
        verdict
    }
}

/// Cuts a sequence of reads, given as (link, bytes) in the order they must be delivered, into
/// consecutive batches: each is the longest run of reads whose predicted makespan over the
/// links (per link `latency + bytes / bandwidth`, the links working in parallel) stays within
/// `target_s`, with at most `max_reads` reads and at least one. Fast links thus take more of
/// each batch than slow ones, and every batch keeps each link busy for about the same time
/// (as far as the placement of the reads allows), bounded, so a bulk restore never holds more
/// than about `target_s` worth of buffers at the tracked rates.
pub fn split_batches(
    links: &[Link],
    reads: &[(usize, u64)],
    target_s: f64,
    max_reads: usize,
) -> Result<Vec<std::ops::Range<usize>>, NvmeError> {
    validate(links)?;
    if !(target_s.is_finite() && target_s > 0.0) {
        return Err(NvmeError::invalid(format!(
            "batch target {target_s} s must be positive and finite"
        )));
    }
    if max_reads == 0 {
        return Err(NvmeError::invalid("a batch must allow at least one read"));
    }
    if let Some((i, &(bad, _))) = reads.iter().enumerate().find(|(_, r)| r.0 >= links.len()) {
        return Err(NvmeError::invalid(format!(
            "read {i} names link {bad}, but there are {} links",
            links.len()
        )));
    }
    let mut out = Vec::new();
    let mut link_bytes = vec![0u64; links.len()];
    let mut start = 0;
    // Only a batch's first read can take it past the target (it goes regardless).
    let mut over = false;
    for (i, &(link, bytes)) in reads.iter().enumerate() {
        let n = i - start;
        if n > 0
            && (n == max_reads || over || links[link].time(link_bytes[link] + bytes) > target_s)
        {
            out.push(start..i);
            start = i;
            link_bytes.fill(0);
        }
        link_bytes[link] += bytes;
        over = links[link].time(link_bytes[link]) > target_s;
    }
    if start < reads.len() {
        out.push(start..reads.len());
    }
    Ok(out)
}

/// Probe settings for [`probe_device`].
#[derive(Debug, Clone, Copy)]
pub struct ProbeConfig {
    /// Number of single small reads (queue depth 1) timed for the latency.
    pub latency_reads: usize,
    /// Transfer size for the bandwidth phase.
    pub block_bytes: usize,
    /// Reads in flight per batch in the bandwidth phase.
    pub depth: usize,
    /// Batches in the bandwidth phase.
    pub batches: usize,
}

impl Default for ProbeConfig {
    fn default() -> Self {
        Self {
            latency_reads: 32,
            block_bytes: 256 << 10,
            depth: 32,
            batches: 8,
        }
    }
}

/// Measures a device at startup with timed O_DIRECT reads over its first `span` bytes (which
/// must exist): latency = median of single small reads, bandwidth = bytes / time of batches of
/// `depth` large reads at spread-out offsets.
pub fn probe_device(
    driver: &dyn IoDriver,
    file: &Arc<DirectFile>,
    span: u64,
    cfg: ProbeConfig,
) -> Result<Link, NvmeError> {
    let align = file.align();
    if cfg.latency_reads == 0 || cfg.depth == 0 || cfg.batches == 0 {
        return Err(NvmeError::invalid("probe counts must be positive"));
    }
    if cfg.block_bytes == 0 || !cfg.block_bytes.is_multiple_of(align) {
        return Err(NvmeError::Misaligned {
            what: "probe block size",
            value: cfg.block_bytes as u64,
            align: align as u64,
        });
    }
    let slots = span / cfg.block_bytes as u64;
    if slots == 0 {
        return Err(NvmeError::invalid(format!(
            "probe span {span} is smaller than one {}-byte block",
            cfg.block_bytes
        )));
    }
    // Golden-ratio stride: offsets spread over the span without repeating soon.
    let mut k = 0u64;
    let mut next_off = || {
        k += 1;
        (k.wrapping_mul(0x9E37_79B9_7F4A_7C15) % slots) * cfg.block_bytes as u64
    };
    let mut lat = Vec::with_capacity(cfg.latency_reads);
    for _ in 0..cfg.latency_reads {
        let req = IoRequest::read(file.clone(), next_off(), AlignedBuf::new(align, align)?)?;
        let t = Instant::now();
        let c = driver.submit(vec![req])?;
        lat.push(t.elapsed().as_secs_f64());
        for c in c {
            c.result?;
        }
    }
    lat.sort_by(f64::total_cmp);
    let latency_s = lat[lat.len() / 2];
    // One set of buffers, touched before the clock starts and reused by every batch: fresh
    // buffers per batch made the probe measure page faults (a tmpfs link probed at the disk's
    // 1.5 GB/s on a 16-core host).
    let mut pool = (0..cfg.depth)
        .map(|_| {
            let mut b = AlignedBuf::new(cfg.block_bytes, align)?;
            b.fill(0xA5);
            Ok(b)
        })
        .collect::<Result<Vec<_>, NvmeError>>()?;
    let mut bytes = 0u64;
    let t = Instant::now();
    for _ in 0..cfg.batches {
        let reqs = pool
            .drain(..)
            .map(|buf| IoRequest::read(file.clone(), next_off(), buf))
            .collect::<Result<Vec<_>, _>>()?;
        for c in driver.submit(reqs)? {
            c.result?;
            bytes += c.buf.len() as u64;
            pool.push(c.buf);
        }
    }
    let secs = t.elapsed().as_secs_f64();
    // Per batch the latency is paid once; the rest is streaming time.
    let stream = (secs - latency_s * cfg.batches as f64).max(secs * 0.5);
    Link::new(bytes as f64 / stream, latency_s)
}

/// Probes the device behind `path` as [`probe_device`] does, over bytes that are really on it.
/// A block device is read in place (reads only). A regular file is not: the blocks of a fresh
/// or sparse file are holes or unwritten extents, which O_DIRECT reads answer with zeros without
/// any device I/O (a virtio disk that plain O_DIRECT reads at 1.44 GB/s probed at 17.5 GB/s that
/// way), and the device file's own pages may be anything. So a scratch file beside it
/// (`<path>.probe`, as large as the probe reads) is written with real bytes through `driver`,
/// synced, probed, and removed whatever the outcome.
pub fn probe_path(driver: &dyn IoDriver, path: &Path, cfg: ProbeConfig) -> Result<Link, NvmeError> {
    {
        let dev = DirectFile::open(path)?;
        if dev.is_block_device() {
            let span = dev.size()?.min(1 << 30);
            return probe_device(driver, &Arc::new(dev), span, cfg);
        }
    }
    let mut scratch = PathBuf::from(path);
    scratch.as_mut_os_string().push(".probe");
    let result = probe_scratch(driver, &scratch, cfg);
    let _ = std::fs::remove_file(&scratch);
    result
}

fn probe_scratch(
    driver: &dyn IoDriver,
    scratch: &Path,
    cfg: ProbeConfig,
) -> Result<Link, NvmeError> {
    let file = Arc::new(DirectFile::open(scratch)?);
    let span = (cfg.block_bytes * cfg.depth * cfg.batches.max(1)) as u64;
    file.ensure_len(span)?;
    let mut pool = (0..cfg.depth.max(1))
        .map(|_| {
            let mut b = AlignedBuf::new(cfg.block_bytes.max(1), file.align())?;
            b.fill(0x5A);
            Ok(b)
        })
        .collect::<Result<Vec<_>, NvmeError>>()?;
    let mut off = 0u64;
    while off < span {
        let mut reqs = Vec::with_capacity(pool.len());
        while off < span {
            let Some(buf) = pool.pop() else { break };
            let len = buf.len() as u64;
            reqs.push(IoRequest::write(file.clone(), off, buf)?);
            off += len;
        }
        for c in driver.submit(reqs)? {
            c.result?;
            pool.push(c.buf);
        }
    }
    file.sync_data()?;
    probe_device(driver, &file, span, cfg)
}
