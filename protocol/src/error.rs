//! The crate's error type and the wire error codes.

wire_enum! {
    /// Error codes carried in an error reply (opcode 0xFFFF). Numbering is part of the wire
    /// format; docs/protocol.md says when each one is used.
    pub enum ErrorCode {
        /// The session id does not exist (never created, closed or evicted).
        NotFound = 1 => "NOT_FOUND",
        /// Malformed frame or body, or arguments that can never be valid (bad geometry, sizes
        /// that do not match the session, layer out of range).
        InvalidArgument = 2 => "INVALID_ARGUMENT",
        /// A limit was hit: frame larger than max_frame_bytes, tiers full, too many sessions.
        ResourceExhausted = 3 => "RESOURCE_EXHAUSTED",
        /// The request is well formed but the state does not allow it (no HELLO yet, append at
        /// a position other than the layer's current length, no common protocol version).
        FailedPrecondition = 4 => "FAILED_PRECONDITION",
        /// The session belongs to another uid, or an admin operation from a non-admin peer.
        PermissionDenied = 5 => "PERMISSION_DENIED",
        /// Temporarily unable to serve (shutting down, a tier offline); retrying may succeed.
        Unavailable = 6 => "UNAVAILABLE",
        /// A server bug or an I/O failure that is not the client's fault.
        Internal = 7 => "INTERNAL",
        /// Unknown or reserved opcode. The connection stays usable.
        Unimplemented = 8 => "UNIMPLEMENTED",
        /// Stored data failed verification (checksum mismatch, corrupt page).
        DataLoss = 9 => "DATA_LOSS",
        /// The session is owned by another node of the remote tier; the message is that node's
        /// name (`remote.node`). Protocol version 3; a version 2 client gets
        /// FAILED_PRECONDITION ([`ErrorCode::for_version`]).
        OwnedElsewhere = 10 => "OWNED_ELSEWHERE",
    }
}

impl ErrorCode {
    /// Whether the error is the daemon's trouble rather than the request's: INTERNAL,
    /// DATA_LOSS, UNAVAILABLE. The others answer what the request asked (a session that is
    /// not there, a bad argument, a full tier, a limit).
    pub fn is_daemons(self) -> bool {
        matches!(self, Self::Internal | Self::DataLoss | Self::Unavailable)
    }

    /// The code and message to send a client that chose protocol `version`: codes newer than
    /// the version become the code that version used, their message a sentence.
    pub fn for_version(self, version: u16, message: &str) -> (ErrorCode, String) {
        match self {
            Self::OwnedElsewhere if version < 3 => (
                Self::FailedPrecondition,
                format!("the session is owned by node {message}"),
            ),
            code => (code, message.to_string()),
        }
    }

    /// Parse a wire value.
    pub fn from_u16(code: u16) -> Result<Self, ProtoError> {
        Self::from_wire(code).ok_or(ProtoError::UnknownErrorCode { code })
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Everything that can go wrong while encoding or decoding a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtoError {
    #[error("bad magic 0x{found:08x} (expected 0x3154564b, \"KVT1\")")]
    BadMagic { found: u32 },
    #[error("reserved header field is {value}, must be 0")]
    ReservedNonZero { value: u32 },
    #[error("frame body of {body_len} bytes exceeds the limit of {max} bytes")]
    FrameTooLarge { body_len: u64, max: u32 },
    #[error("header announces {announced} body bytes but {actual} were given")]
    BodyLenMismatch { announced: u32, actual: usize },
    #[error("unknown or reserved opcode 0x{opcode:04x}")]
    UnknownOpcode { opcode: u16 },
    #[error("opcode 0x{opcode:04x} is a request, expected a reply")]
    NotAReply { opcode: u16 },
    #[error("opcode 0x{opcode:04x} is a reply, expected a request")]
    NotARequest { opcode: u16 },
    #[error("unsupported flags 0x{flags:x} for opcode 0x{opcode:04x}")]
    BadFlags { opcode: u16, flags: u32 },
    #[error("truncated {what}: needs {needed} bytes, {available} left")]
    Truncated {
        what: &'static str,
        needed: usize,
        available: usize,
    },
    #[error("{extra} trailing bytes after the body")]
    TrailingBytes { extra: usize },
    #[error("{what} is not valid UTF-8")]
    InvalidUtf8 { what: &'static str },
    #[error("{what} must be 0 or 1, got {value}")]
    BadBool { what: &'static str, value: u8 },
    #[error("{what} has unknown bits set: {value:#04x}")]
    BadFlagBits { what: &'static str, value: u8 },
    #[error("unknown dtype {value} (0 bf16, 1 f16, 2 f32)")]
    BadDtype { value: u8 },
    #[error("unknown selector {value} (0 bound, 1 sketch)")]
    BadSelector { value: u32 },
    #[error("unknown error code {code}")]
    UnknownErrorCode { code: u16 },
    #[error("{what}: length arithmetic overflows")]
    LengthOverflow { what: &'static str },
    #[error("{what}: {len} bytes is not a multiple of {multiple}")]
    Misaligned {
        what: &'static str,
        len: usize,
        multiple: usize,
    },
    #[error("{what} of {len} does not fit its u32 length field")]
    TooLong { what: &'static str, len: usize },
}

impl ProtoError {
    /// The error code a server answers with when a request fails to decode this way.
    pub fn error_code(&self) -> ErrorCode {
        match self {
            ProtoError::FrameTooLarge { .. } => ErrorCode::ResourceExhausted,
            ProtoError::UnknownOpcode { .. } => ErrorCode::Unimplemented,
            // Only an encoder produces TooLong: a server that cannot encode its own reply.
            ProtoError::TooLong { .. } => ErrorCode::Internal,
            _ => ErrorCode::InvalidArgument,
        }
    }
}
