use kvtier_storage::StorageError;

/// Errors of the kernels crate.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error(transparent)]
    Storage(#[from] StorageError),

    #[error("query: expected {expected} f32 values (q_heads x head_dim), got {got}")]
    QuerySize { expected: usize, got: usize },

    #[error("query value {index} is not finite")]
    NonFiniteQuery { index: usize },

    /// The policy's selector ranks by key sketches but the session's cache keeps none.
    #[error("the policy's sketch selector needs a cache that keeps key sketches")]
    NoSketches,

    #[error("empty decode batch")]
    EmptyBatch,

    #[error("output buffer has {got} floats, the batch needs {expected}")]
    OutputSize { expected: usize, got: usize },

    /// The backend cannot take this batch (a session not open on the device, a capacity);
    /// nothing has changed and another backend may answer it.
    #[error("backend unavailable for this step: {reason}")]
    Unavailable { reason: String },

    #[error("batch entry {entry}: {source}")]
    Entry {
        entry: usize,
        #[source]
        source: Box<KernelError>,
    },
}

impl KernelError {
    /// The error without the batch-entry wrapper.
    pub fn root(&self) -> &KernelError {
        match self {
            KernelError::Entry { source, .. } => source.root(),
            e => e,
        }
    }
}

pub type Result<T, E = KernelError> = std::result::Result<T, E>;
