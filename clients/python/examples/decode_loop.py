#!/usr/bin/env python3
"""Create a session, upload a random prompt through shared memory, run decode steps over
every layer and print per-step latency and selection stats.

    python3 clients/python/examples/decode_loop.py --socket /run/kvtier/tierd.sock \
        --prompt-tokens 8192 --steps 16

Random KV stands in for a model; the point is to exercise the daemon the way an engine does.
"""

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvtier import Client, DecodeEntry, Dtype, Geometry, Policy, f32_to_bf16  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", default=os.environ.get("KVTIER_SOCKET", "/run/kvtier/tierd.sock"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--q-heads", type=int, default=28)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--chunk-tokens", type=int, default=1024, help="tokens per APPEND_KV")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rng = np.random.default_rng(args.seed)
    g = Geometry(args.layers, args.q_heads, args.kv_heads, args.head_dim, Dtype.BF16, args.block_tokens)
    with Client(args.socket, client_name="decode_loop.py", timeout=60) as c:
        print(f"connected to {c.server.server_name} {c.server.server_version} "
              f"(protocol {c.server.version}, max frame {c.server.max_frame_bytes} B)")
        sid = c.create_session(g, Policy(top_k=args.top_k), label="decode_loop")
        try:
            pos = 0
            t0 = time.perf_counter()
            while pos < args.prompt_tokens:
                n = min(args.chunk_tokens, args.prompt_tokens - pos)
                kv = f32_to_bf16(rng.standard_normal((g.layers, 2, n, g.kv_heads, g.head_dim), dtype=np.float32))
                pos = c.append_kv_shm(sid, pos, n, kv)
            dt = time.perf_counter() - t0
            mb = g.append_payload_bytes(args.prompt_tokens) / 1e6
            print(f"session {sid}: appended {pos} tokens ({mb:.1f} MB) in {dt * 1e3:.1f} ms")

            for step in range(args.steps):
                t0 = time.perf_counter()
                sel = moved = 0
                for layer in range(g.layers):
                    q = rng.standard_normal((g.q_heads, g.head_dim), dtype=np.float32)
                    k = f32_to_bf16(rng.standard_normal((g.kv_heads, g.head_dim), dtype=np.float32))
                    v = f32_to_bf16(rng.standard_normal((g.kv_heads, g.head_dim), dtype=np.float32))
                    out = c.decode_batch(layer, [DecodeEntry(sid, pos, q, k, v)], want_stats=True)[0]
                    assert out.out.shape == (g.q_heads, g.head_dim) and np.isfinite(out.out).all()
                    sel += out.stats.blocks_selected
                    moved += out.stats.bytes_moved
                pos += 1
                dt = time.perf_counter() - t0
                print(f"step {step:3d}: pos {pos - 1}, {dt * 1e3:7.2f} ms for {g.layers} layers, "
                      f"{sel} tiles selected, {moved / 1e6:.2f} MB moved")
            info = c.session_info(sid)
            print(f"session {sid}: tokens {info.tokens_min}..{info.tokens_max}, blocks {info.blocks}, "
                  f"host {info.host_bytes / 1e6:.1f} MB")
        finally:
            c.close(sid)
        stats = c.stats()
        print("daemon:", ", ".join(f"{k}={v}" for k, v in sorted(stats.items())))


if __name__ == "__main__":
    main()
