//! Prometheus metrics: every metric name (in [`names`]), the handles the request path records
//! into, and the [`Snapshot`] of scrape-time values (served by [`crate::endpoint`]).
//!
//! Names follow `{prefix}_{name}_{unit}`, with `_total` only on counters. Two kinds of values:
//!
//! - **Scrape-time** values (sessions, tier usage, the counters STATS reports) are read from the
//!   service's relaxed atomics by [`Metrics::refresh`] when a scrape arrives, so a scrape and STATS
//!   read the same numbers and the hot path records them only once.
//! - **Event-time** values (errors by code, rejections by reason, latency and keep-set
//!   histograms) are recorded where they happen, into handles registered once at startup
//!   (an atomic add, or a lock-free bucket push for histograms).
//!
//! Metrics of tiers and links that do not exist in a run (NVMe, the GPU block cache, transfer
//! links, the fetch stage) are registered by the component that owns them, through
//! [`Metrics::register_tier`], [`Metrics::register_link`], [`Metrics::register_nvme`],
//! [`Metrics::register_gpu_cache`] and [`Metrics::register_fetch_stage`]; until then they are
//! absent from the exposition rather than exported as zeros.
//!
//! With metrics off (the default) every handle is a no-op and nothing listens.

use std::sync::Arc;
use std::time::Duration;

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Label, Metadata, Recorder, Unit};
use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};

use kvtier_protocol::ErrorCode;

/// The service's state at one instant: what STATS and a metrics scrape report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub ready: bool,
    pub uptime: Duration,
    pub started_unix_ms: u64,
    pub sessions: u64,
    pub host_bytes_used: u64,
    pub host_bytes_capacity: u64,
    pub host_extents_used: u64,
    pub host_largest_free_bytes: u64,
    pub host_free_ranges: u64,
    pub host_runs_moved: u64,
    pub decode_requests: u64,
    pub decode_entries: u64,
    pub append_tokens: u64,
    pub errors: u64,
    pub rejected: u64,
    pub bytes_touched: u64,
    pub selected_tiles: u64,
    pub append_ns: u64,
    pub select_ns: u64,
    pub fetch_ns: u64,
    pub attend_ns: u64,
}

/// Every exported metric name, in one place.
pub mod names {
    pub const PREFIX: &str = "kvtier";

    // Scrape-time gauges.
    pub const READY: &str = "kvtier_ready";
    pub const UPTIME: &str = "kvtier_uptime_seconds";
    pub const SESSIONS: &str = "kvtier_sessions";
    pub const TIER_USED_BYTES: &str = "kvtier_tier_used_bytes";
    pub const TIER_CAPACITY_BYTES: &str = "kvtier_tier_capacity_bytes";
    pub const TIER_USED_BLOCKS: &str = "kvtier_tier_used_blocks";
    pub const TIER_LARGEST_FREE_BYTES: &str = "kvtier_tier_largest_free_bytes";
    pub const TIER_FREE_RANGES: &str = "kvtier_tier_free_ranges";

    // Scrape-time counters (the same numbers STATS reports).
    pub const DECODE_REQUESTS: &str = "kvtier_decode_requests_total";
    pub const DECODE_ENTRIES: &str = "kvtier_decode_entries_total";
    pub const APPEND_TOKENS: &str = "kvtier_append_tokens_total";
    pub const DECODE_TOUCHED_BYTES: &str = "kvtier_decode_touched_bytes_total";
    pub const DECODE_SELECTED_TILES: &str = "kvtier_decode_selected_tiles_total";

    // Event-time counters.
    pub const ERRORS: &str = "kvtier_errors_total";
    pub const ADMISSION_REJECTIONS: &str = "kvtier_admission_rejections_total";

    // Event-time histograms.
    pub const DECODE_STAGE_SECONDS: &str = "kvtier_decode_stage_seconds";
    pub const DECODE_SECONDS: &str = "kvtier_decode_seconds";
    pub const DECODE_KEEP_SET_BLOCKS: &str = "kvtier_decode_keep_set_blocks";

    // Registered by the tier or backend that owns them.
    pub const LINK_MOVED_BYTES: &str = "kvtier_link_moved_bytes_total";
    pub const GPU_CACHE_HITS: &str = "kvtier_gpu_cache_hits_total";
    pub const GPU_CACHE_LOOKUPS: &str = "kvtier_gpu_cache_lookups_total";
    pub const NVME_IO_ERRORS: &str = "kvtier_nvme_io_errors_total";
    pub const NVME_CHECKSUM_ERRORS: &str = "kvtier_nvme_checksum_errors_total";
    pub const NVME_PAGES_MOVED: &str = "kvtier_nvme_pages_moved_total";
    pub const HOST_RUNS_MOVED: &str = "kvtier_host_runs_moved_total";
    pub const REMOTE_CLAIMS: &str = "kvtier_remote_claims";
    pub const REMOTE_RESUMES: &str = "kvtier_remote_resumes_total";
    pub const REMOTE_OFFLOADS: &str = "kvtier_remote_offloads_total";
    pub const REMOTE_CLAIMS_LOST: &str = "kvtier_remote_claims_lost_total";
}

/// Why a request was refused before it ran (label `reason` of
/// `kvtier_admission_rejections_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// admission.max_sessions reached.
    SessionLimit,
    /// admission.max_queued_requests reached.
    QueueFull,
    /// server.max_connections reached.
    ConnectionLimit,
    /// The host tier had no room for the request, even after demoting what it may demote.
    HostFull,
    /// The uid's share of the host tier (quota.host_share_per_uid) was reached.
    HostShare,
    /// A malformed frame or request body.
    Malformed,
    /// The peer may not do this (EVICT without being an admin).
    Permission,
}

impl Rejection {
    pub const ALL: [Rejection; 7] = [
        Rejection::SessionLimit,
        Rejection::QueueFull,
        Rejection::ConnectionLimit,
        Rejection::HostFull,
        Rejection::HostShare,
        Rejection::Malformed,
        Rejection::Permission,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Rejection::SessionLimit => "max_sessions",
            Rejection::QueueFull => "queue_full",
            Rejection::ConnectionLimit => "max_connections",
            Rejection::HostFull => "host_full",
            Rejection::HostShare => "host_share",
            Rejection::Malformed => "malformed",
            Rejection::Permission => "permission",
        }
    }
}

/// Decode stages timed per DECODE request (label `stage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Append,
    Select,
    Attend,
}

impl Stage {
    pub const ALL: [Stage; 3] = [Stage::Append, Stage::Select, Stage::Attend];
    pub fn label(self) -> &'static str {
        match self {
            Stage::Append => "append",
            Stage::Select => "select",
            Stage::Attend => "attend",
        }
    }
}

/// Latency buckets, seconds: 1 us to 2.5 s.
const SECONDS_BUCKETS: [f64; 19] = [
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
    5e-2, 0.1, 0.25, 1.0, 2.5,
];
/// Keep-set size buckets, blocks per kv-head (37 = 1 sink + 4 local + 32 top-k).
const BLOCKS_BUCKETS: [f64; 12] = [
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 37.0, 64.0, 128.0, 256.0, 512.0, 1024.0,
];

static METADATA: Metadata<'static> = Metadata::new("tierd", metrics::Level::INFO, None);

/// Gauges of one tier (label `tier`), set by the tier's owner (the host tier's at scrape time).
#[derive(Debug, Clone)]
pub struct TierGauges {
    pub used_bytes: Gauge,
    pub capacity_bytes: Gauge,
    pub used_blocks: Gauge,
    pub largest_free_bytes: Gauge,
    pub free_ranges: Gauge,
}

/// NVMe tier counters, registered when the NVMe tier is enabled.
#[derive(Debug, Clone)]
pub struct NvmeMetrics {
    /// Pages that failed verification (STATS `nvme_checksum_errors_total`).
    pub checksum_errors: Counter,
    /// Failed page reads, writes and fdatasyncs (STATS `nvme_io_errors_total`).
    pub io_errors: Counter,
    /// Pages compaction moved to place writes (STATS `nvme_pages_moved_total`).
    pub pages_moved: Counter,
}

/// The remote tier's series (the STATS `remote_*` numbers), refreshed at scrape time; its
/// bytes are the `host_to_remote` and `remote_to_host` links.
#[derive(Debug, Clone)]
pub struct RemoteMetrics {
    pub claims: Gauge,
    pub resumes: Counter,
    pub offloads: Counter,
    pub claims_lost: Counter,
    pub written: Counter,
    pub read: Counter,
}

/// GPU block cache counters (hit rate = hits / lookups), registered by the CUDA backend.
#[derive(Debug, Clone)]
pub struct GpuCacheMetrics {
    pub hits: Counter,
    pub lookups: Counter,
}

/// The daemon's metric handles. Cheap to record into; no-ops when metrics are off.
#[derive(Debug)]
pub struct Metrics {
    recorder: Option<Arc<PrometheusRecorder>>,
    ready: Gauge,
    uptime: Gauge,
    sessions: Gauge,
    host: TierGauges,
    host_runs_moved: Counter,
    decode_requests: Counter,
    decode_entries: Counter,
    append_tokens: Counter,
    touched_bytes: Counter,
    selected_tiles: Counter,
    errors: Vec<(ErrorCode, Counter)>,
    rejections: [Counter; Rejection::ALL.len()],
    stages: [Histogram; 3],
    decode_seconds: Histogram,
    keep_set_blocks: Histogram,
}

impl Metrics {
    /// Handles that record nothing (metrics off).
    pub fn disabled() -> Metrics {
        Metrics::build(None)
    }

    /// A Prometheus recorder and the daemon's handles registered in it.
    pub fn prometheus() -> Metrics {
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS_BUCKETS)
            .and_then(|b| {
                b.set_buckets_for_metric(
                    Matcher::Full(names::DECODE_KEEP_SET_BLOCKS.into()),
                    &BLOCKS_BUCKETS,
                )
            })
            .expect("bucket lists are non-empty")
            .build_recorder();
        Metrics::build(Some(Arc::new(recorder)))
    }

    fn build(recorder: Option<Arc<PrometheusRecorder>>) -> Metrics {
        let r = Registrar(recorder.as_deref());
        r.describe_all();
        Metrics {
            ready: r.gauge(names::READY, &[]),
            uptime: r.gauge(names::UPTIME, &[]),
            sessions: r.gauge(names::SESSIONS, &[]),
            host: r.tier("host"),
            host_runs_moved: r.counter(names::HOST_RUNS_MOVED, &[]),
            decode_requests: r.counter(names::DECODE_REQUESTS, &[]),
            decode_entries: r.counter(names::DECODE_ENTRIES, &[]),
            append_tokens: r.counter(names::APPEND_TOKENS, &[]),
            touched_bytes: r.counter(names::DECODE_TOUCHED_BYTES, &[]),
            selected_tiles: r.counter(names::DECODE_SELECTED_TILES, &[]),
            errors: ErrorCode::ALL
                .iter()
                .map(|&c| (c, r.counter(names::ERRORS, &[("code", c.name())])))
                .collect(),
            rejections: Rejection::ALL
                .map(|x| r.counter(names::ADMISSION_REJECTIONS, &[("reason", x.label())])),
            stages: Stage::ALL
                .map(|s| r.histogram(names::DECODE_STAGE_SECONDS, &[("stage", s.label())])),
            decode_seconds: r.histogram(names::DECODE_SECONDS, &[]),
            keep_set_blocks: r.histogram(names::DECODE_KEEP_SET_BLOCKS, &[]),
            recorder,
        }
    }

    pub fn enabled(&self) -> bool {
        self.recorder.is_some()
    }

    fn registrar(&self) -> Registrar<'_> {
        Registrar(self.recorder.as_deref())
    }

    /// Gauges for another tier (`"nvme"`, `"gpu"`), for the tier's owner to keep current.
    pub fn register_tier(&self, tier: &'static str) -> TierGauges {
        self.registrar().tier(tier)
    }

    /// The byte counter of a transfer link (`"host_to_gpu"`, `"nvme0_to_host"`, ...).
    pub fn register_link(&self, link: &'static str) -> Counter {
        self.registrar()
            .counter(names::LINK_MOVED_BYTES, &[("link", link)])
    }

    pub fn register_nvme(&self) -> NvmeMetrics {
        let r = self.registrar();
        NvmeMetrics {
            checksum_errors: r.counter(names::NVME_CHECKSUM_ERRORS, &[]),
            io_errors: r.counter(names::NVME_IO_ERRORS, &[]),
            pages_moved: r.counter(names::NVME_PAGES_MOVED, &[]),
        }
    }

    pub fn register_remote(&self) -> RemoteMetrics {
        let r = self.registrar();
        RemoteMetrics {
            claims: r.gauge(names::REMOTE_CLAIMS, &[]),
            resumes: r.counter(names::REMOTE_RESUMES, &[]),
            offloads: r.counter(names::REMOTE_OFFLOADS, &[]),
            claims_lost: r.counter(names::REMOTE_CLAIMS_LOST, &[]),
            written: r.counter(names::LINK_MOVED_BYTES, &[("link", "host_to_remote")]),
            read: r.counter(names::LINK_MOVED_BYTES, &[("link", "remote_to_host")]),
        }
    }

    pub fn register_gpu_cache(&self) -> GpuCacheMetrics {
        let r = self.registrar();
        GpuCacheMetrics {
            hits: r.counter(names::GPU_CACHE_HITS, &[]),
            lookups: r.counter(names::GPU_CACHE_LOOKUPS, &[]),
        }
    }

    /// The `stage="fetch"` latency histogram, for backends that move keep-set tiles.
    pub fn register_fetch_stage(&self) -> Histogram {
        self.registrar()
            .histogram(names::DECODE_STAGE_SECONDS, &[("stage", "fetch")])
    }

    pub fn error(&self, code: ErrorCode) {
        if let Some((_, c)) = self.errors.iter().find(|(k, _)| *k == code) {
            c.increment(1);
        }
    }

    pub fn rejection(&self, why: Rejection) {
        self.rejections[why as usize].increment(1);
    }

    /// One DECODE request's stage times and total execution time.
    pub fn decode_timings(&self, t: &kvtier_kernels::StageTimings, total: Duration) {
        let ns = |n: u64| n as f64 * 1e-9;
        self.stages[Stage::Append as usize].record(ns(t.append_ns));
        self.stages[Stage::Select as usize].record(ns(t.select_ns));
        self.stages[Stage::Attend as usize].record(ns(t.attend_ns));
        self.decode_seconds.record(total.as_secs_f64());
    }

    /// One decode entry's keep-set size, blocks per kv-head.
    pub fn keep_set(&self, blocks: usize) {
        self.keep_set_blocks.record(blocks as f64);
    }

    /// Copies the service's scrape-time values into the exported gauges and counters.
    pub fn refresh(&self, s: &Snapshot) {
        self.ready.set(if s.ready { 1.0 } else { 0.0 });
        self.uptime.set(s.uptime.as_secs_f64());
        self.sessions.set(s.sessions as f64);
        self.host.used_bytes.set(s.host_bytes_used as f64);
        self.host.capacity_bytes.set(s.host_bytes_capacity as f64);
        self.host.used_blocks.set(s.host_extents_used as f64);
        self.host
            .largest_free_bytes
            .set(s.host_largest_free_bytes as f64);
        self.host.free_ranges.set(s.host_free_ranges as f64);
        self.host_runs_moved.absolute(s.host_runs_moved);
        self.decode_requests.absolute(s.decode_requests);
        self.decode_entries.absolute(s.decode_entries);
        self.append_tokens.absolute(s.append_tokens);
        self.touched_bytes.absolute(s.bytes_touched);
        self.selected_tiles.absolute(s.selected_tiles);
    }

    /// The text exposition after a refresh from `snapshot` (the caller refreshes what it owns
    /// first). Empty when metrics are off.
    pub fn render(&self, snapshot: &Snapshot) -> String {
        let Some(rec) = &self.recorder else {
            return String::new();
        };
        self.refresh(snapshot);
        rec.handle().render()
    }

    /// The recorder's handle (histogram upkeep), None when metrics are off.
    pub fn handle(&self) -> Option<PrometheusHandle> {
        self.recorder.as_ref().map(|r| r.handle())
    }
}

/// Registers handles in a recorder, or hands out no-ops without one.
struct Registrar<'a>(Option<&'a PrometheusRecorder>);

impl Registrar<'_> {
    fn key(name: &'static str, labels: &[(&'static str, &'static str)]) -> Key {
        Key::from_parts(
            name,
            labels
                .iter()
                .map(|&(k, v)| Label::from_static_parts(k, v))
                .collect::<Vec<_>>(),
        )
    }
    fn counter(&self, name: &'static str, labels: &[(&'static str, &'static str)]) -> Counter {
        self.0.map_or(Counter::noop(), |r| {
            r.register_counter(&Self::key(name, labels), &METADATA)
        })
    }
    fn gauge(&self, name: &'static str, labels: &[(&'static str, &'static str)]) -> Gauge {
        self.0.map_or(Gauge::noop(), |r| {
            r.register_gauge(&Self::key(name, labels), &METADATA)
        })
    }
    fn histogram(&self, name: &'static str, labels: &[(&'static str, &'static str)]) -> Histogram {
        self.0.map_or(Histogram::noop(), |r| {
            r.register_histogram(&Self::key(name, labels), &METADATA)
        })
    }
    fn tier(&self, tier: &'static str) -> TierGauges {
        let l = [("tier", tier)];
        TierGauges {
            used_bytes: self.gauge(names::TIER_USED_BYTES, &l),
            capacity_bytes: self.gauge(names::TIER_CAPACITY_BYTES, &l),
            used_blocks: self.gauge(names::TIER_USED_BLOCKS, &l),
            largest_free_bytes: self.gauge(names::TIER_LARGEST_FREE_BYTES, &l),
            free_ranges: self.gauge(names::TIER_FREE_RANGES, &l),
        }
    }

    /// HELP lines (and units) for every name; a name only appears once it has a series.
    fn describe_all(&self) {
        use names::*;
        let Some(r) = self.0 else { return };
        let c = |n: &'static str, u: Option<Unit>, h: &'static str| {
            r.describe_counter(KeyName::from_const_str(n), u, h.into())
        };
        let g = |n: &'static str, u: Option<Unit>, h: &'static str| {
            r.describe_gauge(KeyName::from_const_str(n), u, h.into())
        };
        let hi = |n: &'static str, u: Option<Unit>, h: &'static str| {
            r.describe_histogram(KeyName::from_const_str(n), u, h.into())
        };
        let (b, s) = (Some(Unit::Bytes), Some(Unit::Seconds));
        g(
            READY,
            None,
            "1 while tierd accepts requests, 0 while it drains at shutdown",
        );
        g(UPTIME, s, "Seconds since tierd started");
        g(SESSIONS, None, "Live sessions");
        g(TIER_USED_BYTES, b, "Bytes of the tier holding KV blocks");
        g(TIER_CAPACITY_BYTES, b, "Configured bytes of the tier");
        g(TIER_USED_BLOCKS, None, "Block extents of the tier in use");
        g(
            TIER_LARGEST_FREE_BYTES,
            b,
            "The longest block run the tier could place now (below free bytes: fragmented)",
        );
        g(TIER_FREE_RANGES, None, "Free ranges of the tier's space");
        c(DECODE_REQUESTS, None, "DECODE requests served");
        c(
            DECODE_ENTRIES,
            None,
            "DECODE entries (session steps) served",
        );
        c(
            APPEND_TOKENS,
            None,
            "Tokens appended by APPEND_KV and DECODE",
        );
        c(
            DECODE_TOUCHED_BYTES,
            b,
            "Bytes read to answer decodes: summaries scanned plus the K/V rows of selected tiles",
        );
        c(
            DECODE_SELECTED_TILES,
            None,
            "Selected (block, kv-head) tiles over all decode entries",
        );
        c(ERRORS, None, "Error replies sent, by wire error code");
        c(
            ADMISSION_REJECTIONS,
            None,
            "Requests refused by admission limits, by reason",
        );
        hi(
            DECODE_STAGE_SECONDS,
            s,
            "Wall time of one DECODE request's stage, per request",
        );
        hi(
            DECODE_SECONDS,
            s,
            "Execution time of one DECODE request (all stages)",
        );
        hi(
            DECODE_KEEP_SET_BLOCKS,
            None,
            "Keep-set size per decode entry, blocks per kv-head",
        );
        c(LINK_MOVED_BYTES, b, "Bytes moved between tiers, by link");
        c(
            GPU_CACHE_HITS,
            None,
            "Keep-set tiles found in the GPU block cache",
        );
        c(
            GPU_CACHE_LOOKUPS,
            None,
            "Keep-set tiles looked up in the GPU block cache",
        );
        c(
            NVME_IO_ERRORS,
            None,
            "NVMe page reads, writes or fdatasyncs that failed (an errno, or a short transfer retries could not finish)",
        );
        c(
            NVME_CHECKSUM_ERRORS,
            None,
            "NVMe pages that failed verification (checksum, header or identity mismatch); never returned as data",
        );
        c(
            NVME_PAGES_MOVED,
            None,
            "NVMe pages compaction moved so that a write fitting in the free bytes but in no free extent was placed",
        );
        c(
            HOST_RUNS_MOVED,
            None,
            "Block runs compaction moved inside the host tier so that a request fitting in the free bytes but in no free range was placed",
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rendered(m: &Metrics) -> String {
        m.handle().unwrap().render()
    }

    #[test]
    fn names_follow_the_convention() {
        use names::*;
        let counters = [
            DECODE_REQUESTS,
            DECODE_ENTRIES,
            APPEND_TOKENS,
            DECODE_TOUCHED_BYTES,
            DECODE_SELECTED_TILES,
            ERRORS,
            ADMISSION_REJECTIONS,
            LINK_MOVED_BYTES,
            GPU_CACHE_HITS,
            GPU_CACHE_LOOKUPS,
            NVME_IO_ERRORS,
            NVME_CHECKSUM_ERRORS,
            NVME_PAGES_MOVED,
            HOST_RUNS_MOVED,
        ];
        let others = [
            READY,
            UPTIME,
            SESSIONS,
            TIER_USED_BYTES,
            TIER_CAPACITY_BYTES,
            TIER_USED_BLOCKS,
            TIER_LARGEST_FREE_BYTES,
            TIER_FREE_RANGES,
            DECODE_STAGE_SECONDS,
            DECODE_SECONDS,
            DECODE_KEEP_SET_BLOCKS,
        ];
        for n in counters.iter().chain(&others) {
            assert!(n.starts_with(&format!("{PREFIX}_")), "{n}");
            assert!(n.chars().all(|c| c.is_ascii_lowercase() || c == '_'), "{n}");
        }
        assert!(counters.iter().all(|n| n.ends_with("_total")));
        assert!(others.iter().all(|n| !n.ends_with("_total")));
    }

    #[test]
    fn optional_tiers_appear_only_once_registered() {
        let m = Metrics::prometheus();
        let text = rendered(&m);
        for absent in [
            names::NVME_IO_ERRORS,
            names::GPU_CACHE_HITS,
            names::LINK_MOVED_BYTES,
            "tier=\"nvme\"",
            "stage=\"fetch\"",
        ] {
            assert!(
                !text.contains(absent),
                "{absent} exported before its tier exists"
            );
        }
        assert!(
            text.contains("kvtier_tier_capacity_bytes{tier=\"host\"} 0"),
            "{text}"
        );
        let nvme = m.register_nvme();
        nvme.checksum_errors.increment(2);
        nvme.io_errors.increment(1);
        m.register_link("nvme0_to_host").increment(4096);
        m.register_tier("nvme").used_bytes.set(8192.0);
        m.register_fetch_stage().record(0.001);
        let text = rendered(&m);
        assert!(
            text.contains("kvtier_nvme_checksum_errors_total 2"),
            "{text}"
        );
        assert!(text.contains("kvtier_nvme_io_errors_total 1"), "{text}");
        assert!(
            text.contains("kvtier_link_moved_bytes_total{link=\"nvme0_to_host\"} 4096"),
            "{text}"
        );
        assert!(
            text.contains("kvtier_tier_used_bytes{tier=\"nvme\"} 8192"),
            "{text}"
        );
        assert!(
            text.contains("kvtier_decode_stage_seconds_count{stage=\"fetch\"} 1"),
            "{text}"
        );
    }

    #[test]
    fn event_metrics_are_labelled_and_histograms_have_buckets() {
        let m = Metrics::prometheus();
        m.error(ErrorCode::NotFound);
        m.error(ErrorCode::NotFound);
        m.rejection(Rejection::QueueFull);
        m.keep_set(37);
        m.decode_timings(
            &kvtier_kernels::StageTimings {
                append_ns: 1_000,
                select_ns: 20_000,
                fetch_ns: 0,
                attend_ns: 300_000,
            },
            Duration::from_micros(400),
        );
        let text = rendered(&m);
        assert!(
            text.contains("kvtier_errors_total{code=\"NOT_FOUND\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("kvtier_errors_total{code=\"INTERNAL\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("kvtier_admission_rejections_total{reason=\"queue_full\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("kvtier_decode_keep_set_blocks_bucket{le=\"37\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("kvtier_decode_stage_seconds_bucket{stage=\"select\",le=\"0.000025\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("kvtier_decode_stage_seconds_bucket{stage=\"select\",le=\"0.00001\"} 0"),
            "{text}"
        );
        assert!(text.contains("# HELP kvtier_errors_total"), "{text}");
    }

    #[test]
    fn disabled_metrics_record_nothing() {
        let m = Metrics::disabled();
        m.error(ErrorCode::Internal);
        m.rejection(Rejection::HostFull);
        assert!(!m.enabled());
        assert!(m.handle().is_none());
    }
}
