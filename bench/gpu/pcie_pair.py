"""Host-to-device copy bandwidth of each GPU alone and of all of them at once.

The in-engine path reads tierd's host arena over each GPU's own PCIe link; with one engine per
GPU the links share the host's memory. This measures what the copy engines get from one pinned
buffer (as tierd's arena is one mapping) on each device alone and on every device together, so
that the engines' rates can be set against the links' measured floors and their sum.

Usage: python3 bench/gpu/pcie_pair.py [--gib 2] [--reps 5]
"""

import argparse
import time

import torch


def rate(devices, src, reps):
    """GB/s of `reps` copies of `src` to each of `devices`, all enqueued before any wait."""
    dsts = [torch.empty(src.numel(), dtype=src.dtype, device=f"cuda:{d}") for d in devices]
    streams = [torch.cuda.Stream(device=f"cuda:{d}") for d in devices]
    for s, dst in zip(streams, dsts):  # warm-up
        with torch.cuda.stream(s):
            dst.copy_(src, non_blocking=True)
    for d in devices:
        torch.cuda.synchronize(d)
    t = time.perf_counter()
    for _ in range(reps):
        for s, dst in zip(streams, dsts):
            with torch.cuda.stream(s):
                dst.copy_(src, non_blocking=True)
    for d in devices:
        torch.cuda.synchronize(d)
    dt = time.perf_counter() - t
    return len(devices) * reps * src.numel() / dt / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    n = torch.cuda.device_count()
    src = torch.empty(int(a.gib * 2**30), dtype=torch.uint8).pin_memory()
    src.random_(0, 255)
    print(f"{n} devices: {[torch.cuda.get_device_name(d) for d in range(n)]}")
    alone = []
    for d in range(n):
        alone.append(rate([d], src, a.reps))
        print(f"device {d} alone: {alone[-1]:.1f} GB/s")
    if n > 1:
        both = rate(list(range(n)), src, a.reps)
        print(f"all {n} together: {both:.1f} GB/s (sum of alone: {sum(alone):.1f}, "
              f"ratio {both / sum(alone):.2f})")


if __name__ == "__main__":
    main()
