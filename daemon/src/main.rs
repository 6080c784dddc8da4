//! `tierd`: parse flags, load and validate the config, build the host tier, serve until
//! SIGTERM or SIGINT.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::os::fd::AsFd;

use clap::Parser;
use tierd::config::{BackendKind, ByteSize, Config, LogFormat};
use tierd::notify::{self, Notifier};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

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

/// Installs the log subscriber; true when logs are plain text on a terminal (where a fatal
/// error is printed as `tierd: ...` rather than logged as well).
fn init_logging(cfg: &Config) -> bool {
    let level: tracing::Level = cfg.log.level.parse().unwrap_or(tracing::Level::INFO);
    let builder = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .with_target(false);
    let format = match cfg.log.format {
        LogFormat::Auto if stderr_is_journal() => LogFormat::Journald,
        LogFormat::Auto => LogFormat::Text,
        f => f,
    };
    let terminal = std::io::IsTerminal::is_terminal(&std::io::stderr());
    match format {
        LogFormat::Json => builder.json().flatten_event(true).init(),
        LogFormat::Journald => builder.with_ansi(false).event_format(JournaldFormat).init(),
        LogFormat::Text | LogFormat::Auto => builder.with_ansi(terminal).init(),
    }
    terminal && matches!(format, LogFormat::Text | LogFormat::Auto)
}

/// systemd sets `JOURNAL_STREAM=<dev>:<inode>` of the stream it connects stdout/stderr to;
/// stderr is the journal when its device and inode match (sd_journal_stream_fd(3)).
fn stderr_is_journal() -> bool {
    use std::os::unix::fs::MetadataExt;
    let Some(v) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Some((dev, ino)) = v.to_str().and_then(|s| s.split_once(':')) else {
        return false;
    };
    let Ok(fd) = std::io::stderr().as_fd().try_clone_to_owned() else {
        return false;
    };
    std::fs::File::from(fd)
        .metadata()
        .is_ok_and(|m| dev.parse() == Ok(m.dev()) && ino.parse() == Ok(m.ino()))
}

/// One line per event, prefixed with its syslog priority (`<3>` error, `<4>` warn, `<6>` info,
/// `<7>` debug and trace), which journald strips and files as the entry's PRIORITY. No
/// timestamp or colour: the journal adds its own. Fields follow the message as `key=value`.
struct JournaldFormat;

impl<S, N> FormatEvent<S, N> for JournaldFormat
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        let priority = match *event.metadata().level() {
            tracing::Level::ERROR => 3,
            tracing::Level::WARN => 4,
            tracing::Level::INFO => 6,
            _ => 7,
        };
        write!(writer, "<{priority}>")?;
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
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
    let terminal = init_logging(&cfg);
    match serve(cfg) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Once: plainly on a terminal, else as a log event (the journal, JSON).
            if terminal {
                eprintln!("tierd: {e}");
            } else {
                tracing::error!("{e}");
            }
            ExitCode::FAILURE
        }
    }
}

/// Reports the locking of the host tier (`host.lock_memory`): ~4.5 GiB/s on 16 cores, so
/// minutes for a large tier. Every few seconds a STATUS= line, a log line, and EXTEND_TIMEOUT_USEC, which keeps the
/// service manager from killing a start that is making progress past TimeoutStartSec.
fn lock_progress(notifier: Option<Arc<Notifier>>) -> impl Fn(usize, usize) + Sync {
    const EVERY: Duration = Duration::from_secs(5);
    let t0 = Instant::now();
    let last = parking_lot::Mutex::new(None::<Instant>);
    move |locked: usize, total: usize| {
        let now = Instant::now();
        {
            let mut last = last.lock();
            if last.is_some_and(|t| now - t < EVERY) && locked < total {
                return;
            }
            *last = Some(now);
        }
        let (done, of) = (ByteSize(locked as u64), ByteSize(total as u64));
        let pct = locked * 100 / total.max(1);
        tracing::info!(
            locked = %done,
            total = %of,
            seconds = format_args!("{:.1}", t0.elapsed().as_secs_f64()),
            "locking the host tier in RAM"
        );
        notify::send(
            notifier.as_deref(),
            &format!(
                "STATUS=locking the host tier in RAM: {done} of {of} ({pct}%)\n\
                 EXTEND_TIMEOUT_USEC={}",
                (6 * EVERY).as_micros()
            ),
        );
    }
}

/// The remote tier's background work of `service` every `every`, until the service is
/// dropped: claims renewed on a thread of their own, on a fixed schedule (a slow round does
/// not push the next one back), and periodic writes on another, so that writing sessions
/// to the cluster never holds renewals up past the claims' time.
fn remote_tick_every(
    service: std::sync::Weak<tierd::Service>,
    every: Duration,
) -> Result<(), String> {
    let flusher = service.clone();
    std::thread::Builder::new()
        .name("tierd-remote".into())
        .spawn(move || {
            let mut next = Instant::now() + every;
            loop {
                std::thread::sleep(next.saturating_duration_since(Instant::now()));
                match service.upgrade() {
                    Some(s) => s.renew_claims(),
                    None => break,
                };
                next = (next + every).max(Instant::now());
            }
        })
        .map_err(|e| format!("starting the remote tier's thread: {e}"))?;
    std::thread::Builder::new()
        .name("tierd-flush".into())
        .spawn(move || loop {
            std::thread::sleep(every);
            match flusher.upgrade() {
                Some(s) => s.flush_if_due(),
                None => break,
            }
        })
        .map(|_| ())
        .map_err(|e| format!("starting the remote tier's flush thread: {e}"))
}

/// Streams resumed sessions' blocks in from the cluster ([`tierd::Service::stream_arrivals`]),
/// on a thread of its own, until the service is dropped; idle, it looks again every 50 ms.
fn stream_arrivals(service: std::sync::Weak<tierd::Service>) -> Result<(), String> {
    std::thread::Builder::new()
        .name("tierd-arrivals".into())
        .spawn(move || loop {
            let moved = match service.upgrade() {
                Some(s) => s.stream_arrivals(),
                None => break,
            };
            if moved == 0 {
                std::thread::sleep(Duration::from_millis(50));
            }
        })
        .map(|_| ())
        .map_err(|e| format!("starting the remote tier's streaming thread: {e}"))
}

fn serve(cfg: Config) -> Result<(), String> {
    tierd::preflight::check(&cfg).map_err(|e| e.to_string())?;
    let notifier = Notifier::from_env()
        .unwrap_or_else(|e| {
            tracing::warn!("{e}; not reporting to the service manager");
            None
        })
        .map(Arc::new);
    let watchdog = match notify::watchdog_from_env() {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!("{e}; watchdog keep-alives disabled");
            None
        }
    };
    if let Some(every) = watchdog {
        tracing::info!(
            interval_ms = every.as_millis() as u64,
            "systemd watchdog enabled"
        );
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("tierd-io")
        .build()
        .map_err(|e| format!("starting the runtime: {e}"))?;
    // Handlers go in before the socket exists: a SIGTERM right after READY=1 must drain, not
    // kill with the default action.
    let shutdown = {
        let _rt = runtime.enter();
        shutdown_signal().map_err(|e| format!("installing signal handlers: {e}"))?
    };
    notify::send(notifier.as_deref(), "STATUS=building the host tier");
    if cfg.backend.threads > 0 {
        rayon_pool(cfg.backend.threads)?;
    }
    let std_listener = tierd::bind(
        &cfg.server.socket_path,
        cfg.server.socket_mode,
        cfg.server.socket_group.as_deref(),
    )
    .map_err(|e| e.to_string())?;
    // Bound before the service is built, so a second daemon on this socket fails before it
    // touches the NVMe tier; connections wait in the backlog until a warm restart is done.
    // A start that fails from here on removes the socket it bound.
    let bound = BoundSocket::new(&cfg.server.socket_path);
    let progress = lock_progress(notifier.clone());
    let arena = tierd::build_arena(&cfg, &progress).map_err(|e| match e {
        kvtier_storage::StorageError::Lock { .. } => format!(
            "host tier: {e}: raise LimitMEMLOCK (systemd) or ulimit -l, or set host.lock_memory = false"
        ),
        kvtier_storage::StorageError::Map { .. } => format!(
            "host tier: {e}: host.capacity is {}; lower it (--host-capacity, or host.capacity in the config file)",
            cfg.host.capacity
        ),
        e => format!("host tier: {e}"),
    })?;
    let gpu = gpu_decoder(&cfg, &arena)?;
    let service = Arc::new(tierd::build_service(&cfg, arena, gpu)?);
    bound.keep();
    if cfg.remote.enabled {
        remote_tick_every(
            Arc::downgrade(&service),
            Duration::from_millis(cfg.remote.claim_ttl_ms / 3),
        )?;
        stream_arrivals(Arc::downgrade(&service))?;
    }
    let usage = service.arena().usage();
    tracing::info!(
        capacity = %tierd::config::ByteSize(usage.bytes_total as u64),
        max_run = %cfg.host.max_run_bytes,
        "host tier ready"
    );
    let mut settings = tierd::server_settings(&cfg);
    settings.notifier = notifier;
    settings.watchdog = watchdog;
    runtime.block_on(async move {
        let listener = tokio::net::UnixListener::from_std(std_listener)
            .map_err(|e| format!("registering the socket: {e}"))?;
        if let Some(addr) = cfg.metrics.listen {
            let metrics = tierd::endpoint::bind(addr)
                .await
                .map_err(|e| e.to_string())?;
            let addr = metrics.local_addr().map_or(addr, |a| a);
            tracing::info!(%addr, "metrics endpoint at http://{addr}/metrics");
            // Scrapes keep working while connections drain; the runtime's end stops it.
            tokio::spawn(tierd::endpoint::serve(
                metrics,
                service.clone(),
                std::future::pending(),
            ));
        }
        tracing::info!(socket = %cfg.server.socket_path.display(), "tierd ready");
        tierd::run(listener, service.clone(), settings, shutdown)
            .await
            .map_err(|e| format!("server: {e}"))?;
        // With the remote tier, unpinned sessions go there and their claims are given up, so
        // another node can take them at once (no-op without the remote tier).
        let (offloaded, not_offloaded) = service.offload_all();
        if offloaded + not_offloaded > 0 {
            tracing::info!(offloaded, failed = not_offloaded, "sessions written to the remote tier");
        }
        // Every other session goes to NVMe so a restart finds it (no-op without the NVMe tier).
        let (ok, failed) = service.persist_all();
        if ok + failed > 0 {
            tracing::info!(persisted = ok, failed, "sessions written to the NVMe tier");
        }
        if failed > 0 {
            // The exit status says so: a service manager (or an operator's script) must not
            // take a shutdown that lost sessions for a clean one.
            return Err(format!(
                "shutdown could not write {failed} of {} session(s) to the NVMe tier: what they held beyond their last durable write is lost",
                ok + failed
            ));
        }
        Ok::<(), String>(())
    })?;
    tracing::info!("tierd stopped");
    Ok(())
}

/// The socket file a start bound, removed if the start fails before serving (a failed start
/// must not leave a socket behind that clients would try). Only the file this process bound:
/// matched by device and inode.
struct BoundSocket {
    path: std::path::PathBuf,
    id: Option<(u64, u64)>,
}

impl BoundSocket {
    fn new(path: &std::path::Path) -> Self {
        use std::os::unix::fs::MetadataExt;
        let id = std::fs::symlink_metadata(path)
            .ok()
            .map(|m| (m.dev(), m.ino()));
        BoundSocket {
            path: path.to_path_buf(),
            id,
        }
    }

    /// The start succeeded: the server owns the socket from here.
    fn keep(mut self) {
        self.id = None;
    }
}

impl Drop for BoundSocket {
    fn drop(&mut self) {
        use std::os::unix::fs::MetadataExt;
        let Some(id) = self.id else { return };
        let ours = std::fs::symlink_metadata(&self.path).is_ok_and(|m| (m.dev(), m.ino()) == id);
        if ours {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Resolves `backend.kind`: auto takes CUDA when a device is present (else the CPU, logged);
/// cuda without a usable device is an error (the daemon exits 1).
fn gpu_decoder(
    cfg: &Config,
    arena: &kvtier_storage::HostArena,
) -> Result<Option<tierd::GpuDecoder>, String> {
    let settings = &cfg.backend.cuda;
    match cfg.backend.kind {
        BackendKind::Cpu => {
            tracing::info!("backend: cpu (configured)");
            Ok(None)
        }
        BackendKind::Auto if !tierd::gpu::device_available() => {
            tracing::info!("backend: cpu (auto: no CUDA driver or device found)");
            Ok(None)
        }
        BackendKind::Auto => match tierd::GpuDecoder::new(arena, settings) {
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
            if !tierd::gpu::device_available() {
                return Err(format!(
                    "backend.kind = \"cuda\" but no CUDA driver or device was found{}; use \"cpu\" or \"auto\"",
                    if cfg!(feature = "cuda") { "" } else { " (tierd was built without the cuda feature)" }
                ));
            }
            let g = tierd::GpuDecoder::new(arena, settings)
                .map_err(|e| format!("backend.kind = \"cuda\": {e}"))?;
            tracing::info!(device = g.device_name(), "backend: cuda");
            Ok(Some(g))
        }
    }
}

fn rayon_pool(threads: usize) -> Result<(), String> {
    kvtier_kernels::set_compute_threads(threads).map_err(|e| format!("compute pool: {e}"))
}

/// Installs the SIGTERM and SIGINT handlers now; the future resolves on the first of them.
fn shutdown_signal() -> std::io::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received"),
            _ = int.recv() => tracing::info!("SIGINT received"),
        }
    })
}
