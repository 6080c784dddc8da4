//! `tierd`: parse flags, load and validate the config, build the host tier, serve until
//! SIGTERM or SIGINT.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use tierd::config::{BackendKind, Config, LogFormat};

/// kvtier daemon: sparse decode attention over tiered KV caches, on a Unix socket.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// TOML config file (see configs/tierd.toml); embedded defaults when omitted.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// Socket path (server.socket_path).
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Host-RAM tier size, e.g. 8GiB (host.capacity).
    #[arg(long)]
    host_capacity: Option<String>,
    /// auto, cpu or cuda (backend.kind).
    #[arg(long)]
    backend: Option<String>,
    /// error, warn, info, debug or trace (log.level).
    #[arg(long)]
    log_level: Option<String>,
    /// Any setting as section.field=value (repeatable), e.g. --set admission.max_sessions=64.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Print the effective configuration as TOML and exit.
    #[arg(long)]
    print_config: bool,
}

fn overrides(args: &Args) -> Result<Vec<(String, String)>, String> {
    let quote = |s: &str| format!("{s:?}");
    let mut v = Vec::new();
    if let Some(p) = &args.socket {
        v.push(("server.socket_path".into(), quote(&p.to_string_lossy())));
    }
    if let Some(c) = &args.host_capacity {
        v.push(("host.capacity".into(), quote(c)));
    }
    if let Some(b) = &args.backend {
        v.push(("backend.kind".into(), quote(b)));
    }
    if let Some(l) = &args.log_level {
        v.push(("log.level".into(), quote(l)));
    }
    for kv in &args.set {
        let (k, val) = kv
            .split_once('=')
            .ok_or_else(|| format!("--set {kv:?}: expected section.field=value"))?;
        v.push((k.trim().into(), val.trim().into()));
    }
    Ok(v)
}

fn init_logging(cfg: &Config) {
    let level: tracing::Level = cfg.log.level.parse().unwrap_or(tracing::Level::INFO);
    let builder = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .with_target(false);
    match cfg.log.format {
        LogFormat::Json => builder.json().flatten_event(true).init(),
        // journald timestamps lines itself; colour only on a terminal.
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let cfg = match overrides(&args).map_err(|e| e.to_string()).and_then(|o| {
        Config::load(args.config.as_deref(), std::env::vars(), &o).map_err(|e| e.to_string())
    }) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("tierd: {e}");
            return ExitCode::from(2);
        }
    };
    if args.print_config {
        print!("{}", toml::to_string(&cfg).expect("config serializes"));
        return ExitCode::SUCCESS;
    }
    init_logging(&cfg);
    match serve(cfg) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            eprintln!("tierd: {e}");
            ExitCode::FAILURE
        }
    }
}

fn serve(cfg: Config) -> Result<(), String> {
    if cfg.backend.threads > 0 {
        rayon_pool(cfg.backend.threads)?;
    }
    let std_listener = tierd::bind(
        &cfg.server.socket_path,
        cfg.server.socket_mode,
        cfg.server.socket_group.as_deref(),
    )
    .map_err(|e| e.to_string())?;
    // Bound before the engine is built, so a second daemon on this socket fails before it
    // touches the NVMe tier; connections wait in the backlog until a warm restart is done.
    let arena = tierd::build_arena(&cfg).map_err(|e| format!("host tier: {e}"))?;
    let gpu = gpu_decoder(&cfg, &arena)?;
    let engine = Arc::new(tierd::build_engine(&cfg, arena, gpu)?);
    let usage = engine.arena().usage();
    tracing::info!(
        capacity = %tierd::config::ByteSize(usage.bytes_total() as u64),
        frame = %cfg.host.frame_bytes,
        frames = usage.frames_total,
        "host tier ready"
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("tierd-io")
        .build()
        .map_err(|e| format!("starting the runtime: {e}"))?;
    let settings = tierd::server_settings(&cfg);
    runtime.block_on(async move {
        let listener = tokio::net::UnixListener::from_std(std_listener)
            .map_err(|e| format!("registering the socket: {e}"))?;
        tracing::info!(socket = %cfg.server.socket_path.display(), "tierd ready");
        tierd::run(listener, engine.clone(), settings, shutdown_signal())
            .await
            .map_err(|e| format!("server: {e}"))?;
        // Every session goes to NVMe so a restart finds it (no-op without the NVMe tier).
        let (ok, failed) = engine.persist_all();
        if ok + failed > 0 {
            tracing::info!(persisted = ok, failed, "sessions written to the NVMe tier");
        }
        Ok::<(), String>(())
    })?;
    tracing::info!("tierd stopped");
    Ok(())
}

/// Resolves `backend.kind`: auto takes CUDA when a device is present (else the CPU, logged);
/// cuda without a usable device is an error (the daemon exits 1).
fn gpu_decoder(
    cfg: &Config,
    arena: &kvtier_storage::HostArena,
) -> Result<Option<tierd::GpuDecoder>, String> {
    let settings = cfg.backend.cuda.settings();
    match cfg.backend.kind {
        BackendKind::Cpu => {
            tracing::info!("backend: cpu (configured)");
            Ok(None)
        }
        BackendKind::Auto if !kvtier_kernels::cuda::device_available() => {
            tracing::info!("backend: cpu (auto: no CUDA driver or device found)");
            Ok(None)
        }
        BackendKind::Auto => match tierd::GpuDecoder::new(arena, &settings) {
            Ok(g) => {
                tracing::info!(device = g.device_name(), "backend: cuda (auto)");
                Ok(Some(g))
            }
            Err(e) => {
                tracing::warn!(error = %e, "backend: cpu (auto: CUDA device present but unusable)");
                Ok(None)
            }
        },
        BackendKind::Cuda => {
            if !kvtier_kernels::cuda::device_available() {
                return Err(
                    "backend.kind = \"cuda\" but no CUDA driver or device was found; use \"cpu\" or \"auto\"".into(),
                );
            }
            let g = tierd::GpuDecoder::new(arena, &settings)
                .map_err(|e| format!("backend.kind = \"cuda\": {e}"))?;
            tracing::info!(device = g.device_name(), "backend: cuda");
            Ok(Some(g))
        }
    }
}

fn rayon_pool(threads: usize) -> Result<(), String> {
    kvtier_kernels::set_compute_threads(threads).map_err(|e| format!("compute pool: {e}"))
}

/// Resolves on the first SIGTERM or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        _ = int.recv() => tracing::info!("SIGINT received"),
    }
}
