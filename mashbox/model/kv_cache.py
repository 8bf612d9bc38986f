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


def _runs(blocks: tuple[int, ...]):
    """(first pool block, count, offset in blocks) of each run of consecutive blocks."""
    i = 0
    while i < len(blocks):
        j = i + 1
        while j < len(blocks) and blocks[j] == blocks[j - 1] + 1:
            j += 1
        yield blocks[i], j - i, i
        i = j


class HostPool:
    """The host-memory prompt cache's K/V (--cache-ram): `num_blocks` blocks of `block`
    positions of every layer, allocated once (pinned on CUDA, so copies are DMA; on the
    CPU the pages are only touched as blocks fill). engine/host_cache.py decides which
    block holds what; this class only copies.

    A save or restore of a run of consecutive pool blocks is one strided copy for all
    layers (blocks saved in one go are consecutive, so a conversation is usually one
    run); the copies move bits, so a restored prefix is bit-identical to the slot it came
    from.
    """

    def __init__(self, cache: KVCache, block: int, num_blocks: int) -> None:
        L, _, H, _, D = cache.k.shape
        self.block = block
        self.num_blocks = num_blocks
        self.device = cache.k.device
        pin = cache.k.device.type == "cuda"
        shape = (L, num_blocks, H, block, D)
        self.k = torch.empty(shape, dtype=cache.k.dtype, pin_memory=pin)  # [layers, num_blocks, kv_heads, block, head_dim]
        self.v = torch.empty(shape, dtype=cache.k.dtype, pin_memory=pin)  # [layers, num_blocks, kv_heads, block, head_dim]
        self._async = pin

    @staticmethod
    def block_bytes(cache: KVCache, block: int) -> int:
        L, _, H, _, D = cache.k.shape
        return 2 * L * H * block * D * cache.k.element_size()

    @classmethod
    def for_cache(cls, cache: KVCache, block: int, cap_bytes: int) -> "HostPool":
        """The pool that fits `cap_bytes` (0 blocks: no host cache)."""
        return cls(cache, block, cap_bytes // cls.block_bytes(cache, block))

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def _slot_view(self, t: torch.Tensor, slot: int, start: int, count: int) -> torch.Tensor:
        """[layers, count, kv_heads, block, head_dim] view of slot positions
        [start, start + count * block)."""
        B = self.block
        return t[:, slot, :, start : start + count * B].unflatten(2, (count, B)).permute(0, 2, 1, 3, 4)

    def save(self, cache: KVCache, slot: int, start: int, blocks: tuple[int, ...]) -> None:
        """Slot positions [start, start + len(blocks) * block) -> these pool blocks.
        Blocking: a device -> host copy into a strided view goes through a temporary
        that must be complete before the pool is read."""
        for first, count, off in _runs(blocks):
            p = start + off * self.block
            self.k[:, first : first + count].copy_(self._slot_view(cache.k, slot, p, count))
            self.v[:, first : first + count].copy_(self._slot_view(cache.v, slot, p, count))

    def restore(self, cache: KVCache, slot: int, blocks: tuple[int, ...], n: int) -> None:
        """These pool blocks -> slot positions [0, len(blocks) * block); the first n are
        the restored prefix, the rest of the last block is never read unmasked. On CUDA
        the host -> device copy is queued on the compute stream, before the forward that
        reads it."""
        for first, count, off in _runs(blocks):
            p = off * self.block
            self._slot_view(cache.k, slot, p, count).copy_(self.k[:, first : first + count], non_blocking=self._async)
            self._slot_view(cache.v, slot, p, count).copy_(self.v[:, first : first + count], non_blocking=self._async)
