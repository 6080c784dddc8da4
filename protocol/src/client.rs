//! Blocking client over a Unix stream socket. One request in flight at a time; every call
//! returns the server's typed error as [`ClientError::Server`].

use std::ffi::OsString;
use std::io::{self, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::error::{ErrorCode, ProtoError};
use crate::fdpass;
use crate::header::{
    Header, Opcode, HEADER_LEN, LAYER_COMMIT_VERSION, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION,
};
use crate::request::{
    AppendData, AppendKvRequest, CreateSessionRequest, DecodeEntryRef, DecodeRequest, HelloRequest,
    Request,
};
use crate::response::{DecodeOutput, HelloReply, Response, StatsReply};
use crate::types::{Geometry, LeaseReply, Policy, ReserveReply, SessionInfo};

/// Largest HELLO reply accepted before the server has told us its limit.
const HELLO_REPLY_MAX: u32 = 64 * 1024;

/// Environment variable naming the daemon socket; overrides every other default.
pub const SOCKET_ENV: &str = "KVTIER_SOCKET";

/// The socket path `tierd` listens on and clients connect to when none is given:
/// `$KVTIER_SOCKET`, else `$XDG_RUNTIME_DIR/kvtier/tierd.sock`, else
/// `/run/kvtier/tierd.sock` for root, else `/tmp/kvtier-<uid>/tierd.sock`. Empty variables
/// count as unset.
pub fn default_socket_path() -> PathBuf {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    socket_path_from(
        std::env::var_os(SOCKET_ENV),
        std::env::var_os("XDG_RUNTIME_DIR"),
        euid,
    )
}

/// [`default_socket_path`] with its inputs made explicit (testable without touching the
/// process environment).
pub fn socket_path_from(
    kvtier_socket: Option<OsString>,
    xdg_runtime_dir: Option<OsString>,
    euid: u32,
) -> PathBuf {
    let set = |v: Option<OsString>| v.filter(|v| !v.is_empty());
    if let Some(p) = set(kvtier_socket) {
        return PathBuf::from(p);
    }
    if let Some(dir) = set(xdg_runtime_dir) {
        return Path::new(&dir).join("kvtier").join("tierd.sock");
    }
    if euid == 0 {
        return PathBuf::from("/run/kvtier/tierd.sock");
    }
    PathBuf::from(format!("/tmp/kvtier-{euid}/tierd.sock"))
}

/// Failures of a client call.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("socket I/O: {0}")]
    Io(#[from] io::Error),
    #[error("protocol: {0}")]
    Proto(#[from] ProtoError),
    /// The server answered with an error reply.
    #[error("server error {code}: {message}")]
    Server { code: ErrorCode, message: String },
    #[error("server closed the connection")]
    Closed,
    #[error("reply carries request id {got}, expected {expected}")]
    RequestIdMismatch { expected: u64, got: u64 },
    #[error("reply opcode 0x{got:04x} does not answer {expected}")]
    UnexpectedReply { expected: &'static str, got: u16 },
    #[error("request body of {len} bytes exceeds the server's max_frame_bytes {max}")]
    FrameTooLarge { len: usize, max: u32 },
    #[error("server chose protocol version {version}, this client speaks {MIN_PROTOCOL_VERSION}..={PROTOCOL_VERSION}")]
    Version { version: u16 },
    #[error("peer sent {count} unexpected file descriptors")]
    UnexpectedFds { count: usize },
}

impl ClientError {
    /// The server's error code, for errors the server reported.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Server { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// Read bytes until `buf` is full, collecting passed descriptors. `Ok(false)` if the stream
/// ended before the first byte (clean close), EOF mid-way is `UnexpectedEof`.
fn read_exact_fds(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> io::Result<bool> {
    let mut done = 0;
    while done < buf.len() {
        let n = fdpass::recv_with_fds(sock, &mut buf[done..], fds)?;
        if n == 0 {
            if done == 0 {
                return Ok(false);
            }
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        done += n;
    }
    Ok(true)
}

/// Read one frame exactly (header, then `body_len` bytes) from a blocking socket. The body
/// replaces the contents of `body`; descriptors received with the frame are appended to
/// `fds`. A header announcing more than `max_body` bytes fails before the body is read.
/// `Ok(None)` on a clean end of stream at a frame boundary.
pub fn read_frame(
    stream: &UnixStream,
    max_body: u32,
    body: &mut Vec<u8>,
    fds: &mut Vec<OwnedFd>,
) -> Result<Option<Header>, ClientError> {
    let mut hbuf = [0u8; HEADER_LEN];
    if !read_exact_fds(stream.as_fd(), &mut hbuf, fds)? {
        return Ok(None);
    }
    let header = Header::decode(&hbuf)?;
    header.check_len(max_body)?;
    body.clear();
    body.resize(header.body_len as usize, 0);
    if !body.is_empty() && !read_exact_fds(stream.as_fd(), body, fds)? {
        return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
    }
    Ok(Some(header))
}

/// A connected, handshaken client.
pub struct Client {
    stream: UnixStream,
    server: HelloReply,
    next_id: u64,
    buf: Vec<u8>,
    body: Vec<u8>,
}

/// Sends `req` and takes the reply matching `pat` (its value `val`); any other reply is a typed
/// error naming both opcodes.
macro_rules! expect_reply {
    ($client:ident, $req:expr, $pat:pat => $val:expr) => {{
        let req = $req;
        match $client.call(&req)? {
            $pat => Ok($val),
            other => Err(unexpected(req.opcode(), &other)),
        }
    }};
}

impl Client {
    /// Connect to the daemon socket at `path` and perform HELLO.
    pub fn connect(path: impl AsRef<Path>) -> Result<Self, ClientError> {
        Self::connect_as(path, "kvtier-protocol-rs")
    }

    /// Like [`Client::connect`] with a client name the server may log.
    pub fn connect_as(path: impl AsRef<Path>, client_name: &str) -> Result<Self, ClientError> {
        Self::handshake(UnixStream::connect(path)?, client_name)
    }

    /// Perform HELLO on an already connected stream.
    pub fn handshake(stream: UnixStream, client_name: &str) -> Result<Self, ClientError> {
        let mut c = Self {
            stream,
            server: HelloReply {
                version: 0,
                max_frame_bytes: HELLO_REPLY_MAX,
                server_name: String::new(),
                server_version: String::new(),
            },
            next_id: 1,
            buf: Vec::new(),
            body: Vec::new(),
        };
        let req = Request::Hello(HelloRequest {
            min_version: MIN_PROTOCOL_VERSION,
            max_version: PROTOCOL_VERSION,
            client_name: client_name.to_owned(),
        });
        match c.call(&req)? {
            Response::Hello(h) => {
                if !(MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&h.version) {
                    return Err(ClientError::Version { version: h.version });
                }
                c.server = h;
                Ok(c)
            }
            other => Err(unexpected(Opcode::Hello, &other)),
        }
    }

    /// What the server said in HELLO (version, max frame, name, version string).
    pub fn server(&self) -> &HelloReply {
        &self.server
    }

    /// Read and write timeout for every later call (None = block forever).
    pub fn set_timeout(&self, timeout: Option<Duration>) -> Result<(), ClientError> {
        self.stream.set_read_timeout(timeout)?;
        self.stream.set_write_timeout(timeout)?;
        Ok(())
    }

    /// Send any request and wait for its reply. Error replies become `ClientError::Server`.
    pub fn call(&mut self, req: &Request<'_>) -> Result<Response, ClientError> {
        let (resp, fds) = self.call_fds(req)?;
        if !fds.is_empty() {
            return Err(ClientError::UnexpectedFds { count: fds.len() });
        }
        Ok(resp)
    }

    /// [`Client::call`], keeping the descriptors that come with the reply (LEASE's arena).
    fn call_fds(&mut self, req: &Request<'_>) -> Result<(Response, Vec<OwnedFd>), ClientError> {
        let id = self.take_id();
        self.buf.clear();
        req.encode_frame(id, &mut self.buf)?;
        self.check_body_len(self.buf.len() - HEADER_LEN)?;
        self.stream.write_all(&self.buf)?;
        self.read_reply_fds(id, req.opcode())
    }

    pub fn create_session(
        &mut self,
        geometry: Geometry,
        policy: Policy,
        label: &str,
    ) -> Result<u64, ClientError> {
        let req = Request::CreateSession(CreateSessionRequest {
            geometry,
            policy,
            label: label.to_owned(),
        });
        expect_reply!(self, req, Response::CreateSession { session } => session)
    }

    /// Append `n_tokens` to every layer, payload inline in the frame (written straight from
    /// `payload`, not copied). Returns the session's new length.
    pub fn append_kv(
        &mut self,
        session: u64,
        start_pos: u64,
        n_tokens: u32,
        payload: &[u8],
    ) -> Result<u64, ClientError> {
        let req = AppendKvRequest {
            session,
            start_pos,
            n_tokens,
            data: AppendData::Inline(payload),
        };
        let id = self.take_id();
        self.buf.clear();
        self.buf.extend_from_slice(&[0u8; HEADER_LEN]);
        req.encode_prefix(&mut self.buf);
        let body_len = self.buf.len() - HEADER_LEN + payload.len();
        self.check_body_len(body_len)?;
        let header = Header::request(Opcode::AppendKv, req.flags(), id, body_len as u32);
        self.buf[..HEADER_LEN].copy_from_slice(&header.encode());
        self.stream.write_all(&self.buf)?;
        self.stream.write_all(payload)?;
        self.append_reply(id)
    }

    /// Append through shared memory: copy `payload` into a fresh sealed memfd and pass it with
    /// SCM_RIGHTS. Returns the session's new length.
    pub fn append_kv_shm(
        &mut self,
        session: u64,
        start_pos: u64,
        n_tokens: u32,
        payload: &[u8],
    ) -> Result<u64, ClientError> {
        let fd = fdpass::sealed_memfd(c"kvtier-append", payload)?;
        self.append_kv_fd(
            session,
            start_pos,
            n_tokens,
            fd.as_fd(),
            0,
            payload.len() as u64,
        )
    }

    /// Append the `len` bytes at `offset` of an existing file or memfd. The range must not
    /// change until this call returns.
    pub fn append_kv_fd(
        &mut self,
        session: u64,
        start_pos: u64,
        n_tokens: u32,
        fd: BorrowedFd<'_>,
        offset: u64,
        len: u64,
    ) -> Result<u64, ClientError> {
        let req = Request::AppendKv(AppendKvRequest {
            session,
            start_pos,
            n_tokens,
            data: AppendData::Shm { offset, len },
        });
        let id = self.take_id();
        self.buf.clear();
        req.encode_frame(id, &mut self.buf)?;
        let sent = fdpass::send_with_fd(self.stream.as_fd(), &[&self.buf], fd)?;
        // The descriptor went with the first byte; the rest (if any) is ordinary data.
        self.stream.write_all(&self.buf[sent..])?;
        self.append_reply(id)
    }

    /// Single-session decode step for `layer`.
    pub fn decode(
        &mut self,
        layer: u32,
        entry: DecodeEntryRef<'_>,
        want_stats: bool,
    ) -> Result<DecodeOutput, ClientError> {
        let mut out = self.decode_batch(layer, &[entry], want_stats)?;
        match out.pop() {
            Some(o) if out.is_empty() => Ok(o),
            _ => Err(ClientError::UnexpectedReply {
                expected: "DECODE with one entry",
                got: Opcode::Decode.reply(),
            }),
        }
    }

    /// Batch decode: many sessions, same layer; outputs in entry order.
    pub fn decode_batch(
        &mut self,
        layer: u32,
        entries: &[DecodeEntryRef<'_>],
        want_stats: bool,
    ) -> Result<Vec<DecodeOutput>, ClientError> {
        let req = Request::Decode(DecodeRequest {
            layer,
            want_stats,
            entries: entries.to_vec(),
        });
        match self.call(&req)? {
            Response::Decode(d) if d.entries.len() == entries.len() => Ok(d.entries),
            other => Err(unexpected(Opcode::Decode, &other)),
        }
    }

    pub fn session_info(&mut self, session: u64) -> Result<SessionInfo, ClientError> {
        expect_reply!(self, Request::SessionInfo { session }, Response::SessionInfo(s) => s)
    }

    /// CLOSE_SESSION.
    pub fn close(&mut self, session: u64) -> Result<(), ClientError> {
        expect_reply!(self, Request::CloseSession { session }, Response::CloseSession => ())
    }

    pub fn list_sessions(&mut self) -> Result<Vec<SessionInfo>, ClientError> {
        expect_reply!(self, Request::ListSessions, Response::ListSessions(l) => l)
    }

    pub fn stats(&mut self) -> Result<StatsReply, ClientError> {
        expect_reply!(self, Request::Stats, Response::Stats(s) => s)
    }

    /// Admin: drop any session.
    pub fn evict(&mut self, session: u64) -> Result<(), ClientError> {
        expect_reply!(self, Request::Evict { session }, Response::Evict => ())
    }

    /// Writes the session to the NVMe tier and frees its host extents; returns the blocks freed.
    pub fn demote(&mut self, session: u64) -> Result<u64, ClientError> {
        expect_reply!(self, Request::Demote { session }, Response::Demote { blocks } => blocks)
    }

    /// Reads every cold block of the session back into RAM; returns the blocks read.
    pub fn promote(&mut self, session: u64) -> Result<u64, ClientError> {
        expect_reply!(self, Request::Promote { session }, Response::Promote { blocks } => blocks)
    }

    /// Moves the session to the remote tier (tierd's `[remote]`): written there, then dropped
    /// here; any node resumes it when asked for it. Returns the blocks written.
    pub fn offload(&mut self, session: u64) -> Result<u64, ClientError> {
        expect_reply!(self, Request::Offload { session }, Response::Offload { blocks } => blocks)
    }

    /// Pins (`true`) or unpins the session: a pinned session is never demoted.
    pub fn pin(&mut self, session: u64, pinned: bool) -> Result<(), ClientError> {
        let req = if pinned {
            Request::Pin { session }
        } else {
            Request::Unpin { session }
        };
        match (self.call(&req)?, pinned) {
            (Response::Pin, true) | (Response::Unpin, false) => Ok(()),
            (other, _) => Err(unexpected(req.opcode(), &other)),
        }
    }

    fn take_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        id
    }

    fn check_body_len(&self, len: usize) -> Result<(), ClientError> {
        let max = self.server.max_frame_bytes;
        // Before HELLO completes the limit is unknown; the HELLO body is tiny anyway.
        if self.server.version != 0 && len > max as usize {
            return Err(ClientError::FrameTooLarge { len, max });
        }
        Ok(())
    }

    fn append_reply(&mut self, id: u64) -> Result<u64, ClientError> {
        match self.read_reply(id, Opcode::AppendKv)? {
            Response::AppendKv { tokens } => Ok(tokens),
            other => Err(unexpected(Opcode::AppendKv, &other)),
        }
    }

    /// Leases session `session` for reading its block runs in place: the block table and the
    /// daemon's shared host arena (map it read-only; see docs/protocol.md, LEASE). The lease
    /// holds until [`Client::release`] or until this connection closes.
    pub fn lease(&mut self, session: u64) -> Result<(LeaseReply, OwnedFd), ClientError> {
        let (resp, mut fds) = self.call_fds(&Request::Lease { session })?;
        match (resp, fds.len()) {
            (Response::Lease(l), 1) => Ok((l, fds.pop().expect("one"))),
            (Response::Lease(_), n) => Err(ClientError::UnexpectedFds { count: n }),
            (other, _) => Err(unexpected(Opcode::Lease, &other)),
        }
    }

    /// Ends this connection's lease of `session`.
    pub fn release(&mut self, session: u64) -> Result<(), ClientError> {
        expect_reply!(self, Request::Release { session }, Response::Release => ())
    }

    /// Opens an append of `tokens` tokens to every layer of a session this connection leases,
    /// whose rows the engine writes in place (docs/protocol.md, RESERVE): where they go.
    pub fn reserve(&mut self, session: u64, tokens: u32) -> Result<ReserveReply, ClientError> {
        expect_reply!(self, Request::Reserve { session, tokens }, Response::Reserve(r) => r)
    }

    /// Adopts the first `tokens` rows written since RESERVE (0 drops them) into every layer
    /// not yet committed; returns the session's stored tokens.
    pub fn commit(&mut self, session: u64, tokens: u32) -> Result<u64, ClientError> {
        let layers = None;
        expect_reply!(self, Request::Commit { session, tokens, layers }, Response::Commit { tokens } => tokens)
    }

    /// Commits the first `tokens` rows of layers `first..first + count` only: checked and
    /// summarized now, adopted with the last layer's COMMIT (protocol version 5; an older
    /// server is [`ClientError::Version`]). Returns the session's stored tokens: unchanged
    /// until every layer is committed.
    pub fn commit_layers(
        &mut self,
        session: u64,
        tokens: u32,
        first: u32,
        count: u32,
    ) -> Result<u64, ClientError> {
        if self.server.version < LAYER_COMMIT_VERSION {
            return Err(ClientError::Version {
                version: self.server.version,
            });
        }
        let layers = Some((first, count));
        expect_reply!(self, Request::Commit { session, tokens, layers }, Response::Commit { tokens } => tokens)
    }

    fn read_reply(&mut self, id: u64, op: Opcode) -> Result<Response, ClientError> {
        let (resp, fds) = self.read_reply_fds(id, op)?;
        if !fds.is_empty() {
            return Err(ClientError::UnexpectedFds { count: fds.len() });
        }
        Ok(resp)
    }

    /// The reply to request `id` and the descriptors that came with it.
    fn read_reply_fds(
        &mut self,
        id: u64,
        op: Opcode,
    ) -> Result<(Response, Vec<OwnedFd>), ClientError> {
        let mut fds = Vec::new();
        let header = read_frame(
            &self.stream,
            self.server.max_frame_bytes,
            &mut self.body,
            &mut fds,
        )?
        .ok_or(ClientError::Closed)?;
        // Before HELLO's reply (version 0) only the HELLO reply is read, alike in every
        // version.
        let version = match self.server.version {
            0 => PROTOCOL_VERSION,
            v => v,
        };
        let resp = Response::decode_for(&header, &self.body, version)?;
        // A server that cannot parse a header answers with request id 0 before closing.
        let id_ok = header.request_id == id || (header.request_id == 0 && header.is_error());
        if !id_ok {
            return Err(ClientError::RequestIdMismatch {
                expected: id,
                got: header.request_id,
            });
        }
        match resp {
            Response::Error(e) => Err(ClientError::Server {
                code: e.code,
                message: e.message,
            }),
            r if header.opcode == op.reply() => Ok((r, fds)),
            _ => Err(ClientError::UnexpectedReply {
                expected: op.name(),
                got: header.opcode,
            }),
        }
    }
}

fn unexpected(op: Opcode, got: &Response) -> ClientError {
    ClientError::UnexpectedReply {
        expected: op.name(),
        got: got.opcode(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(s: &str) -> Option<OsString> {
        Some(OsString::from(s))
    }

    #[test]
    fn socket_path_precedence() {
        assert_eq!(
            socket_path_from(os("/x/y.sock"), os("/run/user/1000"), 1000),
            PathBuf::from("/x/y.sock")
        );
        assert_eq!(
            socket_path_from(None, os("/run/user/1000"), 1000),
            PathBuf::from("/run/user/1000/kvtier/tierd.sock")
        );
        assert_eq!(
            socket_path_from(os(""), os(""), 0),
            PathBuf::from("/run/kvtier/tierd.sock")
        );
        assert_eq!(
            socket_path_from(None, None, 1234),
            PathBuf::from("/tmp/kvtier-1234/tierd.sock")
        );
        // XDG wins over the root default: a root user session with a runtime dir uses it.
        assert_eq!(
            socket_path_from(None, os("/run/user/0"), 0),
            PathBuf::from("/run/user/0/kvtier/tierd.sock")
        );
    }
}
