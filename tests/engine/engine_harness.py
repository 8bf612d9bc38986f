"""Shared by the engine tests: run a real EngineClient (worker process) around a coroutine,
and the default model's ChatML prompts."""
from __future__ import annotations

import asyncio

from mashbox.config import EngineConfig, ServerConfig
from mashbox.engine.client import EngineClient

TIMEOUT = 300


def run_client(coro_fn, cfg: EngineConfig, server: ServerConfig = ServerConfig(), timeout: float = TIMEOUT):
    """Start a client, wait for ready, run `coro_fn(client)`, always stop the worker."""
    async def main():
        client = EngineClient(cfg, server)
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


def chat(tok, user: str) -> list[int]:
    """SmolLM2's ChatML turn, markers as special ids, user text as plain text."""
    return tok.encode_marked([
        ("<|im_start|>", True), ("system\nYou are a helpful assistant.", False), ("<|im_end|>", True),
        ("\n", False), ("<|im_start|>", True), (f"user\n{user}", False), ("<|im_end|>", True),
        ("\n", False), ("<|im_start|>", True), ("assistant\n", False),
    ])
