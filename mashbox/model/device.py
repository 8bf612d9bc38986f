"""device_and_dtype: the one place that chooses the torch device and the compute dtype.

cuda when torch.cuda.is_available() (or asked for), else cpu. dtype "auto" is decided
from what the hardware and mashbox's kernels are, never timed, so a machine and a model
always get the same numerics, busy or quiet, across worker restarts:

- cuda: bfloat16 when the GPU has bfloat16 units (compute capability 8.0 and up),
  else float32.
- cpu: bfloat16 when mashbox's own bfloat16 linear kernel runs on this CPU
  (AVX512-BF16, csrc/linear.c) and takes the model's shapes (an even hidden size), or
  when the CPU has a bfloat16 unit torch's kernels use (x86 AMX-BF16 / AVX512-BF16,
  Arm BF16); else float32, which is faster wherever bfloat16 is emulated.

(An earlier version timed a matmul in both dtypes at each start: on a loaded machine the
timing flipped between starts, 1 start in 4 at load 2.8 on the 2-core CPU chose float32
where the others chose bfloat16.)
"""
from __future__ import annotations

import logging

import torch

from mashbox.model.errors import ModelError

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# /proc/cpuinfo flags (x86) and Features (Arm) that mean a bfloat16 unit
CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


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


def cpu_flags() -> frozenset:
    """The CPU's feature flags as Linux reports them (empty where /proc/cpuinfo is not)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def amx_bf16() -> bool:
    """The CPU has AMX tiles with bfloat16 (Intel since Sapphire Rapids), which oneDNN's
    bfloat16 gemms use (model/kernels.py's prefill choice)."""
    flags = cpu_flags()
    return "amx_bf16" in flags and "amx_tile" in flags


def own_bf16_kernel(hidden_size: int) -> bool:
    """mashbox's AVX512-BF16 linear kernel runs here and packs a [4*hidden, hidden] weight."""
    from mashbox import native
    from mashbox.model.linear import bf16_kernel_available

    return bf16_kernel_available() and native.bf16_packed_bytes(4 * hidden_size, hidden_size) > 0


def auto_dtype(device: torch.device, hidden_size: int) -> tuple[torch.dtype, str]:
    """The dtype "auto" means for this device and model, and why (for the log)."""
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap >= (8, 0):
            return torch.bfloat16, f"the GPU has bfloat16 units (compute capability {cap[0]}.{cap[1]})"
        return torch.float32, f"the GPU has no bfloat16 units (compute capability {cap[0]}.{cap[1]} < 8.0)"
    if own_bf16_kernel(hidden_size):
        return torch.bfloat16, "mashbox's AVX512-BF16 kernel runs on this CPU"
    unit = sorted(CPU_BF16_FLAGS & cpu_flags())
    if unit:
        return torch.bfloat16, f"the CPU has a bfloat16 unit ({', '.join(unit)})"
    return torch.float32, "the CPU has no bfloat16 unit (bfloat16 would be emulated)"


def device_and_dtype(device: str, dtype: str, hidden_size: int = 2048) -> tuple[torch.device, torch.dtype]:
    """("auto"|"cpu"|"cuda", "auto"|"float32"|"bfloat16") -> (torch.device, torch.dtype).

    hidden_size: the model's (whether the own kernel takes its shapes).
    """
    dev = pick_device(device)
    if dtype in DTYPES:
        return dev, DTYPES[dtype]
    if dtype != "auto":
        raise ModelError(f"dtype must be auto, float32 or bfloat16, not {dtype!r}")
    chosen, why = auto_dtype(dev, hidden_size)
    log.info("dtype auto on %s -> %s: %s", dev, str(chosen).removeprefix("torch."), why)
    return dev, chosen
