"""Decode attention on the CPU: csrc's mb_bf16_attention for the rows that feed a token the
model generated (one query per row) in bfloat16.

Each query attends alone over its own keys, with a fixed arithmetic (csrc/attention.c),
so a row's bits never depend on the rows beside it, and one call serves every decode row
of a layer; for short rows it is several times faster than SDPA (README, speed). Prompt
rows keep SDPA (attention_plan.py): over long prompts its blocked gemms are the faster.

Tensor shapes: q [T, heads, head_dim] (rows any stride, heads and dims packed); caches
[slots, kv_heads, capacity, head_dim]; out [T', heads * head_dim] contiguous.
"""
from __future__ import annotations

import math

import torch

from mashbox import native
from mashbox.model import csrc
from mashbox.model.model_config import ModelConfig

MAX_GROUP = 32  # query heads per K/V head (csrc/attention.c)
MAX_HEAD_DIM = 256


def supported(c: ModelConfig, dtype: torch.dtype, device: torch.device) -> bool:
    """The model's decode rows can attend in csrc (with a kernel the caller picks:
    model/kernels.py): bfloat16 on the CPU with the extension built, head_dim a multiple
    of 16 up to 256, up to 32 query heads per K/V head."""
    return (native.NATIVE and device.type == "cpu" and dtype == torch.bfloat16
            and c.head_dim % 16 == 0 and c.head_dim <= MAX_HEAD_DIM
            and c.num_heads % c.num_kv_heads == 0 and c.num_heads // c.num_kv_heads <= MAX_GROUP)


class DecodeRows:
    """One forward's decode rows (made once, used by every layer): rows[i] is the row's
    token in the step, slots[i] its slot, ends[i] its position + 1 (keys [0, end))."""

    __slots__ = ("count", "rows", "slots", "ends", "scale", "window", "kernel")

    def __init__(self, rows: list[tuple[int, int, int]], c: ModelConfig, kernel: int) -> None:
        """rows: (token index, slot, end) of each decode row; kernel: a native.KERNEL_*."""
        self.kernel = kernel
        self.count = len(rows)
        self.rows = torch.tensor([r[0] for r in rows], dtype=torch.int64)  # [n]
        self.slots = torch.tensor([r[1] for r in rows], dtype=torch.int64)  # [n]
        self.ends = torch.tensor([r[2] for r in rows], dtype=torch.int64)  # [n]
        self.scale = 1.0 / math.sqrt(c.head_dim)
        self.window = c.sliding_window or 0

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               out: torch.Tensor) -> None:
        """out[rows[i]] = attention of q[rows[i]] over its slot's keys, for every row."""
        T, H, D = q.shape
        if q.stride(2) != 1 or q.stride(1) != D:
            q = q.contiguous()
        # heads and dims packed: q's rows as [T, heads * head_dim], the same addresses
        csrc.attention(q.as_strided((T, H * D), (q.stride(0), 1)), self.rows, self.slots, self.ends, H, int(k_cache.shape[1]), self.window, self.scale,
                       k_cache, v_cache, out, self.kernel)
