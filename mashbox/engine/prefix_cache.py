"""Which free slot a new request should take, and how much of its prompt is cached there.

Each free slot's cached tokens are summarised by chained block hashes
(`native.block_hashes`: hash i covers tokens[:(i+1)*block]), refreshed when the slot is
released. A lookup hashes the prompt, asks `native.longest_prefix` for the free slot with
the most matching blocks, then extends the match token by token past the last full
block. The match is capped at len(prompt) - 1: the last prompt token is always computed
again, since its logits give the first new token.

With no block in common, the slot whose cache is least valuable is taken (empty first,
then least recently released), so recent conversations stay cached longest.
"""
from __future__ import annotations

import numpy as np

from mashbox import native
from mashbox.engine.slots import SlotTable


class PrefixCache:
    def __init__(self, slots: SlotTable, block: int) -> None:
        if block < 1:
            raise ValueError("prefix block must be >= 1")
        self.slots = slots
        self.block = block
        self.max_blocks = slots.ctx // block + 1
        self.table = np.zeros((slots.num_slots, self.max_blocks), dtype=np.uint64)  # [slots, max_blocks]
        self.counts = np.zeros(slots.num_slots, dtype=np.int32)  # [slots] valid hashes per row
        self.lookups = 0
        self.hit_tokens = 0
        self.hits = 0  # lookups that reused at least one token

    def refresh(self, slot: int) -> None:
        """Re-hash a slot's cached tokens (call when it is released)."""
        n = int(self.slots.kv_len[slot])
        hashes = native.block_hashes(self.slots.tokens[slot, :n], self.block)
        self.counts[slot] = len(hashes)
        self.table[slot, : len(hashes)] = hashes

    def invalidate(self, slot: int) -> None:
        """The slot is being overwritten from position 0 on."""
        self.counts[slot] = 0

    def lookup(self, prompt_ids: np.ndarray) -> tuple[int, int]:
        """(slot, cached tokens) for a prompt among the free slots; counts the lookup.

        prompt_ids: int32[n]. Raises RuntimeError when no slot is free.
        """
        usable = self.slots.usable_mask()
        if not usable.any():
            raise RuntimeError("no free slot")
        self.lookups += 1
        limit = len(prompt_ids) - 1  # always recompute the last prompt token
        slot, blocks = -1, 0
        if limit >= self.block:
            query = native.block_hashes(prompt_ids, self.block)
            slot, blocks = native.longest_prefix(query, self.table, self.counts, usable)
        if slot < 0 or blocks == 0:
            # no full block in common: a partial first block is not worth a lookup table;
            # still extend token by token against the slot we would take anyway
            slot, blocks = self.slots.eviction_choice(), 0
        matched = self._extend(slot, prompt_ids, blocks * self.block)
        matched = max(min(matched, limit), 0)
        if matched:
            self.hits += 1
            self.hit_tokens += matched
        return slot, matched

    def _extend(self, slot: int, prompt_ids: np.ndarray, start: int) -> int:
        cached = self.slots.tokens[slot, : int(self.slots.kv_len[slot])]
        n = min(len(cached), len(prompt_ids))
        if start >= n:
            return min(start, n)
        diff = np.flatnonzero(cached[start:n] != prompt_ids[start:n])
        return start + (int(diff[0]) if len(diff) else n - start)
