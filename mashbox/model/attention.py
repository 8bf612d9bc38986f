"""Attention on the CPU in csrc, bfloat16: decode rows (DecodeRows) and prompt rows
(PrefillRows), each kind in one call per layer.

- Decode rows (a token the model generated, one query per row): mb_bf16_attention, each
  query alone over its own keys in float32; for short rows several times faster than SDPA
  (README, speed).
- Prompt rows (prefill chunks, a prompt's last token recomputed alone):
  mb_bf16_prefill_attention, causal, tiled over 16 queries and blocks of 64 keys (up to 4
  neighbouring tiles walk the keys together, so each K/V block is read once for them), the
  dot products in bfloat16 pairs (vdpbf16ps), the softmax in base 2 with an exp accurate
  to the bfloat16 its probabilities are rounded to (benchmarks/prefill.py measures it).
  Models it cannot take (prefill_supported) keep SDPA for them.
Both have a fixed arithmetic (csrc/attention.c), so a query's bits depend on its own
vector, keys and position only: never on the rows beside it or how its prompt was
chunked. The two rules differ: a generated token's K/V can differ in its last bits from
the same token's computed as part of a later prompt (decoder.py's docstring).

Index tensors: one RowIndex per decoder, made once and refilled per step (no tensor is
allocated per step); the rows of a step are views of it.

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
PREFILL_MAX_GROUP = 16  # the prefill kernel's (csrc/attention.c)
PREFILL_MAX_GROUP_DIM = 1024  # group * head_dim


def supported(c: ModelConfig, dtype: torch.dtype, device: torch.device) -> bool:
    """The model's decode rows can attend in csrc (with a kernel the caller picks:
    model/kernels.py): bfloat16 on the CPU with the extension built, head_dim a multiple
    of 16 up to 256, up to 32 query heads per K/V head."""
    return (native.NATIVE and device.type == "cpu" and dtype == torch.bfloat16
            and c.head_dim % 16 == 0 and c.head_dim <= MAX_HEAD_DIM
            and c.num_heads % c.num_kv_heads == 0 and c.num_heads // c.num_kv_heads <= MAX_GROUP)


def prefill_supported(c: ModelConfig) -> bool:
    """Beyond supported(): the prefill kernel takes up to 16 query heads per K/V head and
    group * head_dim up to 1024."""
    group = c.num_heads // c.num_kv_heads
    return group <= PREFILL_MAX_GROUP and group * c.head_dim <= PREFILL_MAX_GROUP_DIM


class RowIndex:
    """The int64 index rows of one step's csrc attention, made once per decoder: [4, rows]
    grown only when a step has more rows than any before (at most the step's tokens), so
    a step fills it in place instead of making tensors."""

    def __init__(self) -> None:
        self._buf = torch.zeros(2, 4, 0, dtype=torch.int64)  # [decode | prefill, 4 fields, rows]

    def fill(self, which: int, fields: list[list[int]]) -> list[torch.Tensor]:
        """Views [n] of row `which`'s fields (0: decode, 1: prefill), filled from `fields`
        (up to 4 lists of n ints)."""
        n = len(fields[0])
        if self._buf.shape[2] < n:
            grown = torch.zeros(2, 4, max(n, 2 * self._buf.shape[2]), dtype=torch.int64)
            grown[:, :, :self._buf.shape[2]] = self._buf
            self._buf = grown
        view = self._buf[which]
        view.numpy()[:len(fields), :n] = fields
        return [view[i, :n] for i in range(len(fields))]


class DecodeRows:
    """One forward's decode rows (made once, used by every layer): rows[i] is the row's
    token in the step, slots[i] its slot, ends[i] its position + 1 (keys [0, end))."""

    __slots__ = ("count", "rows", "slots", "ends", "scale", "window", "kernel")

    def __init__(self, rows: list[tuple[int, int, int]], c: ModelConfig, kernel: int, index: RowIndex) -> None:
        """rows: (token index, slot, end) of each decode row; kernel: a native.KERNEL_*;
        index: the decoder's RowIndex (rows, slots and ends are views of it, [n] each)."""
        self.kernel = kernel
        self.count = len(rows)
        self.rows, self.slots, self.ends = index.fill(0, [list(f) for f in zip(*rows)])
        self.scale = 1.0 / math.sqrt(c.head_dim)
        self.window = c.sliding_window or 0

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               out: torch.Tensor) -> None:
        """out[rows[i]] = attention of q[rows[i]] over its slot's keys, for every row."""
        csrc.attention(_heads_packed(q), self.rows, self.slots, self.ends, q.shape[1], int(k_cache.shape[1]), self.window, self.scale,
                       k_cache, v_cache, out, self.kernel)


def _heads_packed(q: torch.Tensor) -> torch.Tensor:
    """q [T, heads, head_dim] as [T, heads * head_dim] rows: the same addresses where each
    row's heads and dims are packed, else a packed copy."""
    T, H, D = q.shape
    if q.stride(2) != 1 or q.stride(1) != D:
        q = q.contiguous()
    return q.as_strided((T, H * D), (q.stride(0), 1))


class PrefillRows:
    """One forward's prompt rows (made once, used by every layer): row r's tokens
    firsts[r] .. firsts[r] + lens[r] of the step sit at positions starts[r] + i of slot
    slots[r]; each attends causally over its slot's keys."""

    __slots__ = ("count", "firsts", "slots", "starts", "lens", "scale", "window", "kernel")

    def __init__(self, rows: list[tuple[int, int, int, int]], c: ModelConfig, kernel: int,
                 index: RowIndex) -> None:
        """rows: (first token, slot, start, len) of each prompt row; kernel: a native.KERNEL_*."""
        self.kernel = kernel
        self.count = len(rows)
        self.firsts, self.slots, self.starts, self.lens = index.fill(1, [list(f) for f in zip(*rows)])
        self.scale = 1.0 / math.sqrt(c.head_dim)
        self.window = c.sliding_window or 0

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               out: torch.Tensor) -> None:
        """out[firsts[r] + i] = causal attention of that query over its slot's keys."""
        csrc.prefill_attention(_heads_packed(q), self.firsts, self.slots, self.starts,
                               self.lens, q.shape[1], int(k_cache.shape[1]), self.window, self.scale, k_cache, v_cache,
                               out, self.kernel)
