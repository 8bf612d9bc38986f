"""What the in-process decode benchmarks share (benchmarks/decode.py, constrained.py): the
engine the worker runs, made in this process, and its decode rate over the steps where
every row of a batch decodes.

Import it as `benchmarks.engine_rate` after the benchmark put the repository root, not
its own folder, on sys.path (benchmarks/http.py would shadow the stdlib).
"""
from __future__ import annotations

import logging
import time
from typing import Callable, NamedTuple, Optional, Sequence

from mashbox.config import Constraint, EngineConfig, GenerationRequest, SamplingParams
from mashbox.engine.worker import Engine


class Rate(NamedTuple):
    tok_s: float  # aggregate tokens per second
    step_s: float  # mean seconds per timed step
    clock_s: float  # mean seconds per timed step of the caller's clock (0 without one)


def model_path(path: Optional[str]) -> str:
    """`path`, or the default model (pulled when missing)."""
    if path is not None:
        return path
    from mashbox import registry

    return str(registry.pull(registry.DEFAULT_MODEL_ID, quiet=True))


def make_engine(path: Optional[str], **config) -> Engine:
    """The worker's Engine on `path` (default: the default model), 8 slots, ctx 512 unless
    `config` (EngineConfig fields) says otherwise."""
    logging.basicConfig(level=logging.WARNING)
    return Engine(EngineConfig(**{"model_path": model_path(path), "model_id": "bench", "slots": 8, "ctx": 512,
                                  **config}))


def decode_rate(engine: Engine, prompts: Sequence[str], batch: int, tokens: int, tag: str,
                constraint: Optional[Constraint] = None,
                clock: Optional[Callable[[], float]] = None) -> Rate:
    """`batch` greedy requests of `tokens` new tokens (ignore_eos; prompts taken in turn,
    each under `constraint`), run to the end; only the steps where all `batch` rows decode
    are timed. clock(): a running count of seconds (e.g. a forward timer's) read around
    each timed step. A request that ends other than by length is an error."""
    tok = engine.tokenizer
    for i in range(batch):
        engine.submit(GenerationRequest(
            id=f"{tag}-{i}", tenant="bench", prompt_ids=tuple(tok.encode(prompts[i % len(prompts)])),
            sampling=SamplingParams(temperature=0.0), max_tokens=tokens, ignore_eos=True, constraint=constraint))
    steps, seconds, clocked = 0, 0.0, 0.0
    while engine.has_work:
        decoding = sum(1 for r in engine.scheduler.running.values() if r.state.value == "decoding")
        full = decoding == batch and not engine.scheduler.waiting
        c0 = clock() if clock is not None else 0.0
        t0 = time.perf_counter()
        events = engine.step()
        dt = time.perf_counter() - t0
        for ev in events:
            if ev.finish_reason not in (None, "length"):
                raise RuntimeError(f"{ev.id} finished {ev.finish_reason}: {ev.error}")
        if full:
            steps += 1
            seconds += dt
            clocked += (clock() - c0) if clock is not None else 0.0
    if not steps:
        return Rate(0.0, 0.0, 0.0)
    return Rate(batch * steps / seconds, seconds / steps, clocked / steps)
