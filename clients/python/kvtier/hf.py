"""Hugging Face transformers adapter: decode with the KV of full-attention layers held in tierd.

    from kvtier.hf import KvtierCache, enable
    enable(model)                                   # registers and selects attn "kvtier"
    with KvtierCache(model, socket="/tmp/kvtier/tierd.sock") as cache:   # default_policy(64)
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=32)

How it works:

* `KvtierCache` is a transformers `Cache`. Its full-attention layers are `KvtierLayer`s that
  keep nothing in the engine; sliding-window (and chunked) layers are the stock
  `DynamicSlidingWindowLayer`, so they stay in the engine as usual.
* The attention function registered as ``"kvtier"`` (through `AttentionInterface`; the mask
  interface gets the same name with transformers' SDPA masks) runs every non-kvtier layer,
  and every prefill, with transformers' SDPA attention. During prefill it hands each
  full-attention layer's post-RoPE K/V to the cache; once the last one has arrived the cache
  opens one tierd session per batch row (geometry: the full-attention layers only) and sends
  each row's K/V in one shared-memory APPEND_KV (left padding is dropped: a row's session
  holds only its real tokens).
* Each decode step (one query token) sends one DECODE per full-attention layer, with one
  entry per batch row: q (pre-multiplied by ``scaling * sqrt(D)`` because tierd's softmax
  scale is fixed at ``1/sqrt(D)``), and the new token's k, v, which tierd appends. tierd's
  output replaces the layer's attention output.
* On a GPU, decode steps go through the in-engine path instead (`kvtier.engine.DeviceBatch`,
  when its extension is built and tierd runs with ``host.shared = true`` and lets this process
  LEASE): this process runs kvtier's selector and attention on its own GPU over tierd's arena,
  the new tokens stay on the GPU and go to tierd a block at a time, and no tensor crosses the
  socket per step. The prefill's K/V then go from GPU memory into tierd's arena by DMA
  (`InEngine.append_rows`) instead of through host memory and APPEND_KV. ``engine="auto"`` (the default) takes it when it can and otherwise uses the
  DECODE path, warning once and saying why in `engine_error`; ``"on"`` requires it, ``"off"``
  never uses it.
* A model run with the ``"kvtier"`` implementation but an ordinary `DynamicCache` behaves
  exactly like SDPA, so one loaded model serves both dense and sparse decoding.
* `KvtierStaticCache` is the variant for compiled decoding (``generate(...,
  compile_config=...)``): its full-attention layers name themselves to the attention function
  through the attention's kwargs (not the thread-local hand-off above, which a compiled step
  cannot hold), keep their length in a tensor, and run each decode step's attention as the
  opaque op ``kvtier::attend``; the sliding layers are transformers' static ones.

Errors are typed: `TierdUnavailable` (no daemon on the socket), `GeometryRefused` (tierd
answered INVALID_ARGUMENT to CREATE_SESSION; the message names the geometry), and
`UnsupportedUse` (a use the adapter does not support, such as right padding or beam search).
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
import warnings
import weakref
from typing import List, Optional, Sequence

import numpy as np

try:
    import torch
    from transformers import AttentionInterface
    from transformers.cache_utils import (
        Cache,
        CacheLayerMixin,
        DYNAMIC_LAYER_TYPE_MAPPING,
        STATIC_LAYER_TYPE_MAPPING,
        get_layer_types_and_kwargs,
    )
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as e:
    raise ImportError(
        f"kvtier.hf needs torch >= 2.8 and transformers >= 5 ({e}); install the extra: "
        f"pip install 'kvtier[hf]' (Python 3.10 or newer)") from e

from .client import Client, TierdUnavailable, default_socket_path
from .protocol import (
    DecodeEntry,
    Dtype,
    ErrorCode,
    Geometry,
    KvtierError,
    Policy,
    ServerError,
    f32_to_bf16,
    pack_append_payload,
)

ATTN_IMPLEMENTATION = "kvtier"

__all__ = [
    "ATTN_IMPLEMENTATION",
    "GeometryRefused",
    "KvtierCache",
    "KvtierLayer",
    "KvtierStaticCache",
    "KvtierStaticLayer",
    "TierdUnavailable",
    "UnsupportedUse",
    "connect",
    "default_socket_path",
    "enable",
    "kvtier_attention_forward",
    "register",
]


class GeometryRefused(KvtierError):
    """tierd refused the session geometry or policy (INVALID_ARGUMENT on CREATE_SESSION)."""

    def __init__(self, geometry: Geometry, policy: Policy, message: str):
        super().__init__(
            f"tierd refused session geometry {_geometry_str(geometry)} with policy "
            f"(sink_blocks={policy.sink_blocks}, local_blocks={policy.local_blocks}, "
            f"top_k={policy.top_k}, selector={policy.selector.name.lower()}, "
            f"candidates={policy.candidates}): {message}")
        self.geometry = geometry
        self.policy = policy
        self.message = message


class UnsupportedUse(KvtierError):
    """The adapter does not support this use (e.g. right padding, beam search, softcapping)."""


def _geometry_str(g: Geometry) -> str:
    return (f"(layers={g.layers}, q_heads={g.q_heads}, kv_heads={g.kv_heads}, "
            f"head_dim={g.head_dim}, dtype={Dtype(g.dtype).name}, block_tokens={g.block_tokens}; "
            f"block run {g.kv_heads * 2 * g.block_tokens * g.head_dim * Dtype(g.dtype).elem_bytes} bytes)")


def connect(socket: Optional[str] = None, client_name: str = "kvtier-hf") -> Client:
    """A `Client` on `socket` (default: `default_socket_path()`); `TierdUnavailable` if no
    tierd answers there."""
    return Client(socket, client_name=client_name)


# --------------------------------------------------------------------------- registration

_registered = False


def register() -> str:
    """Registers the ``"kvtier"`` attention function and mask (idempotent); returns the name."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTN_IMPLEMENTATION, kvtier_attention_forward)
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
        _registered = True
    return ATTN_IMPLEMENTATION


def enable(model) -> None:
    """Registers the attention function and switches `model` to it. With any cache other than
    a `KvtierCache` the model then behaves exactly as with ``attn_implementation="sdpa"``."""
    register()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)


# Hand-off from KvtierLayer.update to the attention function that the same attention module
# calls right after it (same thread, same layer): the tensors update returned and the layer.
_handoff = threading.local()


def kvtier_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: Optional[float] = None, **kwargs):
    layer = kwargs.pop(_LAYER_KWARG, None)  # a KvtierStaticLayer's update put it there
    if layer is None:
        pending = getattr(_handoff, "pending", None)
        _handoff.pending = None
        if pending is None or pending[1] is not key or pending[0].layer_idx != getattr(module, "layer_idx", pending[0].layer_idx):
            # Not a layer held in tierd: plain SDPA (sliding layers, or an ordinary cache).
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
        layer = pending[0]
    if kwargs.get("softcap") is not None or getattr(module, "attn_logit_softcapping", None) is not None:
        raise UnsupportedUse("attention logit softcapping is not supported by tierd's attention")
    if dropout:
        raise UnsupportedUse("attention dropout (training mode) is not supported")
    if query.shape[2] > 1:
        out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                     scaling=scaling, **kwargs)
        layer.cache._stage_prefill(layer, key, value, attention_mask)
        return out
    d = query.shape[-1]
    if scaling is None:
        scaling = getattr(module, "scaling", None) or 1.0 / math.sqrt(d)
    out = layer.decode(query[:, :, 0, :], key[:, :, 0, :], value[:, :, 0, :],
                       float(scaling) * math.sqrt(d))
    return out.to(query.dtype).unsqueeze(1), None  # [B, 1, Hq, D]


def _valid_from_mask(mask, batch: int, kv_len: int) -> torch.Tensor:
    """Which key positions hold real tokens, [B, T] bool, from the prefill's 4D mask (the last
    query row sees every real token under a causal mask)."""
    if mask is None:
        return torch.ones(batch, kv_len, dtype=torch.bool)
    row = mask[:, 0, -1, :]
    if row.dtype != torch.bool:
        row = row == 0  # additive float mask: 0 where attended
    return row.to("cpu").expand(batch, kv_len)


# --------------------------------------------------------------------------- the cache


def _multi_token_step() -> UnsupportedUse:
    return UnsupportedUse(
        "a multi-token step after the prefill (chunked prefill, assisted decoding) is not "
        "supported by the kvtier cache: prefill in one forward, then decode one token per step")


class KvtierLayer(CacheLayerMixin):
    """A full-attention layer whose KV lives in tierd. It keeps only the length bookkeeping the
    masks need; `update` passes the new states through to the attention function."""

    is_sliding = False
    is_croppable = False

    def __init__(self, cache: "KvtierCache", layer_idx: int, slot: int):
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.slot = slot  # layer index inside the tierd session
        self.cumulative_length = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        if n > 1 and self.cumulative_length > 0:
            raise _multi_token_step()
        self.cumulative_length += n
        _handoff.pending = (self, key_states)
        return key_states, value_states

    def decode(self, q, k, v, q_scale: float) -> torch.Tensor:
        """The attention output [B, Hq, D] of one decode step at this layer: q [B, Hq, D]; the new
        token's k, v [B, Hkv, D], which tierd appends."""
        return self.cache._decode(self, q, k, v, q_scale)

    def get_mask_sizes(self, query_length: int):
        return self.cumulative_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.cumulative_length = 0
        self.is_initialized = False

    def reorder_cache(self, beam_idx) -> None:
        raise UnsupportedUse("beam search is not supported by the kvtier cache (sessions are per row)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise UnsupportedUse("expanding the batch of a kvtier cache is not supported (num_return_sequences > 1?)")

    def batch_select_indices(self, indices) -> None:
        raise UnsupportedUse("selecting batch rows of a kvtier cache is not supported")

    def crop(self, tokens_to_remove: int) -> None:
        raise UnsupportedUse("cropping a kvtier cache is not supported (tierd sessions are append-only)")


_TORCH_TO_DTYPE = {torch.float32: Dtype.F32, torch.float16: Dtype.F16, torch.bfloat16: Dtype.BF16}


def _to_wire(t: torch.Tensor, dtype: Dtype) -> np.ndarray:
    """A torch tensor as a numpy array in the session dtype (bf16 as uint16 bit patterns)."""
    t = t.detach().to("cpu")
    if dtype == Dtype.BF16:
        if t.dtype == torch.bfloat16:
            return t.contiguous().view(torch.int16).numpy().view(np.uint16)
        return f32_to_bf16(t.float().numpy())
    if dtype == Dtype.F16:
        return t.to(torch.float16).contiguous().numpy()
    return t.to(torch.float32).contiguous().numpy()


class _PrefillByLayer:
    """A prefill handed to tierd layer by layer on the in-engine path: each full layer's K/V is
    copied by DMA into its reserved rows as soon as the model has produced it, and handed to the
    engine's committer at once, which waits for the copy, COMMITs it (tierd checks and
    summarizes the rows) and summarizes it for the device state while the model computes the
    later layers. The last layer is committed at the first decode step (`land`), so the model's
    last layer and the first token run while the committer finishes: the first token costs
    about what dense's does, and the first decode step waits for what is left."""

    def __init__(self, engine, starts: List[int], t: int, layers: int, kv_dtype, seconds: float):
        self.e, self.starts, self.t, self.layers, self.kv_dtype = engine, starts, t, layers, kv_dtype
        self.seconds = seconds  # spent in the hand-off's calls so far

    def layer(self, slot: int, key, value) -> None:
        t0 = time.perf_counter()
        # The copies run on torch's current stream, so these tensors may be freed once they are
        # enqueued: the caching allocator reuses their memory only for work behind them.
        rows = [torch.stack([key[r, :, s:, :], value[r, :, s:, :]], dim=1).to(self.kv_dtype).contiguous()
                for r, s in enumerate(self.starts)]
        self.e.copy_layer(slot, rows)
        if slot < self.layers - 1:
            self.e.commit_layers(slot, 1)
        self.seconds += time.perf_counter() - t0

    def land(self) -> None:
        """Commits the last layer and waits for the committer: the append lands in tierd."""
        t0 = time.perf_counter()
        self.e.commit_layers(self.layers - 1, 1)
        self.seconds += time.perf_counter() - t0


def default_policy(block_tokens: int) -> Policy:
    """`KvtierCache`'s policy when none is given: a sink of 128 tokens, a local window of 512 and
    4,096 distant tokens (the sketch selector's top-k), in blocks of `block_tokens` (at least one
    of each): `Policy(2, 8, 64)` in 64-token blocks, `Policy(1, 4, 32)` in 128-token blocks."""
    return Policy(max(1, 128 // block_tokens), max(1, 512 // block_tokens), max(1, 4096 // block_tokens))


class KvtierCache(Cache):
    """A transformers `Cache` whose full-attention layers live in tierd.

    `model_or_config`: the model (or its config). `client`: a connected `kvtier.Client`, else
    one is opened on `socket` (default `default_socket_path()`). `policy`: the sessions'
    selection policy, counted in blocks of `block_tokens` (default: `default_policy`).
    `dtype`: session dtype (default: the model's — F32, F16 or BF16). `block_tokens`: tokens
    per block, 64 by default (at one budget of keys, 64-token blocks keep answers that
    128-token blocks lose, at no more cost: docs/decisions/0025). `engine`: "auto", "on" or
    "off", the in-engine path for a model on a GPU (module docstring); `max_blocks`: its
    per-session capacity in blocks (16,384: 1M tokens in 64-token blocks).
    `prefill_by_layer`: on the in-engine path, hand the prefill to tierd layer by layer while
    the model computes the later layers (tierd's protocol version 5; the default: the last
    layer lands in tierd at the first decode step), or all layers after the last (False): on
    an H200 the first token comes 1.03-1.06x dense's by layer (32K, eager) and 1.7-1.8x at
    once (docs/decisions/0026).
    Given a model, it switches the model to the ``"kvtier"`` attention (`enable`) if needed;
    given only a config, call `enable(model)` yourself. Close it (or use it as a context
    manager) to close the tierd sessions.
    """

    def __init__(self, model_or_config, client: Optional[Client] = None, socket: Optional[str] = None,
                 policy: Optional[Policy] = None, dtype: Optional[Dtype] = None, block_tokens: int = 64,
                 label: str = "hf", engine: str = "auto", max_blocks: int = 16384,
                 prefill_by_layer: bool = True):
        if engine not in ("auto", "on", "off"):
            raise ValueError(f"engine must be 'auto', 'on' or 'off', not {engine!r}")
        if hasattr(model_or_config, "set_attn_implementation"):
            if getattr(model_or_config.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
                enable(model_or_config)  # the cache only works with the "kvtier" attention
        config = getattr(model_or_config, "config", model_or_config)
        config = config.get_text_config(decoder=True)
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise UnsupportedUse("attention logit softcapping is not supported by tierd's attention")
        if dtype is None:
            mdtype = getattr(model_or_config, "dtype", None) or getattr(config, "dtype", None) or torch.float32
            if isinstance(mdtype, str):
                mdtype = getattr(torch, mdtype)
            dtype = _TORCH_TO_DTYPE.get(mdtype, Dtype.F32)
        layer_types, per_layer_kwargs = get_layer_types_and_kwargs(config)
        if isinstance(per_layer_kwargs, dict):
            # transformers before 5.2x returns one kwargs dict for every layer.
            per_layer_kwargs = [per_layer_kwargs] * len(layer_types)
        layers: List[CacheLayerMixin] = []
        self.full_layers: List[int] = []
        for i, (lt, kw) in enumerate(zip(layer_types, per_layer_kwargs)):
            if lt == "full_attention":
                layers.append(self._full_layer(i, len(self.full_layers)))
                self.full_layers.append(i)
            elif lt in ("sliding_attention", "chunked_attention"):
                layers.append(self._engine_layer(lt, kw))
            else:
                raise UnsupportedUse(f"layer {i} has type {lt!r}; the kvtier cache supports full, sliding and chunked attention")
        super().__init__(layers=layers)
        self._config = config
        self._n_q_heads = int(config.num_attention_heads)
        self.policy = policy if policy is not None else default_policy(block_tokens)
        self.dtype = Dtype(dtype)
        self.block_tokens = block_tokens
        self.label = label
        self._own_client = client is None
        self._client = client if client is not None else connect(socket)
        self.sessions: List[int] = []
        self.positions: Optional[np.ndarray] = None  # [n_full, B]: each session layer's length
        self.geometry: Optional[Geometry] = None
        self._staged: dict = {}
        self.prefill_by_layer = prefill_by_layer
        self._by_layer: Optional[_PrefillByLayer] = None  # a prefill going to tierd layer by layer
        self._starts: List[int] = []  # where each batch row's real tokens start
        self.last_stats = None
        self.want_stats = False
        self.engine_mode, self.max_blocks = engine, max_blocks
        self._socket_path = socket or getattr(self._client, "path", None) or default_socket_path()
        self.device_batch = None  # kvtier.engine.DeviceBatch once decoding in-engine
        self._engine = None  # its kvtier.engine.InEngine, from the prefill on when on a GPU
        self.engine_error: Optional[str] = None  # why "auto" fell back to the DECODE path
        #: Seconds of the prefill's hand-off to tierd (sessions opened, K/V appended), with the
        #: in-engine path's phases summed over the sessions (`InEngine.last_append`'s).
        self.prefill_handoff: Optional[dict] = None

    def _full_layer(self, layer_idx: int, slot: int) -> "KvtierLayer":
        return KvtierLayer(self, layer_idx, slot)

    def _engine_layer(self, layer_type: str, kwargs: dict) -> CacheLayerMixin:
        """A sliding (or chunked) layer, kept in the engine by transformers' own layer."""
        return DYNAMIC_LAYER_TYPE_MAPPING[layer_type](**kwargs)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if getattr(_handoff, "pending", None) is not None:
            _handoff.pending = None
            raise UnsupportedUse(
                "the model's attention did not go through kvtier: call kvtier.hf.enable(model) (or "
                "load it with attn_implementation='kvtier' after kvtier.hf.register())")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Closes the tierd sessions (and the connection if the cache opened it)."""
        client, self._client = getattr(self, "_client", None), None
        if client is None:
            return
        try:
            self._close_sessions(client)
        finally:
            self.sessions = []
            if self._own_client:
                client.disconnect()

    def __enter__(self) -> "KvtierCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _close_device_batch(self) -> None:
        """Releases the engine's leases; the sessions are closed next, so the GPU-held tokens
        are not handed to tierd."""
        db, self.device_batch = self.device_batch, None
        # An engine without a device batch yet (a prefill, no decode step) holds leases
        # until its connection closes: dropped with it, and with it a prefill not landed.
        self._engine, self._by_layer = None, None
        if db is not None:
            try:
                db.close(hand_off=False)
            except (KvtierError, OSError) as e:
                raise TierdUnavailable(f"releasing the engine's leases failed: {e}") from e

    def _close_sessions(self, client) -> None:
        """Ends the device batch and closes every session in tierd (best effort: a session the
        daemon already dropped, or a daemon gone, leaves nothing to close)."""
        self._close_device_batch()
        for sid in self.sessions:
            try:
                client.close(sid)
            except (KvtierError, OSError):
                pass

    def reset(self) -> None:
        self._close_sessions(self._client)
        self.sessions, self.positions, self.geometry, self._staged = [], None, None, {}
        self._by_layer, self._starts = None, []
        super().reset()

    @property
    def client(self) -> Client:
        if self._client is None:
            raise KvtierError("the kvtier cache is closed")
        return self._client

    # -- prefill ---------------------------------------------------------------------------

    def _stage_prefill(self, layer: KvtierLayer, key, value, mask) -> None:
        """One full layer's K/V of a prefill [B, Hkv, T, D], and its attention mask. With
        `prefill_by_layer` on the in-engine path each layer goes to tierd as the model produces
        it (`_PrefillByLayer`); otherwise the layers are kept until the last and handed over
        together."""
        last = layer.slot == len(self.full_layers) - 1
        if layer.slot == 0:
            if self.sessions:
                raise UnsupportedUse("the kvtier cache already holds a prefill; use a new cache per generate call")
            self._by_layer = self._begin_by_layer(key, mask)
        if self._by_layer is not None:
            # The last layer lands at the first decode step (`_land_prefill`).
            self._by_layer.layer(layer.slot, key, value)
            return
        self._staged[layer.slot] = (key.detach(), value.detach())
        if last:
            staged, self._staged = self._staged, {}
            n = len(self.full_layers)
            self._open_sessions([staged[s][0] for s in range(n)], [staged[s][1] for s in range(n)],
                                _valid_from_mask(mask, key.shape[0], key.shape[2]))

    def _create_sessions(self, hkv: int, d: int, valid) -> List[int]:
        """One session per batch row (its real tokens are the row's last ones); returns where
        each row's real tokens start. valid: [B, T] bool (False = padding)."""
        valid = torch.as_tensor(valid, dtype=torch.bool).to("cpu")
        b, t = valid.shape
        starts = []
        for r in range(b):
            row = valid[r]
            n_real = int(row.sum())
            start = t - n_real
            if n_real == 0 or not bool(row[start:].all()):
                raise UnsupportedUse(
                    f"batch row {r}: padding is not on the left (or the row is empty); the kvtier "
                    "cache needs left padding (tokenizer.padding_side = 'left')")
            starts.append(start)
        g = Geometry(len(self.full_layers), self._q_heads(), hkv, d, self.dtype, self.block_tokens)
        self.geometry = g
        client = self.client
        for r in range(b):
            try:
                sid = client.create_session(g, self.policy, label=f"{self.label}-row{r}")
            except (OSError, ConnectionError) as e:
                raise TierdUnavailable(f"lost the connection to tierd: {e}") from e
            except ServerError as e:
                if e.code == ErrorCode.INVALID_ARGUMENT:
                    raise GeometryRefused(g, self.policy, e.message) from e
                raise
            self.sessions.append(sid)
        self._starts = starts
        return starts

    def _begin_by_layer(self, key, mask) -> Optional["_PrefillByLayer"]:
        """Opens the sessions and, on the in-engine path, an append by layer of the prefill
        whose first full layer's K/V is `key`'s; None for the other paths (the sessions, if
        opened, then take the prefill when its last layer is staged)."""
        if (not self.prefill_by_layer or key.device.type != "cuda" or self.engine_mode == "off"
                or self.engine_error is not None):
            return None
        t0 = time.perf_counter()
        b, hkv, t, d = key.shape
        starts = self._create_sessions(hkv, d, _valid_from_mask(mask, b, t))
        e = self._open_engine(key.device)
        if e is None:
            return None
        from .engine import _torch_dtype

        try:
            e.begin_append_by_layer(self.sessions, [t - s for s in starts])
        except (KvtierError, RuntimeError) as err:  # kvtier.engine.EngineError is a RuntimeError
            # E.g. an older tierd (protocol version 4): all layers at once, after the last.
            warnings.warn(f"kvtier: the prefill goes to tierd after its last layer: {err}",
                          RuntimeWarning, stacklevel=4)
            return None
        return _PrefillByLayer(e, starts, t, len(self.full_layers), _torch_dtype(self.dtype),
                               time.perf_counter() - t0)

    def _land_prefill(self) -> None:
        """Lands a prefill handed over by layer (its last layer committed, the committer
        waited for): before the first decode step."""
        pb, self._by_layer = self._by_layer, None
        pb.land()
        self.positions = np.array([[pb.t - s for s in pb.starts]] * len(self.full_layers), dtype=np.int64)
        handoff = dict(seconds=pb.seconds)
        handoff.update(self._engine.last_append() or {})
        self.prefill_handoff = handoff

    def _open_sessions(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], valid) -> None:
        """The prefill of every full layer at once, one session per batch row holding that
        row's real tokens (opened here unless `_begin_by_layer` opened them). keys/values: per
        full layer [B, Hkv, T, D]; valid: [B, T] bool (False = padding)."""
        b, hkv, t, d = keys[0].shape
        t0 = time.perf_counter()
        handoff = dict(seconds=0.0)
        starts = self._starts if self.sessions else self._create_sessions(hkv, d, valid)
        client = self.client
        e = self._open_engine(keys[0].device)
        for r, sid in enumerate(self.sessions):
            s = starts[r]
            if e is not None:
                self._prefill_by_dma(e, sid, [kl[r, :, s:, :] for kl in keys],
                                     [vl[r, :, s:, :] for vl in values], handoff)
                continue
            k = np.stack([_to_wire(kl[r, :, s:, :].transpose(0, 1), self.dtype) for kl in keys])
            v = np.stack([_to_wire(vl[r, :, s:, :].transpose(0, 1), self.dtype) for vl in values])
            try:
                client.append_kv_shm(sid, 0, t - s, pack_append_payload(k, v))
            except (OSError, ConnectionError) as e:
                raise TierdUnavailable(f"lost the connection to tierd while appending the prefill: {e}") from e
        self.positions = np.array([[t - s for s in starts]] * len(self.full_layers), dtype=np.int64)
        handoff["seconds"] = time.perf_counter() - t0
        self.prefill_handoff = handoff

    def _open_engine(self, device):
        """This cache's in-engine path on `device` (its sessions attached), opened once; None
        for the DECODE path (off, not a GPU, or "auto" and it cannot be opened)."""
        if self._engine is not None:
            return self._engine
        if self.engine_mode == "off" or self.engine_error is not None:
            return None
        if device.type != "cuda":
            if self.engine_mode == "on":
                raise UnsupportedUse("engine='on' needs the model on a CUDA device")
            return None
        from . import engine as kv_engine

        try:
            e = kv_engine.InEngine(self._socket_path, self.geometry, self.policy,
                                   device=device.index or 0, max_sessions=len(self.sessions),
                                   max_blocks=self.max_blocks)
            for sid in self.sessions:
                e.attach(sid)
        except (KvtierError, OSError, ValueError, RuntimeError) as err:
            if self.engine_mode == "on":
                raise
            self._fall_back(err)
            return None
        self._engine = e
        return e

    def _fall_back(self, err) -> None:
        """engine="auto" on a GPU takes the DECODE path: said once, since it is much slower."""
        self.engine_error = str(err)
        warnings.warn(f"kvtier: the in-engine path is unavailable, decoding through tierd's "
                      f"DECODE instead: {err}", RuntimeWarning, stacklevel=3)

    #: Tokens per in-place append of a prefill: bounds each RESERVE's reply (its run table).
    PREFILL_CHUNK = 16384

    def _prefill_by_dma(self, e, sid: int, keys, values, phases: dict) -> None:
        """One session's prefill (per full layer k, v [Hkv, n, D] on the GPU) appended by DMA
        into tierd's arena, in chunks; each append's phases are added to `phases`."""
        from .engine import _torch_dtype

        kv_dtype = _torch_dtype(self.dtype)
        # [layers, 1 session, Hkv, K|V, n, D]: a block run's layout.
        rows = torch.stack([torch.stack([k, v], dim=1) for k, v in zip(keys, values)])
        rows = rows.to(kv_dtype).unsqueeze(1).contiguous()
        n = rows.shape[4]
        for first in range(0, n, self.PREFILL_CHUNK):
            e.append_rows([sid], rows, min(self.PREFILL_CHUNK, n - first), first)
            for phase, sec in (e.last_append() or {}).items():
                phases[phase] = phases.get(phase, 0.0) + sec

    def _in_engine(self, q, q_scale: float):
        """The device batch decoding this cache's sessions in this process, opened at the first
        decode step on a GPU; None for the DECODE path."""
        if self.device_batch is not None:
            return self.device_batch
        e = self._open_engine(q.device)
        if e is None:
            return None
        from . import engine as kv_engine

        try:
            self.device_batch = kv_engine.DeviceBatch(e, self.client, self.sessions, q_scale=q_scale)
        except (KvtierError, OSError, ValueError, RuntimeError) as err:
            if self.engine_mode == "on":
                raise
            self._fall_back(err)
            self._engine = None
            return None
        return self.device_batch

    def _q_heads(self) -> int:
        return self._n_q_heads

    @classmethod
    def from_dense(cls, model, dense_cache, attention_mask=None, **kwargs) -> "KvtierCache":
        """A kvtier cache continuing from a prefilled `DynamicCache` (same model): the full
        layers' K/V go to new tierd sessions, sliding layers are copied. `attention_mask` [B, T]
        (1 = real token, left padding) or None. Lets one dense prefill serve several policies."""
        import copy

        cache = cls(model, **kwargs)
        n = dense_cache.get_seq_length(cache.full_layers[0])
        keys = [dense_cache.layers[i].keys for i in cache.full_layers]
        values = [dense_cache.layers[i].values for i in cache.full_layers]
        if attention_mask is None:
            attention_mask = torch.ones(keys[0].shape[0], n, dtype=torch.bool)
        try:
            cache._open_sessions(keys, values, torch.as_tensor(attention_mask).bool())
        except BaseException:
            cache.close()
            raise
        for i, layer in enumerate(cache.layers):
            if isinstance(layer, KvtierLayer):
                layer.cumulative_length = n
                layer.is_initialized = True
                layer.device = keys[0].device
            else:
                cache.layers[i] = copy.deepcopy(dense_cache.layers[i])
        return cache

    # -- decode ----------------------------------------------------------------------------

    def _decode(self, layer: KvtierLayer, q, k, v, q_scale: float) -> torch.Tensor:
        """One DECODE at `layer` for every batch row. q [B, Hq, D]; k, v [B, Hkv, D]."""
        if not self.sessions:
            raise UnsupportedUse("decode step before any prefill: run the prompt through the model first")
        b = q.shape[0]
        if b != len(self.sessions):
            raise UnsupportedUse(f"batch of {b} rows but the cache holds {len(self.sessions)} sessions")
        if self._by_layer is not None:
            self._land_prefill()
        db = self._in_engine(q, q_scale)
        if db is not None:
            self.last_stats = None  # the in-engine path reports no per-step keep-sets
            try:
                out = db.attend(layer.slot, q.detach(), k.detach(), v.detach())
            except (OSError, ConnectionError) as e:
                raise TierdUnavailable(f"lost the connection to tierd during a decode step: {e}") from e
            self.positions[layer.slot] += 1
            return out
        qn = q.detach().to("cpu", torch.float32)
        if q_scale != 1.0:
            qn = qn * q_scale
        qn = qn.numpy()
        kn = _to_wire(k, self.dtype)
        vn = _to_wire(v, self.dtype)
        pos = self.positions[layer.slot]
        entries = [DecodeEntry(sid, int(pos[r]), qn[r], kn[r], vn[r]) for r, sid in enumerate(self.sessions)]
        try:
            outs = self.client.decode_batch(layer.slot, entries, want_stats=self.want_stats)
        except (OSError, ConnectionError) as e:
            raise TierdUnavailable(f"lost the connection to tierd during a decode step: {e}") from e
        pos += 1
        if self.want_stats:
            self.last_stats = [o.stats for o in outs]
        out = torch.from_numpy(np.stack([o.out.reshape(qn.shape[1], qn.shape[2]) for o in outs]))
        return out.to(q.device)


# --------------------------------------------------------------------------- compiled decoding

#: The attention kwarg through which a KvtierStaticLayer's `update` names itself to the
#: attention function (transformers passes the attention's kwargs to `Cache.update`).
_LAYER_KWARG = "kvtier_layer"

#: Every open KvtierStaticCache by its handle: what a compiled step's `kvtier::attend` finds
#: its cache by at run time, so that one compiled step serves every cache of its shapes.
_static_caches: "weakref.WeakValueDictionary[int, KvtierStaticCache]" = weakref.WeakValueDictionary()
_handles = itertools.count(1)


@torch.library.custom_op("kvtier::attend", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: torch.Tensor, slot: int,
            q_scale: float) -> torch.Tensor:
    """One decode step of full layer `slot` of the static cache `handle` (a 0-d int64 CPU
    tensor): q [B, Hq, D], the new token's k, v [B, Hkv, D] -> [B, Hq, D] in q's dtype. Opaque
    to torch.compile: it runs this host code (a DECODE, or the in-engine step and its
    hand-offs) at every step, so a CUDA graph never holds it."""
    cache = _static_caches.get(int(handle))
    if cache is None:
        raise KvtierError("the kvtier cache of this decode step is closed")
    layer = cache.layers[cache.full_layers[slot]]
    # A copy in one step: the in-engine path answers with its own buffer, which an op's
    # output must not alias.
    return cache._decode(layer, q, k, v, q_scale).to(q.dtype, copy=True)


@_attend.register_fake
def _(q, k, v, handle, slot, q_scale):
    return torch.empty_like(q)


class KvtierStaticLayer(KvtierLayer):
    """A full-attention layer of a `KvtierStaticCache`: no Python state changes in a decode
    step (its length is a tensor, its mask size fixed), and the step's attention is one
    `kvtier::attend`, so a compiled decode step is traced once and replayed."""

    is_compileable = True

    def __init__(self, cache: "KvtierStaticCache", layer_idx: int, slot: int, max_cache_len: int):
        super().__init__(cache, layer_idx, slot)
        self.max_cache_len = max_cache_len
        self.cumulative_length = torch.tensor(0, dtype=torch.int64)

    def lazy_initialization(self, key_states, value_states) -> None:
        super().lazy_initialization(key_states, value_states)
        # On the model's device at a fixed address, as StaticLayer keeps its own: a compiled
        # step updates it in place.
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(self.cumulative_length)

    def update(self, key_states, value_states, *args, **kwargs):
        attn_kwargs = kwargs.get("kwargs")
        if attn_kwargs is None:
            raise UnsupportedUse(
                "this model's attention does not pass its kwargs to the cache (transformers' "
                "`cache.update(..., kwargs=kwargs)`); use KvtierCache, the eager adapter")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        if n > 1 and getattr(self.cache._config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
            # Another attention would ignore the layer named below and attend the new token
            # alone in every decode step.
            raise UnsupportedUse(
                "the model's attention is not kvtier's: call kvtier.hf.enable(model) (or load it "
                "with attn_implementation='kvtier' after kvtier.hf.register())")
        if n > 1 and int(self.cumulative_length) > 0:  # only a prefill reads it (not compiled)
            raise _multi_token_step()
        self.cumulative_length.add_(n)
        attn_kwargs[_LAYER_KWARG] = self
        return key_states, value_states

    def decode(self, q, k, v, q_scale: float) -> torch.Tensor:
        return torch.ops.kvtier.attend(q, k, v, self.cache.handle, self.slot, q_scale)

    def get_mask_sizes(self, query_length: int):
        # A decode step's keys are tierd's: the mask the step builds for this layer is not
        # read, and its size stays fixed so that the step's shapes do not change.
        return (self.max_cache_len if query_length == 1 else query_length), 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        self.cumulative_length.zero_()
        self.is_initialized = False


class KvtierStaticCache(KvtierCache):
    """`KvtierCache` for compiled decoding: the way transformers' `StaticCache` does it, for
    ``generate(...)`` with a ``compile_config`` (or ``torch.compile`` of the model's forward).

    `max_cache_len`: the longest sequence (prompt and new tokens) the cache serves; it sizes
    the sliding layers, which stay in the engine as transformers' `StaticSlidingWindowLayer`,
    and the decode step's (unread) full-attention mask. The full layers' tokens live in tierd
    as with `KvtierCache`, with the same keyword arguments. The prefill runs eagerly (as
    `generate` does it); each decode step's full layers run `kvtier::attend`, which the
    compiled step calls as an opaque op, finding this cache by its `handle` at run time: one
    compiled step serves every cache of the same shapes. Needs a model whose attention passes
    its kwargs to `Cache.update` (transformers' decoder models do).
    """

    def __init__(self, model_or_config, max_cache_len: int, **kwargs):
        if max_cache_len < 1:
            raise ValueError(f"max_cache_len must be positive, not {max_cache_len}")
        self.max_cache_len = int(max_cache_len)
        super().__init__(model_or_config, **kwargs)
        key = next(_handles)
        self.handle = torch.tensor(key, dtype=torch.int64)  # on the CPU: the op reads it there
        _static_caches[key] = self

    def _full_layer(self, layer_idx: int, slot: int) -> KvtierLayer:
        return KvtierStaticLayer(self, layer_idx, slot, self.max_cache_len)

    def _engine_layer(self, layer_type: str, kwargs: dict) -> CacheLayerMixin:
        return STATIC_LAYER_TYPE_MAPPING[layer_type](max_cache_len=self.max_cache_len, **kwargs)

    def close(self) -> None:
        handle = getattr(self, "handle", None)
        if handle is not None:
            _static_caches.pop(int(handle), None)
        super().close()

    @classmethod
    def from_dense(cls, model, dense_cache, attention_mask=None, **kwargs):
        raise UnsupportedUse("KvtierStaticCache starts from its own prefill; from_dense is KvtierCache's")
