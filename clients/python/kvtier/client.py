"""Blocking client for tierd over a Unix stream socket (one request in flight at a time)."""

from __future__ import annotations

import array
import fcntl
import mmap
import os
import socket
from typing import List, Optional, Sequence, Tuple

import numpy as np

from . import protocol as p
from .protocol import (
    DecodeEntry,
    DecodeOutput,
    Geometry,
    HelloReply,
    KvtierError,
    Op,
    Policy,
    ProtocolError,
    ServerError,
    SessionInfo,
)

#: Largest HELLO reply accepted before the server has announced its limit.
HELLO_REPLY_MAX = 64 * 1024


class TierdUnavailable(KvtierError, ConnectionError):
    """tierd could not be reached on its socket (the message names the path and what to do)."""


def default_socket_path() -> str:
    """tierd's default socket, by the same rule as the daemon: $KVTIER_SOCKET, else
    $XDG_RUNTIME_DIR/kvtier/tierd.sock, else /run/kvtier/tierd.sock for root, else
    /tmp/kvtier-<uid>/tierd.sock."""
    if os.environ.get("KVTIER_SOCKET"):
        return os.environ["KVTIER_SOCKET"]
    if os.environ.get("XDG_RUNTIME_DIR"):
        return os.path.join(os.environ["XDG_RUNTIME_DIR"], "kvtier", "tierd.sock")
    if os.geteuid() == 0:
        return "/run/kvtier/tierd.sock"
    return f"/tmp/kvtier-{os.geteuid()}/tierd.sock"


def sealed_memfd(payload, name: str = "kvtier-append") -> int:
    """A memfd holding `payload`, sealed against shrink/grow/write. Returns the fd (caller
    closes it). The file offset stays at 0."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        mv = memoryview(payload).cast("B")
        done = 0
        while done < len(mv):
            done += os.pwrite(fd, mv[done:], done)
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd


class ArenaLease:
    """A LEASE (docs/protocol.md 5.10): the session's block table (`table`) and tierd's shared
    host arena, mapped read-only. `run(layer, block)` reads a block run in place (uint8, no
    copy). The runs stay where the table says until `Client.release` or until the connection
    that leased closes; drop the arrays `run` returned before `close`."""

    def __init__(self, table: p.LeaseReply, fd: int, writable: bool = False):
        self.table = table
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        try:
            size = os.fstat(fd).st_size
            if size < table.arena_bytes:
                raise ProtocolError(f"arena descriptor holds {size} bytes, the lease says {table.arena_bytes}")
            self._map = mmap.mmap(fd, table.arena_bytes, flags=mmap.MAP_SHARED, prot=prot)
        finally:
            os.close(fd)

    def run(self, layer: int, block: int) -> Optional[np.ndarray]:
        """The run of (layer, block), or None for a block only on NVMe."""
        at = int(self.table.layers[layer].offsets[block])
        if at == p.LEASE_COLD:
            return None
        return self.run_at(at)

    def run_at(self, at: int) -> np.ndarray:
        """The run at arena offset `at` (a LEASE or RESERVE table entry); writable when the
        lease was taken with `writable=True`, for rows written in place after RESERVE."""
        n = self.table.run_bytes
        if at + n > len(self._map):
            raise ProtocolError(f"run at {at} past the arena's {len(self._map)} bytes")
        return np.frombuffer(self._map, dtype=np.uint8, count=n, offset=at)

    def close(self) -> None:
        self._map.close()

    def __enter__(self) -> "ArenaLease":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Client:
    """Connects to `path` (default: `default_socket_path()`, the daemon's own rule), performs
    HELLO, then offers one method per request. No daemon on the socket raises
    `TierdUnavailable` naming the path; server errors raise `ServerError` with `.code` (an
    `ErrorCode`) and `.message`."""

    def __init__(self, path: Optional[str] = None, client_name: str = "kvtier-python",
                 timeout: Optional[float] = None, sock: Optional[socket.socket] = None):
        if sock is None:
            if path is None:
                path = default_socket_path()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            try:
                sock.connect(path)
            except OSError as e:
                sock.close()
                raise TierdUnavailable(
                    f"cannot reach tierd at {path}: {e.strerror or e}. Start it (e.g. `tierd "
                    f"--socket {path}`), or pass the path / set KVTIER_SOCKET to where it "
                    f"listens") from e
            except BaseException:
                sock.close()
                raise
        else:
            sock.settimeout(timeout)
        self._sock = sock
        self.path = path  # None for a socket given connected
        self._next_id = 1
        self.server = HelloReply(0, HELLO_REPLY_MAX, "", "")
        reply = self._call(Op.HELLO, p.encode_hello(client_name))
        if not p.MIN_PROTOCOL_VERSION <= reply.version <= p.PROTOCOL_VERSION:
            raise ProtocolError(f"server chose protocol version {reply.version}")
        self.server = reply

    # -- connection -----------------------------------------------------------------------

    def disconnect(self) -> None:
        self._sock.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.disconnect()

    # -- requests -------------------------------------------------------------------------

    def create_session(self, geometry: Geometry, policy: Policy = Policy(), label: str = "") -> int:
        return self._call(Op.CREATE_SESSION, p.encode_create_session(geometry, policy, label))

    def append_kv(self, session: int, start_pos: int, n_tokens: int, payload) -> int:
        """Inline append; `payload` is bytes or an array (see `pack_append_payload`).
        Returns the session's new length."""
        data = p.payload_bytes(payload)
        prefix = p.encode_append_prefix(session, start_pos, n_tokens, len(data))
        return self._call(Op.APPEND_KV, prefix, tail=data)

    def append_kv_shm(self, session: int, start_pos: int, n_tokens: int, payload) -> int:
        """Append through a sealed memfd passed with SCM_RIGHTS (no size limit)."""
        data = p.payload_bytes(payload)
        fd = sealed_memfd(data)
        try:
            return self.append_kv_fd(session, start_pos, n_tokens, fd, 0, len(data))
        finally:
            os.close(fd)

    def append_kv_fd(self, session: int, start_pos: int, n_tokens: int, fd: int,
                     offset: int, length: int) -> int:
        """Append `length` bytes at `offset` of an open file or memfd; the range must not
        change until this returns."""
        body = p.encode_append_shm(session, start_pos, n_tokens, offset, length)
        return self._call(Op.APPEND_KV, body, flags=p.FLAG_APPEND_SHM, fd=fd)

    def decode(self, layer: int, session: int, position: int, q, k, v,
               want_stats: bool = False) -> DecodeOutput:
        """One decode step: q float32 [Hq, D]; k, v [Hkv, D] in the session dtype."""
        return self.decode_batch(layer, [DecodeEntry(session, position, q, k, v)], want_stats)[0]

    def decode_batch(self, layer: int, entries: Sequence[DecodeEntry],
                     want_stats: bool = False) -> List[DecodeOutput]:
        outs = self._call(Op.DECODE, p.encode_decode(layer, entries, want_stats))
        if len(outs) != len(entries):
            raise ProtocolError(f"{len(outs)} outputs for {len(entries)} entries")
        for e, o in zip(entries, outs):
            shape = getattr(e.q, "shape", None)
            if shape is not None and int(np.prod(shape)) == o.out.size:
                o.out = o.out.reshape(shape)
        return outs

    def session_info(self, session: int) -> SessionInfo:
        return self._call(Op.SESSION_INFO, p.encode_session(session))

    def close(self, session: int) -> None:
        """CLOSE_SESSION (the connection stays open; see `disconnect`)."""
        self._call(Op.CLOSE_SESSION, p.encode_session(session))

    def list_sessions(self) -> List[SessionInfo]:
        return self._call(Op.LIST_SESSIONS)

    def stats(self) -> dict:
        return self._call(Op.STATS)

    def evict(self, session: int) -> None:
        """Admin: drop any session."""
        self._call(Op.EVICT, p.encode_session(session))

    def demote(self, session: int) -> int:
        """Write the session to the NVMe tier and free its host RAM; returns the blocks freed."""
        return self._call(Op.DEMOTE, p.encode_session(session))

    def offload(self, session: int) -> int:
        """Move the session to the remote tier (tierd's [remote]): written there, then dropped
        here; any node resumes it when asked for it. Returns the blocks written."""
        return self._call(Op.OFFLOAD, p.encode_session(session))

    def promote(self, session: int) -> int:
        """Read every cold block of the session back into host RAM; returns blocks read."""
        return self._call(Op.PROMOTE, p.encode_session(session))

    def pin(self, session: int, pinned: bool = True) -> None:
        """Pin (never demote) or unpin the session."""
        self._call(Op.PIN if pinned else Op.UNPIN, p.encode_session(session))

    def lease(self, session: int, writable: bool = False) -> "ArenaLease":
        """LEASE: the session's block table and tierd's shared host arena, mapped read-only
        (docs/protocol.md 5.10). tierd keeps every run the table names in place until
        `release` or until this connection closes. Needs tierd's `host.shared = true` and an
        admin peer (or tierd's own uid)."""
        fds: List[int] = []
        reply = self._call(Op.LEASE, p.encode_session(session), fds=fds)
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise ProtocolError(f"LEASE reply with {len(fds)} descriptors, expected 1")
        return ArenaLease(reply, fds[0], writable)

    def release(self, session: int) -> None:
        """RELEASE: end this connection's lease of the session (dropping an in-place append
        still open on it)."""
        self._call(Op.RELEASE, p.encode_session(session))

    def reserve(self, session: int, tokens: int) -> "p.ReserveReply":
        """RESERVE: open an append of `tokens` tokens to every layer of a session this
        connection leases, written in place into the arena (docs/protocol.md 5.10): where
        each row goes. COMMIT it with `commit`."""
        return self._call(Op.RESERVE, p.encode_session_tokens(session, tokens))

    def commit(self, session: int, tokens: int, layers: Optional[Tuple[int, int]] = None) -> int:
        """COMMIT: adopt the first `tokens` rows written since `reserve` (0 drops them);
        returns the session's stored tokens. With `layers` (first, count; protocol version 5)
        only those layers are checked and summarized now, and the append lands with the COMMIT
        that leaves no layer uncommitted (the stored tokens do not change before)."""
        if layers is not None and self.server.version < p.LAYER_COMMIT_VERSION:
            raise ProtocolError(f"COMMIT of some layers needs protocol version {p.LAYER_COMMIT_VERSION}; "
                                f"tierd speaks {self.server.version}")
        flags = 0 if layers is None else p.FLAG_COMMIT_LAYERS
        return self._call(Op.COMMIT, p.encode_session_tokens(session, tokens, layers), flags)

    # -- plumbing -------------------------------------------------------------------------

    def _call(self, op: Op, body: bytes = b"", flags: int = 0, tail: bytes = b"",
              fd: Optional[int] = None, fds: Optional[List[int]] = None):
        """Sends a request (with `fd` attached) and reads its reply; descriptors that come with
        the reply are appended to `fds` (closed and refused when `fds` is None)."""
        rid = self._next_id
        self._next_id = (self._next_id + 1) % (1 << 64)
        body_len = len(body) + len(tail)
        if self.server.version and body_len > self.server.max_frame_bytes:
            raise ProtocolError(
                f"request body of {body_len} bytes exceeds max_frame_bytes "
                f"{self.server.max_frame_bytes}; use append_kv_shm for large payloads")
        head = p.encode_header(int(op), flags, rid, body_len) + body
        if fd is None:
            self._sock.sendall(head)
        else:
            fds = array.array("i", [fd])
            sent = self._sock.sendmsg([head], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            # The descriptor travels with the first byte; the rest is ordinary data.
            self._sock.sendall(head[sent:])
        if tail:
            self._sock.sendall(tail)
        got: List[int] = []
        try:
            reply = self._read_reply(rid, op, got)
        except BaseException:
            for d in got:
                os.close(d)
            raise
        if fds is None:
            for d in got:
                os.close(d)
            if got:
                raise ProtocolError(f"{len(got)} unexpected descriptors with the reply")
        else:
            fds.extend(got)
        return reply

    def _recv_exact(self, n: int, fds: List[int]) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        space = socket.CMSG_SPACE(4 * 4)
        while got < n:
            k, anc, _, _ = self._sock.recvmsg_into([view[got:]], space)
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    usable = len(data) - len(data) % 4
                    fds.extend(array.array("i", data[:usable]))
            if k == 0:
                raise ConnectionError("server closed the connection")
            got += k
        return buf

    def _read_reply(self, rid: int, op: Op, fds: List[int]):
        body_len, reply_id, opcode, flags = p.decode_header(bytes(self._recv_exact(p.HEADER_LEN, fds)))
        if body_len > self.server.max_frame_bytes:
            raise ProtocolError(f"reply body of {body_len} bytes exceeds {self.server.max_frame_bytes}")
        body = self._recv_exact(body_len, fds) if body_len else b""
        # Before HELLO's reply (version 0) only that reply is read, alike in every version.
        reply = p.decode_reply(opcode, flags, body, self.server.version or p.PROTOCOL_VERSION)
        if isinstance(reply, p.ErrorReply):
            # id 0: the server could not parse our header and is closing the connection.
            if reply_id not in (rid, 0):
                raise ProtocolError(f"reply id {reply_id}, expected {rid}")
            raise ServerError(reply.code, reply.message)
        if reply_id != rid:
            raise ProtocolError(f"reply id {reply_id}, expected {rid}")
        if opcode != op.reply:
            raise ProtocolError(f"reply opcode 0x{opcode:04x} does not answer {op.name}")
        return reply
