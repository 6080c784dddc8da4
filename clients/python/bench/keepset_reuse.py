"""How often a real model's keep-sets come back: the GPU block cache's hit share on Gemma 3 270M.

The in-engine step's time at long context is set by the keep-set tiles that miss the engine's
GPU block cache (each crosses PCIe). The whole-model benchmark (whole_model.py) runs a random
model over random KV, whose keep-set churn says nothing about a trained model's. This script
measures a trained one on CPU: decode steps of Gemma 3 270M (the package registry's GGUF, as
the fidelity suite) over prose, fed the prose's own next tokens (teacher forcing: a small
model's greedy continuation soon loops, and a loop repeats its queries; `--greedy` for that),
dense attention throughout; at every step and
full-attention layer the query and the cached keys are read, each KV head's keep-set is
computed the way kvtier's selector does (Quest block bounds: a block's score is the largest
over the head's query group of sum_d max(q_d kmax_d, q_d kmin_d); sink, local window, top-k
distant with ties to the lower block), and an LRU tile cache laid out as the engine's
(kernels/cuda/gather.cu: a region of sink + local slots for the fixed part, the rest for the
distant part) is simulated for several sizes. The stored blocks follow the in-engine path:
the prompt's blocks, plus a block every `block_tokens` steps (a hand-off); the tokens since
the last hand-off are attended on the GPU, outside the keep-set.

    python clients/python/bench/keepset_reuse.py --context 16384 --steps 384 --json out.json

Prints, per top-k and cache size, the hit share (every kept tile; what whole_model.py reports)
and the distant picks' overlap with the previous step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import OrderedDict

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvtier.examples import gemma  # noqa: E402
from transformers import AttentionInterface, DynamicCache  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

PROBE = "keepset_probe"


class Lru:
    """An LRU set of `n` block ids: `use` returns whether the block was cached."""

    def __init__(self, n: int):
        self.n, self.d = n, OrderedDict()

    def use(self, b: int) -> bool:
        if b in self.d:
            self.d.move_to_end(b)
            return True
        self.d[b] = None
        if len(self.d) > self.n:
            self.d.popitem(last=False)
        return False


def keep_set(q, keys, nb, bt, sink, local, k):
    """q [G, D] (one KV head's query group), keys [T, D] (T >= nb * bt): (fixed, distant) block
    ids of kvtier's keep-set over the first nb blocks."""
    if nb <= sink + local + k:
        return list(range(nb)), []
    kb = keys[: nb * bt].reshape(nb, bt, -1)
    kmax, kmin = kb.max(1), kb.min(1)  # [nb, D]
    score = np.maximum(q[:, None, :] * kmax[None], q[:, None, :] * kmin[None]).sum(-1).max(0)
    cand = np.arange(sink, nb - local)
    order = np.argsort(-score[cand], kind="stable")  # ties: the lower block first
    distant = sorted(int(b) for b in cand[order[:k]])
    return list(range(sink)) + list(range(nb - local, nb)), distant


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=16384, help="prompt tokens (a multiple of --block-tokens)")
    ap.add_argument("--steps", type=int, default=384)
    ap.add_argument("--ks", default="8,32")
    ap.add_argument("--caches", default="0,64,128,256",
                    help="cache slots per (layer, KV head); 0: twice the keep-set (the engine's default)")
    ap.add_argument("--block-tokens", type=int, default=128)
    ap.add_argument("--sink", type=int, default=1)
    ap.add_argument("--local", type=int, default=4)
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--greedy", action="store_true", help="feed the model's own argmax instead of the prose")
    ap.add_argument("--json")
    a = ap.parse_args()
    bt = a.block_tokens
    if a.context % bt:
        sys.exit("--context must be a multiple of --block-tokens (the stored blocks are full)")
    ks = [int(x) for x in a.ks.split(",")]
    caches = [int(x) for x in a.caches.split(",")]
    torch.manual_seed(a.seed)
    t0 = time.time()
    model, tok = gemma.load()
    full = [i for i, t in enumerate(model.config.layer_types) if t == "full_attention"]
    paras = gemma.prose_paragraphs()
    random.Random(a.seed).shuffle(paras)
    ids = []
    for p in paras:
        ids += tok(" " + p, add_special_tokens=False)["input_ids"]
        if len(ids) >= a.context + a.steps:
            break
    if len(ids) < a.context + a.steps:
        sys.exit(f"only {len(ids)} tokens of prose available")
    ids = [tok.bos_token_id] + ids[: a.context + a.steps - 1]
    ids, forced = ids[: a.context], ids[a.context:]
    print(f"Gemma 3 270M loaded in {time.time() - t0:.1f} s; full-attention layers {full}; "
          f"prompt {len(ids)} tokens", flush=True)

    captured = {}  # layer -> (q [Hq, D], keys [Hkv, T, D]) of the current decode step

    def probe(module, query, key, value, attention_mask, **kwargs):
        if query.shape[2] == 1 and module.layer_idx in full:
            captured[module.layer_idx] = (query[0, :, 0].float().numpy(), key[0].float().numpy())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(PROBE, probe)
    model.set_attn_implementation(PROBE)
    cache = DynamicCache(config=model.config)
    t0 = time.time()
    with torch.inference_mode():
        x = torch.tensor([ids])
        for s in range(0, x.shape[1], a.prefill_chunk):
            logits = model(input_ids=x[:, s:s + a.prefill_chunk], past_key_values=cache, use_cache=True,
                           logits_to_keep=1).logits[:, -1]
    print(f"prefill {len(ids)} tokens in {time.time() - t0:.1f} s", flush=True)

    hq, hkv = model.config.num_attention_heads, model.config.num_key_value_heads
    grp = hq // hkv
    # Per (k, cache size): a (fixed, distant) LRU pair per (layer, KV head), hit/tile counts.
    slots = {(k, c): (c or 2 * (a.sink + a.local + k)) for k in ks for c in caches}
    sims = {key: {(l, h): (Lru(a.sink + a.local), Lru(n - a.sink - a.local)) for l in full for h in range(hkv)}
            for key, n in slots.items()}
    hits = {key: 0 for key in slots}
    tiles = {key: 0 for key in slots}
    overlap = {k: [0, 0] for k in ks}  # distant picks also picked at the step before, of all
    prev = {}
    tok_next = int(logits.argmax(-1)) if a.greedy else forced[0]
    generated = []
    t0 = time.time()
    with torch.inference_mode():
        for step in range(a.steps):
            logits = model(input_ids=torch.tensor([[tok_next]]), past_key_values=cache,
                           use_cache=True).logits[:, -1]
            generated.append(tok_next)
            tok_next = int(logits.argmax(-1)) if a.greedy or step + 1 >= len(forced) else forced[step + 1]
            nb = (a.context + bt * (step // bt)) // bt  # stored blocks (hand-offs every bt steps)
            for l in full:
                q, keys = captured[l]
                for h in range(hkv):
                    for k in ks:
                        fixed, distant = keep_set(q[h * grp:(h + 1) * grp], keys[h], nb, bt, a.sink, a.local, k)
                        p = prev.get((l, h, k))
                        if p is not None:
                            overlap[k][0] += len(set(distant) & p)
                            overlap[k][1] += len(distant)
                        prev[(l, h, k)] = set(distant)
                        for c in caches:
                            fx, ds = sims[(k, c)][(l, h)]
                            if not distant:  # a short layer: everything in one region
                                ds = fx
                            n_hit = sum(fx.use(b) for b in fixed) + sum(ds.use(b) for b in distant)
                            hits[(k, c)] += n_hit
                            tiles[(k, c)] += len(fixed) + len(distant)
            if (step + 1) % 64 == 0:
                print(f"step {step + 1}/{a.steps} ({time.time() - t0:.0f} s)", flush=True)
    text = tok.decode(generated[:60])
    print(f"decoded tokens ({'greedy' if a.greedy else 'the prose'}, first 60): {text!r}")
    rows = []
    for k in ks:
        ov = overlap[k][0] / max(overlap[k][1], 1)
        for c in caches:
            # The first step fills the caches: counted, like a fresh engine's.
            hs = hits[(k, c)] / max(tiles[(k, c)], 1)
            rows.append(dict(top_k=k, cache_slots=slots[(k, c)], default_cache=c == 0,
                             hit_share=round(hs, 4), distant_overlap_prev=round(ov, 4)))
            print(f"k={k:>3} cache {slots[(k, c)]:>4} slots{' (default)' if c == 0 else '':>10}: "
                  f"hit share {hs:.3f}; distant picks kept from the step before {ov:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(model="Gemma 3 270M (GGUF q4_k_m, dequantized, f32)", context=a.context,
                           tokens="greedy" if a.greedy else "prose (teacher forcing)",
                           steps=a.steps, block_tokens=bt, sink=a.sink, local=a.local,
                           full_layers=full, kv_heads=hkv, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
