"""kvtier's block selection rules restated in numpy, for the benchmarks that study them.

The selector itself runs in tierd (kernels/src/select.rs); this is an independent restatement
used to rank blocks, to try other rules on captured queries and keys (selector_study.py) and
to check tierd's keep-sets in the fidelity suite (fidelity.py). One kv head at a time: `q` is
the group's queries `[G, D]`, scaled as tierd gets them (its softmax scale is 1/sqrt(D)); `k`
the layer's keys `[T, D]` for that kv head.
"""

from __future__ import annotations

from typing import Dict, List

import numpy as np


def quantize_rows(x: np.ndarray, levels: int):
    """Symmetric per-row absmax quantization, round half to even: codes in [-levels, levels]
    and one scale per row (float32, as tierd computes them)."""
    x = x.astype(np.float32)
    amax = np.abs(x).max(-1, keepdims=True)
    scale = (amax / np.float32(levels)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    codes = np.clip(np.rint(x / safe), -levels, levels).astype(np.int32)
    codes = np.where(scale > 0, codes, 0)
    return codes, scale[..., 0]


def bf16_outward(x: np.ndarray, up: bool) -> np.ndarray:
    """float32 values rounded to bf16 away from the interior (up: toward +inf), as float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    trunc = bits & np.uint32(0xFFFF0000)
    inexact = (bits & np.uint32(0xFFFF)) != 0
    negative = (bits >> np.uint32(31)) == 1
    away = inexact & (negative != up)
    out = np.where(away, trunc + np.uint32(0x10000), trunc).astype(np.uint32)
    return out.view(np.float32)


def block_scores(q: np.ndarray, k: np.ndarray, t: int, block: int = 128) -> Dict[str, np.ndarray]:
    """Per-block scores over the layer's `t` tokens (`nb` blocks): `bound` (the key bound,
    max over the group: the bound selector), `quarter` (the integer bound of each quarter of the
    block from its int8 quarter codes, max over quarters and the group: the sketch selector's
    first stage), `sketch` (the best int4 x int8 sketched logit: its second stage,
    `sketch_scores`),
    `true_max` (the best true logit), `mass` (the share of the group's dense attention, mean
    over its heads) and `mass_heads` `[G, nb]`."""
    g, d = q.shape
    nb = -(-t // block)
    kk = k[:t].astype(np.float32)
    pad = nb * block - t
    kp = np.concatenate([kk, np.zeros((pad, d), np.float32)]) if pad else kk
    valid = (np.arange(nb * block) < t).reshape(nb, block)
    kb = kp.reshape(nb, block, d)
    hi = np.where(valid[..., None], kb, -np.inf).max(1)
    lo = np.where(valid[..., None], kb, np.inf).min(1)
    bound = np.maximum(q[:, None, :] * hi[None], q[:, None, :] * lo[None]).sum(-1).max(0)
    # The quarter bounds (bf16, rounded outward), their int8 codes with one scale per block
    # (maxima rounded up, minima down; a quarter without tokens an empty box), then per head
    # the best quarter's integer bound against the int8 query: the sketch selector's stage 1.
    nq = 4 if block >= 128 else 2 if block >= 64 else 1  # kvtier_storage::sketch::quarters
    starts = [j * block // nq for j in range(nq + 1)]
    qhi, qlo, filled = [], [], []
    for j in range(nq):
        sl = slice(starts[j], starts[j + 1])
        v = valid[:, sl]
        qhi.append(bf16_outward(np.where(v[..., None], kb[:, sl], -np.inf).max(1), True))
        qlo.append(bf16_outward(np.where(v[..., None], kb[:, sl], np.inf).min(1), False))
        filled.append(v.any(1))
    qhi, qlo, filled = np.stack(qhi, 1), np.stack(qlo, 1), np.stack(filled, 1)  # [nb, nq, d], [nb, nq]
    amax = np.where(filled[..., None], np.maximum(np.abs(np.where(filled[..., None], qhi, 0)),
                                                  np.abs(np.where(filled[..., None], qlo, 0))), 0).max((1, 2))
    bscale = (amax / np.float32(127)).astype(np.float32)
    safe = np.where(bscale > 0, bscale, np.float32(1))[:, None, None]
    with np.errstate(invalid="ignore"):
        chi = np.clip(np.ceil(qhi / safe), -127, 127)
        clo = np.clip(np.floor(qlo / safe), -127, 127)
    chi = np.where(filled[..., None], np.where(bscale[:, None, None] > 0, chi, 0), -127).astype(np.int64)
    clo = np.where(filled[..., None], np.where(bscale[:, None, None] > 0, clo, 0), 127).astype(np.int64)
    qc, qs = quantize_rows(q, 127)
    qc = qc.astype(np.int64)
    ints = (np.einsum("gd,bjd->bjg", np.maximum(qc, 0), chi)
            + np.einsum("gd,bjd->bjg", np.minimum(qc, 0), clo)).max(1)  # [nb, g]
    quarter = ((ints.astype(np.float32) * bscale[:, None]).astype(np.float32) * qs[None, :]).max(1)
    logits = q @ kk.T
    p = np.exp((logits - logits.max(1, keepdims=True)) / np.sqrt(d))
    p /= p.sum(1, keepdims=True)
    mass_heads = np.concatenate([p, np.zeros((g, pad))], 1).reshape(g, nb, block).sum(2)
    true_max = np.concatenate([logits, np.full((g, pad), -np.inf)], 1).reshape(g, nb, block).max(2).max(0)
    return {"bound": bound, "quarter": quarter, "sketch": sketch_scores(q, kk, t, block),
            "true_max": true_max, "mass": mass_heads.mean(0), "mass_heads": mass_heads}


def sketch_scores(q: np.ndarray, k: np.ndarray, t: int, block: int = 128) -> np.ndarray:
    """The sketch selector's second stage [nb]: per block the best token's logit as its int4
    key sketch estimates it, max over the group. Key codes round(k / s) in [-7, 7], s the
    block's channel absmax / 7 (kvtier_storage::sketch); each query head times s quantized to
    int8 per block (kernels/src/select.rs block_query); integer dots, the best token's times
    the query scale."""
    g, d = q.shape
    nb = -(-t // block)
    kk = k[:t].astype(np.float32)
    kb = np.concatenate([kk, np.zeros((nb * block - t, d), np.float32)]).reshape(nb, block, d)
    s = (np.abs(kb).max(1) / np.float32(7)).astype(np.float32)  # [nb, D]
    safe = np.where(s > 0, s, np.float32(1))
    codes = np.where(s[:, None] > 0, np.clip(np.rint(kb / safe[:, None]), -7, 7), 0).astype(np.int64)
    qc, qs = quantize_rows(q.astype(np.float32)[:, None, :] * s[None], 127)  # [G, nb, D]
    dots = np.einsum("gnd,ntd->gnt", qc.astype(np.int64), codes)
    valid = (np.arange(nb * block) < t).reshape(nb, block)
    best = np.where(valid[None], dots, np.iinfo(np.int64).min).max(-1)  # [G, nb]
    return (best.astype(np.float32) * qs).max(0)


def token_sketch(q: np.ndarray, k: np.ndarray, t: int, block: int = 128) -> np.ndarray:
    """The sketch's former second stage [nb], for comparison: int4 key codes with one absmax
    scale per token, against the query quantized once; the best token's sketched logit, max
    over the group."""
    g, d = q.shape
    nb = -(-t // block)
    qc, qs = quantize_rows(q, 127)
    kc, ks = quantize_rows(k[:t].astype(np.float32), 7)
    per_token = (qc.astype(np.int64) @ kc.T.astype(np.int64)).astype(np.float32) * ks[None, :]
    per_token = np.concatenate([per_token, np.full((g, nb * block - t), -np.inf, np.float32)], 1)
    return (per_token.reshape(g, nb, block).max(2) * qs[:, None]).max(0)


def top(scores: np.ndarray, cands, k: int) -> List[int]:
    """The k best of `cands` by `scores`, higher first, ties to the lower block; ascending."""
    order = sorted(cands, key=lambda b: (-scores[b], b))
    return sorted(order[:k])


def keep_set(sc: Dict[str, np.ndarray], nb: int, sink: int, local: int, k: int,
             selector: str = "sketch", candidates: int = 0, block: int = 128) -> List[int]:
    """The keep-set of a layer of `nb` blocks of `block` tokens (after the step's append)
    under a policy."""
    if nb <= sink + local + k:
        return list(range(nb))
    distant = list(range(sink, nb - local))
    if selector == "bound":
        picked = top(sc["bound"], distant, k)
    else:
        # The first stage ranks units of four quarter records (kvtier_kernels::select::
        # unit_blocks) by their best distant block; their distant blocks are the candidates.
        # A layer of at most 16,384 tokens' worth of units (256 blocks at most; `want` if
        # more) skips it.
        g = 1 if block >= 128 else 2 if block >= 64 else 4
        want = -(-max(candidates, k + 2 * (g - 1)) // g)
        scan = max(want, min(256, 16384 // block) // g)
        units = sorted({b // g for b in distant})
        if scan >= len(units):
            cands = distant
        else:
            best = {u: max(sc["quarter"][b] for b in distant if b // g == u) for u in units}
            picked_units = set(top(best, units, want))
            cands = [b for b in distant if b // g in picked_units]
        picked = top(sc["sketch"], cands, k)
    return list(range(sink)) + picked + list(range(nb - local, nb))


def rank(scores: np.ndarray, distant: List[int], block: int) -> int:
    """1-based rank of `block` among `distant` by `scores` (ties to the lower block)."""
    order = sorted(distant, key=lambda b: (-scores[b], b))
    return order.index(block) + 1
