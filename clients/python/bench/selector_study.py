"""Which first stage the sketch selector needs, and how many candidates: a design study on a
real model.

    python clients/python/bench/selector_study.py capture --contexts 8192 16384 32768 --prompts 4 --out /tmp/study
    python clients/python/bench/selector_study.py analyse /tmp/study

`capture` runs Gemma 3 270M (CPU, dense attention) on prose needle prompts and saves, for each
answer step, the query of every global-attention layer and, once per prompt, those layers'
keys (post-RoPE, float16). `analyse` replays selection rules on them in numpy (keepsets.py):
the block bound (the bound selector), the sketch over every distant block, the oracle (true
attention mass), and two-stage rules whose first stage picks `c` candidates that the sketch
then ranks — the quarter bound (the sketch selector), the block bound, the union of each query
head's best blocks by its own bound, 16- and 64-token sub-block bounds, keys projected on their
principal directions and 2-bit keys — and, over every distant block, the second stage's score
against two others: the best token's true logit, and the sketch's former format, int4 keys with
one scale per token in place of one per block and channel (keepsets.token_sketch). It prints, per context and
`c`: how often the keep-set equals scoring every block's sketch, how often it keeps the
needle's block where a head reads it, and the share of the dense attention mass it keeps.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import keepsets  # noqa: E402  (beside this file)

BLOCK = 128
SINK, LOCAL = 1, 4


# --------------------------------------------------------------------------- capture


def capture(a):
    import torch
    from transformers import AttentionInterface, DynamicCache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from kvtier.examples import gemma

    if a.threads:
        torch.set_num_threads(a.threads)
    model, tok = gemma.load()
    cfg = model.config.get_text_config(decoder=True)
    glob_layers = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    rec = {}

    def attn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        li = getattr(module, "layer_idx", None)
        if query.shape[2] == 1 and li in glob_layers:
            d = query.shape[-1]
            s = (scaling if scaling is not None else 1 / np.sqrt(d)) * np.sqrt(d)
            rec.setdefault("q", {}).setdefault(li, []).append((query[0, :, 0, :].float() * s).numpy())
            rec.setdefault("k", {})[li] = key[0].float().numpy()
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kw)

    AttentionInterface.register("capture", attn)
    AttentionMaskInterface.register("capture", sdpa_mask)
    model.set_attn_implementation("capture")
    os.makedirs(a.out, exist_ok=True)
    rng = random.Random(a.seed)
    for ctx in a.contexts:
        for p in range(a.prompts):
            code = gemma.random_code(rng)
            depth = rng.uniform(0.1, 0.6)
            ids, npos = gemma.needle_prompt(tok, ctx, depth, code, a.haystack, seed=a.seed * 7919 + p * 1000 + ctx)
            needle_len = len(tok(" " + gemma.NEEDLE.format(code=code), add_special_tokens=False)["input_ids"])
            cache = DynamicCache(config=model.config)
            x = torch.tensor([ids])
            rec.clear()
            with torch.inference_mode():
                for s in range(0, x.shape[1], a.chunk):
                    logits = model(input_ids=x[:, s:s + a.chunk], cache=cache, use_cache=True,
                                   logits_to_keep=1).logits[:, -1]
                rec.clear()
                out = [int(logits.argmax(-1))]
                for _ in range(a.steps):
                    logits = model(input_ids=torch.tensor([[out[-1]]]), cache=cache, use_cache=True).logits[:, -1]
                    out.append(int(logits.argmax(-1)))
            name = os.path.join(a.out, f"{a.haystack}-{ctx}-{p}.npz")
            arrays = {}
            for li in glob_layers:
                arrays[f"q{li}"] = np.stack(rec["q"][li]).astype(np.float32)  # [steps, Hq, D]
                arrays[f"k{li}"] = rec["k"][li].astype(np.float16)  # [Hkv, T_last, D]
            meta = {"ctx": ctx, "tokens": len(ids), "needle_pos": npos, "needle_len": needle_len,
                    "code": code, "found": gemma.found(tok, out, code), "layers": glob_layers,
                    "answer": tok.decode(out)}
            np.savez_compressed(name, meta=json.dumps(meta), **arrays)
            print(f"{name}: needle at {npos}, dense answer {meta['answer']!r} found={meta['found']}", flush=True)


# --------------------------------------------------------------------------- the rules


def stage1_experiments(q: np.ndarray, k: np.ndarray, t: int, bases: dict) -> dict:
    """Other first-stage scores per block (max over the group) tried against the quarter
    bound: bounds of 16- and 64-token sub-blocks, keys projected on their top principal
    directions (fitted on every key, or on the first 2,048) in int4, 2-bit keys; and per query
    head block bounds, for the union-over-heads rule."""
    g, d = q.shape
    nb = -(-t // BLOCK)
    kk = k[:t].astype(np.float32)
    pad = nb * BLOCK - t
    kp = np.concatenate([kk, np.zeros((pad, d), np.float32)]) if pad else kk
    valid = (np.arange(nb * BLOCK) < t)

    def per_block(x):  # [G, t] per-token scores -> [nb] best over tokens and heads
        x = np.concatenate([x, np.full((g, pad), -np.inf, np.float32)], 1)
        return x.reshape(g, nb, BLOCK).max(2).max(0)

    out = {}
    for sub in (64, 16):
        kb = kp.reshape(nb * BLOCK // sub, sub, d)
        v = valid.reshape(-1, sub)
        hi = np.where(v[..., None], kb, -np.inf).max(1)
        lo = np.where(v[..., None], kb, np.inf).min(1)
        with np.errstate(invalid="ignore"):
            b = np.maximum(q[:, None, :] * hi[None], q[:, None, :] * lo[None]).sum(-1)
        b = np.where(np.isfinite(b), b, -np.inf)
        out[f"sub{sub}"] = b.reshape(g, nb, BLOCK // sub).max(2).max(0)
    for name in ("pca", "pcaearly"):
        vt = bases[name]
        for r in (32, 64):
            pk, pks = keepsets.quantize_rows(kk @ vt[:r].T, 7)
            out[f"{name}{r}"] = per_block(((q @ vt[:r].T) @ pk.T) * pks[None, :])
    lv = np.array((-3, -1, 1, 3), np.float32)
    sc = np.abs(kk).max(-1, keepdims=True) / 3
    kq = lv[np.abs((kk / np.where(sc > 0, sc, 1))[..., None] - lv).argmin(-1)] * sc
    out["int2"] = per_block(q @ kq.T)
    kb = kp.reshape(nb, BLOCK, d)
    v = valid.reshape(nb, BLOCK)
    hi = np.where(v[..., None], kb, -np.inf).max(1)
    lo = np.where(v[..., None], kb, np.inf).min(1)
    out["bound_heads"] = np.maximum(q[:, None, :] * hi[None], q[:, None, :] * lo[None]).sum(-1)  # [G, nb]
    return out


def analyse(a):
    files = sorted(glob.glob(os.path.join(a.dir, "*.npz")))
    rows = {}
    for f in files:
        z = np.load(f)
        meta = json.loads(str(z["meta"]))
        ctx = meta["ctx"]
        nblock = set(range(meta["needle_pos"] // BLOCK, (meta["needle_pos"] + meta["needle_len"] - 1) // BLOCK + 1))
        for li in meta["layers"]:
            qs, kall = z[f"q{li}"], z[f"k{li}"]
            hkv, t_last = kall.shape[0], kall.shape[1]
            steps = qs.shape[0]
            g = qs.shape[1] // hkv
            # Principal directions of each kv head's keys: of all of them, and of the first 2,048.
            bases = [{"pca": np.linalg.svd(kall[h].astype(np.float32), full_matrices=False)[2],
                      "pcaearly": np.linalg.svd(kall[h, :2048].astype(np.float32), full_matrices=False)[2]}
                     for h in range(hkv)]
            for s in range(steps):
                t = t_last - (steps - 1 - s)
                nb = -(-t // BLOCK)
                distant = list(range(SINK, nb - LOCAL))
                fixed = list(range(SINK)) + list(range(nb - LOCAL, nb))
                for h in range(hkv):
                    q = qs[s, h * g:(h + 1) * g]
                    sc = keepsets.block_scores(q, kall[h], t, BLOCK)
                    ex = stage1_experiments(q, kall[h], t, bases[h])
                    nb_ids = [b for b in nblock if b < nb]
                    reads = sc["mass_heads"][:, nb_ids].sum(1).max() >= a.read_mass
                    per_token = keepsets.token_sketch(q, kall[h], t, BLOCK)
                    for k in a.ks:
                        full = keepsets.top(sc["sketch"], distant, k)
                        arms = {"bound (today)": keepsets.top(sc["bound"], distant, k),
                                "sketch, every block": full,
                                "sketch with per-token scales, every block": keepsets.top(per_token, distant, k),
                                "true best token, every block": keepsets.top(sc["true_max"], distant, k),
                                "oracle (true mass)": keepsets.top(sc["mass"], distant, k)}
                        for c in a.cs:
                            cc = max(c, k)
                            arms[f"quarter bound -> {c}"] = keepsets.top(sc["sketch"], keepsets.top(sc["quarter"], distant, cc), k)
                            arms[f"block bound -> {c}"] = keepsets.top(sc["sketch"], keepsets.top(sc["bound"], distant, cc), k)
                            per_head = sorted({b for gi in range(g) for b in keepsets.top(ex["bound_heads"][gi], distant, max(cc // g, 1))})
                            arms[f"per-head bound union -> {c}"] = keepsets.top(sc["sketch"], per_head, k)
                            for name in ("sub64", "sub16", "pca32", "pca64", "pcaearly64", "int2"):
                                arms[f"{name} -> {c}"] = keepsets.top(sc["sketch"], keepsets.top(ex[name], distant, cc), k)
                        for name, keep in arms.items():
                            r = rows.setdefault((ctx, k, name), {"n": 0, "eq_full": 0, "reads": 0, "needle": 0, "mass": 0.0})
                            r["n"] += 1
                            r["eq_full"] += int(keep == full)
                            r["mass"] += float(sc["mass"][keep + fixed].sum())
                            if reads:
                                r["reads"] += 1
                                r["needle"] += int(bool(nblock & set(keep)))
    print(f"{len(files)} prompts; items: (answer step, global layer, kv head); 'reads': items where some head puts "
          f">= {a.read_mass} of its dense attention on the needle's blocks")
    print("| ctx | k | rule | items | equals 'sketch, every block' | needle kept (reads) | dense mass kept |")
    print("|---|---|---|---|---|---|---|")
    for (ctx, k, name), r in sorted(rows.items(), key=lambda x: (x[0][0], x[0][1], x[0][2])):
        nk = f"{r['needle'] / r['reads']:.2f} ({r['needle']}/{r['reads']})" if r["reads"] else "-"
        print(f"| {ctx} | {k} | {name} | {r['n']} | {r['eq_full'] / r['n']:.3f} | {nk} | {r['mass'] / r['n']:.3f} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture")
    c.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384])
    c.add_argument("--prompts", type=int, default=4)
    c.add_argument("--steps", type=int, default=8)
    c.add_argument("--haystack", default="prose")
    c.add_argument("--chunk", type=int, default=2048)
    c.add_argument("--seed", type=int, default=99)
    c.add_argument("--threads", type=int, default=0)
    c.add_argument("--out", default="selector-study")
    an = sub.add_parser("analyse")
    an.add_argument("dir")
    an.add_argument("--ks", type=int, nargs="+", default=[8])
    an.add_argument("--cs", type=int, nargs="+", default=[16, 32, 64])
    an.add_argument("--read-mass", type=float, default=0.1)
    a = ap.parse_args(argv)
    capture(a) if a.cmd == "capture" else analyse(a)


if __name__ == "__main__":
    main()
