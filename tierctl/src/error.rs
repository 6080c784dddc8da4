//! The CLI's error type and its exit codes.

use std::path::PathBuf;
use std::time::Duration;

use kvtier_protocol::client::ClientError;
use kvtier_protocol::ErrorCode;

/// Exit codes, one per kind of failure, so scripts can tell them apart. 2 is clap's usage
/// error.
pub mod exit {
    pub const OK: i32 = 0;
    /// Anything not covered below (an unexpected reply, output that cannot be written).
    pub const OTHER: i32 = 1;
    pub const USAGE: i32 = 2;
    /// No daemon at the socket: the path does not exist or nothing listens on it.
    pub const NOT_RUNNING: i32 = 3;
    /// The socket refused us, or the daemon refused the operation.
    pub const PERMISSION_DENIED: i32 = 4;
    /// The session does not exist.
    pub const NOT_FOUND: i32 = 5;
    /// Any other error reply from the daemon.
    pub const SERVER_ERROR: i32 = 6;
    /// The conversation with the daemon failed: I/O error, protocol violation, timeout.
    pub const COMMUNICATION: i32 = 7;
}

/// Everything that makes a tierctl command fail.
#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    #[error(
        "tierd is not running at {} (start it with `tierd` or `systemctl start tierd`)",
        path.display()
    )]
    NotRunning { path: PathBuf },
    #[error(
        "permission denied connecting to {} (the socket's mode and directory decide who may connect): {source}",
        path.display()
    )]
    SocketPermission {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot connect to {}: {source}", path.display())]
    Connect {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("tierd at {} did not answer within {:?}", path.display(), timeout)]
    Timeout { path: PathBuf, timeout: Duration },
    /// The daemon answered with an error reply.
    #[error("{}", server_message(*code, message, *session, op))]
    Server {
        op: &'static str,
        session: Option<u64>,
        code: ErrorCode,
        message: String,
    },
    #[error("talking to tierd at {}: {source}", path.display())]
    Client { path: PathBuf, source: ClientError },
    #[error("writing output: {0}")]
    Output(#[from] std::io::Error),
    #[error("encoding JSON: {0}")]
    Json(#[from] serde_json::Error),
}

fn server_message(code: ErrorCode, message: &str, session: Option<u64>, op: &str) -> String {
    match (code, session) {
        (ErrorCode::NotFound, Some(id)) => format!("session {id} not found ({code}: {message})"),
        (ErrorCode::OwnedElsewhere, Some(id)) => {
            format!("session {id} is owned by node {message} ({code})")
        }
        (ErrorCode::PermissionDenied, _) if op == "EVICT" => {
            format!("permission denied: EVICT needs an admin peer ({code}: {message})")
        }
        (ErrorCode::PermissionDenied, Some(id)) => {
            format!("permission denied for session {id} ({code}: {message})")
        }
        _ => format!("{op} failed: {code}: {message}"),
    }
}

impl CtlError {
    /// The process exit code for this failure.
    pub fn exit_code(&self) -> i32 {
        match self {
            CtlError::NotRunning { .. } => exit::NOT_RUNNING,
            CtlError::SocketPermission { .. } => exit::PERMISSION_DENIED,
            CtlError::Connect { .. } | CtlError::Timeout { .. } | CtlError::Client { .. } => {
                exit::COMMUNICATION
            }
            CtlError::Server { code, .. } => match code {
                ErrorCode::NotFound => exit::NOT_FOUND,
                ErrorCode::PermissionDenied => exit::PERMISSION_DENIED,
                _ => exit::SERVER_ERROR,
            },
            CtlError::Output(_) | CtlError::Json(_) => exit::OTHER,
        }
    }

    /// Short stable name of the failure for `--json` error objects.
    pub fn kind(&self) -> &'static str {
        match self {
            CtlError::NotRunning { .. } => "not_running",
            CtlError::SocketPermission { .. } => "permission_denied",
            CtlError::Connect { .. } => "connect_failed",
            CtlError::Timeout { .. } => "timeout",
            CtlError::Server { code, .. } => code.name(),
            CtlError::Client { .. } => "communication",
            CtlError::Output(_) | CtlError::Json(_) => "output",
        }
    }

    /// Classify a failed client call. I/O timeouts surface as WouldBlock (SO_RCVTIMEO) or
    /// TimedOut depending on the call.
    pub fn from_client(
        e: ClientError,
        path: &std::path::Path,
        timeout: Duration,
        op: &'static str,
        session: Option<u64>,
    ) -> Self {
        match e {
            ClientError::Server { code, message } => CtlError::Server {
                op,
                session,
                code,
                message,
            },
            ClientError::Io(io)
                if matches!(
                    io.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                CtlError::Timeout {
                    path: path.to_owned(),
                    timeout,
                }
            }
            source => CtlError::Client {
                path: path.to_owned(),
                source,
            },
        }
    }
}
