"""The in-engine data path from Python: tierd's sessions decoded on this process's GPU.

`InEngine` leases sessions from tierd (LEASE, docs/protocol.md 5.10), maps tierd's shared host
arena, registers it with this process's CUDA context and runs kvtier's selector, gather and
attention on the device over the block runs in place: the socket carries no tensors. It wraps
the Rust library `kvtier-engine` through the extension module `kvtier._native`, built with

    cargo build --release -p kvtier-native
    cp target/release/libkvtier_native.so clients/python/kvtier/_native.abi3.so

(`scripts/test.sh` does this with the debug build). tierd must run with `host.shared = true`,
and this process must be an admin peer of tierd (or run as tierd's uid).

Two ways to decode:

* `InEngine.decode_layer`: numpy in, numpy out (a host round trip per call).
* `DeviceBatch`: torch tensors on the engine's GPU, no host synchronization per layer. tierd
  holds each session's stored blocks; the tokens decoded since the last hand-off stay on the
  GPU (a tail of at most one block per layer), attended in kvtier's own layer call and merged
  with the keep-set's attention by log-sum-exp in its last kernel. Every `block_tokens` steps
  the tails go to tierd by DMA from the GPU straight into the sessions' runs in tierd's arena
  (RESERVE, copy, COMMIT; nothing through host buffers or the socket) and the engine's device
  state follows. Its `stage` (the new rows into the tails, q into kvtier's buffer) and
  `finish` (the output's dtype) are a few plain torch ops; `launch` is kvtier's layer. All
  three can be captured in one CUDA graph with the rest of the model's step: `CapturedStep`
  captures a whole step and captures it again after every hand-off (a captured kvtier layer
  is valid until the next bind).
"""

from __future__ import annotations

import time
from typing import List, Optional, Sequence

import numpy as np

from .protocol import Dtype, Geometry, KvtierError, Policy

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
    engine's own. `rank`, `world`: attend only KV heads [rank * n, (rank + 1) * n) of each
    session, n = kv_heads / world, and their query heads (tensor parallelism: q and the outputs
    then have q_heads / world heads). `in_place` (default: with every head) maps tierd's arena
    writable so that `append_rows` (and `DeviceBatch`'s hand-offs) can append rows from the GPU
    into it by DMA; off, the arena is registered read-only where the driver allows.
    `cache_slots`: tiles of GPU memory caching stored blocks per (session, layer, KV head), at
    least the keep-set's size (None: twice it); a block kept again while cached does not cross
    PCIe again."""

    def __init__(self, socket: str, geometry: Geometry, policy: Policy, device: int = 0,
                 max_sessions: int = 8, max_blocks: int = 8192, rank: int = 0, world: int = 1,
                 in_place: Optional[bool] = None, cache_slots: Optional[int] = None):
        if _native is None:
            raise EngineUnavailable(
                f"kvtier._native is not built ({_IMPORT_ERROR}); see kvtier.engine's docstring")
        g = geometry
        in_place = world == 1 if in_place is None else in_place
        try:
            self._e = _native.Engine(
                socket, device,
                (g.layers, g.q_heads, g.kv_heads, g.head_dim, int(g.dtype), g.block_tokens),
                policy.wire(),
                max_sessions, max_blocks, (rank, world), in_place, cache_slots or 0)
        except _native.EngineError as e:
            raise EngineUnavailable(str(e)) from None
        self.geometry = geometry
        self.device = device
        self.rank, self.world = rank, world
        self.in_place = in_place
        self.q_heads = g.q_heads // world  # this engine's query heads per session
        self._by_layer: Optional[List[int]] = None  # the sessions of the last append by layer

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
        q = np.ascontiguousarray(q, dtype="<f4").reshape(len(sessions), self.q_heads, g.head_dim)
        out = self._e.decode_layer(layer, list(sessions), q.tobytes())
        return np.frombuffer(out, dtype="<f4").reshape(q.shape).astype(np.float32)

    def bind(self, sessions: Sequence[int]) -> None:
        """Fix the batch of later `decode_layer_torch` calls (attached, synced sessions, in
        order). Bind again after `sync`, `attach` or `detach`."""
        self._e.bind(list(sessions))
        self._bound = len(sessions)

    def decode_layer_torch(self, layer: int, q, out, lse=None) -> None:
        """Attention of `layer` for the bound batch on the GPU: q float32 [n, q_heads, head_dim]
        (contiguous, on this engine's device) -> `out` (same shape and kind) and, if given,
        `lse` float32 [n, q_heads], the log-sum-exp of each output's scaled scores. Enqueued on
        torch's current stream; returns without waiting."""
        import torch

        g = self.geometry
        n = getattr(self, "_bound", None)
        if n is None:
            raise EngineError("no bound batch: call bind() first")
        hq = self.q_heads
        want = {"q": (q, (n, hq, g.head_dim)), "out": (out, (n, hq, g.head_dim))}
        if lse is not None:
            want["lse"] = (lse, (n, hq))
        for name, (t, shape) in want.items():
            if not isinstance(t, torch.Tensor) or t.device.type != "cuda" or t.device.index != self.device:
                raise ValueError(f"{name} must be a torch tensor on cuda:{self.device}")
            if t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous float32 {shape}, got {t.dtype} {tuple(t.shape)}")
        self._enqueue(layer, (q.data_ptr(), out.data_ptr(), 0 if lse is None else lse.data_ptr()))

    def _enqueue(self, layer: int, ptrs, tail=(0, 0)) -> None:
        """`decode_layer_torch` on buffers already checked: (q, out, lse) addresses, and a
        tail the outputs also attend (`DeviceBatch`'s): the addresses of its rows and of each
        session's newest row index."""
        import torch

        self._e.decode_layer_ptr(layer, *ptrs, torch.cuda.current_stream(self.device).cuda_stream,
                                 *tail)

    def append_rows(self, sessions: Sequence[int], rows, tokens: int, first: int = 0) -> None:
        """Append `tokens` rows to every layer of each of `sessions` by DMA from the GPU into
        their reserved rows of tierd's arena (RESERVE, copy, COMMIT; the device state follows),
        after torch's current stream has produced them. `rows`: [layers, len(sessions),
        kv_heads, 2, capacity, head_dim] in the sessions' dtype, contiguous, on this engine's
        device (per layer and session, each KV head's K rows then its V rows: a block run's
        layout); rows `first .. first + tokens` are appended. Needs `in_place`. Bind again
        afterwards."""
        import torch

        g = self.geometry
        if not self.in_place:
            raise EngineError("this engine was opened without in_place: it cannot append rows")
        want = (g.layers, len(sessions), g.kv_heads, 2, None, g.head_dim)
        if (not isinstance(rows, torch.Tensor) or rows.device.type != "cuda"
                or rows.device.index != self.device):
            raise ValueError(f"rows must be a torch tensor on cuda:{self.device}")
        if (rows.dtype != _torch_dtype(g.dtype) or rows.dim() != 6 or not rows.is_contiguous()
                or any(w is not None and w != s for w, s in zip(want, rows.shape))):
            raise ValueError(f"rows must be contiguous {_torch_dtype(g.dtype)} [layers, sessions, "
                             f"kv_heads, 2, capacity, head_dim] = {want}, got {rows.dtype} {tuple(rows.shape)}")
        cap = rows.shape[4]
        if tokens <= 0 or first < 0 or first + tokens > cap:
            raise ValueError(f"rows {first}..{first + tokens} of a buffer of {cap}")
        row = g.head_dim * rows.element_size()
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._e.append_from_device(list(sessions), rows.data_ptr() + first * row, rows[0, 0].nbytes,
                                   rows[0].nbytes, cap, tokens, stream)

    def begin_append_by_layer(self, sessions: Sequence[int], tokens: Sequence[int]) -> None:
        """Opens an append of `tokens[i]` rows to every layer of `sessions[i]` that the caller
        copies (`copy_layer`) and commits (`commit_layers`) layer by layer, while its model
        still computes the later layers: RESERVE for each. Needs `in_place` and tierd's
        protocol version 5. Bind again after the last layer."""
        if not self.in_place:
            raise EngineError("this engine was opened without in_place: it cannot append rows")
        self._e.begin_append_by_layer(list(sessions), list(tokens))
        self._by_layer = list(sessions)

    def copy_layer(self, layer: int, rows: Sequence) -> None:
        """Enqueues the DMA of layer `layer`'s rows of each session of the open append behind
        torch's current stream and returns at once: `rows[i]` [kv_heads, 2, n, head_dim]
        contiguous in the sessions' dtype on this engine's device (each KV head's K rows, then
        its V rows), its first `tokens[i]` rows appended. The copies run in stream order, so
        `rows` may be freed once this returns (torch's caching allocator reuses the memory only
        for work behind them on that stream), but must not be changed by work on another
        stream before they have run."""
        import torch

        g = self.geometry
        sessions = self._by_layer
        if sessions is None or len(rows) != len(sessions):
            raise EngineError("copy_layer: one rows tensor per session of an open append by layer")
        for r in rows:
            if (not isinstance(r, torch.Tensor) or r.device.type != "cuda" or r.device.index != self.device
                    or r.dtype != _torch_dtype(g.dtype) or r.dim() != 4 or not r.is_contiguous()
                    or (r.shape[0], r.shape[1], r.shape[3]) != (g.kv_heads, 2, g.head_dim)):
                raise ValueError(f"rows must be contiguous {_torch_dtype(g.dtype)} [kv_heads, 2, n, head_dim] "
                                 f"= ({g.kv_heads}, 2, n, {g.head_dim}) on cuda:{self.device}")
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._e.copy_layer(layer, sessions, [r.data_ptr() for r in rows], [r.shape[2] for r in rows], stream)

    def commit_layers(self, first: int, count: int = 1) -> None:
        """Hands layers `first .. first + count` (each copied, none committed) to the engine's
        committer (two threads), which waits for their copies, COMMITs them in tierd and summarizes
        them while the caller goes on; uploads the device state of the layers it has finished
        and returns. The call that commits the last layers waits for the rest, and its COMMIT
        lands the append. An error (this call's, or an earlier call's layers' on the committer)
        drops the append; it is raised by the last call at the latest."""
        self._e.commit_layers(first, count)

    def bound_stats(self) -> List[dict]:
        """Per layer: hits, misses, bytes_moved and tiles of the device calls since `bind`."""
        return [dict(hits=h, misses=m, bytes_moved=b, tiles=t) for h, m, b, t in self._e.bound_stats()]

    def registration(self):
        """(bytes, seconds) of mapping and registering tierd's arena with this process's CUDA
        context (every page is pinned), or None before the first attach. Engines of a process
        on one device over one tierd share the mapping: a later one's seconds are ~0."""
        return self._e.registration()

    def last_append(self) -> Optional[dict]:
        """Seconds of the last `append_rows`, hand-off or append by layer (once its last layer
        is committed) by phase, summed over its sessions: reserve (RESERVE round trips), copy
        (enqueueing the DMA copies and waiting for them; by layer, for their fences), commit
        (COMMIT: tierd checks the rows and folds their bounds and sketches), sync (this
        engine's device state follows: summaries of the new blocks from the runs, uploads).
        None before one reached its copies."""
        t = self._e.last_append()
        return None if t is None else dict(zip(("reserve", "copy", "commit", "sync"), t))

    def keep_sets(self, layer: int) -> List[List[List[int]]]:
        """Keep-sets of the last call at `layer`: [session][kv_head] ascending block ids."""
        return self._e.keep_sets(layer)


EngineError = _native.EngineError if _native is not None else EngineUnavailable


def _torch_dtype(dtype):
    """The torch dtype of a session dtype."""
    import torch

    return {Dtype.BF16: torch.bfloat16, Dtype.F16: torch.float16, Dtype.F32: torch.float32}[Dtype(dtype)]


class DeviceBatch:
    """A batch of tierd sessions decoded through `engine` with torch tensors on its GPU.

    Per layer and step: `attend(layer, q, k, v)`, with q [n, q_heads, head_dim] and the new
    token's k, v [n, kv_heads, head_dim] (post-RoPE, any float dtype) -> the attention output
    [n, q_heads, head_dim] in q's dtype, over the session's stored tokens (kvtier's keep-set)
    and every token since the last hand-off (held here, on the GPU). `q_scale` multiplies q
    first: kvtier's softmax scale is 1/sqrt(head_dim), so a model scaling by s passes
    s * sqrt(head_dim). A step runs every layer once, in order (the tails' next row advances
    after the last layer).

    `attend` is `stage`, `launch` (kvtier's layer, which attends the tail too) and `finish` on
    static buffers, then, after the last layer, `advance()` (it hands the tails to tierd when
    they are full). All of it but `advance` can be captured in a CUDA graph; whoever replays
    the graph calls `advance` after each replay (`CapturedStep` does, and turns `attend`'s own
    off: `advance_in_attend`; while torch's stream is capturing `attend` never advances). A
    graph holding `launch` is valid until the next hand-off: `epoch` counts them.
    """

    def __init__(self, engine: InEngine, client, sessions: Sequence[int], q_scale: float = 1.0):
        import torch

        g = engine.geometry
        if engine.world != 1:
            raise ValueError("DeviceBatch needs an engine of every head: its hand-offs append all "
                             "of a token's heads (a tensor-parallel engine would gather its ranks' "
                             "tails first, which is not built)")
        if not engine.in_place:
            raise ValueError("DeviceBatch hands its tails to tierd in place: open the engine "
                             "with in_place=True")
        self.engine, self.client, self.sessions = engine, client, list(sessions)
        self.q_scale = q_scale
        dev = torch.device("cuda", engine.device)
        n, bt, nl = len(self.sessions), g.block_tokens, g.layers
        # The tails hold tokens in the sessions' dtype (what a hand-off appends).
        kv_dtype = _torch_dtype(g.dtype)
        self.stored = []
        for s in self.sessions:
            engine.attach(s)
            info = client.session_info(s)
            if info.tokens_min != info.tokens_max or info.tokens_max == 0:
                raise ValueError(f"session {s}: layers hold {info.tokens_min}..{info.tokens_max} "
                                 "tokens; a device batch needs the same nonzero count in every layer")
            self.stored.append(info.tokens_max)
        engine.bind(self.sessions)
        # One buffer in a block run's layout per (layer, session): [Hkv][K, V][bt][D], so that a
        # hand-off copies each layer's rows into tierd's runs as they are.
        self.tail = torch.zeros((nl, n, g.kv_heads, 2, bt, g.head_dim), dtype=kv_dtype, device=dev)
        self.tail_k, self.tail_v = self.tail[:, :, :, 0], self.tail[:, :, :, 1]
        # Per session: the tail row of this step's token in every layer (on the device, so that
        # a captured step reads it; kvtier's layer attends rows 0..=pos); `count` is its host
        # copy.
        self.pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.count = 0
        self.q32 = torch.zeros((nl, n, g.q_heads, g.head_dim), dtype=torch.float32, device=dev)
        self.o32 = torch.zeros_like(self.q32)
        self._ptrs = [(self.q32[l].data_ptr(), self.o32[l].data_ptr(), 0) for l in range(nl)]
        self._tails = [(self.tail[l].data_ptr(), self.pos.data_ptr()) for l in range(nl)]
        self._rows = torch.arange(n, device=dev)
        self.g = g
        self.last_handoff = None
        #: Hand-offs so far (each binds the engine again, which invalidates captured launches).
        self.epoch = 0
        #: Whether `attend` at the last layer calls `advance` (off when a graph replays steps).
        self.advance_in_attend = True
        #: Why the last hand-off failed, until one succeeds (the next step tries it again).
        self.handoff_error = None
        #: The device calls' statistics of the period the last hand-off ended (a bind zeroes
        #: them); None before the first.
        self.period_stats = None

    def stage(self, layer: int, q, k, v) -> None:
        """Store the new token's k, v in the layer's tail; q into the layer's query buffer.
        At a full tail (a hand-off that failed), hand it off first: raises again if it fails,
        and never writes past the tail."""
        import torch

        if layer == 0 and not torch.cuda.is_current_stream_capturing():
            self.ensure_room()
        self.tail_k[layer][self._rows, :, self.pos] = k.to(self.tail_k.dtype)
        self.tail_v[layer][self._rows, :, self.pos] = v.to(self.tail_v.dtype)
        if self.q_scale != 1.0:
            torch.mul(q, self.q_scale, out=self.q32[layer])
        else:
            self.q32[layer].copy_(q)

    def launch(self, layer: int) -> None:
        """kvtier's attention over the stored tokens' keep-set and the tail, into the layer's
        output."""
        # The buffers are this batch's own, checked when made; only the binding can change
        # (someone else's bind() of another batch size would overrun them).
        if getattr(self.engine, "_bound", None) != len(self.sessions):
            raise EngineError("the engine's bound batch is not this device batch's: bind it again")
        self.engine._enqueue(layer, self._ptrs[layer], self._tails[layer])

    def finish(self, layer: int, dtype=None):
        """The layer's output [n, q_heads, head_dim] in `dtype` (default the tail's); float32
        returns the batch's own buffer, which the layer's next step overwrites. After the last
        layer the tails' next row advances."""
        if layer == self.g.layers - 1:
            self.pos += 1
        return self.o32[layer].to(dtype or self.tail_k.dtype)

    def attend(self, layer: int, q, k, v):
        import torch

        self.stage(layer, q, k, v)
        self.launch(layer)
        out = self.finish(layer, q.dtype)
        if (layer == self.g.layers - 1 and self.advance_in_attend
                and not torch.cuda.is_current_stream_capturing()):
            self.advance()
        return out

    def advance(self) -> None:
        """One step done in every layer: at a full tail, hand every tail to tierd. The step
        itself is done whatever happens to the hand-off: if it fails, the next step tries it
        again before it writes anything and raises if it fails again (`handoff_error` holds
        this failure meanwhile)."""
        self.count += 1
        if self.count >= self.g.block_tokens:
            try:
                self.flush()
            except (KvtierError, EngineError, OSError) as e:
                self.handoff_error = e

    def ensure_room(self) -> None:
        """Hand the tails to tierd if they are full (the hand-off of `advance` failed, or has
        not run): the next step needs a free row in every tail."""
        if self.count >= self.g.block_tokens:
            self.flush()

    def flush(self) -> None:
        """Hand each session's tail tokens to tierd (RESERVE, DMA from the GPU into the
        reserved rows of its runs, COMMIT), update the engine from the reservations, bind
        again and empty the tails."""
        import torch

        c = self.count
        if c == 0:
            return
        stream = torch.cuda.current_stream(self.engine.device)
        tw = time.perf_counter()
        stream.synchronize()  # the step's own GPU work
        self.period_stats = self.engine.bound_stats()
        t0 = time.perf_counter()
        try:
            self.engine.append_rows(self.sessions, self.tail, c)
        except Exception:
            # What tierd holds now (a failed COMMIT leaves its session as it was); the tails
            # stay full, so the next step tries the hand-off again before it writes.
            try:
                self.stored = [self.client.session_info(s).tokens_max for s in self.sessions]
            except (KvtierError, OSError):
                pass  # tierd is unreachable: its state is unknown here, the error says why
            raise
        self.stored = [n + c for n in self.stored]
        t1 = time.perf_counter()
        self.engine.bind(self.sessions)
        t2 = time.perf_counter()
        self.pos.zero_()
        self.count = 0
        self.epoch += 1
        self.handoff_error = None
        #: Seconds of the last hand-off: waiting for the step's GPU work, the in-place append
        #: (RESERVE, DMA, COMMIT, device state), bind.
        self.last_handoff = dict(wait=t0 - tw, append=t1 - t0, bind=t2 - t1)

    def close(self, hand_off: bool = True) -> None:
        """Detach the sessions, first handing the tails to tierd (`hand_off`; leave it off
        when the sessions are closed next: their last tokens would be appended for nothing)."""
        if hand_off:
            self.flush()
        for s in self.sessions:
            self.engine.detach(s)


class CapturedStep:
    """A whole decode step, kvtier's layers included, replayed as one CUDA graph.

    `step` enqueues one step on torch's current stream from static buffers (a model's layers
    calling `batch.attend`, or `stage`/`launch`/`finish` for every layer), with no host
    synchronization. The first call runs it eagerly on a side stream (torch's warm-up before a
    capture); every later call replays the graph; each call ends with `batch.advance()` (the
    batch's `attend` no longer does). After a hand-off the graph is captured again before its
    next replay: the bind changed the block counts that kvtier's launches were sized for. Each
    capture goes into the memory pool of the one before, which is then dropped (never replayed
    again), so captures reuse the step's intermediate memory.

    A replayed kvtier layer reuses the cache stamps of its capture, so within one hand-off
    period (`block_tokens` steps) the tile cache evicts among the period's tiles by slot, not
    by last use; docs/architecture.md, "The device path".
    """

    def __init__(self, batch: DeviceBatch, step):
        import torch

        self.batch, self.step = batch, step
        batch.advance_in_attend = False
        self.graph = None
        self.epoch = None
        self.pool = torch.cuda.graph_pool_handle()
        #: Captures made so far, and the seconds the last one took (capture and instantiation).
        self.captures = 0
        self.last_capture_s = None

    def __call__(self) -> None:
        import torch

        self.batch.ensure_room()  # a failed hand-off is tried again before the step runs
        if self.graph is None and self.epoch is None:
            # Warm-up (lazy initialisation of libraries' handles and workspaces) on a side
            # stream, as torch asks before a capture: a real step.
            cur = torch.cuda.current_stream()
            side = torch.cuda.Stream()
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                self.step()
            cur.wait_stream(side)
            self.epoch = -1  # captured before the next step
            self.batch.advance()
            return
        if self.epoch != self.batch.epoch:
            self.capture()
        self.graph.replay()
        self.batch.advance()

    def capture(self) -> None:
        """Capture the step now (the next call replays it)."""
        import torch

        t = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.step()
        if self.graph is not None:
            self.graph.reset()
        self.graph = graph
        self.epoch = self.batch.epoch
        self.captures += 1
        self.last_capture_s = time.perf_counter() - t
