"""Fidelity of sparse decode through tierd against dense attention, on Gemma 3 270M.

    python clients/python/bench/fidelity.py --socket /tmp/kvtier/tierd.sock --out bench-out \
        --arms bound:8 sketch:8 sketch:8:all

Needs a running tierd (host capacity of a few GiB; see docs/fidelity.md for the command).
For every prompt the dense prefill runs once in the engine; its KV then serves the dense
continuation (a copy of the engine cache) and one tierd session per arm (KvtierCache.from_dense),
so each policy answers from the identical prefill. An arm is `bound:K` (the key-bound
selector, top-K) or `sketch:K[:C]` (the sketch selector, C candidates, `all` for every block;
default tierd's); `@B` after either gives the arm blocks of B tokens with the sink and local
window of the same token counts as the run's (`sketch:32:all@32` keeps as many keys as
`sketch:8` of 128-token blocks: granularity at a matched budget). `oracle:K[@B]` decodes in
this process, not through tierd: each global layer attends only the oracle's keep-set (sink,
local and the top-K distant blocks by the true dense attention mass of each KV head's group),
the most any block selector can keep at that budget. `sketchmass`, `hybrid`, `truemax`
and `sketch8` (Oracle's doc) are in-process design experiments alike.

Besides the answers, every sparse step is measured against dense attention at each global
layer (the instrument): the share of the dense attention mass inside tierd's keep-set and
inside the oracle's (sink, local and the top-K distant blocks by true mass); in needle trials,
at the (step, layer) items where some head puts >= 0.1 of its dense attention on the
needle's blocks, whether the keep-set holds a needle block and the needle block's rank among
the distant blocks by the true mass, the key bound, the quarter bound and the sketch. tierd's
keep-sets are checked against the rule restated in numpy (keepsets.py).

Writes <out>/fidelity.json (every trial), <out>/fidelity.md (tables) and <out>/recall.png.
Trials are interleaved over the cells, and the JSON is rewritten after each one, so a run
stopped early (--deadline) still reports every cell.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import platform
import random
import sys
import time
from typing import NamedTuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
from kvtier import DEFAULT_CANDIDATES, Policy, Selector  # noqa: E402
from kvtier.examples import gemma  # noqa: E402
from kvtier.hf import ATTN_IMPLEMENTATION, KvtierCache, connect, enable  # noqa: E402
from transformers import AttentionInterface, DynamicCache  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402

import keepsets  # noqa: E402  (beside this file)

#: A (step, layer) item "reads" the needle when some head puts this much dense attention on it.
READ_MASS = 0.1
#: The candidate count that stands for "every distant block".
ALL_BLOCKS = 1 << 20


def wilson(s: int, n: int, z: float = 1.96):
    if n == 0:
        return (float("nan"), float("nan"))
    p = s / n
    den = 1 + z * z / n
    c = (p + z * z / (2 * n)) / den
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, c - h), min(1.0, c + h))


@torch.inference_mode()
def prefill(model, ids, chunk):
    cache = DynamicCache(config=model.config)
    x = torch.tensor([ids])
    logits = None
    for s in range(0, x.shape[1], chunk):
        logits = model(input_ids=x[:, s:s + chunk], cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    return cache, logits


@torch.inference_mode()
def step(model, cache, token):
    return model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True).logits[:, -1]


@torch.inference_mode()
def greedy_continue(model, cache, first, n):
    out = [first]
    for _ in range(n - 1):
        out.append(int(step(model, cache, out[-1]).argmax(-1)))
    return out


class Arm(NamedTuple):
    """A sparse policy under test: its name, selector, top-k, candidates and block geometry."""
    name: str
    selector: str
    k: int
    candidates: int
    block_tokens: int
    sink: int
    local: int


# The arms decoded in this process (Oracle), not through tierd.
IN_PROCESS = ("oracle", "sketchmass", "hybrid", "truemax", "sketch8")


def parse_arm(spec: str, a) -> Arm:
    """The arm `bound:K[@B]` or `sketch:K[:C][@B]` of a run with a's block geometry."""
    body, _, blk = spec.partition("@")
    bt = int(blk) if blk else a.block_tokens
    if (a.sink * a.block_tokens) % bt or (a.local * a.block_tokens) % bt:
        raise SystemExit(f"--arms: {spec!r}: the sink and local window are not whole {bt}-token blocks")
    geometry = (bt, a.sink * a.block_tokens // bt, a.local * a.block_tokens // bt)
    parts = body.split(":")
    if parts[0] in ("bound",) + IN_PROCESS and len(parts) == 2:
        return Arm(spec, parts[0], int(parts[1]), 0, *geometry)
    if parts[0] == "sketch" and len(parts) in (2, 3):
        c = DEFAULT_CANDIDATES if len(parts) == 2 else (ALL_BLOCKS if parts[2] == "all" else int(parts[2]))
        return Arm(spec, "sketch", int(parts[1]), c, *geometry)
    raise SystemExit(f"--arms: {spec!r} is not bound:K[@B], sketch:K[:C][@B] or one of "
                     + ", ".join(f"{x}:K[@B]" for x in IN_PROCESS))


def policy_for(arm: Arm):
    if arm.selector == "bound":
        return Policy.bound(arm.sink, arm.local, arm.k)
    return Policy(arm.sink, arm.local, arm.k, Selector.SKETCH, arm.candidates)


class Recording(KvtierCache):
    """A KvtierCache that keeps, per DECODE, the layer, the query and key it sent and the
    keep-set tierd answered with (the instrument's input)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.want_stats = True
        self.calls = []  # (slot, q [Hq, D] as sent, k [Hkv, D] f32, keep per kv head)

    def _decode(self, layer, q, k, v, q_scale):
        out = super()._decode(layer, q, k, v, q_scale)
        qn = q.detach().to("cpu", torch.float32)[0].numpy() * q_scale
        kn = k.detach().to("cpu", torch.float32)[0].numpy()
        self.calls.append((layer.slot, qn, kn, self.last_stats[0].selected))
        return out


ORACLE_IMPLEMENTATION = "kvtier-fidelity-oracle"


class Oracle:
    """The in-process arms: dense decoding whose global layers attend, at each decode step,
    only a keep-set of each KV head (sink, local window and the top-K distant blocks),
    renormalised over it. `oracle:K` ranks the distant blocks by the group's mean dense
    attention mass (the instrument's oracle). The design experiments use the sketch's former
    format, one absmax scale per token: `sketchmass:K` ranks by the mass the int4 key
    sketches estimate (softmax of every token's sketched logit, summed per block) instead of
    the sketch's best token; `hybrid:K` keeps the ceil(K/2) best by the sketch's best token
    and the rest by that estimated mass; `sketch8:K` ranks by a block's best token in int8
    codes instead of int4 (twice the bytes); `truemax:K` by its best token's true logit (the
    most any best-token sketch can do). It records its calls as
    `Recording` does, so the instrument reads them alike."""

    current = None  # the arm being decoded; the attention function reads it

    def __init__(self, model, arm: Arm):
        cfg = model.config.get_text_config(decoder=True)
        self.slots = {l: i for i, l in enumerate(i for i, t in enumerate(cfg.layer_types)
                                                  if t == "full_attention")}
        self.arm, self.model, self.calls = arm, model, []

    def __enter__(self):
        AttentionInterface.register(ORACLE_IMPLEMENTATION, Oracle.forward)
        AttentionMaskInterface.register(ORACLE_IMPLEMENTATION, sdpa_mask)
        self.model.set_attn_implementation(ORACLE_IMPLEMENTATION)
        Oracle.current = self
        return self

    def __exit__(self, *exc):
        Oracle.current = None
        self.model.set_attn_implementation(ATTN_IMPLEMENTATION)

    def keep(self, score: np.ndarray, best=None):
        """Per KV head, the keep-set by `score` [Hkv, nb]; with `best` (hybrid), the ceil(K/2)
        distant blocks of the highest `best` first, then the rest by `score`."""
        a, nb = self.arm, score.shape[1]
        if nb <= a.sink + a.local + a.k:
            return [list(range(nb))] * score.shape[0]
        distant = list(range(a.sink, nb - a.local))
        fixed = list(range(a.sink)), list(range(nb - a.local, nb))
        if best is None:
            return [fixed[0] + keepsets.top(m, distant, a.k) + fixed[1] for m in score]
        out = []
        for m, b in zip(score, best):
            first = keepsets.top(b, distant, -(-a.k // 2))
            rest = keepsets.top(m, [x for x in distant if x not in first], a.k - len(first))
            out.append(fixed[0] + sorted(first + rest) + fixed[1])
        return out

    @staticmethod
    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        self = Oracle.current
        slot = self.slots.get(getattr(module, "layer_idx", None))
        if query.shape[2] != 1 or slot is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask,
                                          dropout=dropout, scaling=scaling, **kwargs)
        _, hq, _, d = query.shape
        hkv, t = key.shape[1], key.shape[2]
        g, bt = hq // hkv, self.arm.block_tokens
        scaling = scaling or getattr(module, "scaling", None) or 1.0 / math.sqrt(d)
        q = query[0, :, 0].float().reshape(hkv, g, d)
        k, v = key[0].float(), value[0].float()
        logits = torch.einsum("hgd,htd->hgt", q, k) * scaling
        nb = -(-t // bt)
        qt = q * scaling * math.sqrt(d)  # the query as tierd receives it

        def block_best(x):  # [Hkv, G, T] per-token scores -> each block's best, max over the group
            padded = torch.nn.functional.pad(x, (0, nb * bt - t), value=float("-inf"))
            return padded.reshape(hkv, g, nb, bt).amax(-1).amax(1).numpy()

        best, ranked = None, None
        if self.arm.selector in ("sketchmass", "hybrid"):
            sk = Oracle.sketched_logits(qt, k)
            ranked = sk / math.sqrt(d)
            if self.arm.selector == "hybrid":
                best = block_best(sk)
        elif self.arm.selector == "truemax":
            score = block_best(logits)
        elif self.arm.selector == "sketch8":
            score = block_best(Oracle.sketched_logits(qt, k, levels=127))
        else:
            ranked = logits
        if ranked is not None:  # the (true or estimated) mass of each block, mean over the group
            p = torch.nn.functional.pad(torch.softmax(ranked, -1), (0, nb * bt - t))
            score = p.reshape(hkv, g, nb, bt).sum(-1).mean(1).numpy()
        keep = self.keep(score, best)
        allowed = torch.zeros(hkv, nb, dtype=torch.bool)
        for h, blocks in enumerate(keep):
            allowed[h, blocks] = True
        allowed = allowed.repeat_interleave(bt, 1)[:, :t]
        kept = torch.softmax(logits.masked_fill(~allowed[:, None, :], float("-inf")), -1)
        out = torch.einsum("hgt,htd->hgd", kept, v).reshape(1, 1, hq, d)
        self.calls.append((slot, qt.reshape(hq, d).numpy(),
                           k[:, -1].numpy(), keep))
        return out.to(query.dtype), None

    @staticmethod
    def sketched_logits(q, k, levels=7):
        """Every token's logit as the sketch selector's second stage estimates it (q [Hkv, G, D]
        as tierd receives it, k [Hkv, T, D]): int8 query codes against int4 key codes (codes
        in -levels..=levels), each with its absmax scale (keepsets.quantize_rows), [Hkv, G, T]."""
        qc, qs = keepsets.quantize_rows(q.numpy(), 127)
        kc, ks = keepsets.quantize_rows(k.numpy(), levels)
        dots = np.einsum("hgd,htd->hgt", qc.astype(np.float32), kc.astype(np.float32))
        return torch.from_numpy(dots * ks[:, None, :] * qs[..., None])


@contextlib.contextmanager
def continuation(model, cache, client, arm: Arm):
    """(the cache an arm decodes from, its recorder): a tierd session filled from the dense
    prefill, or for the oracle a copy of the dense cache, decoded with its attention."""
    if arm.selector in IN_PROCESS:
        with Oracle(model, arm) as o:
            yield copy.deepcopy(cache), o
    else:
        with Recording.from_dense(model, cache, client=client, policy=policy_for(arm),
                                  block_tokens=arm.block_tokens) as kc:
            yield kc, kc


def instrument(rec: "Recording", prefill_keys, arm: Arm, needle_blocks=None):
    """Per (step, layer) of a sparse continuation: dense mass inside tierd's keep-set and the
    oracle's, whether tierd's keep-set equals the numpy rule, and (needle trials) the needle's
    rank and whether it was kept where a head reads it. prefill_keys: per global layer slot,
    [Hkv, T, D] float32."""
    keys = [np.array(pk) for pk in prefill_keys]
    bt, sink, local, k = arm.block_tokens, arm.sink, arm.local, arm.k
    out = {"mass": [], "oracle_mass": [], "rule_equal": 0, "items": 0, "reads": []}
    for slot, q, knew, keep in rec.calls:
        kv = keys[slot]
        keys[slot] = kv = np.concatenate([kv, knew[:, None, :]], axis=1)
        hkv, t, d = kv.shape
        g = q.shape[0] // hkv
        nb = -(-t // bt)
        for h in range(hkv):
            sc = keepsets.block_scores(q[h * g:(h + 1) * g], kv[h], t, bt)
            fixed = list(range(sink)) + list(range(max(nb - local, sink), nb))
            distant = list(range(sink, max(nb - local, sink)))
            oracle = fixed + keepsets.top(sc["mass"], distant, k) if nb > sink + local + k else list(range(nb))
            out["mass"].append(float(sc["mass"][list(keep[h])].sum()))
            out["oracle_mass"].append(float(sc["mass"][sorted(set(oracle))].sum()))
            if arm.selector in IN_PROCESS:
                # In-process arms against the numpy oracle: the oracle's is a check of the torch
                # one; sketchmass's says how often it keeps what the oracle keeps.
                rule = sorted(set(oracle))
            else:
                rule = keepsets.keep_set(sc, nb, sink, local, k, arm.selector, arm.candidates, bt)
            out["rule_equal"] += int(rule == list(keep[h]))
            out["items"] += 1
            if needle_blocks:
                nbl = [b for b in needle_blocks if b < nb]
                if nbl and sc["mass_heads"][:, nbl].sum(1).max() >= READ_MASS:
                    item = {"kept": bool(set(nbl) & set(keep[h]))}
                    far = [b for b in nbl if b in distant]
                    if far:
                        for name in ("mass", "bound", "quarter", "sketch"):
                            item[f"rank_{name}"] = min(keepsets.rank(sc[name], distant, b) for b in far)
                        item["distant"] = len(distant)
                    out["reads"].append(item)
    return out


def run_needle(model, tok, client, a, ctx, hay, trial, rng):
    code = gemma.random_code(rng)
    depth = rng.uniform(0.1, 0.6)
    ids, npos = gemma.needle_prompt(tok, ctx, depth, code, hay, seed=trial * 1000 + ctx)
    needle_len = len(tok(" " + gemma.NEEDLE.format(code=code), add_special_tokens=False)["input_ids"])
    t0 = time.time()
    cache, logits = prefill(model, ids, a.chunk)
    t_pre = time.time() - t0
    first = int(logits.argmax(-1))
    res = {"kind": "needle", "ctx": ctx, "tokens": len(ids), "haystack": hay, "trial": trial,
           "code": code, "depth": round(depth, 3), "needle_pos": npos, "prefill_s": round(t_pre, 2)}
    dense = greedy_continue(model, copy.deepcopy(cache), first, a.answer_tokens)
    res["dense"] = gemma.found(tok, dense, code)
    res["dense_text"] = tok.decode(dense)
    prefill_keys = prefill_keys_of(model, cache)
    for arm in a.arms:
        bt = arm.block_tokens
        needle_blocks = list(range(npos // bt, (npos + needle_len - 1) // bt + 1))
        with continuation(model, cache, client, arm) as (kc, rec):
            sp = greedy_continue(model, kc, first, a.answer_tokens)
            res[f"{arm.name}_inst"] = instrument(rec, prefill_keys, arm, needle_blocks)
        res[arm.name] = gemma.found(tok, sp, code)
        res[f"{arm.name}_text"] = tok.decode(sp)
    res["total_s"] = round(time.time() - t0, 2)
    return res


def prefill_keys_of(model, cache):
    """The global layers' prefill keys, per layer [Hkv, T, D] float32 (batch row 0)."""
    cfg = model.config.get_text_config(decoder=True)
    full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    return [cache.layers[i].keys[0].float().numpy() for i in full]


@torch.inference_mode()
def run_forced(model, tok, client, a, doc, tokens):
    ctx, m = a.tf_context, a.tf_steps
    ids = [tok.bos_token_id] + tokens[:ctx + m - 1]
    prefix, forced = ids[:ctx], ids[ctx:]
    t0 = time.time()
    cache, logits0 = prefill(model, prefix, a.chunk)
    dense_cache = copy.deepcopy(cache)
    dl = [logits0[0]] + [step(model, dense_cache, t)[0] for t in forced[:m - 1]]
    dense = torch.stack(dl).float()
    res = {"kind": "forced", "doc": doc, "context": ctx, "steps": m}
    top2 = dense.topk(2, -1).values
    confident = (top2[:, 0] - top2[:, 1]) > 1.0
    d_top = dense.argmax(-1)
    d_logp = torch.log_softmax(dense, -1)
    res["confident_steps"] = int(confident.sum())
    prefill_keys = prefill_keys_of(model, cache)
    for arm in a.arms:
        with continuation(model, cache, client, arm) as (kc, rec):
            sl = [logits0[0]] + [step(model, kc, t)[0] for t in forced[:m - 1]]
            inst = instrument(rec, prefill_keys, arm)
        sparse = torch.stack(sl).float()
        agree = sparse.argmax(-1) == d_top
        kl = (d_logp.exp() * (d_logp - torch.log_softmax(sparse, -1))).sum(-1)
        res[arm.name] = {"agree": int(agree.sum()), "agree_confident": int(agree[confident].sum()),
                       "kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "inst": inst}
    res["total_s"] = round(time.time() - t0, 2)
    return res


def arm_names(a):
    return [arm.name for arm in a.arms]


def instrument_summary(insts):
    """Pools instrument records: mean mass shares, rule agreement, needle items."""
    mass = [x for i in insts for x in i["mass"]]
    oracle = [x for i in insts for x in i["oracle_mass"]]
    reads = [r for i in insts for r in i.get("reads", [])]
    items = sum(i["items"] for i in insts)
    out = {"items": items, "mass_mean": float(np.mean(mass)) if mass else float("nan"),
           "oracle_mass_mean": float(np.mean(oracle)) if oracle else float("nan"),
           "rule_equal": sum(i["rule_equal"] for i in insts), "reads": len(reads),
           "needle_kept": sum(r["kept"] for r in reads)}
    far = [r for r in reads if "rank_mass" in r]
    for name in ("mass", "bound", "quarter", "sketch"):
        out[f"median_rank_{name}"] = float(np.median([r[f"rank_{name}"] for r in far])) if far else float("nan")
    out["median_distant"] = float(np.median([r["distant"] for r in far])) if far else float("nan")
    return out


def summarize(results, a):
    needle = [r for r in results if r["kind"] == "needle"]
    forced = [r for r in results if r["kind"] == "forced"]
    cells = {}
    for r in needle:
        cells.setdefault((r["haystack"], r["ctx"]), []).append(r)
    ntab = []
    for (hay, ctx), rs in sorted(cells.items()):
        n = len(rs)
        row = {"haystack": hay, "ctx": ctx, "n": n}
        for key in ["dense"] + arm_names(a):
            s = sum(r[key] for r in rs)
            lo, hi = wilson(s, n)
            row[key] = {"found": s, "recall": s / n, "ci95": [round(lo, 3), round(hi, 3)]}
            if key != "dense":
                row[key]["dense_only"] = sum(r["dense"] and not r[key] for r in rs)
                row[key]["sparse_only"] = sum(r[key] and not r["dense"] for r in rs)
                row[key]["instrument"] = instrument_summary([r[f"{key}_inst"] for r in rs])
        ntab.append(row)
    ftab = []
    if forced:
        steps = sum(r["steps"] for r in forced)
        conf = sum(r["confident_steps"] for r in forced)
        for name in arm_names(a):
            ag = sum(r[name]["agree"] for r in forced)
            agc = sum(r[name]["agree_confident"] for r in forced)
            kl = sum(r[name]["kl_mean"] * r["steps"] for r in forced) / steps
            ftab.append({"arm": name, "steps": steps, "agree": ag, "agree_rate": ag / steps,
                         "agree_ci95": [round(x, 4) for x in wilson(ag, steps)],
                         "confident_steps": conf, "agree_confident": agc,
                         "agree_confident_rate": agc / conf if conf else float("nan"),
                         "agree_confident_ci95": [round(x, 4) for x in wilson(agc, conf)],
                         "kl_mean": kl, "kl_max": max(r[name]["kl_max"] for r in forced),
                         "instrument": instrument_summary([r[name]["inst"] for r in forced]),
                         "docs": len(forced), "context": forced[0]["context"]})
    return ntab, ftab


def write_reports(results, a, meta):
    ntab, ftab = summarize(results, a)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "fidelity.json"), "w") as f:
        json.dump({"meta": meta, "needle": ntab, "forced": ftab, "trials": results}, f, indent=1)
    names = arm_names(a)
    L = ["# kvtier fidelity: sparse (tierd) vs dense, Gemma 3 270M Q4_K_M", "",
         f"- policy: sink_blocks={a.sink}, local_blocks={a.local}, block_tokens={a.block_tokens}; arms "
         + ", ".join(names) + f" (sketch:K without C: {DEFAULT_CANDIDATES} candidates; @B: blocks of B tokens, "
         "the sink and local window of the same token counts)",
         f"- started {meta['started']}, elapsed {meta.get('elapsed_s', 0):.0f} s, machine: {meta['machine']}", "",
         "## Needle retrieval (greedy; found = the 5-digit code in the answer)", "",
         "recall (found/n) [Wilson 95%]; for sparse: discordant pairs vs dense as -dense_only/+sparse_only", ""]
    hdr = "| haystack | ctx | n | dense | " + " | ".join(names) + " |"
    L += [hdr, "|" + "---|" * (4 + len(names))]
    for r in ntab:
        cellstr = []
        for key in ["dense"] + names:
            c = r[key]
            s = f"{c['recall']:.2f} ({c['found']}/{r['n']}) [{c['ci95'][0]:.2f}, {c['ci95'][1]:.2f}]"
            if key != "dense":
                s += f" -{c['dense_only']}/+{c['sparse_only']}"
            cellstr.append(s)
        L.append(f"| {r['haystack']} | {r['ctx']} | {r['n']} | " + " | ".join(cellstr) + " |")
    L += ["", "## The instrument on the needle trials", "",
          "Per (answer step, global layer, kv head) item: dense attention mass inside the keep-set (tierd's, "
          "and the oracle's: the top-K distant blocks by true mass); at the items where some head puts "
          f">= {READ_MASS} of its attention on the needle's blocks ('reads'): the share whose keep-set holds a "
          "needle block, and the needle block's median rank among the distant blocks by true mass, by the key "
          "bound, by the quarter bound and by the sketch; tierd's keep-sets equal to the numpy rule.", "",
          "| haystack | ctx | arm | items | mass kept | oracle mass | reads | needle kept | rank: mass / bound / quarter / sketch (of distant) | = rule |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for r in ntab:
        for key in names:
            i = r[key]["instrument"]
            kept = f"{i['needle_kept'] / i['reads']:.2f} ({i['needle_kept']}/{i['reads']})" if i["reads"] else "-"
            ranks = " / ".join(f"{i[f'median_rank_{n}']:.0f}" for n in ("mass", "bound", "quarter", "sketch"))
            L.append(f"| {r['haystack']} | {r['ctx']} | {key} | {i['items']} | {i['mass_mean']:.3f} | "
                     f"{i['oracle_mass_mean']:.3f} | {i['reads']} | {kept} | {ranks} ({i['median_distant']:.0f}) | "
                     f"{i['rule_equal']}/{i['items']} |")
    if ftab:
        L += ["", f"## Teacher-forced agreement with dense (prose, {ftab[0]['docs']} docs x "
                  f"{ftab[0]['steps'] // ftab[0]['docs']} steps after {ftab[0]['context']} tokens)", "",
              "| arm | top-1 agree | [95%] | confident steps (margin > 1) agree | [95%] | mean KL(dense‖sparse) | max KL | mass kept | oracle mass |",
              "|---|---|---|---|---|---|---|---|---|"]
        for r in ftab:
            i = r["instrument"]
            L.append(f"| {r['arm']} | {r['agree_rate']:.4f} ({r['agree']}/{r['steps']}) | {r['agree_ci95']} | "
                     f"{r['agree_confident_rate']:.4f} ({r['agree_confident']}/{r['confident_steps']}) | "
                     f"{r['agree_confident_ci95']} | {r['kl_mean']:.5f} | {r['kl_max']:.4f} | "
                     f"{i['mass_mean']:.3f} | {i['oracle_mass_mean']:.3f} |")
    with open(os.path.join(a.out, "fidelity.md"), "w") as f:
        f.write("\n".join(L) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        hays = sorted({r["haystack"] for r in ntab})
        fig, axes = plt.subplots(1, len(hays), figsize=(6 * len(hays), 4), squeeze=False)
        for ax, hay in zip(axes[0], hays):
            rows = [r for r in ntab if r["haystack"] == hay]
            xs = [r["ctx"] for r in rows]
            keys = ["dense"] + arm_names(a)
            for j, key in enumerate(keys):
                xj = [x * 2 ** (0.04 * (j - (len(keys) - 1) / 2)) for x in xs]  # spread overlapping points
                ys = [r[key]["recall"] for r in rows]
                lo = [r[key]["recall"] - r[key]["ci95"][0] for r in rows]
                hi = [r[key]["ci95"][1] - r[key]["recall"] for r in rows]
                ax.errorbar(xj, ys, yerr=[lo, hi], marker="o", capsize=3,
                            label=key if key == "dense" else f"sparse {key}",
                            linestyle="--" if key == "dense" else "-", alpha=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [f"{x // 1024}K" for x in xs])
            ax.set_ylim(-0.05, 1.05)
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("needle recall")
            ax.set_title(f"Gemma 3 270M, {hay} haystack (n per point: {', '.join(str(r['n']) for r in rows)})")
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(a.out, "recall.png"), dpi=90)
        plt.close(fig)
    except Exception as e:  # the report is still useful without the plot
        print(f"plot failed: {e}", file=sys.stderr)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--socket", default=None)
    ap.add_argument("--out", default="fidelity-out")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--trials", type=int, nargs="+", default=[10, 8, 5, 3],
                    help="needle trials per haystack for each context")
    ap.add_argument("--haystacks", nargs="+", default=["repeated", "prose"])
    ap.add_argument("--arms", nargs="+", default=["bound:8", "bound:32", "sketch:4", "sketch:8", "sketch:8:all"],
                    help="sparse policies: bound:K or sketch:K[:C] (C a count or all)")
    ap.add_argument("--block-tokens", type=int, default=128)
    ap.add_argument("--sink", type=int, default=1)
    ap.add_argument("--local", type=int, default=4)
    ap.add_argument("--answer-tokens", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens)")
    ap.add_argument("--tf-docs", type=int, default=2)
    ap.add_argument("--tf-context", type=int, default=8192)
    ap.add_argument("--tf-steps", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--deadline", type=float, default=0, help="stop starting trials after this many seconds")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--trial-offset", type=int, default=0,
                    help="number trials (and teacher-forced documents) from here: a second run with "
                         "another offset and --seed draws new prompts and documents, to pool with the first")
    ap.add_argument("--pool", nargs="*", default=[], metavar="JSON",
                    help="with --report-only: more fidelity.json files whose trials are pooled in "
                         "(on the arms every run has)")
    ap.add_argument("--report-only", metavar="JSON", help="rewrite the reports (md, png) from a fidelity.json")
    a = ap.parse_args(argv)
    if a.report_only:
        d = json.load(open(a.report_only))
        a.sink, a.local = d["meta"]["args"]["sink"], d["meta"]["args"]["local"]
        a.block_tokens = d["meta"]["args"]["block_tokens"]
        a.arms = [parse_arm(x, a) for x in d["meta"]["args"]["arm_specs"]]
        trials, meta = d["trials"], d["meta"]
        if a.pool:
            others = [json.load(open(x)) for x in a.pool]
            meta = {**meta, "pooled_runs": [d["meta"]] + [o["meta"] for o in others]}
            # Runs with other arms pool on the arms they all have.
            common = set.intersection(*(set(o["meta"]["args"]["arm_specs"]) for o in others))
            a.arms = [arm for arm in a.arms if arm.name in common]
            for o in others:
                trials = trials + o["trials"]
        write_reports(trials, a, meta)
        return
    if a.threads:
        torch.set_num_threads(a.threads)
    from tqdm import tqdm

    a.arm_specs = a.arms
    a.arms = [parse_arm(x, a) for x in a.arms]

    t_start = time.time()
    meta = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
                       f"python {platform.python_version()}, torch {torch.__version__}",
            "argv": sys.argv, "args": {k: v for k, v in vars(a).items() if k != "arms"}}
    model, tok = gemma.load()
    enable(model)
    client = connect(a.socket)
    rng = random.Random(a.seed)

    jobs = []
    trials = dict(zip(a.contexts, a.trials + [a.trials[-1]] * (len(a.contexts) - len(a.trials))))
    o = a.trial_offset
    for t in range(max(trials.values())):
        for ctx in a.contexts:
            if t < trials[ctx]:
                for hay in a.haystacks:
                    jobs.append(("needle", ctx, hay, o + t))
        if t < a.tf_docs:
            jobs.append(("forced", o + t, None, o + t))
    prose_tokens = None
    results = []
    bar = tqdm(jobs, desc="fidelity", unit="trial", file=sys.stdout, mininterval=5)
    for job in bar:
        if a.deadline and time.time() - t_start > a.deadline:
            print(f"deadline reached: {len(results)}/{len(jobs)} trials done", flush=True)
            break
        if job[0] == "needle":
            _, ctx, hay, t = job
            r = run_needle(model, tok, client, a, ctx, hay, t, rng)
        else:
            if prose_tokens is None:
                paras = gemma.prose_paragraphs()
                prose_tokens = []
            doc = job[1]
            order = list(range(len(paras)))
            random.Random(10_000 + doc).shuffle(order)
            toks = []
            for i in order:
                toks += tok(" " + paras[i], add_special_tokens=False)["input_ids"]
                if len(toks) > a.tf_context + a.tf_steps:
                    break
            r = run_forced(model, tok, client, a, doc, toks)
        results.append(r)
        bar.set_postfix_str(f"{r['kind']} {r.get('ctx', r.get('context'))} {r['total_s']}s")
        meta["elapsed_s"] = time.time() - t_start
        write_reports(results, a, meta)
    meta["elapsed_s"] = time.time() - t_start
    meta["completed_trials"] = len(results)
    meta["planned_trials"] = len(jobs)
    write_reports(results, a, meta)
    print(open(os.path.join(a.out, "fidelity.md")).read())


if __name__ == "__main__":
    main()
