"""Engines of one process share tierd's arena registration: the time each of several
InEngines, opened one after another over one tierd (a 62 GiB shared arena), spends mapping
and registering it. Run on a GPU host with the prebuilt tierd and extension in .device/:
    python3 bench/gpu/register_once.py [--engines 3] [--capacity 62GiB]
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "clients", "python"))
import numpy as np  # noqa: E402

from kvtier import Client, Dtype, Geometry, Policy  # noqa: E402
from kvtier.engine import InEngine  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--capacity", default="62GiB")
    ap.add_argument("--tierd", default=".device/tierd")
    a = ap.parse_args()
    d = tempfile.mkdtemp()
    sock = os.path.join(d, "s.sock")
    tierd = subprocess.Popen([a.tierd, "--socket", sock, "--backend", "cpu", "--host-capacity", a.capacity,
                              "--set", "host.shared=true", "--set", "host.lock_memory=true",
                              "--set", "nvme.enabled=false", "--log-level", "warn"])
    try:
        for _ in range(1200):
            if os.path.exists(sock):
                break
            time.sleep(0.1)
        g = Geometry(28, 28, 4, 128, Dtype.BF16, 128)
        c = Client(sock)
        s = c.create_session(g, Policy(), "register-once")
        rows = 1024
        payload = (np.random.default_rng(1).standard_normal(g.layers * 2 * rows * g.kv_heads * g.head_dim)
                   .astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
        c.append_kv_shm(s, 0, rows, payload)
        for i in range(a.engines):
            e = InEngine(sock, g, Policy())
            t = time.time()
            e.attach(s)
            n, reg = e.registration()
            print(f"engine {i}: attach {time.time() - t:.2f} s, mapping and registering the "
                  f"{n / 2**30:.1f} GiB arena {reg:.3f} s", flush=True)
            del e
    finally:
        tierd.terminate()
        tierd.wait()


if __name__ == "__main__":
    main()
