use kvtier_storage::nvme::CorruptReason;

pub type Result<T> = std::result::Result<T, RemoteError>;

/// What the remote tier can fail with. [`RemoteError::is_data_loss`] separates data the store
/// should hold and does not (or holds damaged) from everything that can be retried or is the
/// caller's to fix.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// The store did not answer in time, or answered with an error of its own (a cluster
    /// down, a failover in progress, a connection refused): retry later.
    #[error("remote store unavailable: {0}")]
    Unavailable(String),
    /// Another node holds a live claim of the session.
    #[error("session {session} is owned by node {owner} (its claim expires in {expires_ms} ms unless renewed)")]
    Owned {
        session: u64,
        owner: String,
        expires_ms: i64,
    },
    /// The claim this write was made under is no longer the current one: it expired, and
    /// perhaps another node took the session (`holder`). Nothing was written.
    #[error("session {session}: claim (token {token}) lost{}", holder.as_ref().map(|h| format!(", now held by {h}")).unwrap_or_default())]
    Fenced {
        session: u64,
        token: u64,
        holder: Option<String>,
    },
    /// The claim's local validity ran out before the write (no renewal reached the store in
    /// time): the write is refused here, before it could race a new owner.
    #[error("session {session}: claim (token {token}) expired locally; not writing")]
    ClaimExpired { session: u64, token: u64 },
    /// Fewer replicas acknowledged the write than `remote.replicas` asks for. The write is
    /// not committed.
    #[error("write not acknowledged by {wanted} replicas of every master within the timeout (fewest: {got})")]
    NotReplicated { wanted: u32, got: u32 },
    /// The record names no page for this run.
    #[error("session {session}: no stored run for layer {layer} block {block}")]
    NoSuchRun {
        session: u64,
        layer: u32,
        block: u32,
    },
    /// The record names a page the store does not hold.
    #[error(
        "session {session}: page of layer {layer} block {block} generation {generation} is missing"
    )]
    MissingPage {
        session: u64,
        layer: u32,
        block: u32,
        generation: u64,
    },
    /// A page failed verification.
    #[error("session {session}: page of layer {layer} block {block} is corrupt: {reason}")]
    CorruptPage {
        session: u64,
        layer: u32,
        block: u32,
        reason: CorruptReason,
    },
    /// A record failed verification or does not decode.
    #[error("session {session}: record is corrupt: {reason}")]
    CorruptRecord { session: u64, reason: String },
    /// The request itself is wrong (a run out of range, given twice, too large).
    #[error("invalid remote request: {0}")]
    Invalid(String),
}

impl RemoteError {
    /// The store should hold this and does not, or holds it damaged: the session's data is
    /// lost, not merely unreachable.
    pub fn is_data_loss(&self) -> bool {
        matches!(
            self,
            RemoteError::NoSuchRun { .. }
                | RemoteError::MissingPage { .. }
                | RemoteError::CorruptPage { .. }
                | RemoteError::CorruptRecord { .. }
        )
    }
}

impl From<redis::RedisError> for RemoteError {
    fn from(e: redis::RedisError) -> Self {
        RemoteError::Unavailable(e.to_string())
    }
}
