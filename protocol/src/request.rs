//! Request bodies. Decoding borrows KV and query payloads from the body buffer.

use crate::error::ProtoError;
use crate::header::{encode_frame, Header, Opcode, FLAG_APPEND_SHM, FLAG_COMMIT_LAYERS, REPLY_BIT};
use crate::types::{get_geometry, get_policy, put_geometry, put_policy, Geometry, Policy};
use crate::wire::{f32s_le, put_len, put_str, put_u16, put_u32, put_u64, Reader};

/// DECODE body flag: return per-entry [`crate::DecodeStats`].
pub const DECODE_WANT_STATS: u32 = 0x1;

/// HELLO: `min_version u16, max_version u16, client_name str`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HelloRequest {
    pub min_version: u16,
    pub max_version: u16,
    pub client_name: String,
}

impl HelloRequest {
    pub fn encode(&self, buf: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_u16(buf, self.min_version);
        put_u16(buf, self.max_version);
        put_str(buf, &self.client_name, "client name")
    }

    pub fn decode(body: &[u8]) -> Result<Self, ProtoError> {
        let mut r = Reader::new(body);
        let out = Self {
            min_version: r.u16("min_version")?,
            max_version: r.u16("max_version")?,
            client_name: r.str("client name")?.to_owned(),
        };
        r.finish()?;
        Ok(out)
    }
}

/// CREATE_SESSION: geometry (21 bytes), policy (12 bytes), `label str`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreateSessionRequest {
    pub geometry: Geometry,
    pub policy: Policy,
    /// Optional human name; may be empty.
    pub label: String,
}

impl CreateSessionRequest {
    pub fn encode(&self, buf: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_geometry(&self.geometry, buf);
        put_policy(&self.policy, buf);
        put_str(buf, &self.label, "session label")
    }

    pub fn decode(body: &[u8]) -> Result<Self, ProtoError> {
        let mut r = Reader::new(body);
        let out = Self {
            geometry: get_geometry(&mut r)?,
            policy: get_policy(&mut r)?,
            label: r.str("session label")?.to_owned(),
        };
        r.finish()?;
        Ok(out)
    }
}

/// Where an APPEND_KV payload lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AppendData<'a> {
    /// Payload bytes follow in the body (`payload_len u64` + bytes).
    Inline(&'a [u8]),
    /// `offset u64, len u64` into the one file descriptor passed with SCM_RIGHTS alongside
    /// the frame (header flag [`FLAG_APPEND_SHM`]).
    Shm { offset: u64, len: u64 },
}

/// APPEND_KV: `session u64, start_pos u64, n_tokens u32, reserved u32 = 0`, then the inline
/// payload or the shared-memory range. The payload is, for each layer, K `[n][Hkv][D]` then
/// V `[n][Hkv][D]` in the session dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AppendKvRequest<'a> {
    pub session: u64,
    pub start_pos: u64,
    pub n_tokens: u32,
    pub data: AppendData<'a>,
}

impl<'a> AppendKvRequest<'a> {
    /// Header flags this request is sent with.
    pub fn flags(&self) -> u16 {
        match self.data {
            AppendData::Inline(_) => 0,
            AppendData::Shm { .. } => FLAG_APPEND_SHM,
        }
    }

    /// Payload length in bytes (inline length or the shared-memory range length).
    pub fn payload_len(&self) -> u64 {
        match self.data {
            AppendData::Inline(p) => p.len() as u64,
            AppendData::Shm { len, .. } => len,
        }
    }

    /// Everything up to the inline payload bytes (the whole body for the shm variant); lets a
    /// client write the payload from its own buffer without copying it into the frame.
    pub fn encode_prefix(&self, buf: &mut Vec<u8>) {
        put_u64(buf, self.session);
        put_u64(buf, self.start_pos);
        put_u32(buf, self.n_tokens);
        put_u32(buf, 0);
        match self.data {
            AppendData::Inline(p) => put_u64(buf, p.len() as u64),
            AppendData::Shm { offset, len } => {
                put_u64(buf, offset);
                put_u64(buf, len);
            }
        }
    }

    pub fn encode(&self, buf: &mut Vec<u8>) -> Result<(), ProtoError> {
        self.encode_prefix(buf);
        if let AppendData::Inline(p) = self.data {
            buf.extend_from_slice(p);
        }
        Ok(())
    }

    /// `flags` are the header flags; [`FLAG_APPEND_SHM`] selects the shared-memory layout.
    pub fn decode(flags: u16, body: &'a [u8]) -> Result<Self, ProtoError> {
        check_flags(Opcode::AppendKv, flags)?;
        let mut r = Reader::new(body);
        let session = r.u64("session")?;
        let start_pos = r.u64("start_pos")?;
        let n_tokens = r.u32("n_tokens")?;
        let reserved = r.u32("append reserved")?;
        if reserved != 0 {
            return Err(ProtoError::ReservedNonZero { value: reserved });
        }
        let data = if flags & FLAG_APPEND_SHM != 0 {
            AppendData::Shm {
                offset: r.u64("shm offset")?,
                len: r.u64("shm len")?,
            }
        } else {
            let len = r.u64("payload_len")?;
            let len = usize::try_from(len).map_err(|_| ProtoError::LengthOverflow {
                what: "payload_len",
            })?;
            AppendData::Inline(r.take(len, "append payload")?)
        };
        r.finish()?;
        Ok(Self {
            session,
            start_pos,
            n_tokens,
            data,
        })
    }
}

/// One DECODE entry, borrowed from the body. Wire: `session u64, position u64, q_len u32,
/// kv_len u32`, then q (`q_len` bytes, f32), k and v (`kv_len` bytes each, session dtype).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeEntryRef<'a> {
    pub session: u64,
    /// The new token's position, which must equal the layer's current length.
    pub position: u64,
    /// `[Hq][D]` little-endian f32.
    pub q: &'a [u8],
    /// `[Hkv][D]` in the session dtype.
    pub k: &'a [u8],
    /// `[Hkv][D]` in the session dtype.
    pub v: &'a [u8],
}

impl DecodeEntryRef<'_> {
    /// Bytes of the fixed part of an entry.
    pub const FIXED_LEN: usize = 8 + 8 + 4 + 4;

    /// The query as f32 values, decoded on the fly.
    pub fn q_f32(&self) -> impl ExactSizeIterator<Item = f32> + '_ {
        f32s_le(self.q)
    }

    /// Copy the query into `out` (`out.len()` must be `q.len() / 4`).
    pub fn read_q_into(&self, out: &mut [f32]) -> Result<(), ProtoError> {
        crate::wire::read_f32s_into(self.q, out)
    }

    fn put(&self, buf: &mut Vec<u8>) -> Result<(), ProtoError> {
        if self.q.len() % 4 != 0 {
            return Err(misaligned_q(self.q.len()));
        }
        if self.k.len() != self.v.len() {
            return Err(ProtoError::Truncated {
                what: "decode v (k and v must have the same length)",
                needed: self.k.len(),
                available: self.v.len(),
            });
        }
        put_u64(buf, self.session);
        put_u64(buf, self.position);
        put_len(buf, self.q.len(), "decode q")?;
        put_len(buf, self.k.len(), "decode k/v")?;
        buf.extend_from_slice(self.q);
        buf.extend_from_slice(self.k);
        buf.extend_from_slice(self.v);
        Ok(())
    }
}

fn misaligned_q(len: usize) -> ProtoError {
    ProtoError::Misaligned {
        what: "decode q",
        len,
        multiple: 4,
    }
}

/// DECODE: `layer u32, flags u32, count u32`, then `count` entries. Many entries = batch
/// decode of several sessions at the same layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeRequest<'a> {
    pub layer: u32,
    pub want_stats: bool,
    pub entries: Vec<DecodeEntryRef<'a>>,
}

impl<'a> DecodeRequest<'a> {
    pub fn encode(&self, buf: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_u32(buf, self.layer);
        put_u32(
            buf,
            if self.want_stats {
                DECODE_WANT_STATS
            } else {
                0
            },
        );
        put_len(buf, self.entries.len(), "decode entries")?;
        for e in &self.entries {
            e.put(buf)?;
        }
        Ok(())
    }

    pub fn decode(body: &'a [u8]) -> Result<Self, ProtoError> {
        let mut r = Reader::new(body);
        let layer = r.u32("layer")?;
        let flags = r.u32("decode flags")?;
        if flags & !DECODE_WANT_STATS != 0 {
            return Err(ProtoError::BadFlags {
                opcode: Opcode::Decode.as_u16(),
                flags,
            });
        }
        let n = r.count("decode entries", DecodeEntryRef::FIXED_LEN)?;
        let mut entries = Vec::with_capacity(n);
        for _ in 0..n {
            let session = r.u64("entry session")?;
            let position = r.u64("entry position")?;
            let q_len = r.u32("q_len")? as usize;
            let kv_len = r.u32("kv_len")? as usize;
            if q_len % 4 != 0 {
                return Err(misaligned_q(q_len));
            }
            let q = r.take(q_len, "decode q")?;
            let k = r.take(kv_len, "decode k")?;
            let v = r.take(kv_len, "decode v")?;
            entries.push(DecodeEntryRef {
                session,
                position,
                q,
                k,
                v,
            });
        }
        r.finish()?;
        Ok(Self {
            layer,
            want_stats: flags & DECODE_WANT_STATS != 0,
            entries,
        })
    }
}

/// A decoded (or to-be-encoded) request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request<'a> {
    Hello(HelloRequest),
    CreateSession(CreateSessionRequest),
    AppendKv(AppendKvRequest<'a>),
    Decode(DecodeRequest<'a>),
    SessionInfo {
        session: u64,
    },
    CloseSession {
        session: u64,
    },
    ListSessions,
    Stats,
    /// Admin: drop any session.
    Evict {
        session: u64,
    },
    /// Write a session's blocks to the NVMe tier and free its host extents.
    Demote {
        session: u64,
    },
    /// Bring every block of a session back into the host tier.
    Promote {
        session: u64,
    },
    /// Move a session to the remote tier: write it there, give up this node's claim and
    /// drop it here (any node resumes it).
    Offload {
        session: u64,
    },
    /// Never demote this session (until UNPIN).
    Pin {
        session: u64,
    },
    Unpin {
        session: u64,
    },
    /// Read a session's block runs in place: its block table and (SCM_RIGHTS) the shared
    /// host arena; the daemon keeps the named extents where they are until RELEASE or the
    /// connection closes.
    Lease {
        session: u64,
    },
    Release {
        session: u64,
    },
    /// Open an append of `tokens` tokens to every layer whose rows the engine writes in place
    /// into the leased arena (the connection must hold the session's lease).
    Reserve {
        session: u64,
        tokens: u32,
    },
    /// Adopt the first `tokens` rows written since RESERVE (0: drop them): of the layers
    /// `layers` names (first, count; since protocol version 5), which are checked and
    /// summarized now and adopted with the last ones, or of every layer not yet committed.
    Commit {
        session: u64,
        tokens: u32,
        layers: Option<(u32, u32)>,
    },
}

impl<'a> Request<'a> {
    pub fn opcode(&self) -> Opcode {
        match self {
            Request::Hello(_) => Opcode::Hello,
            Request::CreateSession(_) => Opcode::CreateSession,
            Request::AppendKv(_) => Opcode::AppendKv,
            Request::Decode(_) => Opcode::Decode,
            Request::SessionInfo { .. } => Opcode::SessionInfo,
            Request::CloseSession { .. } => Opcode::CloseSession,
            Request::ListSessions => Opcode::ListSessions,
            Request::Stats => Opcode::Stats,
            Request::Evict { .. } => Opcode::Evict,
            Request::Demote { .. } => Opcode::Demote,
            Request::Promote { .. } => Opcode::Promote,
            Request::Offload { .. } => Opcode::Offload,
            Request::Pin { .. } => Opcode::Pin,
            Request::Unpin { .. } => Opcode::Unpin,
            Request::Lease { .. } => Opcode::Lease,
            Request::Release { .. } => Opcode::Release,
            Request::Reserve { .. } => Opcode::Reserve,
            Request::Commit { .. } => Opcode::Commit,
        }
    }

    /// Header flags the request is sent with.
    pub fn flags(&self) -> u16 {
        match self {
            Request::AppendKv(a) => a.flags(),
            Request::Commit {
                layers: Some(_), ..
            } => FLAG_COMMIT_LAYERS,
            _ => 0,
        }
    }

    /// Append the body (no header) to `buf`.
    pub fn encode(&self, buf: &mut Vec<u8>) -> Result<(), ProtoError> {
        match self {
            Request::Hello(h) => h.encode(buf),
            Request::CreateSession(c) => c.encode(buf),
            Request::AppendKv(a) => a.encode(buf),
            Request::Decode(d) => d.encode(buf),
            Request::SessionInfo { session }
            | Request::CloseSession { session }
            | Request::Evict { session }
            | Request::Demote { session }
            | Request::Promote { session }
            | Request::Offload { session }
            | Request::Pin { session }
            | Request::Unpin { session }
            | Request::Lease { session }
            | Request::Release { session } => {
                put_u64(buf, *session);
                Ok(())
            }
            Request::Reserve { session, tokens } => {
                put_u64(buf, *session);
                put_u32(buf, *tokens);
                Ok(())
            }
            Request::Commit {
                session,
                tokens,
                layers,
            } => {
                put_u64(buf, *session);
                put_u32(buf, *tokens);
                if let Some((first, count)) = layers {
                    put_u32(buf, *first);
                    put_u32(buf, *count);
                }
                Ok(())
            }
            Request::ListSessions | Request::Stats => Ok(()),
        }
    }

    /// Append a whole frame (header + body) to `buf`.
    pub fn encode_frame(&self, request_id: u64, buf: &mut Vec<u8>) -> Result<(), ProtoError> {
        encode_frame(buf, request_id, self.opcode().as_u16(), self.flags(), |b| {
            self.encode(b)
        })
    }

    /// Decode a request body given its header. Unknown opcodes give `UnknownOpcode`
    /// (UNIMPLEMENTED); every other failure maps to INVALID_ARGUMENT.
    pub fn decode(header: &Header, body: &'a [u8]) -> Result<Self, ProtoError> {
        if body.len() != header.body_len as usize {
            return Err(ProtoError::BodyLenMismatch {
                announced: header.body_len,
                actual: body.len(),
            });
        }
        if header.opcode & REPLY_BIT != 0 {
            return Err(ProtoError::NotARequest {
                opcode: header.opcode,
            });
        }
        let op = Opcode::from_u16(header.opcode)?;
        check_flags(op, header.flags)?;
        let session_only = |body: &[u8]| -> Result<u64, ProtoError> {
            let mut r = Reader::new(body);
            let s = r.u64("session")?;
            r.finish()?;
            Ok(s)
        };
        Ok(match op {
            Opcode::Hello => Request::Hello(HelloRequest::decode(body)?),
            Opcode::CreateSession => Request::CreateSession(CreateSessionRequest::decode(body)?),
            Opcode::AppendKv => Request::AppendKv(AppendKvRequest::decode(header.flags, body)?),
            Opcode::Decode => Request::Decode(DecodeRequest::decode(body)?),
            Opcode::ListSessions => {
                Reader::new(body).finish()?;
                Request::ListSessions
            }
            Opcode::Stats => {
                Reader::new(body).finish()?;
                Request::Stats
            }
            Opcode::SessionInfo
            | Opcode::CloseSession
            | Opcode::Evict
            | Opcode::Demote
            | Opcode::Promote
            | Opcode::Offload
            | Opcode::Pin
            | Opcode::Unpin
            | Opcode::Lease
            | Opcode::Release => {
                Request::for_session(op, session_only(body)?).expect("a session-only opcode")
            }
            Opcode::Reserve | Opcode::Commit => {
                let mut r = Reader::new(body);
                let (session, tokens) = (r.u64("session")?, r.u32("tokens")?);
                // A COMMIT with FLAG_COMMIT_LAYERS names its layers (first, count).
                let layers = match header.flags & FLAG_COMMIT_LAYERS != 0 {
                    true => Some((r.u32("first layer")?, r.u32("layer count")?)),
                    false => None,
                };
                r.finish()?;
                if op == Opcode::Reserve {
                    Request::Reserve { session, tokens }
                } else {
                    Request::Commit {
                        session,
                        tokens,
                        layers,
                    }
                }
            }
        })
    }

    /// The request of a session-only opcode (its body is the session id); None for the others.
    pub fn for_session(op: Opcode, session: u64) -> Option<Self> {
        Some(match op {
            Opcode::SessionInfo => Request::SessionInfo { session },
            Opcode::CloseSession => Request::CloseSession { session },
            Opcode::Evict => Request::Evict { session },
            Opcode::Demote => Request::Demote { session },
            Opcode::Promote => Request::Promote { session },
            Opcode::Offload => Request::Offload { session },
            Opcode::Pin => Request::Pin { session },
            Opcode::Unpin => Request::Unpin { session },
            Opcode::Lease => Request::Lease { session },
            Opcode::Release => Request::Release { session },
            Opcode::Hello
            | Opcode::CreateSession
            | Opcode::AppendKv
            | Opcode::Decode
            | Opcode::ListSessions
            | Opcode::Stats
            | Opcode::Reserve
            | Opcode::Commit => return None,
        })
    }
}

fn check_flags(op: Opcode, flags: u16) -> Result<(), ProtoError> {
    if flags & !op.allowed_flags() != 0 {
        return Err(ProtoError::BadFlags {
            opcode: op.as_u16(),
            flags: u32::from(flags),
        });
    }
    Ok(())
}
