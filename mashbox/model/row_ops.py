"""The per-row operations between a decoder layer's linears, chosen once with the linears:
RMS norm, the MLP's activation, and rope with the K/V cache write.

- CsrcRowOps (csrc's linears): each one csrc call instead of several torch ops
  (mb_bf16_rmsnorm, mb_bf16_silu_mul, mb_bf16_rope_kv), in float32 and rounded once to
  bfloat16.
- TorchRowOps (oneDNN, torch, int8 / int4 linears; float32): torch's ops, which the
  transformers parity tests compare.

Both have the same calls:
    tables(rope, positions)             what rope_kv reads, once per forward
    norm(x, weight, eps)                x [M, hidden] -> [M, hidden]
    act(gate_up)                        [M, 2 I] ([gate | up]) -> [M, I] silu(gate) * up
    rope_kv(qkv, qk, tokens, tables, positions, slots, k_cache, v_cache) -> q [T, heads, head_dim]
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from mashbox.model import csrc
from mashbox.model.model_config import ModelConfig
from mashbox.model.rope import RopeTable


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, k] bfloat16 (unit stride along k) -> [M, k]: csrc's mb_bf16_rmsnorm."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    csrc.rmsnorm(x, weight, eps, out)
    return out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [M, 2 I] bfloat16 ([gate | up], unit stride along it) -> [M, I] silu(gate) * up,
    rounded once: csrc's mb_bf16_silu_mul."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], int(x.shape[1]) // 2, dtype=torch.bfloat16)
    csrc.silu_mul(x, out)
    return out


def rope_kv(qkv: torch.Tensor, tokens: int, heads: int, kv_heads: int, cos: torch.Tensor,
            sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Rotary embedding of q and k in qkv [T', (heads + 2 kv_heads) * head_dim] (its first
    `tokens` rows), q in place, k and v written into the caches [slots, kv_heads, capacity,
    head_dim] at (slots[i], :, positions[i]): csrc's mb_bf16_rope_kv, one call for what
    takes seven torch ops (rope.apply and two index writes)."""
    csrc.rope_kv(qkv, tokens, heads, kv_heads, cos, sin, positions, slots, k_cache, v_cache)


class CsrcRowOps:
    def __init__(self, config: ModelConfig) -> None:
        self.config = config

    def tables(self, rope: RopeTable, positions: torch.Tensor) -> RopeTable:
        return rope  # mb_bf16_rope_kv reads the table rows itself

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate_up)

    def rope_kv(self, qkv: torch.Tensor, qk: Optional[torch.Tensor], tokens: int, tables: RopeTable,
                positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        """qk: the q/k-normed [Tp, heads + kv_heads, head_dim] when the model has q/k norms
        (written back into qkv first), else None."""
        c = self.config
        if qk is not None:
            qkv[:, : c.q_size + c.kv_size] = qk.reshape(qkv.shape[0], -1)
        rope_kv(qkv, tokens, c.num_heads, c.num_kv_heads, tables.cos, tables.sin, positions, slots,
                k_cache, v_cache)
        return qkv[:tokens, : c.q_size].view(tokens, c.num_heads, c.head_dim)  # [T, heads, head_dim]


class TorchRowOps:
    def __init__(self, config: ModelConfig) -> None:
        self.config = config

    def tables(self, rope: RopeTable, positions: torch.Tensor):
        """(rope, cos, sin): the rows of the forward's (padded) positions, [Tp, 1, head_dim]."""
        return rope, rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope_kv(self, qkv: torch.Tensor, qk: Optional[torch.Tensor], tokens: int, tables,
                positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        c = self.config
        H, KV, D = c.num_heads, c.num_kv_heads, c.head_dim
        rope, cos, sin = tables
        if qk is None:
            qk = qkv[:, : c.q_size + c.kv_size].view(qkv.shape[0], H + KV, D)
        qk = rope.apply(qk, cos, sin)  # [Tp, heads + kv_heads, head_dim]
        k_cache[slots, :, positions] = qk[:tokens, H:]
        v_cache[slots, :, positions] = qkv[:tokens, c.q_size + c.kv_size:].view(tokens, KV, D)
        return qk[:tokens, :H]  # [T, heads, head_dim]
