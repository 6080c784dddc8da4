//! NVMe tier: a checksummed page store on O_DIRECT files or block devices, written and read
//! through io_uring (or pread where io_uring is unavailable), its crash-safe manifest, and the
//! link model that splits transfers across devices by bandwidth.
//!
//! # Layout
//!
//! - [`buf`]: [`AlignedBuf`] and [`DirectFile`]: O_DIRECT rules enforced by construction.
//! - [`io`]: the [`IoDriver`] trait and its io_uring, pread and fault-injecting drivers.
//! - [`page`]: the on-disk page format (header, crc32c, identity).
//! - [`store`]: [`PageStore`]: devices, page allocation, bandwidth-weighted striping.
//! - [`manifest`]: the rkyv index of what is on NVMe, replaced atomically.
//! - [`tier`]: [`NvmeTier`]: store + manifest with the crash-safe write order (what the
//!   daemon's demotion/promotion calls).
//! - [`link`]: links, online bandwidth tracking and batch splitting by the tracked rates
//!   (pure logic, no I/O except the probe).

pub mod buf;
mod error;
pub mod io;
pub mod link;
pub mod manifest;
pub mod page;
pub mod store;
pub mod tier;

pub use buf::{AlignedBuf, DirectFile};
pub use error::{CorruptReason, NvmeError};
pub use io::{open_best_driver, IoDriver, IoRequest, OpKind, PreadDriver, UringDriver};
pub use page::PageId;
pub use store::{DeviceConfig, PageAddr, PageStore, PageStoreConfig};
pub use tier::{refuse_runs, BlockRun, NvmeTier, RecoveryReport, TierSource};
