"""Which free slot a new request should take, and how much of its prompt is cached there.

Each free slot's cached tokens are summarised by chained block hashes
(`native.block_hashes`: hash i covers tokens[:(i+1)*block]), refreshed when the slot is
released. A lookup hashes the prompt, asks `native.longest_prefix` for the free slot with
the most matching blocks, then extends the match token by token past the last full
block. The match is capped at len(prompt) - 1: the last prompt token is always computed
again, since its logits give the first new token.

With no block in common, the slot whose cache is least valuable is taken (empty first,
then least recently released), so recent conversations stay cached longest.

A slot still owned by a running request may hold a longer prefix (parallel requests with
the same long system prompt, as agents send them). Owned slots are compared token by
token (their hashes are only refreshed at release), and when one holds at least
`min_copy` more tokens than the best free slot, the lookup asks for a copy: the K/V of
those tokens are copied from that slot into the free slot taken (`Lookup.copy_from`),
which costs a memory copy instead of a prefill.
"""
from __future__ import annotations

import numpy as np

from typing import NamedTuple, Optional

from mashbox import native
from mashbox.engine.slots import SlotTable


class Lookup(NamedTuple):
    slot: int  # the free slot the request takes
    cached: int  # prompt tokens whose K/V it need not compute
    copy_from: Optional[int]  # copy K/V [0, cached) from this slot first; None: in place


class PrefixCache:
    def __init__(self, slots: SlotTable, block: int, min_copy: Optional[int] = None) -> None:
        if block < 1:
            raise ValueError("prefix block must be >= 1")
        self.slots = slots
        self.block = block
        self.min_copy = block if min_copy is None else min_copy
        self.copies = 0  # lookups served by a copy from an owned slot
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

    def lookup(self, prompt_ids: np.ndarray) -> Lookup:
        """Which free slot a prompt takes and how many of its tokens are cached; counts
        the lookup.

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
        source = None
        owned, owned_matched = self._best_owned(prompt_ids, limit)
        if owned >= 0 and owned_matched >= matched + self.min_copy:
            # overwrite the least valuable free slot, not the one that matched a little
            slot, matched, source = self.slots.eviction_choice(), owned_matched, owned
            self.copies += 1
        if matched:
            self.hits += 1
            self.hit_tokens += matched
        return Lookup(slot, matched, source)

    def _best_owned(self, prompt_ids: np.ndarray, limit: int) -> tuple[int, int]:
        """(slot, matched tokens) of the owned slot sharing the longest computed prefix."""
        best, best_n = -1, 0
        for s in range(self.slots.num_slots):
            if self.slots.owner[s] is None:
                continue
            n = max(min(self._extend(s, prompt_ids, 0), limit), 0)
            if n > best_n:
                best, best_n = s, n
        return best, best_n

    def _extend(self, slot: int, prompt_ids: np.ndarray, start: int) -> int:
        cached = self.slots.tokens[slot, : int(self.slots.kv_len[slot])]
        n = min(len(cached), len(prompt_ids))
        if start >= n:
            return min(start, n)
        diff = np.flatnonzero(cached[start:n] != prompt_ids[start:n])
        return start + (int(diff[0]) if len(diff) else n - start)
