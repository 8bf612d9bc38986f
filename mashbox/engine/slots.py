"""The KV slots' bookkeeping (pure Python + numpy, no torch).

One slot holds one whole context. Invariants:
- `tokens[s, :kv_len[s]]` are exactly the tokens whose K/V sit in slot s of the KV cache,
  whether the slot is owned or free. A free slot keeps them so the next request of the
  same conversation can reuse them (prefix cache).
- While a request owns slot s, `tokens[s, :len(request.token_ids)]` is its prompt and
  generated ids (the sampler reads penalty histories from here, without copying).
- `owner[s]` is the owning request id or None.
"""
from __future__ import annotations

from typing import Optional

import numpy as np


class SlotTable:
    def __init__(self, num_slots: int, ctx: int) -> None:
        self.num_slots = num_slots
        self.ctx = ctx
        self.tokens = np.zeros((num_slots, ctx + 1), dtype=np.int32)  # [slots, ctx+1]
        self.kv_len = np.zeros(num_slots, dtype=np.int64)  # [slots]
        self.owner: list[Optional[str]] = [None] * num_slots
        # monotonic use counter: the free slot least recently released is evicted first
        self.last_used = np.zeros(num_slots, dtype=np.int64)  # [slots]
        self._clock = 0

    # -- queries ------------------------------------------------------------------------

    def is_free(self, slot: int) -> bool:
        return self.owner[slot] is None

    @property
    def free_slots(self) -> list[int]:
        return [s for s in range(self.num_slots) if self.owner[s] is None]

    @property
    def num_used(self) -> int:
        return sum(o is not None for o in self.owner)

    def usable_mask(self) -> np.ndarray:
        """uint8[slots]: 1 for free slots (the ones a new request may take)."""
        return np.fromiter((o is None for o in self.owner), dtype=np.uint8, count=self.num_slots)

    def eviction_choice(self) -> int:
        """The free slot whose cache is least valuable: empty first, then least recently used."""
        free = self.free_slots
        if not free:
            raise RuntimeError("no free slot")
        return min(free, key=lambda s: (self.kv_len[s] > 0, self.last_used[s]))

    # -- changes ------------------------------------------------------------------------

    def acquire(self, slot: int, request_id: str, token_ids: list[int], keep: int) -> None:
        """Give `slot` to a request whose first `keep` tokens are already cached there."""
        if self.owner[slot] is not None:
            raise RuntimeError(f"slot {slot} is owned by {self.owner[slot]}")
        if keep > self.kv_len[slot]:
            raise ValueError(f"keep {keep} > cached {self.kv_len[slot]} in slot {slot}")
        n = len(token_ids)
        if n > self.ctx:
            raise ValueError(f"{n} tokens do not fit a slot of {self.ctx}")
        self.owner[slot] = request_id
        self.kv_len[slot] = keep
        self.tokens[slot, keep:n] = token_ids[keep:n]

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Free slot `dst` now holds the first `n` computed tokens of slot `src` (the
        runner copies their K/V before the step's forward)."""
        if self.owner[dst] is not None:
            raise RuntimeError(f"slot {dst} is owned by {self.owner[dst]}")
        if n > self.kv_len[src]:
            raise ValueError(f"copy of {n} tokens > {self.kv_len[src]} computed in slot {src}")
        self.tokens[dst, :n] = self.tokens[src, :n]
        self.kv_len[dst] = n

    def restore(self, dst: int, token_ids: np.ndarray) -> None:
        """Free slot `dst` now holds these tokens (the runner copies their K/V from the
        host pool before the step's forward)."""
        if self.owner[dst] is not None:
            raise RuntimeError(f"slot {dst} is owned by {self.owner[dst]}")
        n = len(token_ids)
        self.tokens[dst, :n] = token_ids
        self.kv_len[dst] = n

    def append(self, slot: int, position: int, token_id: int) -> None:
        """Record a sampled token at `position` (its K/V comes next step)."""
        self.tokens[slot, position] = token_id

    def computed(self, slot: int, kv_len: int) -> None:
        self.kv_len[slot] = kv_len

    def release(self, slot: int) -> None:
        self.owner[slot] = None
        self._clock += 1
        self.last_used[slot] = self._clock
