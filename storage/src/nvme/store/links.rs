//! Per-device timing: each batch's operations folded into the devices' link trackers, the
//! stripe weights they give, and the store's usage report.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::{PageStore, STRIPE_MIN_SAMPLES};
use crate::nvme::io::{IoCompletion, OpKind};
use crate::nvme::link::{Link, LinkTracker};

/// Usage of one device.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceUsage {
    /// The device's page file.
    pub path: PathBuf,
    /// Units of the device ([`StoreUsage::unit`] bytes each).
    pub units_total: u64,
    pub units_used: u64,
    /// Pages (extents) allocated.
    pub pages: u64,
    /// `units_total` and `units_used` in bytes.
    pub bytes_total: u64,
    pub bytes_used: u64,
    /// Free ranges: free bytes in many small ranges refuse pages they add up to
    /// ([`PageStore::largest_free_bytes`] is the longest page that fits now).
    pub free_ranges: u64,
    /// The stripe weight new pages get now: the tracked read throughput once every device has
    /// [`STRIPE_MIN_SAMPLES`] timed reads, else the configured bandwidth.
    pub bandwidth_bytes_per_s: f64,
    /// Online estimate from this device's timed page reads (None before the first).
    pub read_link: Option<Link>,
    /// Tracked read rate at the typical transfer ([`LinkTracker::throughput`]).
    pub read_throughput: Option<f64>,
    /// Timed page reads folded into `read_link` so far.
    pub read_samples: u64,
    /// Online estimate from this device's timed page writes (None before the first).
    pub write_link: Option<Link>,
    /// Timed page writes folded into `write_link` so far.
    pub write_samples: u64,
}

/// Usage and traffic of the store.
#[derive(Debug, Clone, PartialEq)]
pub struct StoreUsage {
    /// Bytes of one unit (see [`PageStore::unit`]).
    pub unit: usize,
    pub devices: Vec<DeviceUsage>,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Pages that failed verification (checksum, header or identity).
    pub corrupt_pages: u64,
    /// Page reads and writes that failed (an errno, or a short transfer that retries could
    /// not finish), and failed fdatasyncs.
    pub io_errors: u64,
}

/// What the link trackers need of one finished operation (its buffer is already recycled).
pub(super) struct OpTiming {
    device: u16,
    bytes: u64,
    started: Instant,
    finished: Instant,
    ok: bool,
}

impl OpTiming {
    pub(super) fn of(c: &IoCompletion, device: u16) -> Self {
        Self {
            device,
            bytes: c.buf.len() as u64,
            started: c.started,
            finished: c.finished,
            ok: c.result.is_ok(),
        }
    }
}

fn measured(t: &LinkTracker) -> Option<Link> {
    (t.samples() > 0).then(|| t.estimate())
}

/// Total time covered by a set of intervals (overlaps counted once), seconds.
pub(super) fn union_seconds(spans: &mut [(Instant, Instant)]) -> f64 {
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

impl PageStore {
    /// The stripe weight of every device: the tracked read throughput once every device has
    /// [`STRIPE_MIN_SAMPLES`] timed reads (so measured and configured figures, which may be
    /// in different units, are never mixed), else the configured bandwidth. Throughput, not
    /// the fitted bandwidth: decode-step batches are of similar sizes, where the fit can give
    /// a link a near-infinite bandwidth and all but every new page.
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

    /// Every device's tracked read link, when each has at least one timed read.
    pub fn read_links(&self) -> Option<Vec<Link>> {
        self.devices
            .iter()
            .map(|d| measured(&d.read.lock()))
            .collect()
    }

    /// Folds a finished batch's timings into the devices' trackers and counts its failures:
    /// per device, the bytes of its successful operations over the time any of them was in
    /// flight.
    pub(super) fn account(&self, kind: OpKind, ops: &[OpTiming]) {
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

    pub fn usage(&self) -> StoreUsage {
        let weights = self.stripe_weights();
        StoreUsage {
            unit: self.unit,
            devices: self
                .devices
                .iter()
                .zip(weights)
                .map(|(d, weight)| {
                    let (used, pages, ranges) = {
                        let a = d.alloc.lock();
                        (a.used(), a.pages(), a.free_ranges())
                    };
                    let (read, write) = (d.read.lock(), d.write.lock());
                    DeviceUsage {
                        path: d.file.path().to_path_buf(),
                        units_total: d.units,
                        units_used: used,
                        pages,
                        bytes_total: d.units * self.unit as u64,
                        bytes_used: used * self.unit as u64,
                        free_ranges: ranges,
                        bandwidth_bytes_per_s: weight,
                        read_link: measured(&read),
                        read_throughput: read.throughput(),
                        read_samples: read.samples(),
                        write_link: measured(&write),
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
