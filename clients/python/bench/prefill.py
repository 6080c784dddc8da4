"""A prefill's K/V from GPU memory into tierd's host tier, two ways:

* ``host``: what kvtier.hf did before the in-engine path appended in place: the K/V copied to
  host memory (``.cpu()``), reordered into APPEND_KV's payload layout and sent as one
  shared-memory APPEND_KV per session (``Client.append_kv_shm``).
* ``dma``: ``InEngine.append_rows``: RESERVE the rows, one DMA copy per layer and block from the
  GPU into the reserved rows of tierd's arena, COMMIT (in chunks of 16384 tokens).

Qwen2.5-7B's attention geometry (28 layers, 4 KV heads, D = 128, bf16, 128-token blocks), random
K/V, one session per repetition (closed after), median of ``--reps``. The floor is the bytes
over PCIe at 55.3 GB/s (the H100 host's measured host<->device rate).

Usage (tierd running with host.shared = true, room for a session):
    python prefill.py --socket /tmp/t/tierd.sock --context 32768 --reps 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvtier import Client, Dtype, Geometry, Policy  # noqa: E402
from kvtier import engine as kv_engine  # noqa: E402
from kvtier.protocol import pack_append_payload  # noqa: E402

GEO = Geometry(28, 28, 4, 128, Dtype.BF16, 128)
PCIE_GBS = 55.3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--paths", default="host,dma", help="which of host, dma to run")
    a = ap.parse_args()
    g, n = GEO, a.context
    c = Client(a.socket, client_name="prefill-bench")
    policy = Policy(1, 4, 32)
    torch.manual_seed(0)
    # [layers, 1 session, kv_heads, K|V, tokens, head_dim]: the layout append_rows takes.
    rows = torch.randn((g.layers, 1, g.kv_heads, 2, n, g.head_dim), device="cuda").to(torch.bfloat16)
    nbytes = rows.numel() * rows.element_size()
    floor_ms = nbytes / (PCIE_GBS * 1e9) * 1e3
    print(f"{torch.cuda.get_device_name(0)}: {n} tokens, {nbytes / 1e9:.2f} GB of K/V; "
          f"PCIe floor {floor_ms:.1f} ms", flush=True)

    t = time.perf_counter()
    e = kv_engine.InEngine(a.socket, g, policy, max_sessions=2, max_blocks=n // g.block_tokens + 8)
    probe = c.create_session(g, policy, "prefill-probe")
    e.attach(probe)  # maps and registers the arena (once per engine)
    e.detach(probe)
    c.close(probe)
    print(f"engine opened, arena registered in {time.perf_counter() - t:.2f} s", flush=True)

    def host(sid):
        # As the adapter's host path: per layer [tokens, kv_heads, D] K and V, on the host.
        k = rows[:, 0, :, 0].transpose(1, 2).cpu().view(torch.int16).numpy().view("u2")
        v = rows[:, 0, :, 1].transpose(1, 2).cpu().view(torch.int16).numpy().view("u2")
        c.append_kv_shm(sid, 0, n, pack_append_payload(k, v))

    phases = []  # per dma repetition: seconds by phase, summed over its chunks

    def dma(sid):
        e.attach(sid)
        split = dict.fromkeys(("reserve", "copy", "commit", "sync"), 0.0)
        for first in range(0, n, 16384):
            e.append_rows([sid], rows, min(16384, n - first), first)
            for k, v in e.last_append().items():
                split[k] += v
        e.detach(sid)
        phases.append(split)

    results = {}
    for rep in range(a.reps):
        for name, fn in (("host", host), ("dma", dma)):
            if name not in a.paths.split(","):
                continue
            sid = c.create_session(g, policy, f"prefill-{name}")
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn(sid)
            ms = (time.perf_counter() - t) * 1e3
            assert c.session_info(sid).tokens_max == n
            c.close(sid)
            results.setdefault(name, []).append(ms)
            print(f"  rep {rep} {name}: {ms:.1f} ms", flush=True)
    for name, ms in results.items():
        med = statistics.median(ms)
        print(f"{name:>5}: median {med:8.1f} ms  {nbytes / med / 1e6:6.2f} GB/s  "
              f"{med / floor_ms:5.2f}x the PCIe floor", flush=True)
    if len(results) == 2:
        h, d = statistics.median(results["host"]), statistics.median(results["dma"])
        print(f"dma / host = {d / h:.2f}", flush=True)
    if phases:
        print("dma by phase (median ms): " + ", ".join(
            f"{k} {statistics.median(p[k] for p in phases) * 1e3:.1f}" for k in phases[0]), flush=True)


if __name__ == "__main__":
    main()
