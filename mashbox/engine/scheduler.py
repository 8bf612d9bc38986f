"""Continuous batching policy (pure Python, no torch).

Every step:
1. Each DECODING request gets a row of one token (its last sampled id).
2. The rest of the token budget (`prefill_chunk` minus the decode rows, at least 1) goes
   to prompt chunks: first to requests already PREFILLING, in admission order, then to
   WAITING requests, each admitted into the free slot with the longest cached prefix of
   its prompt (`PrefixCache.lookup`), or into any free slot with a copy of a longer
   prefix that a running request's slot holds (the plan's `copies`). A request joins the batch the step after it
   arrives; it never waits for others to finish, only for a free slot. Among waiting
   requests, the oldest one of the tenant holding the fewest slots goes first.
3. A row whose chunk completes the prompt samples the first new token.

With a host cache (`host_blocks` > 0, engine/host_cache.py): a request whose prompt the
host pool holds more of than any slot (by at least a block) is admitted into the least
valuable free slot with a restore (the plan's `restores`); a free slot that is taken
first has what it held saved to the pool (the plan's `saves`, run before anything
overwrites the slot), and each prompt is saved when its last chunk is computed (a
snapshot). A waiting request whose prompt shares a prefix of at least a block with a
request PREFILLING now, not all of it computed yet, is held back (`dedupes` counts it) until those
tokens are computed, then admitted with a copy of them: two identical prompts that
arrive together are prefilled once.

After the runner ran the plan, `advance(plan)` records the computed K/V, the worker
appends sampled ids with `append_token` and ends requests with `finish` (which frees the
slot at once, keeping its tokens cached). `cancel` does the same for a request in any
state, and takes a waiting one out of the queue.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Optional

import numpy as np

from mashbox import native
from mashbox.engine.host_cache import HostCache, Match, Save
from mashbox.engine.prefix_cache import PrefixCache
from mashbox.engine.request import Request, State
from mashbox.engine.slots import SlotTable


@dataclass(frozen=True)
class Row:
    """One row of a step's batch."""

    request: Request
    slot: int
    start: int  # position of the first new token = tokens already in the slot
    token_ids: tuple[int, ...]  # the new tokens fed this step
    sample: bool  # the row's last logits give the request's next token

    @property
    def decode(self) -> bool:
        """The row feeds the one token the model generated last (a decode step): it starts
        past the prompt and holds one token."""
        return self.start >= self.request.num_prompt and len(self.token_ids) == 1


@dataclass(frozen=True)
class StepPlan:
    rows: tuple[Row, ...]
    admitted: tuple[Request, ...]  # got a slot this step
    # (src slot, dst slot, tokens): K/V [0, tokens) to copy before the forward
    copies: tuple[tuple[int, int, int], ...] = ()
    # slot K/V -> host pool blocks, run first (before copies, restores and the forward)
    saves: tuple[Save, ...] = ()
    # (dst slot, pool blocks, tokens): host pool -> slot K/V [0, tokens), after the copies
    restores: tuple[tuple[int, tuple[int, ...], int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)

    @property
    def empty(self) -> bool:
        return not self.rows


class Scheduler:
    def __init__(self, num_slots: int, ctx: int, prefill_chunk: int, prefix_block: int,
                 host_blocks: int = 0, host_block_bytes: int = 0, kv_capacity: Optional[int] = None) -> None:
        """host_blocks: pool blocks of the host cache (0 = none), host_block_bytes each;
        kv_capacity: positions a slot's K/V buffer holds (default ctx)."""
        self.ctx = ctx
        self.prefill_chunk = prefill_chunk
        self.slots = SlotTable(num_slots, ctx)
        self.prefix = PrefixCache(self.slots, prefix_block)
        self.host: Optional[HostCache] = (
            HostCache(host_blocks, prefix_block, host_block_bytes, kv_capacity or ctx) if host_blocks else None)
        self._saves: list[Save] = []  # planned since the last plan
        self.dedupes = 0  # admissions held back to reuse a running prefill
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: dict[str, Request] = {}  # PREFILLING or DECODING, admission order

    # -- queries ------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def get(self, request_id: str) -> Optional[Request]:
        r = self.running.get(request_id)
        if r is not None:
            return r
        for r in self.waiting:
            if r.id == request_id:
                return r
        return None

    # -- changes ------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        n = request.num_prompt
        if n < 1:
            raise ValueError("prompt_ids must hold at least one token")
        if n > self.ctx:
            raise ValueError(f"prompt_ids has {n} tokens; the context holds {self.ctx}")
        if request.state is not State.WAITING:
            raise ValueError(f"request {request.id} is {request.state.value}")
        self.waiting.append(request)

    def schedule(self) -> StepPlan:
        if self.host is not None:
            self.host.unpin()  # the last plan's restores ran
        rows: list[Row] = []
        for r in self.running.values():
            if r.state is State.DECODING:
                start = r.num_computed
                assert start == len(r.token_ids) - 1 and start < self.ctx, r
                rows.append(Row(r, r.slot, start, (r.token_ids[-1],), True))
        budget = max(self.prefill_chunk - len(rows), 1)
        for r in self.running.values():
            if budget <= 0:
                break
            if r.state is State.PREFILLING:
                budget -= self._prefill_row(r, budget, rows)
        admitted: list[Request] = []
        copies: list[tuple[int, int, int]] = []
        restores: list[tuple[int, tuple[int, ...], int]] = []
        while budget > 0 and self.waiting and self.slots.free_slots:
            r = self._next_waiting()
            if r is None:  # every waiting request waits for a running prefill
                break
            self._admit(r, copies, restores)
            admitted.append(r)
            budget -= self._prefill_row(r, budget, rows)
        saves, self._saves = tuple(self._saves), []
        return StepPlan(tuple(rows), tuple(admitted), tuple(copies), saves, tuple(restores))

    def advance(self, plan: StepPlan) -> None:
        """The runner computed the plan's K/V."""
        for row in plan.rows:
            r = row.request
            if r.finished:  # cancelled while the step ran; its slot was already released
                continue
            r.num_computed = row.start + len(row.token_ids)
            self.slots.computed(row.slot, r.num_computed)
            if self.host is not None and row.sample and not row.decode:
                self._save(row.slot, r.num_prompt)  # the prompt's end: a snapshot

    def step_failed(self, plan: StepPlan) -> None:
        """The runner raised on `plan`: its saves may not have been copied, so the host
        pool's contents are no longer trusted."""
        if self.host is not None and (plan.saves or self._saves):
            self.host.clear()
            self._saves.clear()

    def append_token(self, r: Request, token_id: int) -> None:
        if r.state is State.PREFILLING:
            if r.num_prompt_left:
                raise RuntimeError(f"request {r.id} sampled before its prompt was computed")
            r.move(State.DECODING)
        elif r.state is not State.DECODING:
            raise RuntimeError(f"request {r.id} is {r.state.value}; cannot take a token")
        r.token_ids.append(token_id)
        self.slots.append(r.slot, len(r.token_ids) - 1, token_id)

    def finish(self, r: Request, reason: str, stop_sequence: Optional[str] = None,
               error: Optional[str] = None) -> None:
        was_waiting = r.state is State.WAITING
        r.move(State.FINISHED)
        r.finish_reason = reason
        r.stop_sequence = stop_sequence
        r.error = error
        if was_waiting:
            self.waiting.remove(r)
            return
        del self.running[r.id]
        self.slots.release(r.slot)
        self.prefix.refresh(r.slot)

    def cancel(self, request_id: str) -> Optional[Request]:
        """Finish a request as cancelled, whatever its state; None if unknown or done."""
        r = self.get(request_id)
        if r is None:
            return None
        self.finish(r, "cancelled")
        return r

    # -- helpers ------------------------------------------------------------------------

    def _next_waiting(self) -> Optional[Request]:
        """The oldest waiting request of the tenant holding the fewest slots, so one
        tenant's burst does not make the others wait behind all of it; None when every
        waiting request is held back for a running prefill (`_waits_for_prefill`)."""
        held = collections.Counter(r.req.tenant for r in self.running.values())
        order = sorted(range(len(self.waiting)), key=lambda j: (held[self.waiting[j].req.tenant], j)) \
            if len(self.waiting) > 1 else [0]
        for i in order:
            r = self.waiting[i]
            if self._waits_for_prefill(r):
                continue
            del self.waiting[i]
            return r
        return None

    def _waits_for_prefill(self, r: Request) -> bool:
        """A request PREFILLING now shares a prefix of at least a block with r and has not
        computed all of it yet: r waits until it has, then copies it."""
        min_copy = self.prefix.min_copy
        if r.num_prompt <= min_copy:
            return False
        prompt = None
        for other in self.running.values():
            if other.state is not State.PREFILLING:
                continue
            if other.token_ids[0] != r.token_ids[0]:
                continue
            if prompt is None:
                prompt = np.asarray(r.token_ids[: r.num_prompt], dtype=np.int32)
            n = min(other.num_prompt, r.num_prompt - 1)
            theirs = self.slots.tokens[other.slot, :n]
            diff = np.flatnonzero(theirs != prompt[:n])
            shared = int(diff[0]) if len(diff) else n
            if shared >= min_copy and shared > other.num_computed:
                if not r.deferred:
                    r.deferred = True
                    self.dedupes += 1
                return True
        return False

    def _save(self, slot: int, n: int) -> None:
        """Plan a save of slot's K/V [0, n) (what the host pool lacks of it)."""
        tokens = self.slots.tokens[slot, :n]
        save = self.host.plan_save(slot, tokens, native.block_hashes(tokens, self.host.block).tolist())
        if save is not None:
            self._saves.append(save)

    def _admit(self, r: Request, copies: list[tuple[int, int, int]],
               restores: list[tuple[int, tuple[int, ...], int]]) -> None:
        prompt = np.asarray(r.token_ids[: r.num_prompt], dtype=np.int32)
        slot, cached, source = self.prefix.lookup(prompt)
        hit: Match = self._host_match(prompt, cached)
        if hit.tokens:
            # the pool holds more: undo the slot lookup's hit, take the least valuable slot
            p = self.prefix
            p.hits -= bool(cached)
            p.hit_tokens -= cached
            p.copies -= source is not None
            slot, cached, source = self.slots.eviction_choice(), hit.tokens, None
            self.host.count_hit(hit)
        if self.host is not None and self.slots.kv_len[slot] > (cached if source is None and not hit.tokens else 0):
            self._save(slot, int(self.slots.kv_len[slot]))  # what the slot held goes to the pool
        if source is not None:
            self.slots.copy_prefix(source, slot, cached)
            copies.append((source, slot, cached))
        if hit.tokens:
            self.slots.restore(slot, prompt[:cached])
            restores.append((slot, hit.blocks, cached))
        self.slots.acquire(slot, r.id, r.token_ids, keep=cached)
        r.slot = slot
        r.num_computed = cached
        r.num_cached = cached
        r.move(State.PREFILLING)
        self.running[r.id] = r

    def _host_match(self, prompt: np.ndarray, cached: int) -> Match:
        """What the host pool holds of the prompt, when it is at least a block more than
        `cached` (what a slot gives)."""
        host = self.host
        if host is None or len(prompt) - 1 < cached + self.prefix.min_copy:
            return Match(0, ())
        hit = host.match(prompt, native.block_hashes(prompt, host.block).tolist(), len(prompt) - 1)
        return hit if hit.tokens >= cached + self.prefix.min_copy else Match(0, ())

    def _prefill_row(self, r: Request, budget: int, rows: list[Row]) -> int:
        n = min(r.num_prompt_left, budget)
        start = r.num_computed
        ids = tuple(r.token_ids[start : start + n])
        rows.append(Row(r, r.slot, start, ids, start + n == r.num_prompt))
        return n
