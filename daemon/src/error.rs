//! Request failures as the wire reports them: a typed code and a message.

use kvtier_kernels::KernelError;
use kvtier_protocol::{ErrorCode, ProtoError};
use kvtier_storage::StorageError;

/// A failed request: the code the client sees and a message saying what was wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ServiceError {
    pub code: ErrorCode,
    pub message: String,
}

impl ServiceError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ServiceError {
            code,
            message: message.into(),
        }
    }
    pub fn not_found(session: u64) -> Self {
        Self::new(ErrorCode::NotFound, format!("no session {session}"))
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidArgument, message)
    }
    pub fn exhausted(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::ResourceExhausted, message)
    }
    pub fn denied(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::PermissionDenied, message)
    }
    pub fn precondition(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::FailedPrecondition, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Internal, message)
    }
    /// The error with `context` before its message, except OWNED_ELSEWHERE, whose message is
    /// the owner's name for the client to go there (protocol.md §3).
    pub fn context(self, context: impl std::fmt::Display) -> Self {
        match self.code {
            ErrorCode::OwnedElsewhere => self,
            code => Self::new(code, format!("{context}: {}", self.message)),
        }
    }
}

impl From<ProtoError> for ServiceError {
    fn from(e: ProtoError) -> Self {
        ServiceError::new(e.error_code(), e.to_string())
    }
}

/// The wire code of a storage failure.
pub fn storage_code(e: &StorageError) -> ErrorCode {
    match e {
        StorageError::ArenaFull { .. }
        | StorageError::QuotaExceeded { .. }
        | StorageError::TooManyTokens { .. } => ErrorCode::ResourceExhausted,
        StorageError::PositionMismatch { .. } | StorageError::UnevenLayers { .. } => {
            ErrorCode::FailedPrecondition
        }
        StorageError::Model(_)
        | StorageError::BlockTooLarge { .. }
        | StorageError::LayerOutOfRange { .. }
        | StorageError::BlockOutOfRange { .. }
        | StorageError::PayloadSize { .. }
        | StorageError::LayerCommitted { .. }
        | StorageError::CommitTokens { .. }
        | StorageError::NonFinite { .. } => ErrorCode::InvalidArgument,
        StorageError::ColdRead { corrupt: true, .. } => ErrorCode::DataLoss,
        StorageError::InvalidArena { .. }
        | StorageError::Map { .. }
        | StorageError::Lock { .. }
        | StorageError::NotResident { .. }
        | StorageError::ColdRead { .. } => ErrorCode::Internal,
    }
}

impl From<StorageError> for ServiceError {
    fn from(e: StorageError) -> Self {
        ServiceError::new(storage_code(&e), e.to_string())
    }
}

impl From<KernelError> for ServiceError {
    fn from(e: KernelError) -> Self {
        let code = match e.root() {
            KernelError::Storage(s) => storage_code(s),
            KernelError::QuerySize { .. } | KernelError::NonFiniteQuery { .. } => {
                ErrorCode::InvalidArgument
            }
            KernelError::EmptyBatch | KernelError::OutputSize { .. } => ErrorCode::InvalidArgument,
            // The service answers on the CPU instead; reaching a client would be a bug.
            KernelError::Unavailable { .. } => ErrorCode::Internal,
            // Sessions are created with sketches exactly when their selector reads them.
            KernelError::NoSketches => ErrorCode::Internal,
            KernelError::Entry { .. } => unreachable!("root() unwraps entries"),
        };
        ServiceError::new(code, e.to_string())
    }
}

pub type ServiceResult<T> = Result<T, ServiceError>;
