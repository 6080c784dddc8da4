//! placeholder

#[cfg(feature = "cuda")]
pub mod cuda;
