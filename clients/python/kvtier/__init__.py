"""Python client for kvtier's tierd daemon (protocol versions 2 to 5, see docs/protocol.md)."""

#: The project's version: tierd's, tierctl's and this package's (one version for all).
__version__ = "0.1.0"

from .client import ArenaLease, Client, TierdUnavailable, default_socket_path, sealed_memfd  # noqa: E402
from .protocol import (
    DEFAULT_CANDIDATES,
    PROTOCOL_VERSION,
    STATS_KEYS,
    DecodeEntry,
    DecodeOutput,
    DecodeStats,
    Dtype,
    ErrorCode,
    Geometry,
    HelloReply,
    KvtierError,
    Op,
    Policy,
    ProtocolError,
    Selector,
    ServerError,
    SessionInfo,
    bf16_to_f32,
    f32_to_bf16,
    pack_append_payload,
)

__all__ = [
    "__version__",
    "ArenaLease",
    "Client",
    "TierdUnavailable",
    "default_socket_path",
    "sealed_memfd",
    "DEFAULT_CANDIDATES",
    "PROTOCOL_VERSION",
    "STATS_KEYS",
    "DecodeEntry",
    "DecodeOutput",
    "DecodeStats",
    "Dtype",
    "ErrorCode",
    "Geometry",
    "HelloReply",
    "KvtierError",
    "Op",
    "Policy",
    "ProtocolError",
    "Selector",
    "ServerError",
    "SessionInfo",
    "bf16_to_f32",
    "f32_to_bf16",
    "pack_append_payload",
]
