"""One request's life inside the worker (pure Python, no torch).

Lifecycle (the table below is the whole rule; anything else raises):

    WAITING ──admit──▶ PREFILLING ──first token──▶ DECODING
       │                   │                           │
       └──────cancel───────┴──── finish / cancel ──────┴──▶ FINISHED

- WAITING: submitted, no slot yet.
- PREFILLING: owns a slot; `num_computed` of its prompt tokens have K/V in the slot
  (the cached prefix counts as computed). Chunks advance it within the step budget.
- DECODING: the whole prompt is computed and at least one token was sampled; every step
  feeds the last sampled token.
- FINISHED: the slot (if any) was released; its K/V stays cached for prefix reuse.
"""
from __future__ import annotations

import enum
import time
from typing import Optional

from mashbox.config import GenerationRequest


class State(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


# state -> states it may move to
TRANSITIONS: dict[State, frozenset[State]] = {
    State.WAITING: frozenset({State.PREFILLING, State.FINISHED}),
    State.PREFILLING: frozenset({State.DECODING, State.FINISHED}),
    State.DECODING: frozenset({State.FINISHED}),
    State.FINISHED: frozenset(),
}


class IllegalTransition(Exception):
    pass


class Request:
    """Per-request state the scheduler and worker share.

    `token_ids` holds the prompt then the generated ids; `num_computed` counts the leading
    ones whose K/V is in the slot. While decoding, num_computed == len(token_ids) - 1 (the
    last sampled token is fed next step).
    """

    def __init__(self, req: GenerationRequest, arrival: Optional[float] = None) -> None:
        self.req = req
        self.id = req.id
        self.token_ids: list[int] = list(req.prompt_ids)
        self.num_prompt = len(req.prompt_ids)
        self.num_computed = 0
        self.num_cached = 0  # prompt tokens served from the prefix cache
        self.slot: Optional[int] = None
        self.state = State.WAITING
        self.finish_reason: Optional[str] = None
        self.stop_sequence: Optional[str] = None
        self.error: Optional[str] = None
        self.started_sent = False  # the `started` event went out
        self.deferred = False  # held back once to reuse another request's prefill
        # perf_counter() seconds
        self.t_arrival = time.perf_counter() if arrival is None else arrival
        self.t_admit: Optional[float] = None
        self.t_first_token: Optional[float] = None
        self.t_last_token: Optional[float] = None

    # -- state --------------------------------------------------------------------------

    def move(self, to: State) -> None:
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"request {self.id}: {self.state.value} -> {to.value}")
        self.state = to

    @property
    def finished(self) -> bool:
        return self.state is State.FINISHED

    # -- tokens -------------------------------------------------------------------------

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def num_prompt_left(self) -> int:
        """Prompt tokens still to prefill (0 once decoding)."""
        return max(self.num_prompt - self.num_computed, 0)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    def __repr__(self) -> str:
        return (
            f"Request({self.id!r}, {self.state.value}, slot={self.slot}, "
            f"computed={self.num_computed}/{len(self.token_ids)})"
        )
