"""KVCache: the static key/value buffers of every slot, allocated once at start-up.

One slot holds one whole context. The decoder writes a token's K/V by index at
[layer, slot, :, position] and reads a slot's keys as the view [layer, slot, :, :length],
so nothing is allocated per token and no slot's data ever moves.

The buffers hold `capacity` positions: ctx rounded up to KEY_BLOCK, because the
batch-invariant decoder reads keys in whole blocks (masking the ones past a query);
positions at or past ctx are never written.
"""
from __future__ import annotations

import torch

from mashbox.model.model_config import ModelConfig

KEY_BLOCK = 64  # the decoder's key block (decoder._KEY_BLOCK)


class KVCache:
    def __init__(self, config: ModelConfig, slots: int, ctx: int, dtype: torch.dtype,
                 device: torch.device):
        if slots < 1 or ctx < 1:
            raise ValueError("KVCache needs slots >= 1 and ctx >= 1")
        self.slots = slots
        self.ctx = ctx
        self.capacity = _capacity(ctx)
        shape = (config.num_layers, slots, config.num_kv_heads, self.capacity, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [layers, slots, kv_heads, capacity, head_dim]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [layers, slots, kv_heads, capacity, head_dim]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @staticmethod
    def bytes_for(config: ModelConfig, slots: int, ctx: int, dtype: torch.dtype) -> int:
        """What a cache of this size would take, for sizing before allocating."""
        item = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * slots * config.num_kv_heads * _capacity(ctx) * config.head_dim * item


def _capacity(ctx: int) -> int:
    return -(-ctx // KEY_BLOCK) * KEY_BLOCK
