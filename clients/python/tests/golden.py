"""Access to the golden frames shared with the Rust crate (protocol/tests/golden)."""

import os

import numpy as np

from kvtier import protocol as p

GOLDEN_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "..", "protocol", "tests", "golden")


def load(name: str) -> bytes:
    with open(os.path.join(GOLDEN_DIR, name + ".hex")) as f:
        lines = [l for l in f.read().splitlines() if not l.lstrip().startswith("#")]
    return bytes(int(h, 16) for h in " ".join(lines).split())


def split(frame: bytes):
    body_len, rid, opcode, flags = p.decode_header(frame[: p.HEADER_LEN])
    body = frame[p.HEADER_LEN :]
    assert body_len == len(body)
    return rid, opcode, flags, body


# The values the Rust test (protocol/tests/golden.rs) encoded.
GEOMETRY = p.Geometry(layers=2, q_heads=4, kv_heads=2, head_dim=4, dtype=p.Dtype.BF16, block_tokens=16)
PAYLOAD = p.f32_to_bf16(np.arange(32, dtype=np.float32) * 0.25)
F = np.float32


def decode_entries():
    i16 = np.arange(16, dtype=F)
    i8 = np.arange(8, dtype=F)
    return [
        p.DecodeEntry(7, 2, (i16 * F(0.125) - F(1)).reshape(4, 4),
                      p.f32_to_bf16(i8 * F(0.5)).reshape(2, 4), p.f32_to_bf16(-i8).reshape(2, 4)),
        p.DecodeEntry(9, 0, (F(1) - i16 * F(0.0625)).reshape(4, 4),
                      p.f32_to_bf16(i8 + F(1)).reshape(2, 4), p.f32_to_bf16(i8 * F(-0.25)).reshape(2, 4)),
    ]


#: The sketch selector with 32 candidates, spelled out: the golden frames fix the wire format,
#: not the default policy of new sessions.
POLICY = p.Policy(1, 4, 32, p.Selector.SKETCH, 32)


def session_info(session: int, label: str, pinned: bool) -> p.SessionInfo:
    return p.SessionInfo(
        session=session, owner_uid=1000, label=label, geometry=GEOMETRY, policy=POLICY,
        tokens_min=2, tokens_max=3, blocks=2, host_bytes=4096, nvme_bytes=0, pinned=pinned,
        created_unix_ms=1_763_800_000_000, last_access_unix_ms=1_763_800_000_500,
        remote_bytes=8192,
    )


def read_frame_fds(sock):
    """Read one frame exactly from a socket, collecting SCM_RIGHTS descriptors."""
    import socket

    fds = []

    def exact(n):
        buf = b""
        while len(buf) < n:
            data, got, _flags, _addr = socket.recv_fds(sock, n - len(buf), 4)
            fds.extend(got)
            if not data:
                raise EOFError
            buf += data
        return buf

    header = exact(p.HEADER_LEN)
    body_len = p.decode_header(header)[0]
    return header + (exact(body_len) if body_len else b""), fds
