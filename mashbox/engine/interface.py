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
- `stats()` is a frozen `EngineStats`: every field has a default, so a new figure is one
  field here (and one line where the client counts it); a test double sets only what its
  test reads.
- `submit` is synchronous and either refuses at once (NotReady, QueueFull) or returns a
  handle whose events always end with exactly one StepEvent carrying finish_reason.
  The engine never runs a request twice: a request its worker failed ends with
  finish_reason "error", and whether to run it again is the api's decision
  (api/generation.py holds the one retry, since only it knows what the client received).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import AsyncIterator, Mapping, Optional, Protocol

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


@dataclass(frozen=True)
class HistogramSnapshot:
    """One latency histogram as Prometheus wants it, in seconds."""

    buckets: tuple[tuple[float, int], ...] = ()  # (upper bound, cumulative count); +Inf is `count`
    sum: float = 0.0
    count: int = 0


def _frozen_map(m: Mapping) -> Mapping:
    return MappingProxyType(dict(m))


@dataclass(frozen=True)
class EngineStats:
    """What the engine counts (`Engine.stats()`): health and /metrics read it."""

    state: str = "loading"  # one of STATES
    running: int = 0  # requests in a slot
    waiting: int = 0  # requests waiting for a slot
    slots: int = 0  # 0: not known yet (the readers fall back to the config)
    slots_used: int = 0
    kv_cache_usage: float = 0.0  # slots_used / slots, 0..1
    ctx: int = 0  # tokens per slot; 0: not known yet
    worker_pid: Optional[int] = None
    worker_restarts: int = 0
    worker_stalls: int = 0  # workers the watchdog took for frozen
    requests_finished: Mapping[str, int] = field(default_factory=dict)  # finish_reason -> count
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefix_cache_lookups: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_copies: int = 0  # admissions whose prefix was copied from a running slot
    # --cache-ram: the host memory prompt cache (bytes are the running worker's levels)
    host_cache_hits: int = 0  # restores
    host_cache_hit_tokens: int = 0
    host_cache_evictions: int = 0
    host_cache_saved_blocks: int = 0
    host_cache_bytes: int = 0
    snapshot_bytes: int = 0
    host_cache_cap_bytes: int = 0
    host_cache_block_bytes: int = 0
    prefill_dedupes: int = 0  # prompts that waited to reuse a running prefill
    cache_namespace: Optional[str] = None
    preemptions: int = 0  # mashbox never preempts
    compiles_after_ready: Optional[int] = None  # None until ready (eager torch: then 0)
    # time_to_first_token_seconds, queue_time_seconds, e2e_request_latency_seconds,
    # time_per_output_token_seconds -> its histogram (a missing one reads as empty)
    histograms: Mapping[str, HistogramSnapshot] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # the mappings are read-only copies, so a reader cannot change what it was given
        object.__setattr__(self, "requests_finished", _frozen_map(self.requests_finished))
        object.__setattr__(self, "histograms", _frozen_map(self.histograms))


class GenerationHandle(Protocol):
    """One submitted request: `async for ev in handle` yields its StepEvents, the last
    one (exactly one) with finish_reason; `cancel()` is idempotent and the final event
    (finish_reason "cancelled") still comes."""

    id: str

    def __aiter__(self) -> AsyncIterator[StepEvent]: ...

    async def __anext__(self) -> StepEvent: ...

    def cancel(self) -> None: ...


class Engine(Protocol):
    """What the api layer calls."""

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

    def stats(self) -> EngineStats: ...
