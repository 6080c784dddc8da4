"""Whole-model greedy decode with the KV in tierd's host tier (the seed paper's
section 10 on this hardware), against the same engine with dense attention.

The model is a randomly initialised Qwen2.5-7B built from its configuration in transformers
(the real architecture and sizes, bf16, nothing downloaded). The decode step is this script's
own loop over the model's modules, so that every engine variant runs the same kernels around
attention and can be captured in CUDA graphs:

* ``dense-hbm``: the KV in GPU memory (a static cache sized for the context), dense attention;
  the whole step is one CUDA graph.
* ``dense-host``: the KV in pinned host memory, copied to the GPU layer by layer each step
  (the dense-from-host floor is its bytes over PCIe); one CUDA graph.
* ``kvtier``: the KV in tierd's shared host arena, decoded in this process through
  ``kvtier.engine.DeviceBatch``: per layer the projections, kvtier's layer (select, gather over
  PCIe, attend), then the tail attention, merge, output projection and MLP, with no host
  synchronization until the step's end. Two ways to run it (``--graphs``, both by default,
  alternating in one run):
  ``whole``: the whole step, kvtier's 28 layers included, is one CUDA graph
  (``kvtier.engine.CapturedStep``), captured again after every hand-off;
  ``segments``: 29 graph replays (everything but kvtier) around 28 eager kvtier launches.
  Every 128 steps the tokens decoded on the GPU go to tierd by DMA into their reserved rows
  (RESERVE, copy, COMMIT per session) and the engine's device state follows from the
  reservations.

The stored context of every session is random bf16 KV (one random 1024-token chunk appended
through the socket from a memfd at every position, each copy's signs flipped in its own random
pattern so that every block is distinct), so the keep-sets are not those of a real model; the
step's structure, sizes and transfers are.

Usage (tierd running with host.shared = true and room for the sessions):
    python whole_model.py --socket /tmp/t/tierd.sock --context 131072 --batches 1,8 \\
        --modes kvtier,dense-hbm,dense-host --dense-contexts 8192,131072 --steps 160
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvtier import DEFAULT_CANDIDATES, Client, Dtype, Geometry, Policy, Selector  # noqa: E402
from kvtier import engine as kv_engine  # noqa: E402

HIDDEN, INTER, LAYERS, HQ, HKV, D = 3584, 18944, 28, 28, 4, 128
VOCAB, THETA, EPS = 152064, 1_000_000.0, 1e-6
GEO = Geometry(LAYERS, HQ, HKV, D, Dtype.BF16, 128)
CHUNK = 1024


def build_model(dev, dtype=torch.bfloat16):
    """The randomly initialised Qwen2.5-7B (seed 0), in `dtype` (this script's step needs bf16)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                      num_attention_heads=HQ, num_key_value_heads=HKV, vocab_size=VOCAB,
                      rope_theta=THETA, rms_norm_eps=EPS, max_position_embeddings=1 << 21,
                      tie_word_embeddings=False, torch_dtype=str(dtype).removeprefix("torch."))
    torch.manual_seed(0)
    with torch.device(dev):
        model = Qwen2ForCausalLM(cfg).to(dtype)
    return model.eval()


class Step:
    """One decode step over the model's modules for a batch of `b`, on static buffers."""

    def __init__(self, model, b, dev):
        self.m, self.b, self.dev = model, b, dev
        self.tok = torch.zeros(b, dtype=torch.long, device=dev)
        self.pos = torch.zeros(b, dtype=torch.long, device=dev)
        self.h = torch.zeros(b, HIDDEN, dtype=torch.bfloat16, device=dev)
        inv = 1.0 / (THETA ** (torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D))
        self.inv_freq = inv

    def rope(self, x):
        ang = self.pos.float().unsqueeze(-1) * self.inv_freq  # [b, D/2]
        cos = torch.cat([ang.cos(), ang.cos()], -1).unsqueeze(1).to(x.dtype)
        sin = torch.cat([ang.sin(), ang.sin()], -1).unsqueeze(1).to(x.dtype)
        x1, x2 = x[..., : D // 2], x[..., D // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def embed(self):
        self.h.copy_(self.m.model.embed_tokens(self.tok))

    def pre(self, l):
        """Layer l up to attention: q [b, Hq, D], k, v [b, Hkv, D] (post-RoPE)."""
        a = self.m.model.layers[l]
        x = a.input_layernorm(self.h)
        sa = a.self_attn
        q = self.rope(sa.q_proj(x).view(self.b, HQ, D))
        k = self.rope(sa.k_proj(x).view(self.b, HKV, D))
        v = sa.v_proj(x).view(self.b, HKV, D)
        return q, k, v

    def post(self, l, attn):
        a = self.m.model.layers[l]
        h = self.h + a.self_attn.o_proj(attn.reshape(self.b, HQ * D).to(torch.bfloat16))
        self.h.copy_(h + a.mlp(a.post_attention_layernorm(h)))

    def head(self):
        logits = self.m.lm_head(self.m.model.norm(self.h))
        self.tok.copy_(logits.argmax(-1))
        self.pos += 1


def dense_attend(q, kc, vc, length):
    """q [b, Hq, D]; kc, vc [b, Hkv, L, D]; attends positions < length [b]."""
    b, L = q.shape[0], kc.shape[2]
    qg = q.view(b, HKV, HQ // HKV, D)
    s = torch.matmul(qg, kc.transpose(-1, -2)).float() * (D ** -0.5)  # [b, Hkv, G, L]
    mask = torch.arange(L, device=q.device).view(1, 1, 1, L) >= length.view(b, 1, 1, 1)
    p = torch.softmax(s.masked_fill(mask, float("-inf")), -1).to(vc.dtype)
    return torch.matmul(p, vc).view(b, HQ, D)


class Dense:
    """Dense attention over a static KV cache of `context + room` positions per layer (rounded
    up to `align`, the rest masked), in GPU memory or in pinned host memory (copied to one GPU
    buffer per layer each step)."""

    def __init__(self, st: Step, context, room, host, align=64):
        b, dev = st.b, st.dev
        # The cache length rounded up to `align` positions (masked): the score and probability
        # matrices have L columns, and with L not a multiple of 8 their bf16 rows are not
        # 16-byte aligned, which sends both matmuls to slower kernels (8K, batch 1 on an H200:
        # 10.3 ms a step at L = 8354 against 8.4 at 8304).
        L = -(-(context + room) // align) * align
        shape = (b, HKV, L, D)
        self.st, self.host, self.L = st, host, L
        if host:
            self.kc = [torch.empty(shape, dtype=torch.bfloat16, pin_memory=True) for _ in range(LAYERS)]
            self.vc = [torch.empty(shape, dtype=torch.bfloat16, pin_memory=True) for _ in range(LAYERS)]
            for t in self.kc + self.vc:
                t.fill_(0.01)  # the values do not change the time; a memset is fast
            self.gk = torch.empty(shape, dtype=torch.bfloat16, device=dev)
            self.gv = torch.empty(shape, dtype=torch.bfloat16, device=dev)
        else:
            self.kc = [torch.randn(shape, dtype=torch.bfloat16, device=dev) for _ in range(LAYERS)]
            self.vc = [torch.randn(shape, dtype=torch.bfloat16, device=dev) for _ in range(LAYERS)]
        st.pos.fill_(context)
        self.rows = torch.arange(b, device=dev)

    def bytes_per_step(self):
        return 2 * LAYERS * self.kc[0].numel() * 2

    def step(self):
        st = self.st
        st.embed()
        for l in range(LAYERS):
            q, k, v = st.pre(l)
            if self.host:
                # The new token goes to the GPU copy; the host cache is the context (a benchmark
                # of reading it, not of keeping it).
                self.gk.copy_(self.kc[l], non_blocking=True)
                self.gv.copy_(self.vc[l], non_blocking=True)
                kc, vc = self.gk, self.gv
            else:
                kc, vc = self.kc[l], self.vc[l]
            kc[self.rows, :, st.pos] = k
            vc[self.rows, :, st.pos] = v
            st.post(l, dense_attend(q, kc, vc, st.pos + 1))
        st.head()


class Kvtier:
    """Attention through kvtier.engine.DeviceBatch: graph segments around kvtier's layers."""

    def __init__(self, st: Step, batch: kv_engine.DeviceBatch, context):
        self.st, self.db = st, batch
        st.pos.fill_(context)
        self.graphs = None
        # Breakdown only: leave kvtier's layers out (the step's other work, hand-offs included).
        self.skip_kvtier = False

    def seg_first(self):
        self.st.embed()
        self._pre(0)

    def _pre(self, l):
        q, k, v = self.st.pre(l)
        self.db.stage(l, q, k, v)

    def seg_mid(self, l):
        """After kvtier's layer l: finish l, then layer l + 1 up to its kvtier layer."""
        self.st.post(l, self.db.finish(l, torch.float32))
        if l + 1 < LAYERS:
            self._pre(l + 1)
        else:
            self.st.head()

    def capture(self):
        segs = [self.seg_first] + [lambda l=l: self.seg_mid(l) for l in range(LAYERS)]
        # Warm up on a side stream (as torch's graph docs ask), then capture each segment. The
        # warm-up runs change the state (tails, positions); the caller resets what it needs.
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for f in segs:
                f()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        self.graphs = []
        for f in segs:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                f()
            self.graphs.append(g)

    def step(self):
        g = self.graphs
        g[0].replay()
        for l in range(LAYERS):
            if not self.skip_kvtier:
                self.db.launch(l)
            g[l + 1].replay()
        self.db.advance()

    def whole_step(self):
        """The step's work, kvtier's layers included, enqueued for one capture."""
        self.seg_first()
        for l in range(LAYERS):
            self.db.launch(l)
            self.seg_mid(l)


def capture_whole(step_fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step_fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step_fn()
    return g.replay


def time_steps(run, steps, warmup, on_step=None):
    """Per-step milliseconds (CUDA events on the current stream between steps, with the host
    waiting at each step's end as a generate loop does to read the token)."""
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    walls = []
    ev[0].record()
    for i in range(steps):
        t = time.perf_counter()
        run()
        ev[i + 1].record()
        ev[i + 1].synchronize()
        walls.append((time.perf_counter() - t) * 1e3)
        if on_step:
            on_step(i)
    return [ev[i].elapsed_time(ev[i + 1]) for i in range(steps)], walls


def fill_sessions(c: Client, n, context, policy):
    """`n` sessions of `context` tokens: one random 1024-token chunk appended at every position,
    each copy with its signs flipped in its own random pattern over (kv head, dim), so every
    block is distinct (identical copies make the keep-sets artificial: every distant pick a
    copy of the same few blocks, which then recur and hit the tile cache)."""
    import numpy as np

    from kvtier.client import sealed_memfd

    rng = np.random.default_rng(7)
    elems = LAYERS * 2 * CHUNK * HKV * D
    base = (rng.standard_normal(elems, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    base = base.reshape(-1, HKV * D)
    ids = [c.create_session(GEO, policy, f"whole-model-{i}") for i in range(n)]
    t = time.time()
    for at in range(0, context, CHUNK):
        signs = (rng.integers(0, 2, HKV * D, dtype=np.uint16) << 15).astype(np.uint16)
        payload = (base ^ signs).tobytes()
        fd = sealed_memfd(payload, "whole-model")
        try:
            for s in ids:
                c.append_kv_fd(s, at, CHUNK, fd, 0, len(payload))
        finally:
            os.close(fd)
    print(f"filled {n} sessions x {context} tokens in {time.time() - t:.1f} s", flush=True)
    return ids


def report(rows, name, context, b, ms, walls, extra=""):
    med = statistics.median(ms)
    row = dict(mode=name, context=context, batch=b, step_ms=med, wall_ms=statistics.median(walls),
               tokens_per_s=b * 1e3 / med, mean_ms=statistics.fmean(ms), max_ms=max(ms), note=extra)
    rows.append(row)
    print(f"{name:>10} ctx={context:>8} b={b}: step p50 {med:7.2f} ms (wall {row['wall_ms']:7.2f}, "
          f"mean {row['mean_ms']:7.2f}, max {row['max_ms']:7.2f}) {row['tokens_per_s']:8.1f} tok/s {extra}",
          flush=True)


def run_kvtier(rows, a, e, db, kt, whole, how, b, tag=""):
    """Times `a.steps` kvtier steps run `how` (whole: one graph; segments: 29 graphs around
    eager kvtier launches). Steps that hand the tails to tierd, and (whole) the step after,
    which captures the graph again, are left out of the median and listed."""
    run = whole if how == "whole" else kt.step
    for _ in range(a.warmup):
        run()
    special, handoffs = [], []
    seen = [whole.captures]
    # The run's tile statistics: a hand-off's bind zeroes the device counters, so add up the
    # periods this run ends (DeviceBatch.period_stats) and subtract what the first one held.
    before = e.bound_stats()
    periods = []

    def on_step(i):
        if db.count == 0:
            special.append(i)
            handoffs.append({k: round(v * 1e3, 1) for k, v in db.last_handoff.items()})
            periods.append(db.period_stats)
        if whole.captures != seen[0]:
            seen[0] = whole.captures
            special.append(i)
            handoffs.append({"capture": round(whole.last_capture_s * 1e3, 1)})

    ms, walls = time_steps(run, a.steps, 0, on_step)

    def total(key):
        return (sum(sum(s[key] for s in p) for p in periods + [e.bound_stats()])
                - sum(s[key] for s in before))

    tiles, hits, moved = total("tiles"), total("hits"), total("bytes_moved")
    plain = [m for i, m in enumerate(ms) if i not in special]
    note = (f"hit share {hits / max(tiles, 1):.3f}, "
            f"{moved / max(tiles, 1) / 1e3:.1f} kB/tile moved; "
            f"hand-off/capture steps {[round(ms[i], 1) for i in special]} ms {handoffs}")
    report(rows, f"kvtier-{how}{tag}", a.context, b, plain,
           [w for i, w in enumerate(walls) if i not in special], note)
    rows[-1]["mean_with_handoffs_ms"] = statistics.fmean(ms)
    rows[-1]["register_s"] = e.registration()[1]


def policy_of(spec: str, top_k: int) -> Policy:
    """`bound`, `sketch` (tierd's default candidates) or `sketch:C`, with a sink of 128 tokens
    and a local window of 512 (1 and 4 blocks of 128 tokens; 4 and 16 of 32)."""
    sink, local = 128 // GEO.block_tokens, 512 // GEO.block_tokens
    if spec == "bound":
        return Policy.bound(sink, local, top_k)
    name, _, c = spec.partition(":")
    if name != "sketch":
        sys.exit(f"--selectors: {spec!r} is not bound, sketch or sketch:C")
    return Policy(sink, local, top_k, Selector.SKETCH, int(c) if c else DEFAULT_CANDIDATES)


def run_engine(rows, a, model, dev, c, ids, policy, cache_slots, rounds, breakdown, tag=""):
    """Opens an engine and a device batch over `ids` with `policy` and `cache_slots` (0: the
    default), times `rounds` rounds of `--graphs`, and closes them (the tails are not handed
    off). `tag` names the engine in the report."""
    b = len(ids)
    t = time.time()
    # GPU memory the engine takes (the driver's free memory, so cudarc's allocations count):
    # what it sizes at creation for max_sessions x max_blocks (mirrors with their bounds and
    # sketches, the block cache), then what attaching and binding the sessions adds.
    free0 = torch.cuda.mem_get_info(dev)[0]
    e = kv_engine.InEngine(a.socket, GEO, policy, device=0, max_sessions=b,
                           max_blocks=(a.context + 4096) // GEO.block_tokens,
                           cache_slots=cache_slots or None)
    free1 = torch.cuda.mem_get_info(dev)[0]
    db = kv_engine.DeviceBatch(e, c, ids)
    free2 = torch.cuda.mem_get_info(dev)[0]
    reg_bytes, reg_s = e.registration()
    print(f"kvtier{tag} b={b} cache_slots={cache_slots or 'default'}: leased, registered, synced in "
          f"{time.time() - t:.1f} s (mapping and registering the {reg_bytes / 2**30:.1f} GiB arena: "
          f"{reg_s:.1f} s); GPU memory: engine {(free0 - free1) / 2**30:.2f} GiB, "
          f"{b} session(s) {(free1 - free2) / 2**30:.2f} GiB", flush=True)
    st = Step(model, b, dev)
    kt = Kvtier(st, db, a.context)
    kt.capture()
    # Capture's warm-up ran two steps' worth of stage/finish: start clean.
    db.pos.zero_()
    st.pos.fill_(a.context)
    whole = kv_engine.CapturedStep(db, kt.whole_step)
    whole()  # its warm-up: one eager step
    for _ in range(rounds):
        for how in a.graphs.split(","):
            run_kvtier(rows, a, e, db, kt, whole, how, b, tag + (f"/c{cache_slots}" if cache_slots else ""))
            rows[-1]["cache_slots"] = cache_slots
            rows[-1]["selector"] = f"{policy.selector.name.lower()}:{policy.candidates}"
            rows[-1]["gpu_engine_bytes"] = free0 - free1
            rows[-1]["gpu_sessions_bytes"] = free1 - free2
    if breakdown:
        kt.skip_kvtier = True
        ms2, walls2 = time_steps(kt.step, min(a.steps, 100), 2)
        report(rows, "no-kvtier", a.context, b, ms2, walls2,
               "the same step with kvtier's 28 layers left out (breakdown only)")
    db.close(hand_off=False)  # the sessions are closed (or left) by the caller
    del kt, db, e, whole
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--dense-contexts", default="8192,CONTEXT",
                    help="contexts of the dense-in-HBM runs (CONTEXT: --context)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--modes", default="kvtier,dense-hbm,dense-host")
    ap.add_argument("--dense-host-batches", default="1")
    ap.add_argument("--top-k", type=int, default=32)
    ap.add_argument("--block-tokens", type=int, default=128, choices=[32, 64, 128],
                    help="the sessions' block size (sessions given with --sessions must have it)")
    ap.add_argument("--selectors", default="bound",
                    help="the engine's selectors, comma-separated: bound, sketch (tierd's default "
                         "candidates) or sketch:C; one engine each in every round, in turn")
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--graphs", default="whole,segments",
                    help="kvtier's step as one graph (whole) and/or 29 graphs around eager "
                         "kvtier launches (segments), run in turn")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of --graphs (alternating)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time the kvtier step with kvtier's layers left out (segments)")
    ap.add_argument("--dense-align", default="64",
                    help="round the dense cache length up to this many positions (1: exact "
                         "length, as before 2026-11-27); several, comma-separated: a dense run "
                         "for each, side by side")
    ap.add_argument("--sessions", default="",
                    help="ids of sessions of --context tokens already in tierd (e.g. engine_bench "
                         "--fill-only's) to decode instead of filling new ones; left open")
    ap.add_argument("--cache-slots", default="0",
                    help="the engine's GPU block cache in tiles per (session, layer, KV head) "
                         "(0: the default, twice the keep-set); several, comma-separated: one "
                         "engine per size in each round, in turn")
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    batches = [int(x) for x in a.batches.split(",")]
    modes = a.modes.split(",")
    print(torch.cuda.get_device_name(0), torch.__version__, flush=True)
    t = time.time()
    model = build_model(dev)
    print(f"random Qwen2.5-7B ({sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params) "
          f"built in {time.time() - t:.1f} s", flush=True)
    rows = []
    global GEO
    GEO = Geometry(LAYERS, HQ, HKV, D, Dtype.BF16, a.block_tokens)
    selectors = a.selectors.split(",")
    policies = [policy_of(x, a.top_k) for x in selectors]
    with torch.inference_mode():
        # Dense baselines first (they need the memory that tierd's sessions take later).
        for b in batches:
            st = Step(model, b, dev)
            dense = [int(x.replace("CONTEXT", str(a.context))) for x in a.dense_contexts.split(",") if x]
            aligns = [int(x) for x in a.dense_align.split(",")]
            runs = [(n, c, h, al) for al in aligns
                    for n, c, h in [("dense-hbm", c, False) for c in dense] + [("dense-host", a.context, True)]]
            for name, ctx, host, align in runs:
                if name not in modes or (host and str(b) not in a.dense_host_batches.split(",")):
                    continue
                try:
                    dn = Dense(st, ctx, a.warmup + a.steps + 8, host, align)
                except (torch.OutOfMemoryError, RuntimeError) as e:
                    print(f"{name} ctx={ctx} b={b}: does not fit ({str(e).splitlines()[0][:120]})", flush=True)
                    torch.cuda.empty_cache()
                    continue
                run = capture_whole(dn.step)
                st.pos.fill_(ctx)
                steps = a.steps if not host else min(a.steps, 12)
                ms, walls = time_steps(run, steps, min(a.warmup, 2))
                floor = f"L={dn.L}"
                if host:
                    floor += f", PCIe floor at 55.3 GB/s: {dn.bytes_per_step() / 55.3e6:.1f} ms"
                report(rows, name, ctx, b, ms, walls, floor)
                del dn, run
                torch.cuda.empty_cache()
                # Pinned buffers freed go to torch's host cache: give them back for tierd.
                torch._C._host_emptyCache()
        if "kvtier" in modes:
            c = Client(a.socket, client_name="whole-model")
            given = [int(x) for x in a.sessions.split(",") if x]
            if given and len(given) < max(batches):
                sys.exit(f"batch {max(batches)} needs {max(batches)} --sessions")
            ids = given or fill_sessions(c, max(batches), a.context, policies[0])
            slots = [int(x) for x in a.cache_slots.split(",")]
            for b in batches:
                # With several cache sizes, each round opens one engine per size in turn (the
                # sessions' stored tokens grow with every hand-off: alternating spreads that).
                per_engine = a.rounds if len(slots) * len(policies) == 1 else 1
                for rnd in range(a.rounds // per_engine):
                    for sel, policy in zip(selectors, policies):
                        for cs in slots:
                            tag = f"/{sel}" if len(policies) > 1 else ""
                            run_engine(rows, a, model, dev, c, ids[:b], policy, cs, per_engine,
                                       a.breakdown and rnd == a.rounds // per_engine - 1, tag)
            if not given:  # sessions given on the command line stay open
                for s in ids:
                    c.close(s)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
