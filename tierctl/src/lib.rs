//! `tierctl`: the admin CLI of the kvtier daemon `tierd`. It speaks the wire protocol
//! (docs/protocol.md) through the blocking client of `kvtier-protocol`.
//!
//! # Layout
//! - [`Cli`] / [`Command`]: the clap command line.
//! - [`run`]: connect, perform one command, print a human table or `--json`.
//! - [`report`]: what each command prints; its serde structs are the `--json` schema.
//! - [`human`]: byte sizes, durations and aligned tables.
//! - [`error`]: [`CtlError`] and the exit codes ([`exit`]).

pub mod error;
pub mod human;
pub mod report;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::{Parser, Subcommand};
use kvtier_protocol::client::{default_socket_path, Client};
use serde::Serialize;

pub use error::{exit, CtlError};

const EXIT_CODES_HELP: &str = "\
Exit codes:
  0  success
  1  other failure (unexpected reply, output error)
  2  usage error
  3  tierd is not running at the socket (missing socket or connection refused)
  4  permission denied (by the socket, or by the daemon for this operation)
  5  session not found
  6  any other error reply from the daemon (its code name and message are printed)
  7  communication failure (I/O, protocol error, timeout)";

/// Administer a running kvtier daemon (tierd).
#[derive(Debug, Parser)]
#[command(name = "tierctl", version, after_help = EXIT_CODES_HELP)]
pub struct Cli {
    /// Daemon socket [default: $KVTIER_SOCKET, else $XDG_RUNTIME_DIR/kvtier/tierd.sock,
    /// else /run/kvtier/tierd.sock as root, else /tmp/kvtier-<uid>/tierd.sock]
    #[arg(long, global = true, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// Machine-readable JSON on stdout (stable field names) instead of tables.
    #[arg(long, global = true)]
    pub json: bool,
    /// Give up on the daemon after this long (e.g. 5s, 250ms, 2m).
    #[arg(long, global = true, value_name = "DURATION", default_value = "5s",
          value_parser = human::parse_duration)]
    pub timeout: Duration,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Daemon reachability, version, uptime, sessions, host tier use and counters, and the
    /// request rates over `--interval` (two STATS that far apart; 0: one STATS, no rates).
    Status {
        /// How long to sample the rates over (e.g. 500ms, 2s; 0 answers at once, without rates).
        #[arg(long, value_name = "DURATION", default_value = "500ms",
              value_parser = human::parse_interval)]
        interval: Duration,
    },
    /// Table of sessions (all of them for an admin, else your own).
    Sessions,
    /// One session: `tierctl session <ID>` (or `session info <ID>`) shows its geometry,
    /// policy, length and storage.
    #[command(args_conflicts_with_subcommands = true, arg_required_else_help = true)]
    Session {
        /// Session id (the same as `session info <ID>`).
        id: Option<u64>,
        #[command(subcommand)]
        command: Option<SessionCommand>,
    },
    /// Close one of your sessions and free its storage.
    Close {
        /// Session id.
        id: u64,
    },
    /// Admin: drop any session regardless of owner.
    Evict {
        /// Session id.
        id: u64,
    },
    /// Write one of your sessions to the NVMe tier and free its host RAM.
    Demote {
        /// Session id.
        id: u64,
    },
    /// Read one of your sessions' NVMe blocks back into host RAM.
    Promote {
        /// Session id.
        id: u64,
    },
    /// Keep one of your sessions in host RAM (never demoted).
    Pin {
        /// Session id.
        id: u64,
    },
    /// Undo `pin`.
    Unpin {
        /// Session id.
        id: u64,
    },
    /// Every STATS key the daemon reports.
    Stats,
    /// Storage tier usage, as reported by the daemon.
    Tier,
}

#[derive(Debug, Subcommand)]
pub enum SessionCommand {
    /// Geometry, policy, length and storage of one session.
    Info {
        /// Session id.
        id: u64,
    },
    /// Move one of your sessions to the remote tier (tierd's `[remote]`): written to the
    /// cluster, then dropped from this node; any node resumes it when asked for it.
    Offload {
        /// Session id.
        id: u64,
    },
}

impl Cli {
    /// The socket this invocation talks to.
    pub fn socket_path(&self) -> PathBuf {
        self.socket.clone().unwrap_or_else(default_socket_path)
    }
}

fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Connect and handshake with the read/write timeout already in place, so a daemon that
/// accepts but never answers cannot hang the CLI.
fn connect(path: &Path, timeout: Duration) -> Result<Client, CtlError> {
    let stream = UnixStream::connect(path).map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused => {
            CtlError::NotRunning {
                path: path.to_owned(),
            }
        }
        std::io::ErrorKind::PermissionDenied => CtlError::SocketPermission {
            path: path.to_owned(),
            source,
        },
        _ => CtlError::Connect {
            path: path.to_owned(),
            source,
        },
    })?;
    let conn = |source: std::io::Error| CtlError::Connect {
        path: path.to_owned(),
        source,
    };
    stream.set_read_timeout(Some(timeout)).map_err(conn)?;
    stream.set_write_timeout(Some(timeout)).map_err(conn)?;
    Client::handshake(stream, "tierctl")
        .map_err(|e| CtlError::from_client(e, path, timeout, "HELLO", None))
}

/// Run one command, writing its result to `out`.
pub fn run(cli: &Cli, out: &mut dyn Write) -> Result<(), CtlError> {
    let path = cli.socket_path();
    let mut client = connect(&path, cli.timeout)?;
    let (p, t) = (path.as_path(), cli.timeout);
    let fail = |op, session| move |e| CtlError::from_client(e, p, t, op, session);
    match &cli.command {
        Command::Status { interval } => {
            // Two samples `interval` apart give current rates, not lifetime averages.
            let earlier = if interval.is_zero() {
                None
            } else {
                let s = client.stats().map_err(fail("STATS", None))?;
                std::thread::sleep(*interval);
                Some(s)
            };
            let stats = client.stats().map_err(fail("STATS", None))?;
            let status = report::Status::new(
                path.display().to_string(),
                client.server(),
                &stats,
                earlier.as_ref(),
            );
            emit(cli, out, &status, || status.render())
        }
        Command::Sessions => {
            let list = client
                .list_sessions()
                .map_err(fail("LIST_SESSIONS", None))?;
            let mut sessions: Vec<report::Session> = list.iter().map(Into::into).collect();
            sessions.sort_by_key(|s| s.session);
            let r = report::Sessions { sessions };
            emit(cli, out, &r, || r.render(now_unix_ms()))
        }
        Command::Session { id, command } => {
            if let Some(SessionCommand::Offload { id }) = command {
                let blocks = client.offload(*id).map_err(fail("OFFLOAD", Some(*id)))?;
                let r = report::TierMove {
                    session: *id,
                    action: "offloaded",
                    blocks,
                };
                return emit(cli, out, &r, || {
                    format!("offloaded session {id}: {blocks} blocks written to the remote tier\n")
                });
            }
            // clap asks for one or the other (arg_required_else_help).
            let id = id
                .as_ref()
                .or(match command {
                    Some(SessionCommand::Info { id }) => Some(id),
                    _ => None,
                })
                .ok_or_else(|| {
                    std::io::Error::new(
                        std::io::ErrorKind::InvalidInput,
                        "give a session id: tierctl session <ID>",
                    )
                })?;
            let info = client
                .session_info(*id)
                .map_err(fail("SESSION_INFO", Some(*id)))?;
            let s = report::Session::from(&info);
            emit(cli, out, &s, || s.render(now_unix_ms()))
        }
        Command::Close { id } => {
            client
                .close(*id)
                .map_err(fail("CLOSE_SESSION", Some(*id)))?;
            let r = report::Dropped {
                session: *id,
                action: "closed",
            };
            emit(cli, out, &r, || format!("closed session {id}\n"))
        }
        Command::Evict { id } => {
            client.evict(*id).map_err(fail("EVICT", Some(*id)))?;
            let r = report::Dropped {
                session: *id,
                action: "evicted",
            };
            emit(cli, out, &r, || format!("evicted session {id}\n"))
        }
        Command::Demote { id } | Command::Promote { id } => {
            let demote = matches!(cli.command, Command::Demote { .. });
            let (op, action, moved) = if demote {
                ("DEMOTE", "demoted", "moved to NVMe")
            } else {
                ("PROMOTE", "promoted", "read into host RAM")
            };
            let blocks = if demote {
                client.demote(*id)
            } else {
                client.promote(*id)
            }
            .map_err(fail(op, Some(*id)))?;
            let r = report::TierMove {
                session: *id,
                action,
                blocks,
            };
            emit(cli, out, &r, || {
                format!("{action} session {id}: {blocks} blocks {moved}\n")
            })
        }
        Command::Pin { id } | Command::Unpin { id } => {
            let pin = matches!(cli.command, Command::Pin { .. });
            let op = if pin { "PIN" } else { "UNPIN" };
            client.pin(*id, pin).map_err(fail(op, Some(*id)))?;
            let r = report::Pinned {
                session: *id,
                pinned: pin,
            };
            emit(cli, out, &r, || {
                format!("{} session {id}\n", if pin { "pinned" } else { "unpinned" })
            })
        }
        Command::Stats => {
            let stats = client.stats().map_err(fail("STATS", None))?;
            let r = report::Stats::from_stats(&stats);
            emit(cli, out, &r, || r.render())
        }
        Command::Tier => {
            let stats = client.stats().map_err(fail("STATS", None))?;
            let r = report::Tiers::from_stats(&stats);
            emit(cli, out, &r, || r.render())
        }
    }
}

fn emit<T: Serialize>(
    cli: &Cli,
    out: &mut dyn Write,
    value: &T,
    human: impl FnOnce() -> String,
) -> Result<(), CtlError> {
    if cli.json {
        serde_json::to_writer_pretty(&mut *out, value)?;
        writeln!(out)?;
    } else {
        out.write_all(human().as_bytes())?;
    }
    Ok(())
}

/// The `--json` error object printed on stdout when a command fails.
#[derive(Debug, Serialize)]
pub struct JsonError {
    pub error: JsonErrorBody,
}

#[derive(Debug, Serialize)]
pub struct JsonErrorBody {
    /// `not_running`, `permission_denied`, `timeout`, ... or the server's code name.
    pub kind: &'static str,
    pub exit_code: i32,
    pub message: String,
}

impl From<&CtlError> for JsonError {
    fn from(e: &CtlError) -> Self {
        Self {
            error: JsonErrorBody {
                kind: e.kind(),
                exit_code: e.exit_code(),
                message: e.to_string(),
            },
        }
    }
}
