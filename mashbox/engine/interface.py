"""The engine as the api layer sees it: two Protocols, the served info, and the errors.

Rules:
- This module is the seam. `mashbox.api` types its engine as `Engine` and its request
  handles as `GenerationHandle`, and catches only the exceptions defined here. The real
  implementation is `engine.client.EngineClient` (a worker process behind a pipe); the
  api tests' double (tests/api/api_scripted_engine.py) implements the same Protocols and
  raises these very classes, so `isinstance` works on both and nothing is matched by name.
- No torch, no numpy, no I/O: the server process imports it.
- `Engine.state` is "loading" until the engine can take requests, then "ok"; it goes
  back to "loading" while a failed worker restarts. `info` is None until the first
  ready, then what the worker measured (a frozen `EngineInfo`).
- `submit` is synchronous and either refuses at once (NotReady, QueueFull) or returns a
  handle whose events always end with exactly one StepEvent carrying finish_reason.
  The engine never runs a request twice: a request its worker failed ends with
  finish_reason "error", and whether to run it again is the api's decision
  (api/generation.py holds the one retry, since only it knows what the client received).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Protocol

from mashbox.config import GenerationRequest, StepEvent

STATES = ("loading", "ok")


class NotReady(Exception):
    """The model is loading (or its worker is restarting)."""


class QueueFull(Exception):
    """Too many requests wait for a slot: `scope` "tenant" (this tenant's cap) or "total"."""

    def __init__(self, scope: str) -> None:
        if scope not in ("tenant", "total"):
            raise ValueError(f"QueueFull scope must be 'tenant' or 'total', not {scope!r}")
        super().__init__(f"too many requests waiting ({scope})")
        self.scope = scope


class EngineStartError(Exception):
    """The worker could not load the model; the message says why."""


@dataclass(frozen=True)
class EngineInfo:
    """What the worker reports once the model is loaded (its ready frame)."""

    model_id: str
    ctx: int  # tokens per slot
    slots: int
    vocab_size: int = 0
    dtype: str = ""
    device: str = ""
    arch: str = ""
    weights_file: str = ""  # the weights' path ("" when not one file)
    bpw: Optional[float] = None  # bits per weight
    gb: Optional[float] = None  # weight bytes / 1e9
    prefix_block: int = 0
    prefill_chunk: int = 0
    pid: Optional[int] = None  # the worker's process id
    cache_namespace: Optional[str] = None  # what cached K/V is valid for (model, tokenizer, policy)
    host_cache_cap_bytes: int = 0  # the host memory prompt cache's pool (--cache-ram), 0 = off

    @classmethod
    def from_wire(cls, d: dict) -> "EngineInfo":
        """The ready frame's dict; keys this build does not know are ignored (logged by the caller)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class GenerationHandle(Protocol):
    """One submitted request: `async for ev in handle` yields its StepEvents, the last
    one (exactly one) with finish_reason; `cancel()` is idempotent and the final event
    (finish_reason "cancelled") still comes."""

    id: str

    def __aiter__(self) -> AsyncIterator[StepEvent]: ...

    async def __anext__(self) -> StepEvent: ...

    def cancel(self) -> None: ...


class Engine(Protocol):
    """What the api layer calls. `stats()` is the dict docs/interfaces.md lists (health
    and /metrics read it)."""

    state: str  # one of STATES
    info: Optional[EngineInfo]
    error: Optional[str]  # a fatal load error: the model cannot be served

    async def start(self) -> None: ...

    async def wait_ready(self, timeout: Optional[float] = None) -> None:
        """Until state is "ok"; raises EngineStartError when the model cannot load."""
        ...

    async def stop(self) -> None: ...

    def submit(self, req: GenerationRequest) -> GenerationHandle:
        """Raises NotReady while loading, QueueFull(scope) when its queue is full."""
        ...

    def stats(self) -> dict[str, Any]: ...
