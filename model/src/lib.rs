//! kvtier's data model, defined once for every crate: a session's [`Geometry`] (the shape of
//! its KV cache and the tile layout it implies), the selection [`Policy`] (sink, local window,
//! top-k distant blocks, and the [`Selector`] that ranks them) and the element type [`DType`] of stored keys and values.
//!
//! The wire (kvtier-protocol), the manifest (kvtier-storage's `nvme::manifest`) and the CUDA
//! configuration (kvtier-kernels' `cuda`) convert to and from these types at their boundaries;
//! nothing else redefines them.

pub mod dtype;
pub mod geometry;

pub use dtype::DType;
pub use geometry::{
    Geometry, Policy, Selector, DEFAULT_CANDIDATES, MAX_BLOCK_TOKENS, MAX_HEADS, MAX_HEAD_DIM,
    MAX_LAYERS, MAX_POLICY_BLOCKS,
};

/// A geometry or policy field out of range; names the field and says what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    #[error("invalid geometry: {field} {reason}")]
    InvalidGeometry { field: &'static str, reason: String },

    #[error("invalid policy: {field} {reason}")]
    InvalidPolicy { field: &'static str, reason: String },
}
