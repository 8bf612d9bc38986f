"""One submitted request as the server process sees it: the handle the engine client gives out.

Rules:
- A handle's life is the table `HANDLE_TRANSITIONS`; any other move raises
  IllegalTransition (a bug in the client, never caused by a request):

      WAITING --started--> RUNNING --final event--> FINISHED --consumer reads it--> CLOSED
         |                    |                        ^
         +-----cancel---------+--> CANCELLING ---------+ (the final event, "cancelled")
         +--------------- final event -----------------+

  FINISHED means the final event is queued (the client forgets the request then);
  CLOSED that the consumer has read it, so iteration stops.
- The client (engine/client.py) moves the state and queues the events (`_push`); the
  consumer iterates. `cancel()` goes to the client, which knows whether a worker has it.
"""
from __future__ import annotations

import asyncio
import collections
import enum
import time
from typing import TYPE_CHECKING, Optional

from mashbox.config import GenerationRequest, StepEvent

if TYPE_CHECKING:
    from mashbox.engine.client import EngineClient


class HandleState(enum.Enum):
    WAITING = "waiting"  # sent to the worker, no slot yet
    RUNNING = "running"  # holds a slot (prefilling or decoding)
    CANCELLING = "cancelling"  # cancel sent; the final event is on its way
    FINISHED = "finished"  # the final event is queued for the consumer
    CLOSED = "closed"  # the consumer has read the final event


# state -> the states it may move to
HANDLE_TRANSITIONS: dict[HandleState, frozenset[HandleState]] = {
    HandleState.WAITING: frozenset({HandleState.RUNNING, HandleState.CANCELLING, HandleState.FINISHED}),
    HandleState.RUNNING: frozenset({HandleState.CANCELLING, HandleState.FINISHED}),
    HandleState.CANCELLING: frozenset({HandleState.FINISHED}),
    HandleState.FINISHED: frozenset({HandleState.CLOSED}),
    HandleState.CLOSED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A handle moved along no edge of HANDLE_TRANSITIONS: a bug in the client."""


class RequestHandle:
    """`async for ev in handle` yields StepEvents, the last one with finish_reason."""

    def __init__(self, client: "EngineClient", req: GenerationRequest) -> None:
        self._client = client
        self.req = req
        self.id = req.id
        self.tenant = req.tenant
        self.state = HandleState.WAITING
        self.t_submit = time.perf_counter()
        self.t_first_token: Optional[float] = None
        self._events: collections.deque[StepEvent] = collections.deque()
        self._wake = asyncio.Event()

    def _goto(self, state: HandleState) -> None:
        if state not in HANDLE_TRANSITIONS[self.state]:
            raise IllegalTransition(f"request {self.id}: {self.state.value} -> {state.value}")
        self.state = state

    def __aiter__(self) -> "RequestHandle":
        return self

    async def __anext__(self) -> StepEvent:
        while not self._events:
            if self.state is HandleState.CLOSED:
                raise StopAsyncIteration
            self._wake.clear()
            await self._wake.wait()
        ev = self._events.popleft()
        if ev.finish_reason is not None:
            self._goto(HandleState.CLOSED)
        return ev

    def cancel(self) -> None:
        """Idempotent; the final event (finish_reason "cancelled") still comes."""
        self._client._cancel(self)

    def _push(self, ev: StepEvent) -> None:
        self._events.append(ev)
        self._wake.set()
