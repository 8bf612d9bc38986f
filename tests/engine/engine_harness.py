"""Shared by the engine tests: run a real EngineClient (worker process) around a coroutine,
build a request, read a handle to its end, and the default model's ChatML prompts."""
from __future__ import annotations

import asyncio
from typing import NamedTuple

from mashbox.config import EngineConfig, GenerationRequest, SamplingParams, ServerConfig, StepEvent
from mashbox.engine.client import EngineClient
from mashbox.engine.interface import GenerationHandle

TIMEOUT = 300


def run_client(coro_fn, cfg: EngineConfig, server: ServerConfig = ServerConfig(), timeout: float = TIMEOUT,
               **client_kw):
    """Start a client (EngineClient keywords: `client_kw`), wait for ready, run
    `coro_fn(client)`, always stop the worker."""
    async def main():
        client = EngineClient(cfg, server, **client_kw)
        await client.start()
        try:
            await client.wait_ready(timeout=timeout)
            return await asyncio.wait_for(coro_fn(client), timeout)
        finally:
            await client.stop()
    return asyncio.run(main())


def run_default(coro_fn, path: str, **kw):
    """The default model, 4 slots, one torch thread: on a shared 2-core machine OpenMP
    barriers with a busy second core cost milliseconds per op."""
    cfg = EngineConfig(model_path=path, model_id="smollm2-135m", **{"slots": 4, "ctx": 2048, "threads": 1, **kw})
    return run_client(coro_fn, cfg)


def tiny_config(path: str, **kw) -> EngineConfig:
    """The tiny random Llama (conftest's `tiny`) in float32 on the CPU, small chunks and blocks."""
    base = dict(model_path=path, model_id="tiny", slots=4, ctx=2048, dtype="float32",
                device="cpu", prefill_chunk=64, prefix_block=16, threads=1)
    base.update(kw)
    return EngineConfig(**base)


def req(rid: str, ids, max_tokens: int = 8, tenant: str = "t", ignore_eos: bool = False,
        **sampling) -> GenerationRequest:
    """A request of prompt `ids`; `sampling` are SamplingParams fields (greedy when empty)."""
    return GenerationRequest(id=rid, tenant=tenant, prompt_ids=tuple(ids), sampling=SamplingParams(**sampling),
                             max_tokens=max_tokens, ignore_eos=ignore_eos)


class Collected(NamedTuple):
    ids: list[int]  # every generated token id
    text: str  # the text deltas joined
    final: StepEvent  # the event with finish_reason
    events: list[StepEvent]


async def collect(handle: GenerationHandle) -> Collected:
    """Read a handle to its final event."""
    events = [ev async for ev in handle]
    return Collected([t for ev in events for t in ev.token_ids], "".join(ev.text for ev in events),
                     events[-1], events)


async def first_event(handle: GenerationHandle, want_tokens: bool) -> list[StepEvent]:
    """Events until one with tokens (or any, when not want_tokens); returns them."""
    seen = []
    async for ev in handle:
        seen.append(ev)
        if ev.finish_reason or (ev.token_ids if want_tokens else True):
            return seen
    return seen


def chat(tok, user: str) -> list[int]:
    """SmolLM2's ChatML turn, markers as special ids, user text as plain text."""
    return tok.encode_marked([
        ("<|im_start|>", True), ("system\nYou are a helpful assistant.", False), ("<|im_end|>", True),
        ("\n", False), ("<|im_start|>", True), (f"user\n{user}", False), ("<|im_end|>", True),
        ("\n", False), ("<|im_start|>", True), ("assistant\n", False),
    ])
