"""The in-engine data path from Python: tierd's sessions decoded on this process's GPU.

`InEngine` leases sessions from tierd (LEASE, docs/protocol.md 5.10), maps tierd's shared host
arena, registers it with this process's CUDA context and runs kvtier's selector, gather and
attention on the device over the block runs in place: the socket carries no tensors. It wraps
the Rust library `kvtier-engine` through the extension module `kvtier._native`, built with

    cargo build --release -p kvtier-native
    cp target/release/libkvtier_native.so clients/python/kvtier/_native.abi3.so

(`scripts/test.sh` does this with the debug build). tierd must run with `host.shared = true`,
and this process must be an admin peer of tierd (or run as tierd's uid).
"""

from __future__ import annotations

from typing import List, Sequence

import numpy as np

from .protocol import Geometry, KvtierError, Policy

try:
    from . import _native
except ImportError as e:  # pragma: no cover - exercised only without the extension
    _native = None
    _IMPORT_ERROR = e


class EngineUnavailable(KvtierError):
    """The extension module is not built, or no CUDA device is usable."""


def available() -> bool:
    """Whether the extension module is present (a CUDA device is checked when opening)."""
    return _native is not None


class InEngine:
    """Sessions of one geometry decoded on CUDA device `device`; the keep-set policy is this
    engine's own."""

    def __init__(self, socket: str, geometry: Geometry, policy: Policy, device: int = 0,
                 max_sessions: int = 8, max_blocks: int = 8192):
        if _native is None:
            raise EngineUnavailable(
                f"kvtier._native is not built ({_IMPORT_ERROR}); see kvtier.engine's docstring")
        g = geometry
        try:
            self._e = _native.Engine(
                socket, device,
                (g.layers, g.q_heads, g.kv_heads, g.head_dim, int(g.dtype), g.block_tokens),
                (policy.sink_blocks, policy.local_blocks, policy.top_k),
                max_sessions, max_blocks)
        except _native.EngineError as e:
            raise EngineUnavailable(str(e)) from None
        self.geometry = geometry

    def attach(self, session: int) -> int:
        """Lease the session and give it device state (synced)."""
        return self._e.attach(session)

    def sync(self, session: int) -> None:
        """Bring the device up to date after appends."""
        self._e.sync(session)

    def detach(self, session: int) -> None:
        self._e.detach(session)

    def decode_layer(self, layer: int, sessions: Sequence[int], q: np.ndarray) -> np.ndarray:
        """Attention of `layer` over each session's stored tokens: q float32
        [n, q_heads, head_dim] -> output of the same shape."""
        g = self.geometry
        q = np.ascontiguousarray(q, dtype="<f4").reshape(len(sessions), g.q_heads, g.head_dim)
        out = self._e.decode_layer(layer, list(sessions), q.tobytes())
        return np.frombuffer(out, dtype="<f4").reshape(q.shape).astype(np.float32)

    def keep_sets(self, layer: int) -> List[List[List[int]]]:
        """Keep-sets of the last call at `layer`: [session][kv_head] ascending block ids."""
        return self._e.keep_sets(layer)


EngineError = _native.EngineError if _native is not None else EngineUnavailable
