"""transformers' own ``generate()`` with kvtier's caches against dense: what a transformers user
gets, prefill and decode, eager and compiled.

The model is the randomly initialised Qwen2.5-7B of whole_model.py (bf16, on the GPU), or with
``--tiny`` a tiny random Qwen2 on this machine's device (float32; to try the script anywhere).
The prompt is random token ids, every batch row the same length; greedy decoding.

Modes (``--modes``), each with a fresh cache per ``generate``:
* ``dense``: transformers' `DynamicCache`, eager.
* ``dense-compiled``: `StaticCache`, ``generate(..., compile_config=...)`` (torch.compile;
  CUDA graphs with ``mode="reduce-overhead"`` on a GPU).
* ``kvtier``: `KvtierCache`, eager (on a GPU its decode steps take the in-engine path).
* ``kvtier-compiled``: `KvtierStaticCache` with the same compile_config.

Per (context, batch, mode):
* ``first``: seconds of ``generate(max_new_tokens=1)`` (prefill and the first token) after one
  warm-up call, which pays a process's first arena registration and any compilation; median
  of ``--reps``. ``warmup`` is that first call.
* ``step``: ms per decode step, the median over ``--reps`` of (generate with 1 + N new tokens
  minus generate with 1) / N: transformers' loop, sampling and all.
* ``same``: for kvtier-compiled, whether its N greedy tokens equal kvtier's.

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

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvtier import Policy  # noqa: E402
from kvtier.hf import KvtierCache, KvtierStaticCache, enable  # noqa: E402


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


class Run:
    """One (model, prompt) pair's generate calls in one mode."""

    def __init__(self, model, ids, mode, socket, policy, dev):
        self.model, self.ids, self.mode = model, ids, mode
        self.socket, self.policy, self.dev = socket, policy, dev

    def cache(self, new_tokens):
        from transformers import DynamicCache, StaticCache

        m, n = self.model, self.ids.shape[1] + new_tokens
        if self.mode == "dense":
            return DynamicCache(config=m.config)
        if self.mode == "dense-compiled":
            return StaticCache(config=m.config, max_cache_len=n)
        if self.mode == "kvtier":
            return KvtierCache(m, socket=self.socket, policy=self.policy)
        return KvtierStaticCache(m, max_cache_len=n, socket=self.socket, policy=self.policy)

    def generate(self, new_tokens):
        """(seconds, the new tokens) of one generate call with a fresh cache."""
        kw = dict(input_ids=self.ids, attention_mask=torch.ones_like(self.ids),
                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=0)
        if self.mode.endswith("compiled"):
            kw["compile_config"] = compile_config(self.dev)
        else:
            kw["disable_compile"] = True
        c = self.cache(new_tokens)
        try:
            sync(self.dev)
            t = time.perf_counter()
            out = self.model.generate(cache=c, **kw)
            sync(self.dev)
            return time.perf_counter() - t, out[:, self.ids.shape[1]:].cpu()
        finally:
            if hasattr(c, "close"):
                c.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--modes", default="dense,kvtier,kvtier-compiled")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tiny", action="store_true", help="a tiny random Qwen2 (any device)")
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a.tiny:
        model = tiny_model(dev)
    else:
        from whole_model import build_model

        model = build_model(dev)
    enable(model)
    policy = Policy(1, 4, a.top_k)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}; policy {policy}; {a.new_tokens} new tokens, "
          f"median of {a.reps}", flush=True)
    rows = []
    for ctx in map(int, a.contexts.split(",")):
        for b in map(int, a.batches.split(",")):
            g = torch.Generator().manual_seed(ctx + b)
            ids = torch.randint(3, model.config.vocab_size, (b, ctx), generator=g).to(dev)
            tokens = {}
            for mode in a.modes.split(","):
                run = Run(model, ids, mode, a.socket, policy, dev)
                warm, _ = run.generate(1)
                if mode.endswith("compiled"):
                    run.generate(a.new_tokens + 1)  # compiles the decode step
                firsts, steps = [], []
                for _ in range(a.reps):
                    t1, _ = run.generate(1)
                    tn, out = run.generate(a.new_tokens + 1)
                    firsts.append(t1)
                    steps.append((tn - t1) / a.new_tokens * 1e3)
                tokens[mode] = out
                row = dict(context=ctx, batch=b, mode=mode, warmup_s=warm,
                           first_s=statistics.median(firsts), step_ms=statistics.median(steps))
                if mode == "kvtier-compiled" and "kvtier" in tokens:
                    row["same"] = bool(torch.equal(out, tokens["kvtier"]))
                rows.append(row)
                print(f"{ctx:>7} x {b}  {mode:<16} warm-up {warm:7.2f} s  first {row['first_s']:7.3f} s"
                      f"  step {row['step_ms']:8.2f} ms" + (f"  same as kvtier: {row['same']}"
                                                            if "same" in row else ""), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=name, torch=torch.__version__, policy=str(policy),
                           new_tokens=a.new_tokens, reps=a.reps, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
