"""One client that batches its sessions: one DECODE per layer carrying every session.

The socket path's other shape of load beside tierbench's one connection per session: an engine
that decodes ``--sessions`` sequences together sends, per layer, one DECODE whose entries are
all of them. With decoder lanes (``backend.cuda.lanes``) the sessions may sit on several lanes,
and such a batch then runs one device call per lane; this measures what that costs against one
lane. Qwen2.5-7B's attention geometry (28 layers, 28/4 heads, D = 128, bf16, 128-token blocks),
policy sink 1, local 4, top-k 32; the context is one random 1024-token chunk appended until
``--context``; tiles are hot after the first step. Prints tokens/s (sessions x steps / s) and
the per-DECODE p50.

Usage (tierd running, room for the sessions):
    python batched_decode.py --socket /tmp/t/tierd.sock --sessions 8 --context 32768 --steps 60
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvtier import Client, Dtype, Geometry, Policy  # noqa: E402
from kvtier.protocol import DecodeEntry, pack_append_payload  # noqa: E402

GEO = Geometry(28, 28, 4, 128, Dtype.BF16, 128)
CHUNK = 1024


def bf16(rng: np.random.Generator, shape) -> np.ndarray:
    """Random normal values as bf16 bit patterns (uint16)."""
    return (rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    a = ap.parse_args()
    if a.context % CHUNK:
        sys.exit(f"--context must be a multiple of {CHUNK}")
    rng = np.random.default_rng(7)
    shape = (GEO.layers, CHUNK, GEO.kv_heads, GEO.head_dim)
    payload = pack_append_payload(bf16(rng, shape), bf16(rng, shape))
    c = Client(a.socket)
    sessions = [c.create_session(GEO, Policy(1, 4, 32), f"batched{i}") for i in range(a.sessions)]
    t0 = time.perf_counter()
    for s in sessions:
        for start in range(0, a.context, CHUNK):
            c.append_kv_shm(s, start, CHUNK, payload)
    fill = time.perf_counter() - t0
    hqd = (GEO.q_heads, GEO.head_dim)
    kvd = (GEO.kv_heads, GEO.head_dim)
    q = [rng.standard_normal(hqd, dtype=np.float32) for _ in sessions]
    k = [bf16(rng, kvd) for _ in sessions]
    lat = []
    pos = a.context
    t_start = None
    for step in range(a.warmup + a.steps):
        if step == a.warmup:
            t_start = time.perf_counter()
            lat.clear()
        for layer in range(GEO.layers):
            entries = [DecodeEntry(s, pos, q[i], k[i], k[i]) for i, s in enumerate(sessions)]
            t = time.perf_counter()
            c.decode_batch(layer, entries)
            lat.append(time.perf_counter() - t)
        pos += 1
    wall = time.perf_counter() - t_start
    print(
        f"sessions {a.sessions} context {a.context}: fill {fill:.1f} s; "
        f"{a.sessions * a.steps / wall:.1f} tokens/s; DECODE p50 {statistics.median(lat) * 1e6:.0f} us"
    )
    for s in sessions:
        c.close(s)


if __name__ == "__main__":
    main()
