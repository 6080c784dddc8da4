#!/usr/bin/env python3
"""What sharing tierd's host arena with an engine process costs (a design question).

The daemon owns the arena: an anonymous memfd, its pages already written. An engine process
maps the same memfd (received over SCM_RIGHTS in the real design; inherited here) and registers
it with its own CUDA context so its kernels can read KV in place. This measures, on the GPU
host, for each size:
  - owner: creating the memfd and writing every page (what the daemon has done long before);
  - engine: mmap of the shared memfd, then cudaHostRegister (mapped) of the whole range, in a
    second process, cold (first registration) — the engine's start-up cost;
  - engine: cudaMemcpy host->device from the registered shared mapping (pinned path), GB/s,
    beside the same copy from a private pinned buffer (the floor).

Usage: python3 bench/gpu/shared_arena.py [--sizes-gb 1,4,16] [--json OUT]
"""

import argparse
import ctypes
import json
import mmap
import os
import subprocess
import sys
import time


def engine(fd: int, size: int) -> dict:
    import torch

    torch.cuda.init()
    torch.zeros(1, device="cuda")  # context up before timing
    rt = torch.cuda.cudart()
    t0 = time.perf_counter()
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    t_map = time.perf_counter() - t0
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    t0 = time.perf_counter()
    # cudaHostRegisterMapped = 2 (the daemon registers the same way).
    err = rt.cudaHostRegister(addr, size, 2)
    t_reg = time.perf_counter() - t0
    if int(err) != 0:
        return {"error": f"cudaHostRegister returned {err}"}
    # Copy bandwidth from the registered shared mapping vs a private pinned buffer.
    n = min(size, 1 << 30)
    shared = torch.frombuffer(mm, dtype=torch.uint8, count=n)
    private = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")

    def gbps(src):
        dev.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            dev.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        times.sort()
        return n / times[len(times) // 2] / 1e9

    out = {
        "mmap_s": t_map,
        "register_s": t_reg,
        "register_gb_per_s": size / t_reg / 1e9,
        "h2d_shared_gb_per_s": gbps(shared),
        "h2d_private_pinned_gb_per_s": gbps(private),
    }
    t0 = time.perf_counter()
    rt.cudaHostUnregister(addr)
    out["unregister_s"] = time.perf_counter() - t0
    del shared
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-gb", default="1,4,16")
    ap.add_argument("--json")
    ap.add_argument("--engine", nargs=2, type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.engine:
        print(json.dumps(engine(*a.engine)))
        return 0
    rows = []
    for gb in [float(x) for x in a.sizes_gb.split(",")]:
        size = int(gb * (1 << 30))
        t0 = time.perf_counter()
        fd = os.memfd_create("kvtier-arena")
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size, flags=mmap.MAP_SHARED) as mm:
            page = b"\x01" * (1 << 20)
            for off in range(0, size, len(page)):
                mm[off : off + len(page)] = page
        t_fill = time.perf_counter() - t0
        p = subprocess.run(
            [sys.executable, __file__, "--engine", str(fd), str(size)],
            pass_fds=(fd,),
            capture_output=True,
            text=True,
        )
        os.close(fd)
        try:
            r = json.loads(p.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            r = {"error": p.stderr[-2000:]}
        r.update({"size_gb": gb, "owner_fill_s": t_fill})
        rows.append(r)
        print(json.dumps(r), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
