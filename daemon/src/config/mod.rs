//! tierd configuration: embedded defaults, then a TOML file, then `TIERD_<SECTION>_<FIELD>`
//! environment variables, then command-line overrides; validated as a whole with errors that
//! name the field.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

mod load;
pub use load::ConfigError;

/// A byte count written as an integer or a string with a binary unit ("256KiB", "8 GiB").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "toml::Value", into = "String")]
pub struct ByteSize(pub u64);

impl std::str::FromStr for ByteSize {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let n: u64 = num
            .parse()
            .map_err(|_| format!("{s:?} is not a size (examples: 4096, \"256KiB\", \"8GiB\")"))?;
        let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kib" | "kb" => 1 << 10,
            "m" | "mib" | "mb" => 1 << 20,
            "g" | "gib" | "gb" => 1 << 30,
            "t" | "tib" | "tb" => 1 << 40,
            other => return Err(format!("unknown size unit {other:?} in {s:?}")),
        };
        n.checked_mul(mult)
            .map(ByteSize)
            .ok_or_else(|| format!("{s:?} overflows"))
    }
}

impl TryFrom<toml::Value> for ByteSize {
    type Error = String;
    fn try_from(v: toml::Value) -> Result<Self, String> {
        match v {
            toml::Value::Integer(i) if i >= 0 => Ok(ByteSize(i as u64)),
            toml::Value::String(s) => s.parse(),
            other => Err(format!("expected a size, got {other}")),
        }
    }
}

impl From<ByteSize> for String {
    fn from(b: ByteSize) -> String {
        b.to_string()
    }
}

impl std::fmt::Display for ByteSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let b = self.0;
        for (shift, unit) in [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")] {
            if b >= 1 << shift && b.is_multiple_of(1 << shift) {
                return write!(f, "{}{unit}", b >> shift);
            }
        }
        write!(f, "{b}")
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub server: ServerConfig,
    pub host: HostConfig,
    pub admission: AdmissionConfig,
    pub quota: QuotaConfig,
    pub auth: AuthConfig,
    pub backend: BackendConfig,
    pub nvme: NvmeConfig,
    pub remote: RemoteConfig,
    pub log: LogConfig,
    pub metrics: MetricsConfig,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// Unix socket path; its parent directory is created (0755) if missing.
    pub socket_path: PathBuf,
    /// Permission bits of the socket file (who may connect), e.g. 0o660 (a TOML integer, or
    /// a string "0o660"; printed as the string).
    #[serde(serialize_with = "octal_mode", deserialize_with = "mode_bits")]
    pub socket_mode: u32,
    /// Group (name or numeric id) to give the socket file, so its members may connect.
    pub socket_group: Option<String>,
    /// Largest request or reply body; larger KV uploads use shared memory.
    pub max_frame_bytes: ByteSize,
    /// Open connections at once; more are refused with RESOURCE_EXHAUSTED.
    pub max_connections: usize,
    /// Connections one uid may hold at once (0: only `max_connections`); admins exempt.
    pub max_connections_per_uid: usize,
    /// Of `max_connections`, the slots kept for admins (`auth.admin_uids` / `admin_gids`),
    /// so an operator can connect while other users hold the rest.
    pub admin_connections: usize,
    /// How long shutdown waits for in-flight requests before dropping them.
    pub shutdown_grace_ms: u64,
    /// A new connection that has not completed HELLO this long after it was accepted is
    /// closed, whatever it sent meanwhile (0: never).
    pub handshake_timeout_ms: u64,
    /// A connection that completes no request for this long is closed (0: never), so idle
    /// connections cannot hold every `max_connections` slot.
    pub idle_timeout_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct HostConfig {
    /// Host-RAM tier size (anonymous memory, touched only as blocks fill).
    pub capacity: ByteSize,
    /// The largest (layer, block) run a session may have: each run takes an extent of its own
    /// size (rounded up to 4 KiB), so this only bounds geometries. The default, 16 MiB, takes
    /// every open model up to 70B at 128-token blocks in f32 (a 64-KV-head MHA model's run
    /// is 8 MiB). Also set by `frame_bytes`, its name before runs were variable-size (see
    /// [`RENAMED`]).
    pub max_run_bytes: ByteSize,
    /// Advise transparent huge pages for the arena.
    pub huge_pages: bool,
    /// mlock the arena (needs LimitMEMLOCK); pinned memory for the GPU backend implies it.
    pub lock_memory: bool,
    /// Back the arena with a memfd that engine processes may map (LEASE, the in-engine data
    /// path). Off by default: shared memory gets transparent huge pages only where the
    /// kernel's `shmem_enabled` allows them.
    pub shared: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionConfig {
    pub max_sessions: usize,
    /// APPEND_KV / DECODE requests executing at once (each uses the compute pool).
    pub max_concurrent_requests: usize,
    /// Requests waiting for an execution slot; beyond this, RESOURCE_EXHAUSTED.
    pub max_queued_requests: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct QuotaConfig {
    /// Sessions one uid may hold at once (admins exempt; 0: only admission.max_sessions).
    pub max_sessions_per_uid: usize,
    /// Share of the host tier's bytes one uid's sessions may hold (admin uids exempt; 1.0:
    /// no quota). Beyond it that uid's appends and decodes answer RESOURCE_EXHAUSTED; other
    /// users' sessions are not demoted to make room for it.
    pub host_share_per_uid: f64,
    /// Share of the NVMe tier's pages one uid's sessions may reference (admin uids exempt;
    /// 1.0: no quota). A write past it (DEMOTE, write-through, shutdown) is refused.
    pub nvme_share_per_uid: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AuthConfig {
    /// Peers with one of these uids may see every session and EVICT.
    pub admin_uids: Vec<u32>,
    /// Peers whose primary gid is one of these are admins too.
    pub admin_gids: Vec<u32>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// CUDA when a device is present, else the CPU backend (logged).
    Auto,
    Cpu,
    Cuda,
}

/// `backend.coalesce`: whether concurrent DECODEs from different connections (of any layers) run
/// as one step.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Coalesce {
    /// With the CUDA backend (one device call for many requests); CPU steps of different
    /// requests already run in parallel.
    Auto,
    Always,
    Never,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct BackendConfig {
    pub kind: BackendKind,
    /// Concurrent DECODEs as one step.
    pub coalesce: Coalesce,
    /// Threads of the compute pool (0 = one per core).
    pub threads: usize,
    /// The CUDA path (used when `kind` resolves to cuda).
    pub cuda: GpuSettings,
}

/// `[backend.cuda]`: device and device-memory sizing of the CUDA decode path. One backend is
/// compiled per distinct (geometry, policy) of the sessions, lazily at session creation, up to
/// `max_backends`; sessions beyond that, or of a geometry the kernels cannot run, use the CPU
/// path.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct GpuSettings {
    /// CUDA device ordinal.
    pub device: usize,
    /// Distinct (geometry, policy) backends at most; each holds its own device state.
    pub max_backends: usize,
    /// Sessions per (geometry, policy) with device state, over all lanes.
    pub max_sessions: u32,
    /// Decoders on the device, each with its own streams, buffers and share of the session
    /// slots, so that the steps of sessions placed on different lanes run at once (a session
    /// stays on the lane it was opened on; requests of one lane are still coalesced). At most
    /// `max_sessions`. More lanes serve clients that decode one session per connection faster
    /// (8 on 8 lanes: 5.1-6.4x one), and clients that batch their sessions into one DECODE
    /// slower (0.7-1.0x), so the default is one (docs/benchmarks.md, "Decoder lanes").
    pub lanes: u32,
    /// Blocks per session layer at most (context capacity = max_blocks x block_tokens).
    pub max_blocks: u32,
    /// Sessions per device call; larger batches are split.
    pub max_batch: u32,
    /// GPU tile-cache slots per (session, layer, kv head); 0 = twice the keep-set size.
    pub cache_slots: u32,
    /// Bytes per cuMemHostRegister call when registering the arena (rounded down to whole
    /// arena segments, at least one).
    pub register_chunk: ByteSize,
    /// How each layer's kernels are launched (docs/benchmarks.md, "Coalesced steps of mixed
    /// layers, and the launch mode").
    pub launch: LaunchSetting,
}

/// `backend.cuda.launch`: how a device call launches each layer's kernels.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LaunchSetting {
    /// Fused while the layer's last call mostly missed the GPU block cache, split otherwise
    /// (the kernels' own rule, tuned on their benchmark).
    Auto,
    /// One launch for everything but the merge: the fewest host calls per layer (the
    /// default).
    Fused,
    /// The fixed part of the keep-set on a second stream beside the selector.
    Split,
}

impl Default for GpuSettings {
    fn default() -> Self {
        GpuSettings {
            device: 0,
            max_backends: 2,
            max_sessions: 8,
            lanes: 1,
            // 1M tokens at B = 128.
            max_blocks: 8192,
            max_batch: 8,
            cache_slots: 0,
            register_chunk: ByteSize(1 << 30),
            // The daemon's calls are small and hot, and host-bound: fused measured ahead of
            // auto there (docs/benchmarks.md, "Coalesced steps of mixed layers, and the
            // launch mode").
            launch: LaunchSetting::Fused,
        }
    }
}

/// Which I/O driver the NVMe tier uses.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum IoDriverKind {
    /// io_uring when the kernel allows it, else pread/pwrite (logged).
    Auto,
    Uring,
    Pread,
}

/// One page file or block device of the NVMe tier.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NvmeDevice {
    pub path: PathBuf,
    pub capacity: ByteSize,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct NvmeConfig {
    /// Keep a durable copy of sessions on NVMe: demotion, write-through, warm restart.
    pub enabled: bool,
    /// Holds the manifest, and the default page file when `devices` is empty.
    pub dir: PathBuf,
    /// Page files or block devices; pages are striped over them by measured bandwidth.
    pub devices: Vec<NvmeDevice>,
    /// Size of the default page file `<dir>/pages-0` (preallocated).
    pub capacity: ByteSize,
    /// Make every APPEND_KV durable before acknowledging it.
    pub write_through: bool,
    /// When host-tier use passes this fraction, least recently used unpinned sessions are
    /// demoted until it falls below `low_water`.
    pub high_water: f64,
    pub low_water: f64,
    /// The I/O driver of the page files. Also set by `engine`, its old name (see [`RENAMED`]).
    pub driver: IoDriverKind,
    pub queue_depth: u32,
    /// Threads a bulk page-store batch (demotion, warm restart) and the warm restart's
    /// rebuild of tiles and bounds may use, the caller's included (0: one per core, at most 8).
    pub workers: usize,
    /// Speculative promotion: after a step that read cold blocks, bring in this many more
    /// candidates per kv-head (those ranked just below the cut) in the background (0: off).
    pub prefetch_blocks: u32,
    /// When manifest files exist but none verifies: `refuse` to start (the default: nothing
    /// is touched) or `quarantine` them and the page files into `dir/quarantine-<ms>/` and
    /// start empty.
    pub damaged_manifests: DamagedManifests,
}

/// `nvme.damaged_manifests`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DamagedManifests {
    Refuse,
    Quarantine,
}

/// `$STATE_DIRECTORY` (systemd StateDirectory=), else `/var/lib/kvtier` for root, else
/// `$XDG_STATE_HOME/kvtier` or `~/.local/state/kvtier`.
pub fn default_state_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("STATE_DIRECTORY").filter(|d| !d.is_empty()) {
        let first = d
            .to_string_lossy()
            .split(':')
            .next()
            .unwrap_or_default()
            .to_string();
        return PathBuf::from(first);
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        return PathBuf::from("/var/lib/kvtier");
    }
    if let Some(d) = std::env::var_os("XDG_STATE_HOME").filter(|d| !d.is_empty()) {
        return Path::new(&d).join("kvtier");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/tmp".into());
    Path::new(&home).join(".local/state/kvtier")
}

impl Default for NvmeConfig {
    fn default() -> Self {
        NvmeConfig {
            enabled: true,
            dir: default_state_dir(),
            devices: Vec::new(),
            capacity: ByteSize(4 << 30),
            write_through: false,
            high_water: 0.9,
            low_water: 0.75,
            driver: IoDriverKind::Auto,
            queue_depth: 64,
            workers: 0,
            prefetch_blocks: 8,
            damaged_manifests: DamagedManifests::Refuse,
        }
    }
}

/// `[remote]`: the remote tier, a Redis Cluster every node shares (docs/operations.md, "Several
/// nodes: the remote tier"). Off by default: a single node needs no Redis.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct RemoteConfig {
    pub enabled: bool,
    /// Cluster nodes to start from, `redis://host:port` each (at least one).
    pub seeds: Vec<String>,
    /// Prefix of every key tierd writes (several deployments can share a cluster).
    pub key_prefix: String,
    /// This node's name in session claims (empty: the host name). Unique per node.
    pub node: String,
    /// How long a claim on a session lasts unless renewed (renewed every third of it).
    pub claim_ttl_ms: u64,
    /// Replicas of each master that must acknowledge a write before it counts (Redis WAIT).
    pub replicas: u32,
    pub replica_timeout_ms: u64,
    pub connect_timeout_ms: u64,
    pub response_timeout_ms: u64,
    /// Acknowledge an APPEND_KV or DECODE only once its tokens are in the cluster.
    pub write_through: bool,
    /// Without write-through, write what the cluster lacks of every unpinned session this
    /// often (0: only at OFFLOAD and shutdown).
    pub flush_interval_ms: u64,
    /// Resume a session from its block summaries: serve it at once, its blocks read from the
    /// cluster when a step keeps them and the rest streamed in the background (false: read
    /// every page before serving it).
    pub resume_from_summaries: bool,
    /// Stream a session resumed from its summaries into the host tier behind its steps
    /// (false: read its blocks only when a step keeps them).
    pub stream_resumed: bool,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        RemoteConfig {
            enabled: false,
            seeds: Vec::new(),
            key_prefix: "kvtier".into(),
            node: String::new(),
            claim_ttl_ms: 10_000,
            replicas: 1,
            replica_timeout_ms: 2_000,
            connect_timeout_ms: 2_000,
            response_timeout_ms: 5_000,
            write_through: false,
            flush_interval_ms: 30_000,
            resume_from_summaries: true,
            stream_resumed: true,
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// `journald` when stderr is the journal (systemd sets $JOURNAL_STREAM), else `text`.
    Auto,
    /// Lines prefixed with their syslog priority (`<3>` error .. `<7>` trace) and no timestamp,
    /// so journald files each line at the right level and stamps it itself.
    Journald,
    /// Human-readable timestamped lines.
    Text,
    /// One JSON object per line with structured fields.
    Json,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// error, warn, info, debug or trace.
    pub level: String,
    pub format: LogFormat,
}

/// The Prometheus scrape endpoint.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsConfig {
    /// Address to serve `GET /metrics` on, e.g. "127.0.0.1:9464". Unset (the default): off.
    pub listen: Option<std::net::SocketAddr>,
    /// Allow a non-loopback `listen` address (the endpoint has no authentication).
    pub allow_remote: bool,
}

/// The socket path clients and the daemon agree on when nothing is configured:
/// `$KVTIER_SOCKET`, else `$XDG_RUNTIME_DIR/kvtier/tierd.sock`, else `/run/kvtier/tierd.sock`
/// for root, else `/tmp/kvtier-<uid>/tierd.sock`.
pub fn default_socket_path() -> PathBuf {
    kvtier_protocol::client::default_socket_path()
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            socket_path: default_socket_path(),
            socket_mode: 0o660,
            socket_group: None,
            max_frame_bytes: ByteSize(16 << 20),
            max_connections: 1024,
            max_connections_per_uid: 256,
            admin_connections: 16,
            shutdown_grace_ms: 10_000,
            handshake_timeout_ms: 10_000,
            idle_timeout_ms: 600_000,
        }
    }
}

impl Default for HostConfig {
    fn default() -> Self {
        HostConfig {
            capacity: ByteSize(default_host_capacity()),
            max_run_bytes: ByteSize(kvtier_storage::arena::DEFAULT_MAX_RUN_BYTES as u64),
            huge_pages: true,
            lock_memory: false,
            shared: false,
        }
    }
}

/// A quarter of physical RAM, rounded down to whole GiB (at least 1 GiB). The arena is
/// anonymous memory touched only as blocks fill, so an idle daemon costs little.
fn default_host_capacity() -> u64 {
    // SAFETY: sysconf has no preconditions; it returns -1 on unknown names.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    let ram = if pages > 0 && page > 0 {
        pages as u64 * page as u64
    } else {
        4 << 30
    };
    ((ram / 4) >> 30).max(1) << 30
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            max_sessions: 4096,
            max_concurrent_requests: 64,
            max_queued_requests: 4096,
        }
    }
}

impl Default for QuotaConfig {
    fn default() -> Self {
        QuotaConfig {
            max_sessions_per_uid: 1024,
            // Off by default: the usual deployment is one engine uid that should have the
            // whole tier. Hosts shared by several users set them (configs/tierd.toml).
            host_share_per_uid: 1.0,
            nvme_share_per_uid: 1.0,
        }
    }
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig {
            admin_uids: vec![0],
            admin_gids: vec![],
        }
    }
}

impl Default for BackendConfig {
    fn default() -> Self {
        BackendConfig {
            kind: BackendKind::Auto,
            coalesce: Coalesce::Auto,
            threads: 0,
            cuda: GpuSettings::default(),
        }
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            level: "info".into(),
            format: LogFormat::Auto,
        }
    }
}

/// A mode as TOML would spell it: `--print-config` shows "0o660", not 432.
fn octal_mode<S: serde::Serializer>(mode: &u32, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format!("0o{mode:o}"))
}

/// A mode from a TOML integer (`0o660`, or decimal) or a string of octal digits (`"0o660"`,
/// `"660"`).
fn mode_bits<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Mode {
        Bits(u32),
        Text(String),
    }
    match Mode::deserialize(d)? {
        Mode::Bits(b) => Ok(b),
        Mode::Text(t) => u32::from_str_radix(t.trim_start_matches("0o"), 8).map_err(|_| {
            serde::de::Error::custom(format!("{t:?} is not an octal mode such as 0o660"))
        }),
    }
}

#[cfg(test)]
mod tests;
