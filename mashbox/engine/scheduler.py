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

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)

    @property
    def empty(self) -> bool:
        return not self.rows


class Scheduler:
    def __init__(self, num_slots: int, ctx: int, prefill_chunk: int, prefix_block: int) -> None:
        self.ctx = ctx
        self.prefill_chunk = prefill_chunk
        self.slots = SlotTable(num_slots, ctx)
        self.prefix = PrefixCache(self.slots, prefix_block)
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
        while budget > 0 and self.waiting and self.slots.free_slots:
            r = self._next_waiting()
            self._admit(r, copies)
            admitted.append(r)
            budget -= self._prefill_row(r, budget, rows)
        return StepPlan(tuple(rows), tuple(admitted), tuple(copies))

    def advance(self, plan: StepPlan) -> None:
        """The runner computed the plan's K/V."""
        for row in plan.rows:
            r = row.request
            if r.finished:  # cancelled while the step ran; its slot was already released
                continue
            r.num_computed = row.start + len(row.token_ids)
            self.slots.computed(row.slot, r.num_computed)

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

    def _next_waiting(self) -> Request:
        """The oldest waiting request of the tenant holding the fewest slots, so one
        tenant's burst does not make the others wait behind all of it."""
        if len(self.waiting) > 1:
            held = collections.Counter(r.req.tenant for r in self.running.values())
            i = min(range(len(self.waiting)), key=lambda j: (held[self.waiting[j].req.tenant], j))
            if i:
                r = self.waiting[i]
                del self.waiting[i]
                return r
        return self.waiting.popleft()

    def _admit(self, r: Request, copies: list[tuple[int, int, int]]) -> None:
        prompt = np.asarray(r.token_ids[: r.num_prompt], dtype=np.int32)
        slot, cached, source = self.prefix.lookup(prompt)
        if source is not None:
            self.slots.copy_prefix(source, slot, cached)
            copies.append((source, slot, cached))
        self.slots.acquire(slot, r.id, r.token_ids, keep=cached)
        r.slot = slot
        r.num_computed = cached
        r.num_cached = cached
        r.move(State.PREFILLING)
        self.running[r.id] = r

    def _prefill_row(self, r: Request, budget: int, rows: list[Row]) -> int:
        n = min(r.num_prompt_left, budget)
        start = r.num_computed
        ids = tuple(r.token_ids[start : start + n])
        rows.append(Row(r, r.slot, start, ids, start + n == r.num_prompt))
        return n
