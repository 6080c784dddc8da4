"""What a resume from the remote tier replaces: the dense prefill of a random Qwen2.5-7B (bf16,
SDPA attention) over a prompt of N tokens on one GPU, the K/V kept in transformers' cache and
only the last position's logits computed. One warm-up at 4K, then each context `--reps` times
(median). Usage (GPU host): python3 bench/gpu/prefill_compute.py --contexts 32768,131072
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "clients", "python", "bench"))

from whole_model import build_model  # noqa: E402


def prefill(model, n):
    ids = torch.randint(0, 150000, (1, n), device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, logits_to_keep=1)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    model = build_model("cuda")
    model.config._attn_implementation = "sdpa"
    print(torch.cuda.get_device_name(), torch.__version__)
    prefill(model, 4096)
    for n in map(int, a.contexts.split(",")):
        ts = [prefill(model, n) for _ in range(a.reps)]
        print(f"prefill {n} tokens: median {statistics.median(ts):.2f} s ({', '.join(f'{t:.2f}' for t in ts)})")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
