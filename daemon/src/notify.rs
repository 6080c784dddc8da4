//! The systemd notification protocol (sd_notify(3)), implemented directly: one datagram of
//! `KEY=VALUE` lines to the socket named by `$NOTIFY_SOCKET` (a path, or an abstract address
//! written with a leading `@`). tierd sends `READY=1` once the host tier, the NVMe index and
//! the socket are up, `WATCHDOG=1` from the event loop, `STATUS=` lines, and `STOPPING=1`.
//!
//! Outside systemd (`NOTIFY_SOCKET` unset) every call is a no-op.

use std::ffi::OsStr;
use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::Duration;

/// Why `$NOTIFY_SOCKET` could not be used.
#[derive(Debug, thiserror::Error)]
pub enum NotifyError {
    #[error("NOTIFY_SOCKET={value:?}: {reason}")]
    BadAddress { value: String, reason: &'static str },
    #[error("NOTIFY_SOCKET: {0}")]
    Io(#[from] io::Error),
}

/// A connection to the service manager's notification socket.
#[derive(Debug)]
pub struct Notifier {
    socket: UnixDatagram,
    addr: SocketAddr,
}

impl Notifier {
    /// The notifier `$NOTIFY_SOCKET` names, or `None` when it is unset or empty.
    pub fn from_env() -> Result<Option<Notifier>, NotifyError> {
        match std::env::var_os("NOTIFY_SOCKET") {
            Some(v) if !v.is_empty() => Notifier::new(&v).map(Some),
            _ => Ok(None),
        }
    }

    /// A notifier for `addr`: an absolute path, or `@name` for an abstract socket.
    pub fn new(addr: &OsStr) -> Result<Notifier, NotifyError> {
        let bytes = addr.as_bytes();
        let bad = |reason| NotifyError::BadAddress {
            value: addr.to_string_lossy().into_owned(),
            reason,
        };
        let addr = match bytes.first() {
            Some(b'@') => SocketAddr::from_abstract_name(&bytes[1..])
                .map_err(|_| bad("abstract name too long"))?,
            Some(b'/') => {
                SocketAddr::from_pathname(addr).map_err(|_| bad("path too long or contains NUL"))?
            }
            _ => return Err(bad("must be an absolute path or start with '@'")),
        };
        let socket = UnixDatagram::unbound()?;
        Ok(Notifier { socket, addr })
    }

    /// Sends `state` (newline-separated `KEY=VALUE` assignments) in one datagram.
    pub fn notify(&self, state: &str) -> io::Result<()> {
        let n = self.socket.send_to_addr(state.as_bytes(), &self.addr)?;
        if n != state.len() {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                format!("short notification datagram ({n} of {} bytes)", state.len()),
            ));
        }
        Ok(())
    }

    /// `STATUS=` text must stay on one line: the protocol is line-based.
    pub fn status_line(status: &str) -> String {
        format!("STATUS={}", status.replace('\n', " "))
    }
}

/// Sends `state` if running under a service manager; logs (never fails) otherwise.
pub fn send(notifier: Option<&Notifier>, state: &str) {
    if let Some(n) = notifier {
        if let Err(e) = n.notify(state) {
            tracing::warn!(error = %e, state = state.lines().next().unwrap_or(""), "sd_notify failed");
        }
    }
}

/// How often to send `WATCHDOG=1`: half of `$WATCHDOG_USEC` (as sd_watchdog_enabled(3)
/// recommends), when the watchdog is on and meant for this process (`$WATCHDOG_PID` unset or
/// our pid). `None` when no watchdog is configured.
pub fn watchdog_interval(
    usec: Option<&OsStr>,
    pid: Option<&OsStr>,
    my_pid: u32,
) -> Result<Option<Duration>, NotifyError> {
    let parse = |name: &'static str, v: &OsStr| -> Result<u64, NotifyError> {
        v.to_str()
            .and_then(|s| s.trim().parse().ok())
            .ok_or(NotifyError::BadAddress {
                value: format!("{name}={}", v.to_string_lossy()),
                reason: "not an unsigned integer",
            })
    };
    let Some(usec) = usec.filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    if let Some(pid) = pid.filter(|v| !v.is_empty()) {
        if parse("WATCHDOG_PID", pid)? != my_pid as u64 {
            return Ok(None);
        }
    }
    let usec = parse("WATCHDOG_USEC", usec)?;
    if usec == 0 {
        return Ok(None);
    }
    Ok(Some(Duration::from_micros(usec / 2)))
}

/// [`watchdog_interval`] for this process's environment.
pub fn watchdog_from_env() -> Result<Option<Duration>, NotifyError> {
    watchdog_interval(
        std::env::var_os("WATCHDOG_USEC").as_deref(),
        std::env::var_os("WATCHDOG_PID").as_deref(),
        std::process::id(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(s: &str) -> &OsStr {
        OsStr::new(s)
    }

    #[test]
    fn path_and_abstract_addresses_receive_datagrams() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let rx = UnixDatagram::bind(&path).unwrap();
        Notifier::new(path.as_os_str())
            .unwrap()
            .notify("READY=1\nSTATUS=up")
            .unwrap();
        let mut buf = [0u8; 64];
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1\nSTATUS=up");

        let name = format!("kvtier-notify-test-{}", std::process::id());
        let rx = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(&name).unwrap()).unwrap();
        Notifier::new(os(&format!("@{name}")))
            .unwrap()
            .notify("WATCHDOG=1")
            .unwrap();
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"WATCHDOG=1");
    }

    #[test]
    fn bad_addresses_are_refused_and_a_missing_listener_is_an_error() {
        for bad in ["relative/path", "", &format!("/{}", "x".repeat(200))] {
            assert!(
                matches!(Notifier::new(os(bad)), Err(NotifyError::BadAddress { .. })),
                "{bad:?}"
            );
        }
        let dir = tempfile::tempdir().unwrap();
        let n = Notifier::new(dir.path().join("nobody").as_os_str()).unwrap();
        assert!(n.notify("READY=1").is_err());
    }

    #[test]
    fn watchdog_interval_is_half_and_only_for_our_pid() {
        let half = Some(Duration::from_millis(1500));
        assert_eq!(watchdog_interval(None, None, 7).unwrap(), None);
        assert_eq!(
            watchdog_interval(Some(os("3000000")), None, 7).unwrap(),
            half
        );
        assert_eq!(
            watchdog_interval(Some(os("3000000")), Some(os("7")), 7).unwrap(),
            half
        );
        assert_eq!(
            watchdog_interval(Some(os("3000000")), Some(os("8")), 7).unwrap(),
            None,
            "meant for another process"
        );
        assert_eq!(watchdog_interval(Some(os("0")), None, 7).unwrap(), None);
        assert!(watchdog_interval(Some(os("soon")), None, 7).is_err());
        assert!(watchdog_interval(Some(os("10")), Some(os("-1")), 7).is_err());
    }

    #[test]
    fn status_stays_on_one_line() {
        assert_eq!(Notifier::status_line("a\nb"), "STATUS=a b");
    }
}
