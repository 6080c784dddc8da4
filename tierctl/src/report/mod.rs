//! What each command reports, as serde structs (the `--json` schema; field names are
//! stable) and their human renderings.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use kvtier_protocol::{stats_keys as keys, SessionInfo, StatsReply};
use serde::Serialize;

use crate::human::{self, Align, Table};

/// `tierctl status`.
#[derive(Debug, Serialize)]
pub struct Status {
    /// The socket asked.
    pub socket: String,
    /// HELLO's answer.
    pub server_name: String,
    pub server_version: String,
    pub protocol_version: u16,
    pub max_frame_bytes: u32,
    /// From here on STATS values, `null` where the daemon does not report the key.
    ///
    /// Whether the daemon accepts requests (false while it drains for shutdown).
    pub ready: Option<bool>,
    pub uptime_ms: Option<u64>,
    pub sessions: Option<u64>,
    pub host_bytes_used: Option<u64>,
    pub host_bytes_capacity: Option<u64>,
    /// The longest run each tier could place now and its free ranges: a tier whose largest
    /// free extent is far below its free bytes is fragmented.
    pub host_largest_free_bytes: Option<u64>,
    pub host_free_ranges: Option<u64>,
    pub decode_requests_total: Option<u64>,
    pub decode_entries_total: Option<u64>,
    pub append_tokens_total: Option<u64>,
    pub errors_total: Option<u64>,
    /// Of `errors_total`, the daemon's trouble (INTERNAL, DATA_LOSS, UNAVAILABLE).
    pub daemon_errors_total: Option<u64>,
    pub rejected_total: Option<u64>,
    pub nvme_bytes_used: Option<u64>,
    pub nvme_bytes_capacity: Option<u64>,
    pub nvme_largest_free_bytes: Option<u64>,
    pub nvme_free_ranges: Option<u64>,
    /// Each NVMe device's online read/write estimates (empty without the NVMe tier).
    pub nvme_links: Vec<NvmeLink>,
    /// Per-second rates over the interval between two STATS samples (`null` without one).
    pub rates: Option<Rates>,
}

/// `, largest free extent X in N free ranges` where the daemon reports them.
fn free_space(largest: Option<u64>, ranges: Option<u64>) -> String {
    match (largest, ranges) {
        (Some(l), Some(n)) => format!(
            ", largest free extent {} in {n} free ranges",
            human::bytes(l)
        ),
        _ => String::new(),
    }
}

/// Counter deltas per second between two STATS replies.
#[derive(Debug, Serialize)]
pub struct Rates {
    pub interval_ms: u64,
    pub decode_requests_per_s: f64,
    pub decode_entries_per_s: f64,
    pub append_tokens_per_s: f64,
    pub errors_per_s: f64,
}

impl Rates {
    /// Rates between `earlier` and `later`; None if either lacks uptime or no time passed.
    pub fn between(earlier: &StatsReply, later: &StatsReply) -> Option<Self> {
        let dt = later
            .get(keys::UPTIME_MS)?
            .checked_sub(earlier.get(keys::UPTIME_MS)?)?;
        if dt == 0 {
            return None;
        }
        let rate = |k: &str| {
            let d = later
                .get(k)
                .unwrap_or(0)
                .saturating_sub(earlier.get(k).unwrap_or(0));
            d as f64 * 1000.0 / dt as f64
        };
        Some(Rates {
            interval_ms: dt,
            decode_requests_per_s: rate(keys::DECODE_REQUESTS_TOTAL),
            decode_entries_per_s: rate(keys::DECODE_ENTRIES_TOTAL),
            append_tokens_per_s: rate(keys::APPEND_TOKENS_TOTAL),
            errors_per_s: rate(keys::ERRORS_TOTAL),
        })
    }
}

impl Status {
    pub fn new(
        socket: String,
        hello: &kvtier_protocol::HelloReply,
        stats: &StatsReply,
        earlier: Option<&StatsReply>,
    ) -> Self {
        Self {
            ready: stats.get("ready").map(|v| v != 0),
            nvme_bytes_used: stats.get("nvme_bytes_used"),
            nvme_bytes_capacity: stats.get("nvme_bytes_capacity"),
            nvme_largest_free_bytes: stats.get("nvme_largest_free_bytes"),
            nvme_free_ranges: stats.get("nvme_free_ranges"),
            host_largest_free_bytes: stats.get("host_largest_free_bytes"),
            host_free_ranges: stats.get("host_free_ranges"),
            nvme_links: NvmeLink::from_stats(stats),
            rates: earlier.and_then(|e| Rates::between(e, stats)),
            socket,
            server_name: hello.server_name.clone(),
            server_version: hello.server_version.clone(),
            protocol_version: hello.version,
            max_frame_bytes: hello.max_frame_bytes,
            uptime_ms: stats.get(keys::UPTIME_MS),
            sessions: stats.get(keys::SESSIONS),
            host_bytes_used: stats.get(keys::HOST_BYTES_USED),
            host_bytes_capacity: stats.get(keys::HOST_BYTES_CAPACITY),
            decode_requests_total: stats.get(keys::DECODE_REQUESTS_TOTAL),
            decode_entries_total: stats.get(keys::DECODE_ENTRIES_TOTAL),
            append_tokens_total: stats.get(keys::APPEND_TOKENS_TOTAL),
            errors_total: stats.get(keys::ERRORS_TOTAL),
            daemon_errors_total: stats.get("daemon_errors_total"),
            rejected_total: stats.get(keys::REJECTED_TOTAL),
        }
    }

    pub fn render(&self) -> String {
        let opt = |v: Option<u64>| v.map_or_else(|| "not reported".into(), |v| v.to_string());
        let mut t = Table::new(&[("", Align::Left), ("", Align::Left)]);
        let mut kv = |k: &str, v: String| t.row(vec![format!("{k}:"), v]);
        kv(
            "daemon",
            format!(
                "{} {} (reachable at {})",
                self.server_name, self.server_version, self.socket
            ),
        );
        kv(
            "protocol",
            format!(
                "v{}, max frame {}",
                self.protocol_version,
                human::bytes(u64::from(self.max_frame_bytes))
            ),
        );
        kv(
            "ready",
            self.ready.map_or_else(
                || "not reported".into(),
                |r| {
                    if r {
                        "yes".into()
                    } else {
                        "no (draining)".into()
                    }
                },
            ),
        );
        kv(
            "uptime",
            self.uptime_ms.map_or_else(
                || "not reported".into(),
                |ms| human::duration(Duration::from_millis(ms)),
            ),
        );
        kv("sessions", opt(self.sessions));
        kv(
            "host tier",
            self.host_bytes_used.map_or_else(
                || "not reported".into(),
                |u| {
                    human::usage(u, self.host_bytes_capacity)
                        + &free_space(self.host_largest_free_bytes, self.host_free_ranges)
                },
            ),
        );
        if let Some(u) = self.nvme_bytes_used {
            kv(
                "nvme tier",
                human::usage(u, self.nvme_bytes_capacity)
                    + &free_space(self.nvme_largest_free_bytes, self.nvme_free_ranges),
            );
        }
        for l in &self.nvme_links {
            kv(&format!("nvme dev{}", l.device), l.render());
        }
        kv("decode requests", opt(self.decode_requests_total));
        kv("decode entries", opt(self.decode_entries_total));
        kv("tokens appended", opt(self.append_tokens_total));
        // Most error replies answer what a request asked (a session that is not there, a bad
        // argument, a full tier); those that are the daemon's trouble are worth a look.
        kv(
            "errors",
            match (self.errors_total, self.daemon_errors_total) {
                (Some(all), Some(daemon)) => format!(
                    "{all} ({daemon} the daemon's: INTERNAL, DATA_LOSS, UNAVAILABLE; {} answering requests)",
                    all.saturating_sub(daemon)
                ),
                (all, _) => opt(all),
            },
        );
        kv("rejected", opt(self.rejected_total));
        if let Some(r) = &self.rates {
            kv(
                "rates",
                format!(
                    "{:.1} decode req/s, {:.1} entries/s, {:.1} tokens appended/s, {:.2} errors/s (over {} ms)",
                    r.decode_requests_per_s,
                    r.decode_entries_per_s,
                    r.append_tokens_per_s,
                    r.errors_per_s,
                    r.interval_ms
                ),
            );
        }
        // The header row of a key/value table is empty; drop it.
        t.render()
            .split_once('\n')
            .map_or(String::new(), |(_, rest)| rest.to_owned())
    }
}

/// One session (`session info`, and each element of `sessions`): the protocol's
/// [`SessionInfo`], its `session` field named `id`.
#[derive(Debug, Serialize)]
#[serde(transparent)]
pub struct Session(pub SessionInfo);

impl From<&SessionInfo> for Session {
    fn from(s: &SessionInfo) -> Self {
        Self(s.clone())
    }
}

impl std::ops::Deref for Session {
    type Target = SessionInfo;
    fn deref(&self) -> &SessionInfo {
        &self.0
    }
}

impl Session {
    /// The sessions table's STATE column: DAMAGED, else where the session's blocks are
    /// (`ram`, `nvme` once demoted, `remote` once in the cluster, joined by `+`, `-` with
    /// none), and `pinned`.
    fn state_cell(&self) -> String {
        if self.damaged {
            return "DAMAGED".into();
        }
        let places: Vec<&str> = [
            (self.host_bytes, "ram"),
            (self.nvme_bytes, "nvme"),
            (self.remote_bytes, "remote"),
        ]
        .into_iter()
        .filter(|&(b, _)| b > 0)
        .map(|(_, p)| p)
        .collect();
        let place = match places.is_empty() {
            true => "-".to_string(),
            false => places.join("+"),
        };
        if self.pinned {
            format!("{place} pinned")
        } else {
            place
        }
    }

    fn geometry_cell(&self) -> String {
        let g = &self.geometry;
        format!(
            "{}/{}/{}/{}/{}/{}",
            g.layers, g.q_heads, g.kv_heads, g.head_dim, g.dtype, g.block_tokens
        )
    }

    fn tokens_cell(&self) -> String {
        // Layers differ only while a decode step is in flight.
        if self.tokens_min == self.tokens_max {
            self.tokens_max.to_string()
        } else {
            format!("{}-{}", self.tokens_min, self.tokens_max)
        }
    }

    fn label_cell(&self) -> String {
        if self.label.is_empty() {
            "-".into()
        } else {
            self.label.clone()
        }
    }

    /// `session info`: one field per line.
    pub fn render(&self, now_unix_ms: u64) -> String {
        let p = &self.policy;
        let mut t = Table::new(&[("", Align::Left), ("", Align::Left)]);
        let mut kv = |k: &str, v: String| t.row(vec![format!("{k}:"), v]);
        kv("session", self.session.to_string());
        kv("owner uid", self.owner_uid.to_string());
        kv("label", self.label_cell());
        kv("geometry (L/Hq/Hkv/D/dtype/B)", self.geometry_cell());
        kv(
            "policy",
            format!(
                "sink {}, local {}, top-k {}",
                p.sink_blocks, p.local_blocks, p.top_k
            ),
        );
        kv("tokens", self.tokens_cell());
        kv("blocks", self.blocks.to_string());
        kv("host bytes", human::bytes(self.host_bytes));
        kv("nvme bytes", human::bytes(self.nvme_bytes));
        kv("remote bytes", human::bytes(self.remote_bytes));
        kv("pinned", if self.pinned { "yes" } else { "no" }.into());
        if self.damaged {
            kv(
                "state",
                "DAMAGED: stored data failed verification; close it to delete".into(),
            );
        }
        kv(
            "created",
            format!("{} ago", human::age(self.created_unix_ms, now_unix_ms)),
        );
        kv(
            "last access",
            format!("{} ago", human::age(self.last_access_unix_ms, now_unix_ms)),
        );
        t.render()
            .split_once('\n')
            .map_or(String::new(), |(_, rest)| rest.to_owned())
    }
}

/// `tierctl sessions`.
#[derive(Debug, Serialize)]
pub struct Sessions {
    pub sessions: Vec<Session>,
}

impl Sessions {
    pub fn render(&self, now_unix_ms: u64) -> String {
        if self.sessions.is_empty() {
            return "no sessions\n".into();
        }
        let mut t = Table::new(&[
            ("ID", Align::Right),
            ("OWNER", Align::Right),
            ("LABEL", Align::Left),
            ("L/Hq/Hkv/D/dtype/B", Align::Left),
            ("TOKENS", Align::Right),
            ("BLOCKS", Align::Right),
            ("HOST", Align::Right),
            ("STATE", Align::Left),
            ("LAST ACCESS", Align::Right),
        ]);
        for s in &self.sessions {
            t.row(vec![
                s.session.to_string(),
                s.owner_uid.to_string(),
                s.label_cell(),
                s.geometry_cell(),
                s.tokens_cell(),
                s.blocks.to_string(),
                human::bytes(s.host_bytes),
                s.state_cell(),
                human::age(s.last_access_unix_ms, now_unix_ms),
            ]);
        }
        t.render()
    }
}

/// One NVMe device's online link estimates, from STATS `nvme_dev<i>_{read,write}_*`
/// (0: no transfer of that kind timed yet).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct NvmeLink {
    pub device: u32,
    pub read_bytes_per_s: u64,
    pub read_latency_ns: u64,
    pub write_bytes_per_s: u64,
    pub write_latency_ns: u64,
}

impl NvmeLink {
    /// Devices 0, 1, ... for as long as the daemon reports `nvme_dev<i>_read_bytes_per_s`.
    pub fn from_stats(stats: &StatsReply) -> Vec<Self> {
        (0u32..)
            .map_while(|i| {
                let get = |what: &str| stats.get(&format!("nvme_dev{i}_{what}"));
                Some(Self {
                    device: i,
                    read_bytes_per_s: get("read_bytes_per_s")?,
                    read_latency_ns: get("read_latency_ns").unwrap_or(0),
                    write_bytes_per_s: get("write_bytes_per_s").unwrap_or(0),
                    write_latency_ns: get("write_latency_ns").unwrap_or(0),
                })
            })
            .collect()
    }

    /// `read 1.3 GiB/s (85 us), write not measured yet`.
    pub fn render(&self) -> String {
        let op = |bw: u64, lat: u64| {
            if bw == 0 {
                "not measured yet".to_owned()
            } else if lat == 0 {
                // The fit's intercept clamps at 0 when transfers are all alike: no latency
                // was resolved, which is not a latency of 0 ns.
                format!("{} (latency not resolved)", human::rate(bw))
            } else {
                format!("{} ({})", human::rate(bw), human::latency_ns(lat))
            }
        };
        format!(
            "read {}, write {}",
            op(self.read_bytes_per_s, self.read_latency_ns),
            op(self.write_bytes_per_s, self.write_latency_ns)
        )
    }
}

/// One storage tier's usage, built only from keys the daemon reports.
#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct TierRow {
    pub tier: String,
    pub bytes_used: Option<u64>,
    pub bytes_capacity: Option<u64>,
    /// Block runs resident (extents of their run size, so no fixed capacity in runs).
    pub extents_used: Option<u64>,
}

/// `tierctl tier`.
#[derive(Debug, Serialize)]
pub struct Tiers {
    pub tiers: Vec<TierRow>,
    /// Each NVMe device's online read/write estimates (empty without the NVMe tier).
    pub nvme_links: Vec<NvmeLink>,
}

impl Tiers {
    /// A row for every prefix `P` such that the daemon reports `P_bytes_used` or
    /// `P_bytes_capacity` (today `host`; NVMe and GPU rows appear when the daemon adds
    /// their keys). Host first, then the others by name.
    pub fn from_stats(stats: &StatsReply) -> Self {
        let mut names: Vec<&str> = stats
            .entries
            .iter()
            .filter_map(|(k, _)| {
                k.strip_suffix("_bytes_used")
                    .or_else(|| k.strip_suffix("_bytes_capacity"))
            })
            .filter(|p| !p.is_empty())
            .collect();
        names.sort_by_key(|n| (*n != "host", *n));
        names.dedup();
        let tiers = names
            .into_iter()
            .map(|n| TierRow {
                tier: n.to_owned(),
                bytes_used: stats.get(&format!("{n}_bytes_used")),
                bytes_capacity: stats.get(&format!("{n}_bytes_capacity")),
                extents_used: stats.get(&format!("{n}_extents_used")),
            })
            .collect();
        Self {
            tiers,
            nvme_links: NvmeLink::from_stats(stats),
        }
    }

    pub fn render(&self) -> String {
        if self.tiers.is_empty() {
            return "the daemon reports no tier usage\n".into();
        }
        let opt_bytes = |v: Option<u64>| v.map_or_else(|| "-".into(), human::bytes);
        let opt = |v: Option<u64>| v.map_or_else(|| "-".into(), |v| v.to_string());
        let mut t = Table::new(&[
            ("TIER", Align::Left),
            ("USED", Align::Right),
            ("CAPACITY", Align::Right),
            ("USE%", Align::Right),
            ("RUNS", Align::Right),
        ]);
        for r in &self.tiers {
            let pct = match (r.bytes_used, r.bytes_capacity) {
                (Some(u), Some(c)) if c > 0 => format!("{:.1}%", u as f64 * 100.0 / c as f64),
                _ => "-".into(),
            };
            t.row(vec![
                r.tier.clone(),
                opt_bytes(r.bytes_used),
                opt_bytes(r.bytes_capacity),
                pct,
                opt(r.extents_used),
            ]);
        }
        let mut out = t.render();
        if !self.nvme_links.is_empty() {
            out.push_str("\nNVMe devices (online estimates from page reads and writes):\n");
            for l in &self.nvme_links {
                let _ = writeln!(out, "  dev{}  {}", l.device, l.render());
            }
        }
        out
    }
}

/// `tierctl stats`: every key the daemon reports, sorted by name.
#[derive(Debug, Serialize)]
pub struct Stats {
    pub stats: BTreeMap<String, u64>,
}

impl Stats {
    pub fn from_stats(stats: &StatsReply) -> Self {
        Self {
            stats: stats.entries.iter().cloned().collect(),
        }
    }

    pub fn render(&self) -> String {
        let w = self.stats.keys().map(|k| k.len()).max().unwrap_or(0);
        let mut out = String::new();
        for (k, v) in &self.stats {
            // Byte-valued keys also get a human size; the raw number stays first.
            if k.contains("bytes") && *v >= 1024 {
                let _ = writeln!(out, "{k:<w$}  {v} ({})", human::bytes(*v));
            } else {
                let _ = writeln!(out, "{k:<w$}  {v}");
            }
        }
        out
    }
}

/// `close` / `evict`.
#[derive(Debug, Serialize)]
pub struct Dropped {
    pub session: u64,
    /// `closed` or `evicted`.
    pub action: &'static str,
}

/// `demote` / `promote` / `session offload`.
#[derive(Debug, Serialize)]
pub struct TierMove {
    pub session: u64,
    /// `demoted`, `promoted` or `offloaded`.
    pub action: &'static str,
    /// Blocks freed from host RAM (demote), read back (promote) or written to the remote tier
    /// (offload).
    pub blocks: u64,
}

/// `pin` / `unpin`.
#[derive(Debug, Serialize)]
pub struct Pinned {
    pub session: u64,
    pub pinned: bool,
}

#[cfg(test)]
mod tests;
