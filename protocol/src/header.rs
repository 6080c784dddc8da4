//! The fixed 24-byte frame header and the opcode table.

use crate::error::ProtoError;

/// `"KVT1"` read as a little-endian u32.
pub const MAGIC: u32 = 0x3154_564B;
/// Size of every frame header.
pub const HEADER_LEN: usize = 24;
/// The newest protocol version this crate speaks.
pub const PROTOCOL_VERSION: u16 = 5;
/// The first protocol version whose COMMIT may name its layers.
pub const LAYER_COMMIT_VERSION: u16 = 5;
/// The oldest protocol version this crate speaks: version 2 is version 3 without the error
/// code OWNED_ELSEWHERE (a server answers a version 2 client FAILED_PRECONDITION instead).
pub const MIN_PROTOCOL_VERSION: u16 = 2;
/// Set on a request opcode to form its success reply opcode.
pub const REPLY_BIT: u16 = 0x8000;
/// Opcode of every error reply.
pub const ERROR_OPCODE: u16 = 0xFFFF;
/// Header flag of APPEND_KV: the body names a range of a file descriptor passed with
/// SCM_RIGHTS instead of carrying the payload inline.
pub const FLAG_APPEND_SHM: u16 = 0x0001;
/// Header flag of COMMIT (protocol version 5): the body names the layers it commits.
pub const FLAG_COMMIT_LAYERS: u16 = 0x0001;
/// The tier-operation opcode range: DEMOTE 0x0010, PROMOTE 0x0011, PIN 0x0012, UNPIN 0x0013,
/// LEASE 0x0014, RELEASE 0x0015, RESERVE 0x0016, COMMIT 0x0017, OFFLOAD 0x0018;
/// 0x0019..=0x001F are reserved (answered with UNIMPLEMENTED).
pub const RESERVED_TIER_OPCODES: std::ops::RangeInclusive<u16> = 0x0019..=0x001F;

wire_enum! {
    /// Request opcodes. A success reply's opcode is `opcode | 0x8000`; an error reply's is
    /// 0xFFFF.
    pub enum Opcode {
        Hello = 0x0001 => "HELLO",
        CreateSession = 0x0002 => "CREATE_SESSION",
        AppendKv = 0x0003 => "APPEND_KV",
        Decode = 0x0004 => "DECODE",
        SessionInfo = 0x0005 => "SESSION_INFO",
        CloseSession = 0x0006 => "CLOSE_SESSION",
        ListSessions = 0x0007 => "LIST_SESSIONS",
        Stats = 0x0008 => "STATS",
        Evict = 0x0009 => "EVICT",
        Demote = 0x0010 => "DEMOTE",
        Promote = 0x0011 => "PROMOTE",
        Pin = 0x0012 => "PIN",
        Unpin = 0x0013 => "UNPIN",
        Lease = 0x0014 => "LEASE",
        Release = 0x0015 => "RELEASE",
        Reserve = 0x0016 => "RESERVE",
        Commit = 0x0017 => "COMMIT",
        Offload = 0x0018 => "OFFLOAD",
    }
}

impl Opcode {
    /// The success reply's wire opcode.
    pub fn reply(self) -> u16 {
        self as u16 | REPLY_BIT
    }

    /// Parse a request opcode; unknown and reserved values are `UnknownOpcode`
    /// (answered with UNIMPLEMENTED).
    pub fn from_u16(opcode: u16) -> Result<Self, ProtoError> {
        Self::from_wire(opcode).ok_or(ProtoError::UnknownOpcode { opcode })
    }

    /// Header flag bits this request may carry.
    pub fn allowed_flags(self) -> u16 {
        match self {
            Opcode::AppendKv => FLAG_APPEND_SHM,
            Opcode::Commit => FLAG_COMMIT_LAYERS,
            _ => 0,
        }
    }
}

/// A decoded frame header. `opcode` stays raw so that a server can answer an unknown opcode
/// (UNIMPLEMENTED) and keep the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub body_len: u32,
    pub request_id: u64,
    pub opcode: u16,
    pub flags: u16,
}

impl Header {
    /// Header for a request.
    pub fn request(opcode: Opcode, flags: u16, request_id: u64, body_len: u32) -> Self {
        Self {
            body_len,
            request_id,
            opcode: opcode.as_u16(),
            flags,
        }
    }

    /// Wire bytes: magic, body_len, request_id, opcode, flags, reserved = 0.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        out[4..8].copy_from_slice(&self.body_len.to_le_bytes());
        out[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        out[16..18].copy_from_slice(&self.opcode.to_le_bytes());
        out[18..20].copy_from_slice(&self.flags.to_le_bytes());
        out
    }

    /// Parse and check magic and the reserved field. Does not look at the opcode or the body
    /// length: call [`Header::check_len`] before reading the body.
    pub fn decode(bytes: &[u8; HEADER_LEN]) -> Result<Self, ProtoError> {
        let u32_at =
            |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
        let u16_at = |i: usize| u16::from_le_bytes([bytes[i], bytes[i + 1]]);
        let magic = u32_at(0);
        if magic != MAGIC {
            return Err(ProtoError::BadMagic { found: magic });
        }
        let reserved = u32_at(20);
        if reserved != 0 {
            return Err(ProtoError::ReservedNonZero { value: reserved });
        }
        let mut id = [0u8; 8];
        id.copy_from_slice(&bytes[8..16]);
        Ok(Self {
            body_len: u32_at(4),
            request_id: u64::from_le_bytes(id),
            opcode: u16_at(16),
            flags: u16_at(18),
        })
    }

    /// Refuse a body larger than `max` bytes, from the header alone.
    pub fn check_len(&self, max: u32) -> Result<(), ProtoError> {
        if self.body_len > max {
            return Err(ProtoError::FrameTooLarge {
                body_len: u64::from(self.body_len),
                max,
            });
        }
        Ok(())
    }

    /// True for reply opcodes (success or error).
    pub fn is_reply(&self) -> bool {
        self.opcode & REPLY_BIT != 0
    }

    /// True for an error reply.
    pub fn is_error(&self) -> bool {
        self.opcode == ERROR_OPCODE
    }
}

/// Write a full frame (header + body produced by `body`) to the end of `buf`, patching the
/// body length in once the body is known.
pub(crate) fn encode_frame(
    buf: &mut Vec<u8>,
    request_id: u64,
    opcode: u16,
    flags: u16,
    body: impl FnOnce(&mut Vec<u8>) -> Result<(), ProtoError>,
) -> Result<(), ProtoError> {
    let start = buf.len();
    let header = Header {
        body_len: 0,
        request_id,
        opcode,
        flags,
    };
    buf.extend_from_slice(&header.encode());
    if let Err(e) = body(buf) {
        buf.truncate(start);
        return Err(e);
    }
    let body_len = buf.len() - start - HEADER_LEN;
    let Ok(len32) = u32::try_from(body_len) else {
        buf.truncate(start);
        return Err(ProtoError::TooLong {
            what: "frame body",
            len: body_len,
        });
    };
    buf[start + 4..start + 8].copy_from_slice(&len32.to_le_bytes());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Header {
        Header::request(Opcode::Decode, 0, 0x0102_0304_0506_0708, 40)
    }

    #[test]
    fn header_layout_is_fixed() {
        let b = sample().encode();
        assert_eq!(&b[0..4], b"KVT1");
        assert_eq!(&b[4..8], &[40, 0, 0, 0]);
        assert_eq!(&b[8..16], &[8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(&b[16..18], &[4, 0]);
        assert_eq!(&b[18..24], &[0; 6]);
        assert_eq!(Header::decode(&b).unwrap(), sample());
    }

    #[test]
    fn bad_magic_is_rejected() {
        let mut b = sample().encode();
        b[0] = b'X';
        assert!(matches!(
            Header::decode(&b),
            Err(ProtoError::BadMagic { found }) if found == u32::from_le_bytes(*b"XVT1")
        ));
    }

    #[test]
    fn reserved_must_be_zero() {
        let mut b = sample().encode();
        b[23] = 1;
        assert_eq!(
            Header::decode(&b),
            Err(ProtoError::ReservedNonZero { value: 1 << 24 })
        );
    }

    #[test]
    fn oversized_body_rejected_from_header() {
        let h = Header::request(Opcode::AppendKv, 0, 1, 1 << 20);
        assert_eq!(h.check_len(1 << 20), Ok(()));
        let err = h.check_len((1 << 20) - 1).unwrap_err();
        assert_eq!(err.error_code(), crate::ErrorCode::ResourceExhausted);
    }

    #[test]
    fn unknown_and_reserved_opcodes() {
        for op in [0u16, 0x000A, 0x0019, 0x001F, 0x7FFF, 0x8001, 0xFFFF] {
            let err = Opcode::from_u16(op).unwrap_err();
            assert_eq!(err, ProtoError::UnknownOpcode { opcode: op });
            assert_eq!(err.error_code(), crate::ErrorCode::Unimplemented);
        }
        for op in Opcode::ALL {
            assert_eq!(Opcode::from_u16(op.as_u16()), Ok(op));
            assert_eq!(op.reply(), op.as_u16() | 0x8000);
        }
    }
}
