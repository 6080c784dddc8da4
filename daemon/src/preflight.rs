//! Startup checks that would otherwise surface later as an opaque failure (an `mlock` ENOMEM
//! after minutes of setup, a bind EACCES): each fails fast with a message naming the fix.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::config::{ByteSize, Config};

/// A startup precondition that does not hold.
#[derive(Debug, thiserror::Error)]
pub enum PreflightError {
    #[error(
        "host.lock_memory needs {need} of locked memory but RLIMIT_MEMLOCK is {limit} and the \
         process lacks CAP_IPC_LOCK: raise LimitMEMLOCK (systemd) or ulimit -l, or set \
         host.lock_memory = false"
    )]
    Memlock { need: ByteSize, limit: ByteSize },
    #[error(
        "cannot create the socket in {dir}: {reason} for uid {uid}; under systemd use \
         RuntimeDirectory=kvtier with server.socket_path = \"/run/kvtier/tierd.sock\", otherwise \
         choose a server.socket_path in a directory this user may write"
    )]
    SocketDir {
        dir: PathBuf,
        reason: String,
        uid: u32,
    },
}

/// Runs every check `cfg` calls for.
pub fn check(cfg: &Config) -> Result<(), PreflightError> {
    if cfg.host.lock_memory {
        check_memlock(cfg.host.capacity.0, memlock_limit(), has_cap_ipc_lock())?;
    }
    check_socket_dir(&cfg.server.socket_path)
}

/// `need` bytes may be locked under a soft limit of `limit` (`None` = unlimited), or with
/// CAP_IPC_LOCK, which lifts the limit.
pub fn check_memlock(
    need: u64,
    limit: Option<u64>,
    cap_ipc_lock: bool,
) -> Result<(), PreflightError> {
    match limit {
        Some(l) if l < need && !cap_ipc_lock => Err(PreflightError::Memlock {
            need: ByteSize(need),
            limit: ByteSize(l),
        }),
        _ => Ok(()),
    }
}

/// The soft RLIMIT_MEMLOCK, `None` when unlimited.
pub fn memlock_limit() -> Option<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the valid struct we pass.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) };
    if rc != 0 || r.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    Some(r.rlim_cur)
}

/// Whether CAP_IPC_LOCK is in this process's effective set (from /proc/self/status).
pub fn has_cap_ipc_lock() -> bool {
    const CAP_IPC_LOCK: u32 = 14;
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0)
}

/// The socket's directory (or, if it does not exist yet, the nearest existing ancestor, where
/// it will be created) must be writable and searchable by us, on a writable file system.
fn check_socket_dir(socket: &Path) -> Result<(), PreflightError> {
    let Some(mut dir) = socket.parent().filter(|d| !d.as_os_str().is_empty()) else {
        return Ok(());
    };
    while !dir.exists() {
        match dir.parent() {
            Some(p) if !p.as_os_str().is_empty() => dir = p,
            _ => return Ok(()),
        }
    }
    let Ok(c) = CString::new(dir.as_os_str().as_bytes()) else {
        return Ok(());
    };
    // SAFETY: `c` is a valid NUL-terminated path; faccessat only reads it.
    let rc = unsafe {
        libc::faccessat(
            libc::AT_FDCWD,
            c.as_ptr(),
            libc::W_OK | libc::X_OK,
            libc::AT_EACCESS,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    Err(PreflightError::SocketDir {
        dir: dir.into(),
        reason: std::io::Error::last_os_error().to_string(),
        // SAFETY: geteuid has no preconditions and cannot fail.
        uid: unsafe { libc::geteuid() },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memlock_needs_the_limit_or_the_capability() {
        let gib = 1 << 30;
        assert!(check_memlock(gib, None, false).is_ok());
        assert!(check_memlock(gib, Some(gib), false).is_ok());
        assert!(check_memlock(gib, Some(8 << 20), true).is_ok());
        let e = check_memlock(gib, Some(8 << 20), false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("1GiB") && e.contains("8MiB"), "{e}");
        assert!(
            e.contains(
                "raise LimitMEMLOCK (systemd) or ulimit -l, or set host.lock_memory = false"
            ),
            "{e}"
        );
    }

    #[test]
    fn socket_dir_checks_the_nearest_existing_ancestor() {
        let dir = tempfile::tempdir().unwrap();
        assert!(check_socket_dir(&dir.path().join("a/b/tierd.sock")).is_ok());
        use std::os::unix::fs::PermissionsExt;
        let ro = dir.path().join("ro");
        std::fs::create_dir(&ro).unwrap();
        std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
        let r = check_socket_dir(&ro.join("run/tierd.sock"));
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            assert!(r.is_ok(), "root may write anywhere DAC allows: {r:?}");
        } else {
            let e = r.unwrap_err().to_string();
            assert!(e.contains("/ro:") && e.contains("RuntimeDirectory"), "{e}");
        }
    }
}
