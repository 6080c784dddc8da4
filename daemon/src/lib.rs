//! tierd: the kvtier daemon. Keeps sessions' full KV caches in the host tier and serves sparse
//! decode attention over a Unix socket (protocol: docs/protocol.md).
//!
//! # Layout
//!
//! - [`config`]: TOML config with defaults, env and CLI layering, and validation.
//! - [`engine`]: sessions, ownership, admission, and every operation's semantics.
//! - [`server`]: the socket (safe bind, framing with SCM_RIGHTS, admission slots, shutdown).
//! - [`error`]: request failures as typed wire errors.
//! - [`notify`]: the systemd notification protocol (READY=1, WATCHDOG=1, STATUS=, STOPPING=1).
//! - [`metrics`]: every Prometheus metric name, the recording handles, the scrape endpoint.
//! - [`preflight`]: startup checks that fail fast naming the fix (memlock limit, permissions).
//! - `main.rs`: a thin binary: parse flags, load config, build the arena, serve until SIGTERM.
//!
//! The request path: a connection task reads one frame exactly (header, then body), decodes it
//! with `kvtier-protocol` (KV payloads stay borrowed from the body buffer), and runs it. APPEND_KV
//! and DECODE take an admission slot and run on the blocking pool, where `kvtier-kernels` splits
//! selection and attention over the compute pool (rayon).

pub mod config;
pub mod engine;
pub mod error;
pub mod metrics;
pub mod notify;
pub mod preflight;
pub mod server;

pub use config::Config;
pub use engine::{Engine, EngineLimits, Peer};
pub use server::{bind, run, ServerSettings};

use std::time::Duration;

use kvtier_storage::{ArenaOptions, HostArena};

/// Builds the host arena and engine a config describes.
pub fn build_engine(cfg: &Config) -> Result<Engine, kvtier_storage::StorageError> {
    let mut opts = ArenaOptions::new(
        cfg.host.capacity.0 as usize,
        cfg.host.frame_bytes.0 as usize,
    );
    opts.huge_pages = cfg.host.huge_pages;
    opts.lock = cfg.host.lock_memory;
    let arena = HostArena::new(&opts)?;
    let metrics = if cfg.metrics.listen.is_some() {
        metrics::Metrics::prometheus()
    } else {
        metrics::Metrics::disabled()
    };
    Ok(Engine::new(
        arena,
        EngineLimits {
            max_sessions: cfg.admission.max_sessions,
            admin_uids: cfg.auth.admin_uids.clone(),
            admin_gids: cfg.auth.admin_gids.clone(),
        },
    )
    .with_metrics(metrics))
}

/// The socket settings a config describes.
pub fn server_settings(cfg: &Config) -> ServerSettings {
    ServerSettings {
        max_frame_bytes: cfg.server.max_frame_bytes.0 as u32,
        max_connections: cfg.server.max_connections,
        max_concurrent_requests: cfg.admission.max_concurrent_requests,
        max_queued_requests: cfg.admission.max_queued_requests,
        shutdown_grace: Duration::from_millis(cfg.server.shutdown_grace_ms),
        socket_path: Some(cfg.server.socket_path.clone()),
        notifier: None,
        watchdog: None,
    }
}
