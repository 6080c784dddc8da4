use std::io;

/// Errors of the storage crate. Every variant carries the values a caller needs to explain the
/// failure without parsing the message.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// A geometry or policy out of range.
    #[error(transparent)]
    Model(#[from] kvtier_model::ModelError),

    #[error("invalid arena configuration: {reason}")]
    InvalidArena { reason: String },

    #[error("host arena full: {wanted} runs of {run_bytes} bytes do not fit ({bytes_free} of {bytes_total} bytes free, largest free extent {largest_free})")]
    ArenaFull {
        wanted: usize,
        run_bytes: usize,
        bytes_free: usize,
        largest_free: usize,
        bytes_total: usize,
    },

    #[error("host quota: {bytes_used} of {limit} bytes in use, {wanted} more wanted (quota.host_share_per_uid)")]
    QuotaExceeded {
        bytes_used: usize,
        wanted: usize,
        limit: usize,
    },

    #[error("a block run of {block_bytes} bytes exceeds the largest the host arena takes, host.max_run_bytes = {max_run_bytes}")]
    BlockTooLarge {
        block_bytes: usize,
        max_run_bytes: usize,
    },

    #[error("layer {layer} out of range (session has {layers} layers)")]
    LayerOutOfRange { layer: u32, layers: u32 },

    #[error("block {block} of layer {layer} out of range (the layer has {blocks} blocks)")]
    BlockOutOfRange {
        layer: u32,
        block: u32,
        blocks: usize,
    },

    #[error("position {got} at layer {layer} does not continue the sequence: expected {expected}")]
    PositionMismatch { layer: u32, expected: u64, got: u64 },

    #[error("{what}: expected {expected} bytes, got {got}")]
    PayloadSize {
        what: &'static str,
        expected: usize,
        got: usize,
    },

    #[error("{what} contains a non-finite value (NaN or infinity) at element {index}")]
    NonFinite { what: &'static str, index: usize },

    #[error("layers hold different token counts ({min} to {max}): an in-place append needs every layer at one length")]
    UnevenLayers { min: u64, max: u64 },

    #[error("layer {layer} of this in-place append is already committed")]
    LayerCommitted { layer: u32 },

    #[error(
        "{got} tokens committed where this in-place append's earlier layers committed {expected}"
    )]
    CommitTokens { expected: u64, got: u64 },

    #[error("session would exceed {max} tokens")]
    TooManyTokens { max: u64 },

    #[error("{blocks} block(s) of layer {layer} are not resident and no colder tier was given")]
    NotResident { layer: u32, blocks: usize },

    /// A cold block could not be read back from a colder tier. `corrupt`: the stored bytes failed verification
    /// (checksum or identity) — data loss, not a transient fault.
    #[error("reading block {block} of layer {layer} from {tier}: {reason}")]
    ColdRead {
        /// The tier read, as prose ("the NVMe tier").
        tier: &'static str,
        layer: u32,
        block: u32,
        reason: String,
        corrupt: bool,
    },

    #[error("mapping {bytes} bytes of anonymous memory failed: {source}")]
    Map { bytes: usize, source: io::Error },

    #[error("locking the host arena in RAM failed ({source}); raise RLIMIT_MEMLOCK (LimitMEMLOCK=infinity in the systemd unit) or disable lock_memory")]
    Lock { source: io::Error },
}

impl StorageError {
    /// Block `block` of `layer` could not be read back from `tier`; `corrupt` when its stored
    /// bytes failed verification.
    pub fn cold_read(
        tier: &'static str,
        layer: u32,
        block: u32,
        reason: impl std::fmt::Display,
        corrupt: bool,
    ) -> Self {
        StorageError::ColdRead {
            tier,
            layer,
            block,
            reason: reason.to_string(),
            corrupt,
        }
    }
}

pub type Result<T, E = StorageError> = std::result::Result<T, E>;
