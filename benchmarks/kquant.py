"""K-quant linear kernels (csrc/kquant.c) against the bfloat16 kernel on the same shapes.

For each weight shape [n, k] (2048x8192 and 8192x2048 by default) and format (Q4_K,
Q6_K by default): random GGUF blocks (d and dmin of real models' sizes), and the same
weight dequantized by gguf to bfloat16 and packed for csrc/linear.c. Each is timed on 1
row (GEMV, a batch-1 decode step) and on 8 rows (a batch-8 step), best of --repeat runs
of --calls calls, with the threads torch runs. Printed per case: the time per call,
tok/s-equivalent (rows per second), the weight bytes read per second, and that rate as
a share of the machine's read bandwidth measured in the same run (a sum over a large
bfloat16 tensor, as benchmarks/decode.py measures it):

    q4_k 2048x8192 m=1: kq 0.31 ms 3200 tok/s 0.59 ns/32 weights a row 30.1 GB/s (48% of read) |
        bf16 0.55 ms ... | kq/bf16 1.8x

Usage: python benchmarks/kquant.py [--shapes 2048x8192,8192x2048] [--types q4_k,q6_k,q5_k]
       [--rows 1,8] [--calls 50] [--repeat 5] [--threads N] [--single] [--quick]
       (--quick: a smoke run; --single: the fastest single call, steadier on a busy machine;
       run it in two trees in the same minute to compare kernels)
Timings on a busy machine mean little: the load average is printed beside them.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

# the repository root instead of this folder: benchmarks/http.py would shadow the stdlib
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from mashbox import native, native_ref  # noqa: E402
from mashbox.model import csrc, linear  # noqa: E402

TYPES = {"q4_k": 12, "q5_k": 13, "q6_k": 14}


def read_bandwidth(nbytes: int = 512 << 20, reps: int = 5) -> float:
    """Bytes per second of the best of `reps` sums over a large bfloat16 tensor."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def random_rows(qtype: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8[n, k / 256 * block bytes]: random integers and scales, d and dmin ~1e-3."""
    rng = np.random.default_rng(seed)
    size, blocks = native_ref.KQ_BLOCK_BYTES[qtype], k // native_ref.KQ_BLOCK
    w = rng.integers(0, 256, (n, blocks, size), dtype=np.uint8)
    half = lambda a: a.astype(np.float16).view(np.uint8).reshape(n, blocks, 2)  # noqa: E731
    d = half(rng.standard_normal((n, blocks)) * 1e-3)
    if qtype == 14:
        w[..., 208:210] = d
    else:
        w[..., 0:2] = d
        w[..., 2:4] = half(np.abs(rng.standard_normal((n, blocks))) * 1e-3)
    return w.reshape(n, blocks * size)


def best_seconds(fn, calls: int, repeat: int, single: bool = False) -> float:
    """The best mean over `repeat` runs of `calls` calls; with single, the fastest one call
    of calls * repeat (a call a neighbour's process interrupted drops out: on a shared
    machine it is the figure that moves least)."""
    fn()  # warm: pages touched, caches of code
    best = float("inf")
    for _ in range(repeat):
        if single:
            for _ in range(calls):
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
            continue
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="2048x8192,8192x2048", help="n x k (outputs x inputs), comma-separated")
    ap.add_argument("--types", default="q4_k,q6_k")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch's (and the kernels') threads; 0: as torch has it")
    ap.add_argument("--quick", action="store_true", help="a smoke run: one small shape, few calls")
    ap.add_argument("--single", action="store_true",
                    help="time calls one by one and keep the fastest (steadier on a busy machine; with "
                         "--threads 1 and a shape that fits L3, e.g. 256x8192, it measures the kernel's arithmetic)")
    args = ap.parse_args()
    if args.quick:
        args.shapes, args.calls, args.repeat = "512x2048", 3, 1
    if not linear.bf16_kernel_available():
        sys.exit("no AVX512-BF16 kernel on this CPU: nothing to compare")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    pool, threads = csrc.parallel(), torch.get_num_threads()
    kernel = native.bf16_kernel()
    read = read_bandwidth(64 << 20 if args.quick else 512 << 20)
    print(f"threads {threads}, read bandwidth {read / 1e9:.1f} GB/s, load average "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        for name in args.types.split(","):
            qtype = TYPES[name]
            w = random_rows(qtype, n, k)
            dense = torch.from_numpy(gguf.quants.dequantize(w, gguf.GGMLQuantizationType(qtype))).bfloat16()
            bf16 = linear.BF16Linear(dense)
            for m in (int(v) for v in args.rows.split(",")):
                x = torch.randn(m, k).bfloat16()
                y = torch.empty(m, n, dtype=torch.bfloat16)
                xa, ya = x.view(torch.int16).data_ptr(), y.view(torch.int16).data_ptr()

                def kq() -> None:
                    native.kq_linear_ptr(qtype, w.ctypes.data, w.shape[1], n, k, xa, k, m, 0, ya,
                                         native.Y_BF16, n, kernel, pool, threads)

                t_kq = best_seconds(kq, args.calls, args.repeat, args.single)
                t_bf = best_seconds(lambda: bf16(x), args.calls, args.repeat, args.single)
                kq_rate, bf_rate = w.nbytes / t_kq, n * k * 2 / t_bf
                print(f"{name} {n}x{k} m={m}: kq {t_kq * 1e3:.3f} ms {m / t_kq:.0f} tok/s "
                      f"{t_kq * 1e9 * 32 / (n * k * m):.2f} ns/32 weights a row "
                      f"{kq_rate / 1e9:.1f} GB/s ({100 * kq_rate / read:.0f}% of read) | bf16 "
                      f"{t_bf * 1e3:.3f} ms {m / t_bf:.0f} tok/s {bf_rate / 1e9:.1f} GB/s "
                      f"({100 * bf_rate / read:.0f}% of read) | kq/bf16 {t_bf / t_kq:.2f}x", flush=True)
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
