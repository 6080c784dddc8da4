//! tierd: the kvtier daemon. Keeps sessions' full KV caches in the host tier and serves sparse
//! decode attention over a Unix socket (protocol: docs/protocol.md).
//!
//! # Layout
//!
//! - [`config`]: TOML config with defaults, env and CLI layering, and validation.
//! - [`service`]: sessions, ownership, admission, and every operation's semantics.
//! - [`server`]: the socket (safe bind, framing with SCM_RIGHTS, admission slots, shutdown).
//! - [`error`]: request failures as typed wire errors.
//! - [`prefetch`]: speculative promotion of blocks ranked just below the cut (NVMe tier).
//! - [`gpu`]: the CUDA decode path ([`GpuDecoder`]) over the registered host arena.
//! - [`notify`]: the systemd notification protocol (READY=1, WATCHDOG=1, STATUS=, STOPPING=1).
//! - [`metrics`]: every Prometheus metric name, the recording handles, the scrape-time snapshot.
//! - [`endpoint`]: the Prometheus scrape endpoint.
//! - [`preflight`]: startup checks that fail fast naming the fix (memlock limit, permissions).
//! - `main.rs`: a thin binary: parse flags, load config, build the arena, serve until SIGTERM.
//!
//! The request path: a connection task reads one frame exactly (header, then body), decodes it
//! with `kvtier-protocol` (KV payloads stay borrowed from the body buffer), and runs it. APPEND_KV
//! and DECODE take an admission slot and run in place off the event loop (`block_in_place`),
//! where `kvtier-kernels` splits selection and attention over the compute pool (rayon).

pub mod config;
pub mod endpoint;
pub mod error;
pub mod gpu;
pub mod metrics;
pub mod notify;
pub mod prefetch;
pub mod preflight;
pub mod server;
pub mod service;

pub use config::Config;
pub use gpu::{GpuDecoder, GpuError, GpuSettings};
pub use server::{bind, run, ServerSettings};
pub use service::{Peer, Service, ServiceLimits, TierSettings};

use std::sync::Arc;
use std::time::Duration;

use kvtier_storage::nvme::NvmeTier;
use kvtier_storage::{ArenaOptions, HostArena};

/// Builds the host arena a config describes; `progress(locked, total)` (bytes) while it is
/// locked in RAM (`host.lock_memory`), from the locking threads.
pub fn build_arena(
    cfg: &Config,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> Result<HostArena, kvtier_storage::StorageError> {
    let mut opts = ArenaOptions::new(
        cfg.host.capacity.0 as usize,
        cfg.host.max_run_bytes.0 as usize,
    );
    opts.huge_pages = cfg.host.huge_pages;
    opts.lock = cfg.host.lock_memory;
    opts.shared = cfg.host.shared;
    HostArena::with_progress(&opts, progress)
}

/// Opens the NVMe tier (recovering its manifest) and builds the service over `arena`; `gpu` is
/// the CUDA decode path over the same arena when the backend resolved to cuda. Sessions found
/// on NVMe are loaded back (warm restart).
pub fn build_service(
    cfg: &Config,
    arena: HostArena,
    gpu: Option<GpuDecoder>,
) -> Result<Service, String> {
    let tier =
        open_tier(cfg).map_err(|e| format!("NVMe tier at {}: {e}", cfg.nvme.dir.display()))?;
    let service = Service::with_tier(
        arena,
        ServiceLimits {
            max_sessions: cfg.admission.max_sessions,
            max_sessions_per_uid: cfg.quota.max_sessions_per_uid,
            host_share_per_uid: cfg.quota.host_share_per_uid,
            nvme_share_per_uid: cfg.quota.nvme_share_per_uid,
            max_reply_bytes: cfg.server.max_frame_bytes.0 as usize,
            coalesce: match cfg.backend.coalesce {
                config::Coalesce::Auto => gpu.is_some(),
                config::Coalesce::Always => true,
                config::Coalesce::Never => false,
            },
            admin_uids: cfg.auth.admin_uids.clone(),
            admin_gids: cfg.auth.admin_gids.clone(),
        },
        tier,
        gpu,
    )
    .with_metrics(if cfg.metrics.listen.is_some() {
        metrics::Metrics::prometheus()
    } else {
        metrics::Metrics::disabled()
    });
    let service = match open_remote(cfg)? {
        Some(remote) => service.with_remote(remote),
        None => service,
    };
    let t0 = std::time::Instant::now();
    let (loaded, problems) = service.recover();
    if loaded > 0 || !problems.is_empty() {
        tracing::info!(sessions = loaded, elapsed = ?t0.elapsed(), "restored sessions from the NVMe tier");
    }
    for p in problems {
        tracing::error!("{p} (left on NVMe, not served)");
    }
    let (dropped, unchecked) = service.defer_to_remote();
    if dropped + unchecked > 0 {
        tracing::info!(
            dropped,
            unchecked,
            "restored sessions the remote tier holds are the cluster's"
        );
    }
    Ok(service)
}

/// Opens the NVMe tier the `[nvme]` section describes (None when disabled): the page files,
/// the I/O driver, the manifest (recovered), with devices weighted by a startup bandwidth probe.
pub fn open_tier(cfg: &Config) -> Result<Option<(Arc<NvmeTier>, TierSettings)>, String> {
    use kvtier_storage::nvme::io::UringConfig;
    use kvtier_storage::nvme::{self, DeviceConfig, PageStore, PageStoreConfig};
    let n = &cfg.nvme;
    if !n.enabled {
        return Ok(None);
    }
    std::fs::create_dir_all(&n.dir).map_err(|e| format!("creating {}: {e}", n.dir.display()))?;
    lock_state_dir(&n.dir)?;
    let uring = UringConfig {
        queue_depth: n.queue_depth,
    };
    let driver: Arc<dyn nvme::IoDriver> = match n.driver {
        config::IoDriverKind::Auto => nvme::open_best_driver(uring),
        config::IoDriverKind::Uring => {
            Arc::new(nvme::UringDriver::new(uring).map_err(|e| e.to_string())?)
        }
        config::IoDriverKind::Pread => Arc::new(nvme::PreadDriver::new()),
    };
    let driver = with_test_faults(driver)?;
    let devices: Vec<(std::path::PathBuf, u64)> = if n.devices.is_empty() {
        vec![(n.dir.join("pages-0"), n.capacity.0)]
    } else {
        n.devices
            .iter()
            .map(|d| (d.path.clone(), d.capacity.0))
            .collect()
    };
    check_manifests(cfg, &devices)?;
    let mut configs = Vec::new();
    for (path, capacity) in &devices {
        if !path.exists() {
            // Said before the space is taken: on embedded defaults this is 4 GiB in the state
            // directory, which surprises a first run.
            tracing::info!(
                file = %path.display(),
                bytes = capacity,
                gib = *capacity as f64 / (1u64 << 30) as f64,
                "creating the NVMe tier's page file, preallocated (nvme.capacity sets its size, nvme.enabled=false turns the tier off)"
            );
        }
        // One device needs no weight; several are striped in proportion to measured bandwidth.
        let bandwidth = if devices.len() > 1 {
            // Probed over a written scratch file beside it: a fresh device file's unwritten
            // extents read back as zeros without I/O and would probe far too fast. (The page
            // store sizes the device file when it opens.)
            let link = nvme::link::probe_path(driver.as_ref(), path, Default::default())
                .map_err(|e| e.to_string())?;
            tracing::info!(device = %path.display(), gbps = link.bandwidth_bytes_per_s / 1e9, latency_us = link.latency_s * 1e6, "probed NVMe device");
            link.bandwidth_bytes_per_s
        } else {
            1.0
        };
        configs.push(DeviceConfig {
            path: path.clone(),
            capacity_bytes: *capacity,
            bandwidth_bytes_per_s: bandwidth,
        });
    }
    let store = PageStore::open(
        &PageStoreConfig {
            devices: configs,
            max_payload: cfg.host.max_run_bytes.0 as usize,
        },
        driver,
    )
    .map_err(|e| e.to_string())?;
    if n.workers > 0 {
        store.set_workers(n.workers).map_err(|e| e.to_string())?;
    }
    let (tier, report) = NvmeTier::open(store, &n.dir).map_err(|e| e.to_string())?;
    for skipped in &report.skipped_manifests {
        tracing::warn!(manifest = %skipped, "skipped a damaged manifest file");
    }
    tracing::info!(
        driver = tier.store().driver_name(),
        workers = tier.store().workers(),
        epoch = report.epoch,
        sessions = report.sessions,
        pages = report.pages,
        "NVMe tier ready"
    );
    Ok(Some((
        Arc::new(tier),
        TierSettings {
            write_through: n.write_through,
            high_water: n.high_water,
            low_water: n.low_water,
            prefetch_blocks: n.prefetch_blocks,
        },
    )))
}

/// The environment variable that turns on I/O fault injection, for the fault campaign
/// (daemon/tests/fault_campaign.rs) only: `<seed>,<write probability>[,<read probability>]`.
/// Each page write then fails with that probability, as EIO, ENOSPC or a torn (short) write,
/// and each page read as EIO or a short read. Only debug builds and release builds with the
/// `test-faults` feature have it ([`INJECTS_FAULTS`]); a release tierd ignores the variable.
pub const TEST_IO_FAULTS_ENV: &str = "KVTIER_TEST_IO_FAULTS";

/// Whether this build honours [`TEST_IO_FAULTS_ENV`].
pub const INJECTS_FAULTS: bool = cfg!(any(debug_assertions, feature = "test-faults"));

#[cfg(not(any(debug_assertions, feature = "test-faults")))]
fn with_test_faults(
    driver: Arc<dyn kvtier_storage::nvme::IoDriver>,
) -> Result<Arc<dyn kvtier_storage::nvme::IoDriver>, String> {
    if std::env::var_os(TEST_IO_FAULTS_ENV).is_some() {
        tracing::warn!("{TEST_IO_FAULTS_ENV} is ignored: this build has no fault injection");
    }
    Ok(driver)
}

#[cfg(any(debug_assertions, feature = "test-faults"))]
fn with_test_faults(
    driver: Arc<dyn kvtier_storage::nvme::IoDriver>,
) -> Result<Arc<dyn kvtier_storage::nvme::IoDriver>, String> {
    use kvtier_storage::nvme::io::{Fault, FaultRule, FaultyDriver, Trigger};
    use kvtier_storage::nvme::OpKind;
    let Ok(spec) = std::env::var(TEST_IO_FAULTS_ENV) else {
        return Ok(driver);
    };
    let bad = || format!("{TEST_IO_FAULTS_ENV}={spec:?}: expected <seed>,<write p>[,<read p>]");
    let mut parts = spec.split(',').map(str::trim);
    let seed: u64 = parts.next().and_then(|s| s.parse().ok()).ok_or_else(bad)?;
    let write: f64 = parts.next().and_then(|s| s.parse().ok()).ok_or_else(bad)?;
    let read: f64 = match parts.next() {
        Some(p) => p.parse().map_err(|_| bad())?,
        None => 0.0,
    };
    tracing::warn!(seed, write, read, "TEST ONLY: injecting page I/O faults");
    let rule = |kind, fault, p| FaultRule {
        kind: Some(kind),
        fault,
        trigger: Trigger::Probability(p),
    };
    let mut rules: Vec<FaultRule> = [Fault::Eio, Fault::Enospc, Fault::ShortTransfer]
        .map(|f| rule(OpKind::Write, f, write / 3.0))
        .to_vec();
    rules.extend([Fault::Eio, Fault::ShortTransfer].map(|f| rule(OpKind::Read, f, read / 2.0)));
    let faulty = FaultyDriver::new(driver, rules, seed).map_err(|e| e.to_string())?;
    Ok(Arc::new(faulty))
}

/// Before any page file is opened: when manifest files exist but none verifies, refuse to
/// start (`nvme.damaged_manifests = "refuse"`), or move them and the page files aside
/// (`"quarantine"`), so that starting empty never reuses the pages they describe.
fn check_manifests(cfg: &Config, devices: &[(std::path::PathBuf, u64)]) -> Result<(), String> {
    use kvtier_storage::nvme::{manifest, NvmeError};
    let dir = &cfg.nvme.dir;
    match manifest::ManifestStore::open(dir) {
        Err(NvmeError::DamagedManifests { .. })
            if cfg.nvme.damaged_manifests == config::DamagedManifests::Quarantine =>
        {
            let files: Vec<_> = devices.iter().map(|(p, _)| p.clone()).collect();
            let q = manifest::quarantine(dir, &files).map_err(|e| e.to_string())?;
            tracing::warn!(
                quarantine = %q.display(),
                "no manifest verifies: moved the manifests and page files aside, starting empty"
            );
            Ok(())
        }
        Err(e) => Err(e.to_string()),
        Ok(_) => Ok(()),
    }
}

/// Takes an exclusive lock on `dir/lock` for the life of the process: two daemons on the same
/// page files would overwrite each other's pages.
fn lock_state_dir(dir: &std::path::Path) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let path = dir.join("lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| format!("opening {}: {e}", path.display()))?;
    // SAFETY: flock only takes a descriptor we own.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Err(format!(
            "{} is in use by another tierd (nvme.dir must differ per daemon)",
            dir.display()
        ));
    }
    // The lock must outlive every use of the tier: keep the descriptor open until exit.
    std::mem::forget(file);
    Ok(())
}

/// A timeout in ms, 0 meaning none.
fn millis(ms: u64) -> Option<Duration> {
    (ms > 0).then(|| Duration::from_millis(ms))
}

/// Connects to the remote tier's cluster the `[remote]` section describes (None when
/// disabled). A cluster that cannot be reached fails the start, rather than a first OFFLOAD.
pub fn open_remote(cfg: &Config) -> Result<Option<service::Remote>, String> {
    let r = &cfg.remote;
    if !r.enabled {
        return Ok(None);
    }
    let ms = Duration::from_millis;
    let store = kvtier_remote::ClusterStore::connect(kvtier_remote::ClusterConfig {
        seeds: r.seeds.clone(),
        key_prefix: r.key_prefix.clone(),
        connect_timeout: ms(r.connect_timeout_ms),
        response_timeout: ms(r.response_timeout_ms),
        claim_ttl: ms(r.claim_ttl_ms),
        replicas: r.replicas,
        replica_timeout: ms(r.replica_timeout_ms),
        ..Default::default()
    })
    .map_err(|e| format!("remote tier at {}: {e}", r.seeds.join(", ")))?;
    let node = if r.node.is_empty() {
        host_name()
    } else {
        r.node.clone()
    };
    tracing::info!(node = %node, seeds = %r.seeds.join(", "), replicas = r.replicas, "remote tier connected");
    Ok(Some(service::Remote::new(
        Arc::new(store),
        node,
        r.write_through,
        (r.flush_interval_ms > 0).then(|| ms(r.flush_interval_ms)),
        r.resume_from_summaries,
        r.stream_resumed,
    )))
}

/// This host's name (`remote.node`'s default).
fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into `buf`.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    match (rc, std::str::from_utf8(&buf[..end])) {
        (0, Ok(name)) if !name.is_empty() => name.to_string(),
        _ => format!("tierd-{}", std::process::id()),
    }
}

/// The socket settings a config describes.
pub fn server_settings(cfg: &Config) -> ServerSettings {
    ServerSettings {
        max_frame_bytes: cfg.server.max_frame_bytes.0 as u32,
        max_connections: cfg.server.max_connections,
        max_connections_per_uid: cfg.server.max_connections_per_uid,
        admin_connections: cfg.server.admin_connections,
        max_concurrent_requests: cfg.admission.max_concurrent_requests,
        max_queued_requests: cfg.admission.max_queued_requests,
        shutdown_grace: Duration::from_millis(cfg.server.shutdown_grace_ms),
        handshake_timeout: millis(cfg.server.handshake_timeout_ms),
        idle_timeout: millis(cfg.server.idle_timeout_ms),
        socket_path: Some(cfg.server.socket_path.clone()),
        notifier: None,
        watchdog: None,
    }
}
