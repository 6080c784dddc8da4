"""kvtier wire protocol (versions 2 to 5): framing, body encoders and reply decoders.

Pure Python + numpy. The byte layout is specified in docs/protocol.md; the golden frames in
protocol/tests/golden/*.hex are checked by tests/test_golden.py.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

MAGIC = 0x3154564B  # b"KVT1" little-endian
HEADER = struct.Struct("<IIQHHI")
HEADER_LEN = HEADER.size  # 24
PROTOCOL_VERSION = 5  # the newest this package speaks
LAYER_COMMIT_VERSION = 5  # the first whose COMMIT may name its layers
MIN_PROTOCOL_VERSION = 2  # version 3 less the error code OWNED_ELSEWHERE
REPLY_BIT = 0x8000
ERROR_OPCODE = 0xFFFF
FLAG_APPEND_SHM = 0x0001
FLAG_COMMIT_LAYERS = 0x0001  # COMMIT: the body names its layers (version 5)
DECODE_WANT_STATS = 0x1
#: Opcodes reserved for future tier operations; servers answer them with UNIMPLEMENTED.
RESERVED_TIER_OPCODES = range(0x0019, 0x0020)


class Op(IntEnum):
    HELLO = 0x0001
    CREATE_SESSION = 0x0002
    APPEND_KV = 0x0003
    DECODE = 0x0004
    SESSION_INFO = 0x0005
    CLOSE_SESSION = 0x0006
    LIST_SESSIONS = 0x0007
    STATS = 0x0008
    EVICT = 0x0009
    DEMOTE = 0x0010
    PROMOTE = 0x0011
    PIN = 0x0012
    UNPIN = 0x0013
    LEASE = 0x0014  # reading block runs in place (docs/protocol.md 5.10)
    RELEASE = 0x0015
    RESERVE = 0x0016  # an append written in place into the leased arena (5.10)
    COMMIT = 0x0017
    OFFLOAD = 0x0018  # a session moved to the remote tier (5.9)

    @property
    def reply(self) -> int:
        return int(self) | REPLY_BIT


class ErrorCode(IntEnum):
    NOT_FOUND = 1
    INVALID_ARGUMENT = 2
    RESOURCE_EXHAUSTED = 3
    FAILED_PRECONDITION = 4
    PERMISSION_DENIED = 5
    UNAVAILABLE = 6
    INTERNAL = 7
    UNIMPLEMENTED = 8
    DATA_LOSS = 9
    OWNED_ELSEWHERE = 10  # another node of the remote tier owns the session; the message names it


class Dtype(IntEnum):
    BF16 = 0
    F16 = 1
    F32 = 2

    @property
    def elem_bytes(self) -> int:
        return 4 if self is Dtype.F32 else 2

    @property
    def numpy_dtype(self) -> np.dtype:
        """numpy type holding one element: bf16 travels as uint16 bit patterns."""
        return np.dtype({Dtype.BF16: "<u2", Dtype.F16: "<f2", Dtype.F32: "<f4"}[self])


STATS_KEYS = (
    "uptime_ms",
    "sessions",
    "host_bytes_used",
    "host_bytes_capacity",
    "host_extents_used",
    "decode_requests_total",
    "decode_entries_total",
    "append_tokens_total",
    "errors_total",
    "rejected_total",
    "bytes_touched_total",
)


class KvtierError(Exception):
    """Base class of every error raised by this package."""


class ProtocolError(KvtierError):
    """Malformed or unexpected bytes on the wire."""


class ServerError(KvtierError):
    """The server answered with an error reply."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


# --------------------------------------------------------------------------- bf16 helpers


def f32_to_bf16(x) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    a = np.ascontiguousarray(x, dtype=np.float32)
    bits = a.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)
    return rounded


def bf16_to_f32(b) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32 (exact)."""
    u = np.ascontiguousarray(b, dtype=np.uint16)
    return (u.astype(np.uint32) << 16).view(np.float32)


# --------------------------------------------------------------------------- value types


@dataclass(frozen=True)
class Geometry:
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: Dtype = Dtype.BF16
    block_tokens: int = 128

    def q_bytes(self) -> int:
        return self.q_heads * self.head_dim * 4

    def kv_token_bytes(self) -> int:
        return self.kv_heads * self.head_dim * Dtype(self.dtype).elem_bytes

    def append_payload_bytes(self, n_tokens: int) -> int:
        return self.layers * 2 * n_tokens * self.kv_token_bytes()


class Selector(IntEnum):
    """How a decode step ranks distant blocks (docs/protocol.md, "Policy")."""

    BOUND = 0  # Quest-style key bounds, max over the query group (the rule before sketches)
    SKETCH = 1  # quarter-bound candidates ranked by int4 key sketches (channel scales)


#: Candidates per kv head of the daemon's default sketch selector.
DEFAULT_CANDIDATES = 64


@dataclass(frozen=True)
class Policy:
    """Which blocks a step keeps: `sink_blocks`, the last `local_blocks`, and the `top_k`
    distant blocks ranked by `selector`; the sketch selector scores the union of each query
    head's max(`candidates`, `top_k`) best blocks by its own bound."""

    sink_blocks: int = 1
    local_blocks: int = 4
    top_k: int = 32
    selector: Selector = Selector.SKETCH
    candidates: int = DEFAULT_CANDIDATES

    @classmethod
    def bound(cls, sink_blocks: int = 1, local_blocks: int = 4, top_k: int = 32) -> "Policy":
        """The bound selector's policy (no candidates)."""
        return cls(sink_blocks, local_blocks, top_k, Selector.BOUND, 0)

    def wire(self):
        """(sink_blocks, local_blocks, top_k, selector code, candidates)."""
        return (self.sink_blocks, self.local_blocks, self.top_k, int(self.selector), self.candidates)


@dataclass
class HelloReply:
    version: int
    max_frame_bytes: int
    server_name: str
    server_version: str


@dataclass
class SessionInfo:
    session: int
    owner_uid: int
    label: str
    geometry: Geometry
    policy: Policy
    tokens_min: int
    tokens_max: int
    blocks: int
    host_bytes: int
    nvme_bytes: int
    pinned: bool
    created_unix_ms: int
    last_access_unix_ms: int
    #: Its stored data failed verification at startup: every use raises DATA_LOSS, close()
    #: deletes what remains (wire: bit 1 of the state byte).
    damaged: bool = False
    #: Bytes of its block runs the remote tier holds (protocol version 4; 0 before it).
    remote_bytes: int = 0


@dataclass
class DecodeStats:
    """What one DECODE entry's step did (docs/protocol.md, DECODE reply). Mind the units:
    `blocks_total` counts the layer's blocks once (per kv head), the others count (block, kv
    head) tiles summed over the kv heads, so `blocks_selected` can exceed `blocks_total`."""

    blocks_total: int  # blocks in the layer after the append, per kv head
    blocks_selected: int  # kept (block, kv head) tiles, summed over kv heads
    bytes_touched: int  # bytes the step reads: summaries scanned, kept tiles' valid K/V rows
    bytes_moved: int  # bytes moved between tiers for the step (host->GPU, NVMe->host)
    cache_hits: int  # kept tiles already in the GPU block cache
    blocks_ram: int  # kept tiles served from host RAM
    blocks_nvme: int  # kept tiles read from NVMe
    selected: List[List[int]] = field(default_factory=list)  # per kv head, kept block ids

    def __repr__(self) -> str:
        return (f"DecodeStats(blocks_total={self.blocks_total} per kv head, blocks_selected="
                f"{self.blocks_selected} tiles over kv heads, bytes_touched={self.bytes_touched}, "
                f"bytes_moved={self.bytes_moved}, cache_hits={self.cache_hits}, blocks_ram="
                f"{self.blocks_ram}, blocks_nvme={self.blocks_nvme}, selected={self.selected})")


@dataclass
class DecodeOutput:
    out: np.ndarray  # float32, [Hq * D] (the client reshapes to the query's shape)
    stats: Optional[DecodeStats]


@dataclass
class ErrorReply:
    code: ErrorCode
    message: str


@dataclass
class DecodeEntry:
    """One DECODE entry. q: float32 [Hq, D]; k, v: [Hkv, D] in the session dtype (uint16 bf16
    bit patterns, float16 or float32), or raw little-endian bytes."""

    session: int
    position: int
    q: object
    k: object
    v: object


Header = Tuple[int, int, int, int]  # body_len, request_id, opcode, flags

# --------------------------------------------------------------------------- primitives


class _Writer:
    def __init__(self) -> None:
        self.buf = bytearray()

    def u8(self, v: int) -> "_Writer":
        self.buf += struct.pack("<B", v)
        return self

    def u16(self, v: int) -> "_Writer":
        self.buf += struct.pack("<H", v)
        return self

    def u32(self, v: int) -> "_Writer":
        self.buf += struct.pack("<I", v)
        return self

    def u64(self, v: int) -> "_Writer":
        self.buf += struct.pack("<Q", v)
        return self

    def raw(self, b) -> "_Writer":
        self.buf += b
        return self

    def str(self, s: str) -> "_Writer":
        b = s.encode("utf-8")
        return self.u32(len(b)).raw(b)


class _Reader:
    def __init__(self, body) -> None:
        self.mv = memoryview(body)
        self.pos = 0

    def take(self, n: int, what: str) -> memoryview:
        if n > len(self.mv) - self.pos:
            raise ProtocolError(f"truncated {what}: needs {n} bytes, {len(self.mv) - self.pos} left")
        out = self.mv[self.pos : self.pos + n]
        self.pos += n
        return out

    def _unpack(self, fmt: str, n: int, what: str) -> int:
        return struct.unpack(fmt, self.take(n, what))[0]

    def u8(self, what: str) -> int:
        return self._unpack("<B", 1, what)

    def u16(self, what: str) -> int:
        return self._unpack("<H", 2, what)

    def u32(self, what: str) -> int:
        return self._unpack("<I", 4, what)

    def u64(self, what: str) -> int:
        return self._unpack("<Q", 8, what)

    def bool(self, what: str) -> bool:
        v = self.u8(what)
        if v not in (0, 1):
            raise ProtocolError(f"{what} must be 0 or 1, got {v}")
        return v == 1

    def str(self, what: str) -> str:
        n = self.u32(what)
        try:
            return bytes(self.take(n, what)).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ProtocolError(f"{what} is not valid UTF-8") from e

    def count(self, what: str, min_item: int) -> int:
        n = self.u32(what)
        if n * min_item > len(self.mv) - self.pos:
            raise ProtocolError(f"truncated {what}: {n} items cannot fit")
        return n

    def finish(self) -> None:
        extra = len(self.mv) - self.pos
        if extra:
            raise ProtocolError(f"{extra} trailing bytes after the body")


# --------------------------------------------------------------------------- framing


def encode_header(opcode: int, flags: int, request_id: int, body_len: int) -> bytes:
    return HEADER.pack(MAGIC, body_len, request_id, opcode, flags, 0)


def decode_header(b) -> Header:
    if len(b) != HEADER_LEN:
        raise ProtocolError(f"header must be {HEADER_LEN} bytes, got {len(b)}")
    magic, body_len, request_id, opcode, flags, reserved = HEADER.unpack(b)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic 0x{magic:08x}")
    if reserved != 0:
        raise ProtocolError(f"reserved header field is {reserved}, must be 0")
    return body_len, request_id, opcode, flags


def frame(opcode: int, flags: int, request_id: int, body=b"") -> bytes:
    return encode_header(opcode, flags, request_id, len(body)) + bytes(body)


# --------------------------------------------------------------------------- request bodies


def _le_bytes(x, what: str, allowed: Sequence[str]) -> bytes:
    if isinstance(x, (bytes, bytearray, memoryview)):
        return bytes(x)
    a = np.asarray(x)
    if a.dtype.kind + str(a.dtype.itemsize) not in allowed:
        raise TypeError(f"{what}: dtype {a.dtype} not accepted (use one of {allowed})")
    return np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes()


KV_DTYPES = ("u2", "f2", "f4")  # bf16 bit patterns, f16, f32


def kv_bytes(x, what: str = "k/v") -> bytes:
    """K/V data as wire bytes: uint16 (bf16 bits), float16 or float32 arrays, or raw bytes."""
    return _le_bytes(x, what, KV_DTYPES)


def payload_bytes(x) -> bytes:
    """An APPEND_KV payload as bytes: raw bytes, or a uint8 / KV-dtype array."""
    return _le_bytes(x, "append payload", KV_DTYPES + ("u1",))


def q_bytes(q) -> bytes:
    """A query as little-endian float32 bytes (any float array is converted to float32)."""
    if isinstance(q, (bytes, bytearray, memoryview)):
        return bytes(q)
    return np.ascontiguousarray(q, dtype="<f4").tobytes()


def pack_append_payload(k, v) -> bytes:
    """APPEND_KV payload from K and V of shape [L, n, Hkv, D]: per layer K then V."""
    k = np.asarray(k)
    v = np.asarray(v)
    if k.shape != v.shape or k.ndim != 4 or k.dtype != v.dtype:
        raise ValueError(f"k and v must both be [L, n, Hkv, D] of one dtype, got {k.shape} {v.shape}")
    return kv_bytes(np.stack([k, v], axis=1), "append payload")


def encode_hello(client_name: str, min_version: int = MIN_PROTOCOL_VERSION,
                 max_version: int = PROTOCOL_VERSION) -> bytes:
    return bytes(_Writer().u16(min_version).u16(max_version).str(client_name).buf)


def _geometry(w: _Writer, g: Geometry) -> None:
    w.u32(g.layers).u32(g.q_heads).u32(g.kv_heads).u32(g.head_dim).u8(int(g.dtype)).u32(g.block_tokens)


def encode_create_session(geometry: Geometry, policy: Policy = Policy(), label: str = "") -> bytes:
    w = _Writer()
    _geometry(w, geometry)
    for x in policy.wire():
        w.u32(x)
    w.str(label)
    return bytes(w.buf)


def encode_append_prefix(session: int, start_pos: int, n_tokens: int, payload_len: int) -> bytes:
    """Inline APPEND_KV body up to (not including) the payload bytes."""
    return bytes(_Writer().u64(session).u64(start_pos).u32(n_tokens).u32(0).u64(payload_len).buf)


def encode_append_inline(session: int, start_pos: int, n_tokens: int, payload) -> bytes:
    p = bytes(payload)
    return encode_append_prefix(session, start_pos, n_tokens, len(p)) + p


def encode_append_shm(session: int, start_pos: int, n_tokens: int, offset: int, length: int) -> bytes:
    """Body of the shared-memory APPEND_KV (send with header flag FLAG_APPEND_SHM)."""
    return bytes(_Writer().u64(session).u64(start_pos).u32(n_tokens).u32(0).u64(offset).u64(length).buf)


def encode_decode(layer: int, entries: Sequence[DecodeEntry], want_stats: bool = False) -> bytes:
    w = _Writer().u32(layer).u32(DECODE_WANT_STATS if want_stats else 0).u32(len(entries))
    for e in entries:
        q = q_bytes(e.q)
        k = kv_bytes(e.k, "k")
        v = kv_bytes(e.v, "v")
        if len(q) % 4:
            raise ValueError(f"q of {len(q)} bytes is not whole f32s")
        if len(k) != len(v):
            raise ValueError(f"k ({len(k)} bytes) and v ({len(v)} bytes) differ in size")
        w.u64(e.session).u64(e.position).u32(len(q)).u32(len(k)).raw(q).raw(k).raw(v)
    return bytes(w.buf)


def encode_session(session: int) -> bytes:
    """Body of SESSION_INFO, CLOSE_SESSION and EVICT."""
    return struct.pack("<Q", session)


def encode_session_tokens(session: int, tokens: int, layers: Optional[Tuple[int, int]] = None) -> bytes:
    """Body of RESERVE and COMMIT; a COMMIT may name its layers (first, count)."""
    if layers is None:
        return struct.pack("<QI", session, tokens)
    return struct.pack("<QIII", session, tokens, *layers)


# --------------------------------------------------------------------------- reply bodies


def _selector(code: int) -> Selector:
    try:
        return Selector(code)
    except ValueError:
        raise ProtocolError(f"unknown selector {code} (0 bound, 1 sketch)") from None


def _session_info(r: _Reader, version: int) -> SessionInfo:
    session = r.u64("session")
    owner = r.u32("owner_uid")
    label = r.str("label")
    geometry = Geometry(
        layers=r.u32("layers"),
        q_heads=r.u32("q_heads"),
        kv_heads=r.u32("kv_heads"),
        head_dim=r.u32("head_dim"),
        dtype=_dtype(r.u8("dtype")),
        block_tokens=r.u32("block_tokens"),
    )
    policy = Policy(r.u32("sink_blocks"), r.u32("local_blocks"), r.u32("top_k"),
                    _selector(r.u32("selector")), r.u32("candidates"))
    return SessionInfo(
        session=session,
        owner_uid=owner,
        label=label,
        geometry=geometry,
        policy=policy,
        tokens_min=r.u64("tokens_min"),
        tokens_max=r.u64("tokens_max"),
        blocks=r.u64("blocks"),
        host_bytes=r.u64("host_bytes"),
        nvme_bytes=r.u64("nvme_bytes"),
        **_session_state(r.u8("session state")),
        created_unix_ms=r.u64("created_unix_ms"),
        last_access_unix_ms=r.u64("last_access_unix_ms"),
        remote_bytes=r.u64("remote_bytes") if version >= 4 else 0,
    )


def _session_state(v: int) -> dict:
    """The SessionInfo state byte: bit 0 pinned, bit 1 damaged; other bits are refused."""
    if v & ~0b11:
        raise ProtocolError(f"session state has unknown bits set: {v:#04x}")
    return {"pinned": bool(v & 1), "damaged": bool(v & 2)}


def _dtype(v: int) -> Dtype:
    try:
        return Dtype(v)
    except ValueError:
        raise ProtocolError(f"unknown dtype {v}") from None


SESSION_INFO_MIN_LEN = 106


def _decode_stats(r: _Reader) -> DecodeStats:
    s = DecodeStats(
        blocks_total=r.u32("blocks_total"),
        blocks_selected=r.u32("blocks_selected"),
        bytes_touched=r.u64("bytes_touched"),
        bytes_moved=r.u64("bytes_moved"),
        cache_hits=r.u32("cache_hits"),
        blocks_ram=r.u32("blocks_ram"),
        blocks_nvme=r.u32("blocks_nvme"),
    )
    for _ in range(r.count("selected kv heads", 4)):
        n = r.count("selected block ids", 4)
        s.selected.append(list(struct.unpack(f"<{n}I", r.take(4 * n, "selected block ids"))))
    return s


Reply = Union[HelloReply, int, List[DecodeOutput], SessionInfo, List[SessionInfo], dict, None, ErrorReply]


def decode_reply(opcode: int, flags: int, body, version: int = PROTOCOL_VERSION) -> Reply:
    """Decode a reply body of protocol `version` (the one the connection negotiated). Returns, by opcode: HelloReply; session id (CREATE_SESSION); new
    length (APPEND_KV); blocks moved (DEMOTE, PROMOTE, OFFLOAD); list of DecodeOutput; SessionInfo; None
    (CLOSE_SESSION, EVICT, PIN, UNPIN); list
    of SessionInfo; dict key -> value (STATS); ErrorReply (opcode 0xFFFF)."""
    if not opcode & REPLY_BIT:
        raise ProtocolError(f"opcode 0x{opcode:04x} is not a reply")
    if flags:
        raise ProtocolError(f"reply flags must be 0, got 0x{flags:x}")
    r = _Reader(body)
    if opcode == ERROR_OPCODE:
        code = r.u16("error code")
        try:
            code = ErrorCode(code)
        except ValueError:
            raise ProtocolError(f"unknown error code {code}") from None
        out: Reply = ErrorReply(code, r.str("error message"))
    else:
        try:
            op = Op(opcode & ~REPLY_BIT)
        except ValueError:
            raise ProtocolError(f"unknown reply opcode 0x{opcode:04x}") from None
        if op is Op.HELLO:
            out = HelloReply(r.u16("version"), r.u32("max_frame_bytes"), r.str("server name"), r.str("server version"))
        elif op in (Op.CREATE_SESSION, Op.APPEND_KV, Op.DEMOTE, Op.PROMOTE, Op.COMMIT, Op.OFFLOAD):
            out = r.u64("reply value")
        elif op is Op.DECODE:
            outs = []
            for _ in range(r.count("decode outputs", 5)):
                n = r.count("decode output", 4)
                vec = np.frombuffer(r.take(4 * n, "decode output"), dtype="<f4").astype(np.float32)
                stats = _decode_stats(r) if r.bool("has_stats") else None
                outs.append(DecodeOutput(vec, stats))
            out = outs
        elif op is Op.SESSION_INFO:
            out = _session_info(r, version)
        elif op is Op.LIST_SESSIONS:
            n = r.count("session list", SESSION_INFO_MIN_LEN)
            out = [_session_info(r, version) for _ in range(n)]
        elif op is Op.STATS:
            stats = {}
            for _ in range(r.count("stats entries", 12)):
                k = r.str("stats key")
                stats[k] = r.u64("stats value")
            out = stats
        elif op is Op.LEASE:
            instance, arena_bytes, run_bytes = r.u64("instance"), r.u64("arena_bytes"), r.u64("run_bytes")
            layers = []
            for _ in range(r.count("lease layers", 12)):
                tokens = r.u64("tokens")
                n = r.count("lease blocks", 8)
                offsets = np.frombuffer(r.take(8 * n, "block offsets"), dtype="<u8").astype(np.uint64)
                layers.append(LeaseLayer(tokens, offsets))
            out = LeaseReply(instance, arena_bytes, run_bytes, layers)
        elif op is Op.RESERVE:
            start, tokens = r.u64("start"), r.u32("tokens")
            layers = []
            for _ in range(r.count("reserve layers", 4)):
                n = r.count("reserve blocks", 8)
                layers.append(np.frombuffer(r.take(8 * n, "block offsets"), dtype="<u8").astype(np.uint64))
            out = ReserveReply(start, tokens, layers)
        else:  # CLOSE_SESSION, EVICT, PIN, UNPIN, RELEASE
            out = None
    r.finish()
    return out


#: A LEASE offset of a block that is only on NVMe.
LEASE_COLD = (1 << 64) - 1


@dataclass
class LeaseLayer:
    """One layer of a LEASE reply: stored tokens and each block's run offset in the arena
    (`LEASE_COLD` for a block only on NVMe)."""
    tokens: int
    offsets: np.ndarray


@dataclass
class LeaseReply:
    """LEASE's reply (docs/protocol.md 5.10); the arena's memfd came with it."""
    instance: int
    arena_bytes: int
    run_bytes: int
    layers: List[LeaseLayer]


@dataclass
class ReserveReply:
    """RESERVE's reply (docs/protocol.md 5.10): the reserved rows start at position `start`;
    per layer, the arena offsets of the runs they go to, the first being block
    `start // block_tokens`."""
    start: int
    tokens: int
    layers: List[np.ndarray]


def encode_reply_body(op: Op, value) -> bytes:
    """Encode simple success reply bodies (used by tests and fakes): CREATE_SESSION and
    APPEND_KV take an int, CLOSE_SESSION and EVICT take None."""
    if op in (Op.CREATE_SESSION, Op.APPEND_KV):
        return struct.pack("<Q", value)
    if op in (Op.CLOSE_SESSION, Op.EVICT):
        return b""
    raise ValueError(f"no simple reply encoder for {op.name}")


def encode_error_body(code: ErrorCode, message: str) -> bytes:
    return bytes(_Writer().u16(int(code)).str(message).buf)
