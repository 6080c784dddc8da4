//! kvtier storage: the data model of a session's KV cache and the host-RAM tier.
//!
//! # Layout
//!
//! - [`Geometry`], [`Policy`], [`DType`]: the data model, defined in kvtier-model and
//!   re-exported here (with its modules, `geometry` and `dtype`) for the crates built on storage.
//! - [`arena`]: [`HostArena`], variable-size block-run extents in one anonymous mapping (the
//!   host tier), carved by [`extents`]; `space` indexes the extents of both tiers and plans
//!   compaction (moving extents out of a window so a run fits where the free space is in
//!   pieces).
//! - [`kv`]: [`KvCache`], one session's per-layer block tables and incremental block summaries.
//! - [`sketch`]: int4 key sketches (one scale per channel of a block), kept beside the
//!   summaries for the sketch selector.
//! - `par`: the scoped-thread fan-out of the bulk paths (page store batches, block restores;
//!   [`zip_mut`] also serves the in-engine library's bulk summaries).
//! - [`nvme`]: the NVMe tier: I/O drivers (io_uring, pread), checksummed page store, crash-safe
//!   manifest and link model.
//!
//! A tile is one (layer, block, kv-head): the K tile `[B x D]` followed by the V tile `[B x D]`.
//! The tiles of one (layer, block) are adjacent, forming a block run that takes one arena extent of its size.
//! Nothing here depends on a GPU, and io_uring only in the NVMe tier's I/O driver (with a pread
//! fallback where it is unavailable): policy code is testable anywhere.

pub mod arena;
pub mod error;
pub mod extents;
pub mod kv;
pub mod nvme;
mod par;
pub mod sketch;
mod space;
pub mod testing;

pub use arena::{ArenaOptions, ArenaUsage, Extent, HostArena, HostQuota, Relocation};
pub use error::{Result, StorageError};
pub use kv::{
    in_place_row, summary_bytes, ColdSource, InPlaceAppend, KvCache, LayerView, SavedRuns,
    StoredBlock,
};
pub use kvtier_model::{dtype, geometry, DType, Geometry, ModelError, Policy, Selector};
pub use par::{default_workers, zip_mut};
