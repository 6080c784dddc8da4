//! The one error type of the NVMe tier.

use std::io;
use std::path::PathBuf;

use super::io::OpKind;

/// Everything that can go wrong in the NVMe tier. Fields say what and where, so a caller can
/// map each case to a protocol error code without parsing messages.
#[derive(Debug, thiserror::Error)]
pub enum NvmeError {
    /// An operating-system call failed.
    #[error("{op} on {path:?} failed: {source}")]
    Os {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    /// The filesystem refuses O_DIRECT (tmpfs and some overlay filesystems do).
    #[error("{path:?} does not support O_DIRECT (EINVAL on open); put the NVMe tier on a real filesystem or block device")]
    DirectIoUnsupported { path: PathBuf },

    /// io_uring cannot be used here (kernel without it, seccomp/sandbox, sysctl
    /// kernel.io_uring_disabled, or a missing feature); callers fall back to pread.
    #[error("io_uring unavailable: {reason}")]
    UringUnavailable {
        reason: String,
        #[source]
        source: Option<io::Error>,
    },

    /// A buffer or offset breaks the O_DIRECT alignment rules.
    #[error("misaligned {what}: {value} is not a multiple of {align}")]
    Misaligned {
        what: &'static str,
        value: u64,
        align: u64,
    },

    /// An invalid argument (configuration, sizes, indices).
    #[error("invalid argument: {what}")]
    InvalidArgument { what: String },

    /// A positional read or write failed with an errno.
    #[error("{kind:?} of {len} bytes at offset {offset} failed: {source}")]
    Io {
        kind: OpKind,
        offset: u64,
        len: usize,
        #[source]
        source: io::Error,
    },

    /// A read returned fewer bytes than asked for and could not be completed (end of file).
    #[error("short read at offset {offset}: wanted {expected} bytes, got {got}")]
    ShortRead {
        offset: u64,
        expected: usize,
        got: usize,
    },

    /// A write stored fewer bytes than asked for and made no further progress.
    #[error("short write at offset {offset}: wanted {expected} bytes, wrote {got}")]
    ShortWrite {
        offset: u64,
        expected: usize,
        got: usize,
    },

    /// The device (or filesystem) is out of space (ENOSPC).
    #[error("no space left writing {len} bytes at offset {offset}")]
    NoSpace { offset: u64, len: usize },

    /// The page store has no room for the request: `requested` pages of `page_bytes` bytes
    /// each. Free space may be in pieces smaller than a page (`largest_free_bytes` is the
    /// largest page that would fit on any device).
    #[error("page store full: wanted {requested} pages of {page_bytes} bytes, {free_bytes} bytes free (largest free extent {largest_free_bytes} bytes)")]
    Full {
        requested: usize,
        page_bytes: u64,
        free_bytes: u64,
        largest_free_bytes: u64,
    },

    /// A page failed verification: the bytes on disk are not the page the caller asked for.
    /// Never returned as data. `page` is the page's first unit ([`super::PageAddr::page`]).
    #[error("corrupt page at unit {page} of device {device}: {reason}")]
    Corrupt {
        device: u16,
        page: u64,
        reason: CorruptReason,
    },

    /// A manifest file failed verification.
    #[error("corrupt manifest {path:?}: {reason}")]
    CorruptManifest { path: PathBuf, reason: String },

    /// A manifest file that verifies (magic, length, checksum) but is of a format version this
    /// build cannot read: written by a newer tierd. Never skipped in favour of an older
    /// manifest, which would serve stale data and later delete the newer file.
    #[error("manifest {path:?} has format version {found}; this build reads versions {oldest} to {newest} (was it written by a newer tierd?)")]
    UnsupportedManifestVersion {
        path: PathBuf,
        found: u32,
        oldest: u32,
        newest: u32,
    },

    /// Manifest files exist but none verifies (every copy of every epoch is damaged).
    /// Starting empty would reuse, and so overwrite, the pages of the sessions they describe:
    /// the tier refuses to open until an operator quarantines them (see
    /// [`super::manifest::quarantine`]).
    #[error("no manifest in {dir:?} verifies ({files} file(s) damaged): refusing to start empty over their pages; set nvme.damaged_manifests = \"quarantine\" to move them and the page files aside and start empty")]
    DamagedManifests { dir: PathBuf, files: usize },

    /// The manifest and the devices disagree (unit, device count or sizes, a page out of range
    /// or overlapping another).
    #[error("manifest does not match the page store: {what}")]
    ManifestMismatch { what: String },

    /// The I/O driver's thread is gone (it panicked or was shut down).
    #[error("I/O driver stopped")]
    DriverStopped,
}

/// Why a page failed verification.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CorruptReason {
    /// The header magic is wrong: not a page, never written, or torn.
    BadMagic { found: u32 },
    /// A page format this build does not read.
    BadVersion { found: u16 },
    /// The header names another (session, layer, block, generation) than expected.
    WrongIdentity {
        expected: super::page::PageId,
        found: super::page::PageId,
    },
    /// The payload length in the header is impossible for this page size.
    BadLength { found: u32, max: usize },
    /// The checksum over header fields and payload does not match.
    Checksum { stored: u32, computed: u32 },
    /// The checksum is right but not the one the index recorded for this page.
    UnexpectedChecksum { expected: u32, found: u32 },
}

impl std::fmt::Display for CorruptReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::BadMagic { found } => write!(f, "bad magic {found:#010x}"),
            Self::BadVersion { found } => write!(f, "unknown format version {found}"),
            Self::WrongIdentity { expected, found } => {
                write!(f, "expected {expected:?}, found {found:?}")
            }
            Self::BadLength { found, max } => write!(f, "payload length {found} > {max}"),
            Self::Checksum { stored, computed } => {
                write!(f, "crc32c stored {stored:#010x}, computed {computed:#010x}")
            }
            Self::UnexpectedChecksum { expected, found } => {
                write!(f, "crc32c {found:#010x}, index says {expected:#010x}")
            }
        }
    }
}

impl NvmeError {
    pub(crate) fn os(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        Self::Os {
            op,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn invalid(what: impl Into<String>) -> Self {
        Self::InvalidArgument { what: what.into() }
    }

    /// True for errors that mean data the caller asked for is gone or wrong (as opposed to a
    /// transient or configuration problem): the daemon reports these as data loss.
    pub fn is_data_loss(&self) -> bool {
        matches!(self, Self::Corrupt { .. } | Self::ShortRead { .. })
    }
}
