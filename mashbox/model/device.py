"""device_and_dtype: the one place that chooses the torch device and the compute dtype.

cuda when torch.cuda.is_available() (or asked for), else cpu. dtype "auto" is measured,
not guessed: a decode-shaped matmul ([8, hidden] x [hidden, n], n >= 4*hidden and the
weight larger than the caches) is timed in float32 and bfloat16 on the chosen device, on
the kernels the decoder would run, and the faster wins.
"""
from __future__ import annotations

import logging
import time

import torch

from mashbox.model.errors import ModelError

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ModelError("device cuda was asked for but torch.cuda.is_available() is False")
        return torch.device("cuda")
    if device == "cpu":
        return torch.device("cpu")
    raise ModelError(f"device must be auto, cpu or cuda, not {device!r}")


PROBE_BYTES = 128 << 20  # float32 weights the probe streams through: more than any cache


def _matmul_seconds(device: torch.device, dtype: torch.dtype, hidden: int, reps: int) -> float:
    """Best time of [8, hidden] x [hidden, rows] where the weight is at least the
    [hidden, 4*hidden] of a decoder's MLP and at least PROBE_BYTES in float32: decode is
    bound by reading weights from memory, and a matrix that fits in the CPU's caches
    would time arithmetic instead. One large matmul rather than many small ones: on an
    oversubscribed CPU each parallel region can wait a whole scheduler slice."""
    gen = torch.Generator().manual_seed(0)
    rows = max(4 * hidden, PROBE_BYTES // (4 * hidden))
    x = torch.randn(8, hidden, generator=gen).to(device=device, dtype=dtype)
    w = torch.empty(rows, hidden, dtype=dtype, device=device).uniform_(-1.0, 1.0)
    matmul = _linear_as_the_decoder_runs_it(w)
    best = float("inf")
    with torch.inference_mode():
        matmul(x)  # warm-up: kernel selection, first touch
        for _ in range(reps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            matmul(x)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
    return best


def _linear_as_the_decoder_runs_it(w: torch.Tensor):
    """x -> x @ w.T on the kernel the decoder would use for w's dtype and device: mashbox's
    bfloat16 kernel where the CPU has AVX512-BF16, oneDNN's packed weights on other CPUs,
    torch's linear on CUDA (decoder._pack_weights makes the same choices)."""
    if w.device.type == "cpu":
        from mashbox.model.linear import BF16Linear, bf16_kernel_available

        if w.dtype == torch.bfloat16 and bf16_kernel_available():
            return BF16Linear(w)
        if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 2)
            return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], "")
    return lambda x: torch.nn.functional.linear(x, w)


def device_and_dtype(device: str, dtype: str, hidden_size: int = 2048) -> tuple[torch.device, torch.dtype]:
    """("auto"|"cpu"|"cuda", "auto"|"float32"|"bfloat16") -> (torch.device, torch.dtype).

    hidden_size sizes the auto-dtype probe; pass the model's when it is known.
    """
    dev = pick_device(device)
    if dtype in DTYPES:
        return dev, DTYPES[dtype]
    if dtype != "auto":
        raise ModelError(f"dtype must be auto, float32 or bfloat16, not {dtype!r}")
    times = {name: _matmul_seconds(dev, dt, hidden_size, reps=5) for name, dt in DTYPES.items()}
    chosen = min(times, key=times.get)
    rows = max(4 * hidden_size, PROBE_BYTES // (4 * hidden_size))
    log.info("dtype auto on %s: [8, %d] x [%d, %d] matmul float32 %.3f ms, bfloat16 %.3f ms -> %s",
             dev, hidden_size, hidden_size, rows, times["float32"] * 1e3,
             times["bfloat16"] * 1e3, chosen)
    return dev, DTYPES[chosen]
