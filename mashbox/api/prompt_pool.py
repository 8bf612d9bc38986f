"""PromptPool: where the server prepares big request bodies, away from its event loop.

Rules:
- One per served ApiContext, made with it (app.make_context) and shut down with the
  server (app.serve_async); an ApiContext without one (the handler-level tests')
  prepares every body inline.
- A job is `job(api, req) -> T`: parse the body, convert it, render and tokenize the
  prompt (pipeline.prepare, messages.count_body). A body under BIG_BODY_BYTES runs
  inline (a hop would cost more than the work); a bigger one in the pool, at most
  PROMPT_WORKERS at once, the others waiting their turn.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from typing import TYPE_CHECKING, Any, Callable, TypeVar

if TYPE_CHECKING:
    from mashbox.api.common import ApiContext

T = TypeVar("T")

BIG_BODY_BYTES = 1 << 20
PROMPT_WORKERS = 2  # big prompts prepared at once; the server process has few cores to spare


class PromptPool:
    def __init__(self) -> None:
        self._threads = concurrent.futures.ThreadPoolExecutor(PROMPT_WORKERS, thread_name_prefix="mashbox-prompt")

    async def run(self, api: "ApiContext", req: Any, job: Callable[["ApiContext", Any], T]) -> T:
        """`job(api, req)`, in the pool when the body is big (module rules)."""
        if len(req.body) < BIG_BODY_BYTES:
            return job(api, req)
        return await asyncio.get_running_loop().run_in_executor(self._threads, job, api, req)

    def shutdown(self) -> None:
        """No new jobs; running ones finish in their threads (the server is stopping)."""
        self._threads.shutdown(wait=False, cancel_futures=True)
