"""What a cross-process hand-off on one GPU costs: the design kvtier did not
take, where the engine hands each layer's query to a daemon process that runs the attention on
the same GPU, against the one it took (the attention runs in the engine's own process).

Two processes share a device buffer (CUDA IPC memory) and two interprocess events. Each round
the engine process runs a kernel, records its event and flips a flag in shared host memory (the
fastest host signal there is: a spin, no syscall); the daemon process sees it, makes its stream
wait for the event, runs a kernel, records its event and flips the flag back; the engine's
stream waits for that before its next kernel. A decode step would do this once per layer. The
same ping-pong between two streams of one process, and the two kernels back to back on one
stream, are the baselines. Run it with and without MPS (nvidia-cuda-mps-control -d) to see
what time-slicing between the two contexts costs.

Usage: python handoff.py [--rounds 20000]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import struct
import time

import torch
import torch.multiprocessing as mp

OFF_FLAG = 0


def spin_until(buf, want: int) -> None:
    while struct.unpack_from("q", buf, OFF_FLAG)[0] != want:
        pass


def daemon_side(x, h_engine, h_daemon, shm_name, rounds):
    torch.cuda.set_device(0)
    ev_engine = torch.cuda.Event.from_ipc_handle(0, h_engine)
    ev_daemon = torch.cuda.Event.from_ipc_handle(0, h_daemon)
    fd = os.open(shm_name, os.O_RDWR)
    buf = mmap.mmap(fd, 4096)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for r in range(rounds):
            spin_until(buf, 2 * r + 1)
            s.wait_event(ev_engine)
            x.add_(1)
            ev_daemon.record(s)
            struct.pack_into("q", buf, OFF_FLAG, 2 * r + 2)
    s.synchronize()


def two_processes(rounds: int) -> float:
    x = torch.zeros(1, device="cuda")
    ev_engine = torch.cuda.Event(interprocess=True)
    ev_daemon = torch.cuda.Event(interprocess=True)
    shm_name = f"/dev/shm/kvtier-handoff-{os.getpid()}"
    with open(shm_name, "wb") as f:
        f.write(b"\0" * 4096)
    fd = os.open(shm_name, os.O_RDWR)
    buf = mmap.mmap(fd, 4096)
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=daemon_side,
                    args=(x, ev_engine.ipc_handle(), ev_daemon.ipc_handle(), shm_name, rounds))
    p.start()
    s = torch.cuda.current_stream()
    # Warm-up round trip (the child attaches the IPC handles first).
    t0 = None
    for r in range(rounds):
        if r == rounds // 10:
            torch.cuda.synchronize()
            t0, r0 = time.perf_counter(), r
        x.add_(1)
        ev_engine.record(s)
        struct.pack_into("q", buf, OFF_FLAG, 2 * r + 1)
        spin_until(buf, 2 * r + 2)
        s.wait_event(ev_daemon)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / (rounds - r0)
    p.join()
    os.unlink(shm_name)
    assert x.item() == 2 * rounds, f"ordering broke: {x.item()} != {2 * rounds}"
    return dt


def two_streams(rounds: int) -> float:
    x = torch.zeros(1, device="cuda")
    a, b = torch.cuda.current_stream(), torch.cuda.Stream()
    ea, eb = torch.cuda.Event(), torch.cuda.Event()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(rounds):
        x.add_(1)
        ea.record(a)
        b.wait_event(ea)
        with torch.cuda.stream(b):
            x.add_(1)
        eb.record(b)
        a.wait_event(eb)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / rounds


def one_stream(rounds: int) -> float:
    x = torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(rounds):
        x.add_(1)
        x.add_(1)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / rounds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    for name, f in [("one stream, two kernels", one_stream), ("two streams, one process", two_streams),
                    ("two processes (CUDA IPC)", two_processes)]:
        us = [f(a.rounds) * 1e6 for _ in range(a.repeats)]
        print(f"{a.label:>8} {name:>28}: {statistics.median(us):7.2f} us per round trip "
              f"(runs {', '.join(f'{u:.2f}' for u in us)})", flush=True)


if __name__ == "__main__":
    main()
