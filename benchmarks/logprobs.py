"""What logprobs cost per sampled row: native.logprobs (csrc/sample.c mb_logprobs) against
native.sample on the same logits, at the vocab sizes of the default model (49152) and of
Qwen3 (151936), for top_n 0, 5 and 20. Rows that ask for no logprobs never call it.

Usage: python benchmarks/logprobs.py [--repeat 200]

Prints one line per vocab size, and the load average: figures from a busy machine mean
little (the README's figures come from a quiet one)."""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from mashbox import native


def per_call_us(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - t0) / repeat)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    assert native.NATIVE, native.MISSING
    rng = np.random.default_rng(0)
    for vocab in (49152, 151936):
        logits = (rng.standard_normal((1, vocab)) * 3).astype(np.float32)
        params = np.array([[0.0, 1.0, 0, 0.0, 1.0, 0.0, 0.0]], np.float32)
        hist = np.zeros(0, np.int32), np.zeros(2, np.int32), np.zeros(1, np.int32)
        state = np.zeros(1, np.uint64)
        greedy = per_call_us(lambda: native.sample(logits, params, state, *hist), args.repeat)
        params_t = params.copy()
        params_t[0, :2] = (0.8, 0.9)
        top_p = per_call_us(lambda: native.sample(logits, params_t, state, *hist), args.repeat)
        ids = np.zeros(1, np.int32)
        lp = {n: per_call_us(lambda n=n: native.logprobs(logits, ids, n), args.repeat) for n in (0, 5, 20)}
        print(f"vocab {vocab}: sample greedy {greedy:.0f} us, temperature+top_p {top_p:.0f} us | logprobs "
              + ", ".join(f"top {n} {v:.0f} us" for n, v in lp.items()) + " (per row)")
    print("load average", os.getloadavg())


if __name__ == "__main__":
    main()
