//! The counters, STATS and metrics of the engine: what it reports, read at scrape time.

use super::*;

/// STATS keys tierd reports beyond the protocol's initial set (docs/protocol.md §5.7).
pub mod extra_stats_keys {
    kvtier_protocol::key_list! {
        /// 1 while the daemon accepts requests, 0 once shutdown has begun (draining).
        READY = "ready";
        /// Wall-clock start time, ms since the Unix epoch.
        STARTED_UNIX_MS = "started_unix_ms";
        /// Selected (block, kv-head) tiles over all decode entries.
        SELECTED_TILES_TOTAL = "selected_tiles_total";
        /// Summed wall time of the stages of CPU-path DECODE requests, ns.
        DECODE_APPEND_NS_TOTAL = "decode_append_ns_total";
        DECODE_SELECT_NS_TOTAL = "decode_select_ns_total";
        DECODE_FETCH_NS_TOTAL = "decode_fetch_ns_total";
        DECODE_ATTEND_NS_TOTAL = "decode_attend_ns_total";
        /// The longest run extent the host tier could hand out now, and its free ranges.
        HOST_LARGEST_FREE_BYTES = "host_largest_free_bytes";
        HOST_FREE_RANGES = "host_free_ranges";
        /// Runs moved inside the host tier to place a request that fit in the free bytes but in
        /// no free range (compaction).
        HOST_RUNS_MOVED_TOTAL = "host_runs_moved_total";
        /// Error replies that are the daemon's trouble, not the request's: INTERNAL, DATA_LOSS,
        /// UNAVAILABLE (a part of `errors_total`, which counts every error reply).
        DAEMON_ERRORS_TOTAL = "daemon_errors_total";
    }
}

/// Monotonic counters reported by STATS (relaxed atomics: read at scrape time).
#[derive(Debug, Default)]
pub struct Counters {
    pub decode_requests: AtomicU64,
    pub decode_entries: AtomicU64,
    pub append_tokens: AtomicU64,
    pub errors: AtomicU64,
    /// Of `errors`, those that are the daemon's trouble
    /// ([`kvtier_protocol::ErrorCode::is_daemons`]).
    pub daemon_errors: AtomicU64,
    pub rejected: AtomicU64,
    pub bytes_touched: AtomicU64,
    pub demotions: AtomicU64,
    pub blocks_demoted: AtomicU64,
    pub blocks_promoted: AtomicU64,
    /// Runs moved inside the host tier by compaction.
    pub host_runs_moved: AtomicU64,
    pub selected_tiles: AtomicU64,
    pub append_ns: AtomicU64,
    pub select_ns: AtomicU64,
    pub fetch_ns: AtomicU64,
    pub attend_ns: AtomicU64,
    /// Decode entries the CUDA device answered.
    pub gpu_entries: AtomicU64,
    /// GPU decode calls answered on the CPU after the appends (a device failure, or a device
    /// keep-set naming a block still on NVMe).
    pub gpu_cpu_fallbacks: AtomicU64,
    /// Entries whose device keep-set named a block still on NVMe (should stay 0).
    pub gpu_cold_divergences: AtomicU64,
    /// DECODE requests answered by a step shared with other requests (`backend.coalesce`).
    pub decode_coalesced: AtomicU64,
    /// Decode steps run (one per coalesced group): `decode_entries / decode_steps` is the mean
    /// batch a step served.
    pub decode_steps: AtomicU64,
    /// The remote tier: sessions resumed here and offloaded from here, block runs and their
    /// bytes written to and read from the cluster, claims found taken by another node.
    pub remote_resumes: AtomicU64,
    pub remote_offloads: AtomicU64,
    pub remote_blocks_written: AtomicU64,
    pub remote_bytes_written: AtomicU64,
    pub remote_bytes_read: AtomicU64,
    pub remote_claims_lost: AtomicU64,
    /// Blocks of resumed sessions read from the cluster because a step kept them, and
    /// streamed in ahead of need (`arrival.rs`).
    pub remote_blocks_fetched: AtomicU64,
    pub remote_blocks_streamed: AtomicU64,
    /// Sessions moved from NVMe to the cluster because the page store was full.
    pub remote_demotions: AtomicU64,
}

impl Counters {
    /// Counts `read`, payloads (runs or summaries) read from the remote tier.
    pub(super) fn read_from_remote(&self, read: &[Vec<u8>]) {
        let bytes: usize = read.iter().map(Vec::len).sum();
        self.remote_bytes_read
            .fetch_add(bytes as u64, Ordering::Relaxed);
    }
}

/// The NVMe tier's metric series.
pub(super) struct NvmeSeries {
    pub(super) usage: crate::metrics::TierGauges,
    pub(super) read: metrics::Counter,
    pub(super) written: metrics::Counter,
    pub(super) counters: crate::metrics::NvmeMetrics,
}

impl Service {
    /// Copies the remote tier's counters into its metric series (scrape time).
    fn refresh_remote_metrics(&self) {
        let (Some(m), Some(r)) = (&self.remote_metrics, &self.remote) else {
            return;
        };
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        m.claims.set(r.claims_held() as f64);
        m.resumes.absolute(get(&c.remote_resumes));
        m.offloads.absolute(get(&c.remote_offloads));
        m.claims_lost.absolute(get(&c.remote_claims_lost));
        m.written.absolute(get(&c.remote_bytes_written));
        m.read.absolute(get(&c.remote_bytes_read));
    }

    /// Copies the NVMe tier's usage and traffic into its metric series (scrape time).
    pub fn refresh_tier_metrics(&self) {
        self.refresh_remote_metrics();
        let (Some(m), Some((tier, _))) = (&self.nvme_metrics, &self.tier) else {
            return;
        };
        let su = tier.store().usage();
        let sum = |f: fn(&kvtier_storage::nvme::store::DeviceUsage) -> u64| -> f64 {
            su.devices.iter().map(f).sum::<u64>() as f64
        };
        m.usage.used_bytes.set(sum(|d| d.bytes_used));
        m.usage.capacity_bytes.set(sum(|d| d.bytes_total));
        m.usage.used_blocks.set(sum(|d| d.pages));
        m.usage
            .largest_free_bytes
            .set(tier.store().largest_free_bytes() as f64);
        m.usage.free_ranges.set(sum(|d| d.free_ranges));
        m.read.absolute(su.bytes_read);
        m.written.absolute(su.bytes_written);
        m.counters.checksum_errors.absolute(su.corrupt_pages);
        m.counters.io_errors.absolute(su.io_errors);
        m.counters.pages_moved.absolute(tier.pages_moved());
    }

    /// The Prometheus exposition, every scrape-time value refreshed first (empty when metrics
    /// are off).
    pub fn render_metrics(&self) -> String {
        if self.metrics.handle().is_none() {
            return String::new();
        }
        self.refresh_tier_metrics();
        self.metrics.render(&self.snapshot())
    }

    /// The counters and usage STATS and metrics report.
    pub fn snapshot(&self) -> Snapshot {
        let u = self.arena.usage();
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Snapshot {
            ready: self.ready.load(Ordering::Relaxed),
            uptime: self.started.elapsed(),
            started_unix_ms: self.started_unix_ms,
            sessions: self.session_count() as u64,
            host_bytes_used: u.bytes_used as u64,
            host_bytes_capacity: u.bytes_total as u64,
            host_extents_used: u.extents_used as u64,
            host_largest_free_bytes: u.largest_free_bytes as u64,
            host_free_ranges: u.free_ranges as u64,
            host_runs_moved: get(&c.host_runs_moved),
            decode_requests: get(&c.decode_requests),
            decode_entries: get(&c.decode_entries),
            append_tokens: get(&c.append_tokens),
            errors: get(&c.errors),
            rejected: get(&c.rejected),
            bytes_touched: get(&c.bytes_touched),
            selected_tiles: get(&c.selected_tiles),
            append_ns: get(&c.append_ns),
            select_ns: get(&c.select_ns),
            fetch_ns: get(&c.fetch_ns),
            attend_ns: get(&c.attend_ns),
        }
    }

    pub fn stats(&self) -> StatsReply {
        let s = self.snapshot();
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        use extra_stats_keys as x;
        let mut entries = vec![
            (stats_keys::UPTIME_MS, s.uptime.as_millis() as u64),
            (stats_keys::SESSIONS, s.sessions),
            (stats_keys::HOST_BYTES_USED, s.host_bytes_used),
            (stats_keys::HOST_BYTES_CAPACITY, s.host_bytes_capacity),
            (stats_keys::HOST_EXTENTS_USED, s.host_extents_used),
            (stats_keys::DECODE_REQUESTS_TOTAL, s.decode_requests),
            (stats_keys::DECODE_ENTRIES_TOTAL, s.decode_entries),
            (stats_keys::APPEND_TOKENS_TOTAL, s.append_tokens),
            (stats_keys::ERRORS_TOTAL, s.errors),
            (stats_keys::REJECTED_TOTAL, s.rejected),
            (stats_keys::BYTES_TOUCHED_TOTAL, s.bytes_touched),
            (x::READY, s.ready as u64),
            (x::STARTED_UNIX_MS, s.started_unix_ms),
            (x::SELECTED_TILES_TOTAL, s.selected_tiles),
            (x::DECODE_APPEND_NS_TOTAL, s.append_ns),
            (x::DECODE_SELECT_NS_TOTAL, s.select_ns),
            (x::DECODE_FETCH_NS_TOTAL, s.fetch_ns),
            (x::DECODE_ATTEND_NS_TOTAL, s.attend_ns),
            (x::HOST_LARGEST_FREE_BYTES, s.host_largest_free_bytes),
            (x::HOST_FREE_RANGES, s.host_free_ranges),
            (x::HOST_RUNS_MOVED_TOTAL, s.host_runs_moved),
            (x::DAEMON_ERRORS_TOTAL, get(&self.counters.daemon_errors)),
        ];
        let mut links = Vec::new();
        if let Some((tier, _)) = &self.tier {
            let su = tier.store().usage();
            let used: u64 = su.devices.iter().map(|d| d.bytes_used).sum();
            let total: u64 = su.devices.iter().map(|d| d.bytes_total).sum();
            for (i, d) in su.devices.iter().enumerate() {
                links.extend(nvme_link_stats(i, "read", d.read_link));
                links.extend(nvme_link_stats(i, "write", d.write_link));
            }
            entries.extend([
                ("nvme_bytes_used", used),
                ("nvme_bytes_capacity", total),
                ("nvme_largest_free_bytes", tier.store().largest_free_bytes()),
                (
                    "nvme_free_ranges",
                    su.devices.iter().map(|d| d.free_ranges).sum(),
                ),
                ("nvme_devices", su.devices.len() as u64),
                ("nvme_sessions", tier.session_ids().len() as u64),
                ("nvme_read_bytes_total", su.bytes_read),
                ("nvme_written_bytes_total", su.bytes_written),
                ("nvme_checksum_errors_total", su.corrupt_pages),
                ("nvme_io_errors_total", su.io_errors),
                ("nvme_pages_moved_total", tier.pages_moved()),
                ("demotions_total", get(&c.demotions)),
                ("blocks_demoted_total", get(&c.blocks_demoted)),
                ("blocks_promoted_total", get(&c.blocks_promoted)),
                (
                    "blocks_prefetched_total",
                    self.prefetcher.as_ref().map_or(0, |p| get(&p.promoted)),
                ),
            ]);
        }
        if let Some(r) = &self.remote {
            entries.extend([
                ("remote_claims", r.claims_held() as u64),
                ("remote_resumes_total", get(&c.remote_resumes)),
                ("remote_offloads_total", get(&c.remote_offloads)),
                ("remote_blocks_written_total", get(&c.remote_blocks_written)),
                ("remote_written_bytes_total", get(&c.remote_bytes_written)),
                ("remote_read_bytes_total", get(&c.remote_bytes_read)),
                ("remote_claims_lost_total", get(&c.remote_claims_lost)),
                ("remote_blocks_fetched_total", get(&c.remote_blocks_fetched)),
                (
                    "remote_blocks_streamed_total",
                    get(&c.remote_blocks_streamed),
                ),
                ("remote_demotions_total", get(&c.remote_demotions)),
            ]);
        }
        if self.limits.coalesce {
            entries.push(("decode_coalesced_total", get(&c.decode_coalesced)));
            entries.push(("decode_steps_total", get(&c.decode_steps)));
        }
        if self.gpu.is_some() {
            entries.extend([
                ("gpu_decode_entries_total", get(&c.gpu_entries)),
                ("gpu_cpu_fallbacks_total", get(&c.gpu_cpu_fallbacks)),
                ("gpu_cold_divergences_total", get(&c.gpu_cold_divergences)),
            ]);
        }
        StatsReply {
            entries: entries
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .chain(links)
                .collect(),
        }
    }
}

/// STATS entries of one NVMe device link's online estimate: `nvme_dev<i>_<op>_bytes_per_s`
/// and `nvme_dev<i>_<op>_latency_ns`, 0 until the device has a timed transfer of that kind.
pub(super) fn nvme_link_stats(
    device: usize,
    op: &str,
    link: Option<kvtier_storage::nvme::link::Link>,
) -> [(String, u64); 2] {
    let (bw, lat) = link.map_or((0, 0), |l| {
        (
            l.bandwidth_bytes_per_s.round() as u64,
            (l.latency_s * 1e9).round() as u64,
        )
    });
    [
        (format!("nvme_dev{device}_{op}_bytes_per_s"), bw),
        (format!("nvme_dev{device}_{op}_latency_ns"), lat),
    ]
}
