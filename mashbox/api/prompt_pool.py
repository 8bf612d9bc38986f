"""PromptPool: where the server prepares big request bodies, away from its event loop.

Rules:
- One per served ApiContext, made with it (app.make_context) and shut down with the
  server (app.serve_async); an ApiContext without one (the handler-level tests', and
  the parse processes' own) prepares every body inline.
- A job is `job(api, req) -> T`, a module-level function or a functools.partial of
  one (it is pickled by name): parse the body, convert it, render and tokenize the
  prompt (pipeline.prepare, messages.count_body). A body under BIG_BODY_BYTES runs
  inline (a hop would cost more than the work).
- A bigger one runs in a parse process: PROMPT_WORKERS of them at most, started with
  "spawn" (no copy of the server's loop, sockets or threads) when the first big body
  comes, each loading the tokenizer from engine_config.model_path and the template
  from the server's template source, so it renders what the server would; more big
  requests wait their turn. A thread would not do: orjson.loads of 20 MB holds the GIL
  for ~60 ms, and a template render and a tokenizer's id list of megabytes for longer,
  while every other connection (/health included) waits on it.
- What crosses: the job, the engine's EngineInfo as it is when the job is sent (the
  context length, the model's names), the request's path, headers and body; back come
  the job's value (a request value and a prompt of at most ctx ids, or a count), the
  session tag the job set, or the HTTPError it raised, rebuilt here with the same
  status, message, type, code, param and headers. Any other exception is the job's bug
  and is raised here as it is.
- A parse process that dies (killed, out of memory) breaks the pool: a new one is made
  and the job runs once more there.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generic, Optional, TypeVar

from mashbox.config import EngineConfig, GenerationRequest, ServerConfig
from mashbox.engine.interface import EngineInfo, EngineStats
from mashbox.http.response import HTTPError

if TYPE_CHECKING:
    from mashbox.api.common import ApiContext

log = logging.getLogger("mashbox.api")

T = TypeVar("T")

BIG_BODY_BYTES = 1 << 20
PROMPT_WORKERS = 2  # big prompts prepared at once; the server process has few cores to spare


@dataclass(frozen=True)
class _Failure:
    """An HTTPError's fields, as they cross the process boundary."""

    status: int
    message: str
    type: Optional[str]
    code: Optional[str]
    param: Optional[str]
    headers: tuple[tuple[str, str], ...]

    def error(self) -> HTTPError:
        return HTTPError(self.status, self.message, self.type, self.code, self.param, list(self.headers))


@dataclass(frozen=True)
class _Outcome(Generic[T]):
    value: Optional[T]
    session_tag: Optional[str]
    failure: Optional[_Failure]


class PromptPool:
    def __init__(self, server_config: ServerConfig, engine_config: EngineConfig,
                 template_source: Optional[str], workers: int = PROMPT_WORKERS) -> None:
        self._args = (server_config, engine_config, template_source)
        self._workers = workers
        self._pool = self._make()

    def _make(self) -> concurrent.futures.ProcessPoolExecutor:
        # No process starts until the first big body (then one per waiting job, up to workers).
        return concurrent.futures.ProcessPoolExecutor(self._workers, mp_context=multiprocessing.get_context("spawn"),
                                                      initializer=_start_child, initargs=self._args)

    async def run(self, api: "ApiContext", req: Any, job: Callable[["ApiContext", Any], T]) -> T:
        """`job(api, req)`: inline for a small body, in a parse process for a big one."""
        if len(req.body) < BIG_BODY_BYTES:
            return job(api, req)
        loop = asyncio.get_running_loop()
        args = (job, api.engine.info, req.path, dict(req.headers), req.body)
        for attempt in (1, 2):
            pool = self._pool
            try:
                outcome: _Outcome[T] = await loop.run_in_executor(pool, _run_in_child, *args)
                break
            except BrokenProcessPool:
                if attempt == 2:
                    raise
                log.warning("a prompt parse process died; starting new ones and preparing the request again")
                if self._pool is pool:
                    self._pool = self._make()
        if outcome.session_tag is not None:
            req.session_tag = outcome.session_tag
        if outcome.failure is not None:
            raise outcome.failure.error()
        return outcome.value  # type: ignore[return-value]

    def shutdown(self) -> None:
        """No new jobs; running ones are stopped (the server is stopping: nobody waits for them)."""
        # ProcessPoolExecutor has no public way to stop a running job before 3.14
        # (terminate_workers): stop its processes by hand.
        processes = list((self._pool._processes or {}).values())
        self._pool.shutdown(wait=False, cancel_futures=True)
        for p in processes:
            if p.is_alive():
                p.terminate()


# -- in the parse process ----------------------------------------------------------------

class _Served:
    """The engine as a job sees it in a parse process: ready, with the info the server's
    engine had when the job was sent. Nothing is submitted there."""

    def __init__(self, info: Optional[EngineInfo]) -> None:
        self.state = "ok"
        self.info = info
        self.error: Optional[str] = None

    async def start(self) -> None:
        raise RuntimeError("a parse process runs no engine")

    async def wait_ready(self, timeout: Optional[float] = None) -> None:
        raise RuntimeError("a parse process runs no engine")

    async def stop(self) -> None:
        pass

    def submit(self, req: GenerationRequest) -> Any:
        raise RuntimeError("a parse process submits nothing")

    def stats(self) -> EngineStats:
        return EngineStats(state=self.state)


# This process's configs, tokenizer and template (set once by _start_child): a parse
# process serves one PromptPool, so its context is process-wide by construction.
_CHILD: Optional[tuple] = None


def _start_child(server_config: ServerConfig, engine_config: EngineConfig, template_source: Optional[str]) -> None:
    global _CHILD
    from mashbox.text.chat import ChatTemplate
    from mashbox.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(engine_config.model_path)
    _CHILD = (server_config, engine_config, tokenizer, ChatTemplate(tokenizer, template_source))


def _run_in_child(job: Callable[["ApiContext", Any], T], info: Optional[EngineInfo], path: str,
                  headers: dict, body: bytes) -> _Outcome[T]:
    from mashbox.api.common import ApiContext
    from mashbox.http.request import Request

    if _CHILD is None:
        raise RuntimeError("the parse process was not started by PromptPool")
    server_config, engine_config, tokenizer, template = _CHILD
    api = ApiContext(server_config, engine_config, _Served(info), tokenizer, template)
    req = Request("POST", path, headers=headers, body=body)
    try:
        value = job(api, req)
    except HTTPError as exc:
        failure = _Failure(exc.status, exc.message, exc.type, exc.code, exc.param, tuple(exc.headers))
        return _Outcome(None, req.session_tag, failure)
    return _Outcome(value, req.session_tag, None)
