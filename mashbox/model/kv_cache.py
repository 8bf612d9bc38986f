"""KVCache: the static key/value buffers of every slot, allocated once at start-up.

One slot holds one whole context. The decoder writes a token's K/V by index at
[layer, slot, :, position] and reads a slot's keys as the view [layer, slot, :, :length],
so nothing is allocated per token and no slot's data ever moves.

The buffers hold `capacity` = key_width(ctx) positions, because the batch-invariant
decoder reads a row's keys [0, key_width(end)) (masking the ones past each query);
positions at or past ctx are never written.
"""
from __future__ import annotations

import torch

from mashbox.model.model_config import ModelConfig

KEY_BLOCK = 512  # SDPA's key split on CPU
SHORT_KEYS = 128  # one narrower width that gives a query the same bits as a whole block


def key_width(end: int) -> int:
    """Keys the decoder reads for a row ending at `end`: 128 up to 128, else whole blocks
    of 512. Measured on this project's CPU (see decoder.py): a query's SDPA result is
    the same at widths 128, 512, 1024, ... while its keys fit the narrowest, and differs
    at other widths (256, 320, 384, ...)."""
    return SHORT_KEYS if end <= SHORT_KEYS else -(-end // KEY_BLOCK) * KEY_BLOCK


class KVCache:
    def __init__(self, config: ModelConfig, slots: int, ctx: int, dtype: torch.dtype,
                 device: torch.device):
        if slots < 1 or ctx < 1:
            raise ValueError("KVCache needs slots >= 1 and ctx >= 1")
        self.slots = slots
        self.ctx = ctx
        self.capacity = key_width(ctx)
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
        return 2 * config.num_layers * slots * config.num_kv_heads * key_width(ctx) * config.head_dim * item
