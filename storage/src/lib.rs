//! placeholder
pub mod nvme;
