//! Reply bodies (success replies and the error reply).

use crate::error::{ErrorCode, ProtoError};
use crate::header::{encode_frame, Header, Opcode, ERROR_OPCODE, PROTOCOL_VERSION, REPLY_BIT};
use crate::types::{DecodeStats, LeaseReply, ReserveReply, SessionInfo};
use crate::wire::{put_f32s, put_len, put_str, put_u16, put_u32, put_u64, put_u8, Reader};

/// HELLO reply: `version u16, max_frame_bytes u32, server_name str, server_version str`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HelloReply {
    /// The negotiated protocol version.
    pub version: u16,
    /// Largest body (bytes, header excluded) the server accepts or sends.
    pub max_frame_bytes: u32,
    pub server_name: String,
    pub server_version: String,
}

impl HelloReply {
    fn put(&self, buf: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_u16(buf, self.version);
        put_u32(buf, self.max_frame_bytes);
        put_str(buf, &self.server_name, "server name")?;
        put_str(buf, &self.server_version, "server version")
    }

    fn get(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(Self {
            version: r.u16("version")?,
            max_frame_bytes: r.u32("max_frame_bytes")?,
            server_name: r.str("server name")?.to_owned(),
            server_version: r.str("server version")?.to_owned(),
        })
    }
}

/// Result of one DECODE entry.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeOutput {
    /// Attention output `[Hq][D]`.
    pub out: Vec<f32>,
    /// Present when the request set the want-stats flag.
    pub stats: Option<DecodeStats>,
}

/// DECODE reply: `count u32`, then per entry `out_len u32` (f32 elements), the f32s,
/// `has_stats u8`, and the stats when `has_stats` is 1.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DecodeReply {
    pub entries: Vec<DecodeOutput>,
}

impl DecodeReply {
    fn put(&self, buf: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_len(buf, self.entries.len(), "decode outputs")?;
        for e in &self.entries {
            put_len(buf, e.out.len(), "decode output")?;
            put_f32s(buf, &e.out);
            match &e.stats {
                None => put_u8(buf, 0),
                Some(s) => {
                    put_u8(buf, 1);
                    s.put(buf)?;
                }
            }
        }
        Ok(())
    }

    fn get(r: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let n = r.count("decode outputs", 5)?;
        let mut entries = Vec::with_capacity(n);
        for _ in 0..n {
            let len = r.count("decode output", 4)?;
            let bytes = r.take(len * 4, "decode output")?;
            let out = crate::wire::f32s_le(bytes).collect();
            let stats = if r.bool("has_stats")? {
                Some(DecodeStats::get(r)?)
            } else {
                None
            };
            entries.push(DecodeOutput { out, stats });
        }
        Ok(Self { entries })
    }
}

/// STATS reply: `count u32`, then `(key str, value u64)` pairs. Keys are open-ended; see
/// [`crate::stats_keys`] for the initial set.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StatsReply {
    pub entries: Vec<(String, u64)>,
}

impl StatsReply {
    /// Value of `key`, if the server reported it.
    pub fn get(&self, key: &str) -> Option<u64> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, v)| *v)
    }
}

/// Error reply (opcode 0xFFFF): `code u16, message str`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorReply {
    pub code: ErrorCode,
    pub message: String,
}

impl ErrorReply {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

impl From<&ProtoError> for ErrorReply {
    fn from(e: &ProtoError) -> Self {
        Self::new(e.error_code(), e.to_string())
    }
}

/// A decoded (or to-be-encoded) reply.
#[derive(Debug, Clone, PartialEq)]
pub enum Response {
    Hello(HelloReply),
    CreateSession {
        session: u64,
    },
    /// The session's new length in tokens.
    AppendKv {
        tokens: u64,
    },
    Decode(DecodeReply),
    SessionInfo(SessionInfo),
    CloseSession,
    ListSessions(Vec<SessionInfo>),
    Stats(StatsReply),
    Evict,
    /// Blocks written to NVMe (or already there) whose host extents were freed.
    Demote {
        blocks: u64,
    },
    /// Blocks read back into the host tier.
    Promote {
        blocks: u64,
    },
    /// Blocks written to the remote tier.
    Offload {
        blocks: u64,
    },
    Pin,
    Unpin,
    /// The block table of a leased session; the arena's descriptor travels with the frame.
    Lease(LeaseReply),
    Release,
    /// Where the reserved rows go.
    Reserve(ReserveReply),
    /// The session's stored tokens after the commit.
    Commit {
        tokens: u64,
    },
    Error(ErrorReply),
}

impl Response {
    /// Wire opcode: request opcode | 0x8000, or 0xFFFF for an error.
    pub fn opcode(&self) -> u16 {
        match self.request_opcode() {
            Some(op) => op.reply(),
            None => ERROR_OPCODE,
        }
    }

    /// The request this reply answers; None for an error reply.
    pub fn request_opcode(&self) -> Option<Opcode> {
        Some(match self {
            Response::Hello(_) => Opcode::Hello,
            Response::CreateSession { .. } => Opcode::CreateSession,
            Response::AppendKv { .. } => Opcode::AppendKv,
            Response::Decode(_) => Opcode::Decode,
            Response::SessionInfo(_) => Opcode::SessionInfo,
            Response::CloseSession => Opcode::CloseSession,
            Response::ListSessions(_) => Opcode::ListSessions,
            Response::Stats(_) => Opcode::Stats,
            Response::Evict => Opcode::Evict,
            Response::Demote { .. } => Opcode::Demote,
            Response::Offload { .. } => Opcode::Offload,
            Response::Promote { .. } => Opcode::Promote,
            Response::Pin => Opcode::Pin,
            Response::Unpin => Opcode::Unpin,
            Response::Lease(_) => Opcode::Lease,
            Response::Release => Opcode::Release,
            Response::Reserve(_) => Opcode::Reserve,
            Response::Commit { .. } => Opcode::Commit,
            Response::Error(_) => return None,
        })
    }

    /// Append the body (no header) to `buf`, in the current protocol version.
    pub fn encode(&self, buf: &mut Vec<u8>) -> Result<(), ProtoError> {
        self.encode_for(PROTOCOL_VERSION, buf)
    }

    /// Append the body (no header) to `buf`, as protocol `version` lays it out.
    pub fn encode_for(&self, version: u16, buf: &mut Vec<u8>) -> Result<(), ProtoError> {
        match self {
            Response::Hello(h) => h.put(buf),
            Response::CreateSession { session } => {
                put_u64(buf, *session);
                Ok(())
            }
            Response::AppendKv { tokens } | Response::Commit { tokens } => {
                put_u64(buf, *tokens);
                Ok(())
            }
            Response::Reserve(r) => r.put(buf),
            Response::Decode(d) => d.put(buf),
            Response::SessionInfo(s) => s.put(buf, version),
            Response::ListSessions(list) => {
                put_len(buf, list.len(), "session list")?;
                list.iter().try_for_each(|s| s.put(buf, version))
            }
            Response::Stats(s) => {
                put_len(buf, s.entries.len(), "stats entries")?;
                for (k, v) in &s.entries {
                    put_str(buf, k, "stats key")?;
                    put_u64(buf, *v);
                }
                Ok(())
            }
            Response::Demote { blocks }
            | Response::Promote { blocks }
            | Response::Offload { blocks } => {
                put_u64(buf, *blocks);
                Ok(())
            }
            Response::Lease(l) => l.put(buf),
            Response::CloseSession
            | Response::Evict
            | Response::Pin
            | Response::Unpin
            | Response::Release => Ok(()),
            Response::Error(e) => {
                put_u16(buf, e.code.as_u16());
                put_str(buf, &e.message, "error message")
            }
        }
    }

    /// Append a whole frame (header + body) answering `request_id` to `buf`, in the current
    /// protocol version.
    pub fn encode_frame(&self, request_id: u64, buf: &mut Vec<u8>) -> Result<(), ProtoError> {
        self.encode_frame_for(PROTOCOL_VERSION, request_id, buf)
    }

    /// [`Response::encode_frame`] for a connection that negotiated protocol `version`.
    pub fn encode_frame_for(
        &self,
        version: u16,
        request_id: u64,
        buf: &mut Vec<u8>,
    ) -> Result<(), ProtoError> {
        encode_frame(buf, request_id, self.opcode(), 0, |b| {
            self.encode_for(version, b)
        })
    }

    /// Decode a reply body of the current protocol version given its header.
    pub fn decode(header: &Header, body: &[u8]) -> Result<Self, ProtoError> {
        Self::decode_for(header, body, PROTOCOL_VERSION)
    }

    /// Decode a reply body of protocol `version` given its header.
    pub fn decode_for(header: &Header, body: &[u8], version: u16) -> Result<Self, ProtoError> {
        if body.len() != header.body_len as usize {
            return Err(ProtoError::BodyLenMismatch {
                announced: header.body_len,
                actual: body.len(),
            });
        }
        if header.opcode & REPLY_BIT == 0 {
            return Err(ProtoError::NotAReply {
                opcode: header.opcode,
            });
        }
        if header.flags != 0 {
            return Err(ProtoError::BadFlags {
                opcode: header.opcode,
                flags: u32::from(header.flags),
            });
        }
        let mut r = Reader::new(body);
        let out = if header.opcode == ERROR_OPCODE {
            Response::Error(ErrorReply {
                code: ErrorCode::from_u16(r.u16("error code")?)?,
                message: r.str("error message")?.to_owned(),
            })
        } else {
            match Opcode::from_u16(header.opcode & !REPLY_BIT)? {
                Opcode::Hello => Response::Hello(HelloReply::get(&mut r)?),
                Opcode::CreateSession => Response::CreateSession {
                    session: r.u64("session")?,
                },
                Opcode::AppendKv => Response::AppendKv {
                    tokens: r.u64("tokens")?,
                },
                Opcode::Decode => Response::Decode(DecodeReply::get(&mut r)?),
                Opcode::SessionInfo => Response::SessionInfo(SessionInfo::get(&mut r, version)?),
                Opcode::CloseSession => Response::CloseSession,
                Opcode::ListSessions => {
                    let n = r.count("session list", SessionInfo::MIN_WIRE_LEN)?;
                    let mut list = Vec::with_capacity(n);
                    for _ in 0..n {
                        list.push(SessionInfo::get(&mut r, version)?);
                    }
                    Response::ListSessions(list)
                }
                Opcode::Stats => {
                    let n = r.count("stats entries", 12)?;
                    let mut entries = Vec::with_capacity(n);
                    for _ in 0..n {
                        let k = r.str("stats key")?.to_owned();
                        entries.push((k, r.u64("stats value")?));
                    }
                    Response::Stats(StatsReply { entries })
                }
                Opcode::Evict => Response::Evict,
                Opcode::Demote => Response::Demote {
                    blocks: r.u64("blocks")?,
                },
                Opcode::Promote => Response::Promote {
                    blocks: r.u64("blocks")?,
                },
                Opcode::Offload => Response::Offload {
                    blocks: r.u64("blocks")?,
                },
                Opcode::Pin => Response::Pin,
                Opcode::Unpin => Response::Unpin,
                Opcode::Lease => Response::Lease(LeaseReply::get(&mut r)?),
                Opcode::Release => Response::Release,
                Opcode::Reserve => Response::Reserve(ReserveReply::get(&mut r)?),
                Opcode::Commit => Response::Commit {
                    tokens: r.u64("tokens")?,
                },
            }
        };
        r.finish()?;
        Ok(out)
    }
}
