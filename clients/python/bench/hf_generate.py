"""transformers' own ``generate()`` with kvtier's caches against dense: what a transformers user
gets, prefill and decode, eager and compiled.

The model is the randomly initialised Qwen2.5-7B of whole_model.py (bf16, on the GPU; ``--dtype
float32`` the same weights in float32), or with ``--tiny`` a tiny random Qwen2 on this machine's
device (float32; to try the script anywhere). The prompt is random token ids, every batch row
the same length; greedy decoding.

Modes (``--modes``), each with a fresh cache per ``generate``:
* ``dense``: transformers' `DynamicCache`, eager.
* ``dense-compiled``: `StaticCache`, ``generate(..., compile_config=...)`` (torch.compile;
  CUDA graphs with ``mode="reduce-overhead"`` on a GPU).
* ``kvtier``: `KvtierCache`, eager (on a GPU its decode steps take the in-engine path, and
  its prefill goes to tierd layer by layer while the model computes the later layers).
* ``kvtier-compiled``: `KvtierStaticCache` with the same compile_config.
* ``kvtier-at-once``, ``kvtier-compiled-at-once``: the same with ``prefill_by_layer=False``
  (the prefill goes to tierd after the forward, every layer at once).

Per (context, batch, mode), each number the median over ``--reps`` generate calls of 1 + N
new tokens, timed inside the call (a logits processor synchronizes and reads the clock):
* ``first``: seconds from the call to the first token's logits (prefill and the first token).
* ``step``: ms between later tokens' logits, the median step of the call (``mean`` too):
  transformers' loop, sampling and all. The median leaves out a compiled step's recording.
* ``same_steps``: for kvtier-compiled, per row how many leading greedy tokens equal kvtier's
  (for dense-compiled, dense's): what compilation alone changes on a random model shows in
  dense-compiled against dense. For an ``-at-once`` mode, its twin's that hands the prefill
  over by layer: the same stored KV, so every token should match.
  ``forced_agree``: one more call decoding the eager mode's tokens (teacher-forced), per row
  the steps whose own greedy pick is that token; ``forced_gap_max`` the largest logit gap by
  which a pick beat it (a random model's near-ties show as small gaps).
* ``handoff``: for kvtier's caches, the prefill's hand-off to tierd by phase
  (`KvtierCache.prefill_handoff`).
Before the timed calls, one warm-up call per mode with a ``--warmup-tokens`` prompt and the
timed calls' cache size pays a process's first arena registration and any compilation, so
``first`` is that of a second and later cache of the process.

Usage (tierd running with host.shared = true and room for batch x context tokens):
    python hf_generate.py --socket /tmp/t/tierd.sock --contexts 32768,131072 --batches 1,4 \\
        --new-tokens 64 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvtier import Policy  # noqa: E402
from kvtier.hf import KvtierCache, KvtierStaticCache, enable  # noqa: E402

#: Blocks of whole_model.py's step, which this compares against (its default), so that
#: `Policy(1, 4, top_k)` is the same budget in both (``--block-tokens`` changes it).
BLOCK_TOKENS = 128
#: Tokens a row the engine is sized for.
MAX_TOKENS = 1 << 20


def tiny_model(dev):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1 << 20)
    torch.manual_seed(0)
    with torch.device(dev):
        return Qwen2ForCausalLM(cfg).eval()


def compile_config(dev):
    from transformers.generation.configuration_utils import CompileConfig

    cc = CompileConfig(fullgraph=True, mode="reduce-overhead" if dev.type == "cuda" else "default")
    cc._compile_all_devices = True  # transformers compiles only on accelerators by default
    return cc


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Clock:
    """A logits processor that reads the clock (the device synchronized) at every token."""

    def __init__(self, dev):
        self.dev, self.times = dev, []

    def __call__(self, input_ids, scores):
        sync(self.dev)
        self.times.append(time.perf_counter())
        return scores


class Run:
    """One (model, prompt) pair's generate calls in one mode."""

    def __init__(self, model, ids, mode, socket, policy, dev, block_tokens=BLOCK_TOKENS):
        self.model, self.ids, self.mode = model, ids, mode
        self.socket, self.policy, self.dev = socket, policy, dev
        self.blocks = dict(block_tokens=block_tokens, max_blocks=MAX_TOKENS // block_tokens)
        self.handoff = None  # the last call's KvtierCache.prefill_handoff
        self.engine_error = None  # and its engine_error

    def cache(self, n):
        """A fresh cache of this mode for `n` tokens."""
        from transformers import DynamicCache, StaticCache

        m = self.model
        if self.mode == "dense":
            return DynamicCache(config=m.config)
        if self.mode == "dense-compiled":
            return StaticCache(config=m.config, max_cache_len=n)
        by_layer = not self.mode.endswith("-at-once")
        if self.mode.removesuffix("-at-once") == "kvtier":
            return KvtierCache(m, socket=self.socket, policy=self.policy,
                               prefill_by_layer=by_layer, **self.blocks)
        return KvtierStaticCache(m, max_cache_len=n, socket=self.socket, policy=self.policy,
                                 prefill_by_layer=by_layer, **self.blocks)

    def generate(self, new_tokens, ids=None, force=None):
        """(seconds to the first token's logits, the later steps' ms, the new tokens) of one
        generate call with a fresh cache; `ids` (default: the run's prompt) may be shorter than
        the prompt, the cache is sized for the prompt all the same. `force`: a `Forced`."""
        from transformers import LogitsProcessorList

        ids = self.ids if ids is None else ids
        clock = Clock(self.dev)
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=0,
                  logits_processor=LogitsProcessorList([clock] + ([force] if force else [])))
        if "compiled" in self.mode:
            kw["compile_config"] = compile_config(self.dev)
        else:
            kw["disable_compile"] = True
        c = self.cache(self.ids.shape[1] + new_tokens)
        try:
            sync(self.dev)
            t = time.perf_counter()
            out = self.model.generate(cache=c, **kw)
            sync(self.dev)
        finally:
            self.handoff = getattr(c, "prefill_handoff", None)
            self.engine_error = getattr(c, "engine_error", None)
            if hasattr(c, "close"):
                c.close()
        steps = [(b - a) * 1e3 for a, b in zip(clock.times, clock.times[1:])]
        return clock.times[0] - t, steps, out[:, ids.shape[1]:].cpu()


class Forced:
    """A logits processor that decodes given tokens (teacher forcing) and records, at every
    step, whether the model's own greedy pick is the given token, and by how much its logit
    tops the given token's: near-ties show as small gaps."""

    def __init__(self, tokens):
        self.tokens, self.step, self.agree, self.gaps = tokens, 0, [], []

    def __call__(self, input_ids, scores):
        want = self.tokens[:, self.step].to(scores.device)[:, None]
        logits = scores.float()
        best = logits.max(dim=-1)
        self.agree.append((best.indices == want[:, 0]).cpu())
        self.gaps.append((best.values - logits.gather(1, want)[:, 0]).cpu())
        self.step += 1
        return torch.full_like(scores, float("-inf")).scatter_(1, want, 0.0)

    def summary(self):
        """(steps agreeing per batch row, the largest gap where they do not)."""
        agree, gaps = torch.stack(self.agree, 1), torch.stack(self.gaps, 1)
        return agree.sum(1).tolist(), float(gaps[~agree].max()) if (~agree).any() else 0.0


def describe(row, n):
    """One printed line of a row of `n` new tokens."""
    out = (f"{row['context']:>7} x {row['batch']}  {row['mode']:<16} warm-up {row['warmup_s']:7.2f} s"
           f"  first {row['first_s']:7.3f} s  step {row['step_ms']:8.2f} ms"
           f" (mean {row['step_mean_ms']:.2f})")
    if "same_steps" in row:
        out += (f"  same leading tokens {row['same_steps']} of {n}, teacher-forced "
                f"{row['forced_agree']} (largest gap {row['forced_gap_max']:.4f})")
    if "handoff" in row:
        out += "  hand-off " + " ".join(f"{k} {v:.3f}" for k, v in row["handoff"].items())
    if "engine_error" in row:
        out += f"  DECODE path: {row['engine_error']}"
    return out


def same_steps(a, b):
    """Per batch row, how many leading new tokens of `a` equal `b`'s."""
    eq = (a == b).int().cumprod(dim=1)
    return eq.sum(dim=1).tolist()


def profile(run, a):
    """One more generate call under torch's profiler: where a step's time goes, by op."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.dev.type == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        run.generate(a.new_tokens + 1)
    device_key = "self_cuda_time_total" if run.dev.type == "cuda" else "self_cpu_time_total"
    print(f"profile of {run.mode} (prefill and {a.new_tokens} steps), by device time:\n"
          + prof.key_averages().table(sort_by=device_key, row_limit=20), flush=True)
    print(f"profile of {run.mode}, by host time:\n"
          + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20), flush=True)


def measure(run, a, tokens):
    """One mode's row: a warm-up call, then `--reps` timed calls (medians)."""
    t = time.perf_counter()
    run.generate(a.new_tokens + 1, run.ids[:, :a.warmup_tokens])
    warm = time.perf_counter() - t
    firsts, steps, means = [], [], []
    began = time.time()  # wall clock, to line the steps up with the GPU's clock log
    for _ in range(a.reps):
        first, st, out = run.generate(a.new_tokens + 1)
        firsts.append(first)
        steps.append(statistics.median(st))
        means.append(statistics.fmean(st))
    ctx, b = run.ids.shape[1], run.ids.shape[0]
    row = dict(context=ctx, batch=b, mode=run.mode, began=began, warmup_s=warm,
               first_s=statistics.median(firsts), step_ms=statistics.median(steps),
               step_mean_ms=statistics.median(means), firsts_s=firsts, steps_ms=steps,
               last_steps_ms=[round(x, 3) for x in st])
    if run.handoff:
        row["handoff"] = run.handoff  # the last call's prefill hand-off to tierd, by phase
    if run.engine_error:
        row["engine_error"] = run.engine_error  # why "auto" took the DECODE path
    if a.profile and run.mode in a.profile.split(","):
        profile(run, a)
    tokens[run.mode] = out
    # The tokens a mode should match: eager for compiled, and the prefill by layer for at once.
    ref = {"kvtier-compiled": "kvtier", "dense-compiled": "dense", "kvtier-at-once": "kvtier",
           "kvtier-compiled-at-once": "kvtier-compiled"}.get(run.mode)
    if ref in tokens:
        row["same_steps"] = same_steps(out, tokens[ref])
        # Teacher-forced on the eager mode's tokens: whether each step's own pick agrees.
        forced = Forced(tokens[ref])
        run.generate(a.new_tokens + 1, force=forced)
        row["forced_agree"], row["forced_gap_max"] = forced.summary()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--modes", default="dense,kvtier,kvtier-compiled")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--warmup-tokens", type=int, default=2048,
                    help="the warm-up call's prompt length (its cache is the timed calls' size)")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--block-tokens", type=int, default=BLOCK_TOKENS,
                    help="kvtier's block size (KvtierCache's own default is 64)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random Qwen2 (any device)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="the Qwen2.5-7B's dtype, and so its sessions' (float32: where compiled "
                         "and eager numerics part by less than a bf16 rounding)")
    ap.add_argument("--profile", default="",
                    help="modes (comma-separated) to run once more under torch's profiler")
    ap.add_argument("--deadline", type=float, default=0,
                    help="seconds after which no further mode is started (0: none)")
    ap.add_argument("--json")
    a = ap.parse_args()
    t_start = time.perf_counter()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a.tiny:
        model = tiny_model(dev)
    else:
        from whole_model import build_model

        model = build_model(dev, getattr(torch, a.dtype))
    enable(model)
    policy = Policy(1, 4, a.top_k)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}; {model.dtype}; {a.block_tokens}-token blocks, "
          f"policy {policy}; {a.new_tokens} new tokens, median of {a.reps}", flush=True)
    rows = []
    for ctx in map(int, a.contexts.split(",")):
        for b in map(int, a.batches.split(",")):
            g = torch.Generator().manual_seed(ctx + b)
            ids = torch.randint(3, model.config.vocab_size, (b, ctx), generator=g).to(dev)
            tokens = {}
            for mode in a.modes.split(","):
                if a.deadline and time.perf_counter() - t_start > a.deadline:
                    print(f"{ctx:>7} x {b}  {mode:<16} not run: past the {a.deadline:.0f} s deadline",
                          flush=True)
                    continue
                try:
                    row = measure(Run(model, ids, mode, a.socket, policy, dev, a.block_tokens),
                                  a, tokens)
                except Exception as e:  # noqa: BLE001 - one mode's failure must not end the run
                    print(f"{ctx:>7} x {b}  {mode:<16} FAILED: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:300] if str(e) else ''}", flush=True)
                    traceback.print_exc()
                    rows.append(dict(context=ctx, batch=b, mode=mode, error=repr(e)[:500]))
                    continue
                finally:
                    if dev.type == "cuda":
                        # The engine allocates outside torch: give back what the mode cached.
                        torch.cuda.empty_cache()
                rows.append(row)
                print(describe(row, a.new_tokens + 1), flush=True)
    from torch._dynamo.utils import counters

    print("compile counters:", {k: dict(v) for k, v in counters.items()
                                if k in ("stats", "inductor", "graph_break")}, flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=name, torch=torch.__version__, dtype=str(model.dtype),
                           block_tokens=a.block_tokens, policy=str(policy), new_tokens=a.new_tokens, reps=a.reps, rows=rows),
                      f, indent=1)


if __name__ == "__main__":
    main()
