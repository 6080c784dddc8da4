"""What tierd's COMMIT of an in-place prefill costs, all layers at once and layer by layer, with
no GPU: this process writes the rows through its own mapping of tierd's arena (as an engine's
DMA does), then COMMITs them. Both sessions must then decode alike at every layer (the same
bounds and sketches), which the script checks.

Usage (tierd running with host.shared = true and room for two sessions of --tokens):
    python commit_bench.py --socket /tmp/td/s.sock --tokens 32768 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from kvtier import Client, Dtype, Geometry, Policy, f32_to_bf16  # noqa: E402

QWEN = Geometry(28, 28, 4, 128, Dtype.BF16, 128)  # Qwen2.5-7B attention


def fill(c: Client, session: int, tokens: int, src: np.ndarray) -> None:
    """RESERVE `tokens` rows and write random finite bf16 rows where the reply says."""
    with c.lease(session, writable=True) as lease:
        for layer in c.reserve(session, tokens).layers:
            for j, at in enumerate(layer):
                run = lease.run_at(int(at))
                run[:] = np.roll(src, 2 * j)[:len(run)]  # whole bf16 values, a block apart
                del run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    g = QWEN
    rng = np.random.default_rng(1)
    src = f32_to_bf16(rng.standard_normal(g.kv_heads * 2 * g.block_tokens * g.head_dim,
                                          dtype=np.float32)).view(np.uint8)
    with Client(a.socket) as c:
        for rnd in range(a.rounds):
            at_once, by_layer = c.create_session(g, Policy(1, 4, 8)), c.create_session(g, Policy(1, 4, 8))
            fill(c, at_once, a.tokens, src)
            t = time.perf_counter()
            c.commit(at_once, a.tokens)
            whole = time.perf_counter() - t
            fill(c, by_layer, a.tokens, src)
            per = []
            for layer in range(g.layers):
                t = time.perf_counter()
                c.commit(by_layer, a.tokens, layers=(layer, 1))
                per.append(time.perf_counter() - t)
            q = rng.standard_normal((g.q_heads, g.head_dim), dtype=np.float32)
            k = f32_to_bf16(rng.standard_normal((g.kv_heads, g.head_dim), dtype=np.float32))
            alike = sum(
                np.array_equal(x.out, y.out) and x.stats == y.stats
                for x, y in ([c.decode(l, s, a.tokens, q, k, k, want_stats=True) for s in (at_once, by_layer)]
                             for l in range(g.layers)))
            print(f"round {rnd}: {a.tokens} tokens, COMMIT of every layer {whole * 1e3:.0f} ms; "
                  f"one layer at a time: median {statistics.median(per) * 1e3:.1f} ms, "
                  f"{sum(per) * 1e3:.0f} ms for all; decode alike at {alike}/{g.layers} layers",
                  flush=True)
            for s in (at_once, by_layer):
                c.release(s)
                c.close(s)
            if alike != g.layers:
                sys.exit("the sessions decode differently")


if __name__ == "__main__":
    main()
