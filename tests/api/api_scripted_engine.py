"""A scripted stand-in for EngineClient, and the real server process code around it.

Used only where the real model cannot produce the case on demand: exact chunk
sequences for a known output (reasoning, tool calls split at odd places), a worker
failure mid-stream, a full queue, a model still loading. Everything else runs the real
server (conftest.py).

`ScriptedEngine.script(req) -> list[StepEvent | float | Exception]` decides what a
submitted request yields (a number: that many seconds without an event); an Exception
item first is raised from submit() instead (QueueFull, NotReady). `InProcessServer` runs
the real app (router, guard, routes) on a real socket in a thread with its own event
loop; `server_fixtures` makes a wire test module's `script`, `engine` and `app` fixtures
around them.

The double implements engine/interface.py's `Engine` and `GenerationHandle` and raises
that module's own NotReady / QueueFull (re-exported here for the tests), so the api
layer treats it exactly as the EngineClient.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Callable, Optional

import pytest

from mashbox.config import EngineConfig, GenerationRequest, ServerConfig, StepEvent, Timings
from mashbox.engine.interface import Engine, EngineInfo, EngineStats, GenerationHandle, NotReady, QueueFull

__all__ = ["EngineInfo", "NotReady", "QueueFull", "ScriptedEngine", "ScriptedHandle", "InProcessServer",
           "server_fixtures", "text_events"]


def text_events(req: GenerationRequest, pieces: list[str], finish: str = "stop",
                stop_sequence: Optional[str] = None, error: Optional[str] = None) -> list[StepEvent]:
    """Events for an answer given as text deltas (one token each), then the finish."""
    n = len(req.prompt_ids)
    events = [StepEvent(id=req.id, started=True, prompt_tokens=n)]
    for i, p in enumerate(pieces):
        events.append(StepEvent(id=req.id, token_ids=(100 + i,), text=p, prompt_tokens=n))
    timings = Timings(queue_ms=1.5, prompt_ms=20.0, predicted_ms=40.0, prompt_n=n - 2, cache_n=2,
                      predicted_n=len(pieces))
    events.append(StepEvent(id=req.id, finish_reason=finish, stop_sequence=stop_sequence, error=error,
                            prompt_tokens=n, cached_tokens=2, timings=timings))
    return events


class ScriptedHandle:
    def __init__(self, engine: "ScriptedEngine", req: GenerationRequest, events: list):
        self.engine = engine
        self.req = req
        self.id = req.id
        self.events = list(events)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> StepEvent:
        if self.cancelled:
            raise StopAsyncIteration
        while self.events and isinstance(self.events[0], (int, float)):
            await asyncio.sleep(self.events.pop(0))  # a number: seconds without an event (a long prefill)
        if not self.events:
            # A script without a finish event: wait (e.g. a slow prefill) until cancelled.
            await asyncio.sleep(3600)
        await asyncio.sleep(self.engine.delay_s)
        return self.events.pop(0)

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self.engine.cancelled.append(self.req.id)


class ScriptedEngine:
    def __init__(self, script: Callable[[GenerationRequest], list], ready: bool = True, ctx: int = 256):
        self.script = script
        self.state = "ok" if ready else "loading"
        self.info: Optional[EngineInfo] = EngineInfo(model_id="scripted", ctx=ctx, slots=2) if ready else None
        self.submitted: list[GenerationRequest] = []
        self.cancelled: list[str] = []
        self.delay_s = 0.0
        self.error: Optional[str] = None

    async def start(self) -> None:
        pass

    async def wait_ready(self, timeout: Optional[float] = None) -> None:
        """Until a test sets `state` to "ok" (from its own thread: so this looks, rather
        than waits on an event of this loop)."""
        async def ok():
            while self.state != "ok":
                await asyncio.sleep(0.01)
        await asyncio.wait_for(ok(), timeout)

    async def stop(self) -> None:
        pass

    def submit(self, req: GenerationRequest) -> ScriptedHandle:
        if self.state != "ok":
            raise NotReady()
        events = self.script(req)
        if events and isinstance(events[0], Exception):
            raise events[0]
        self.submitted.append(req)
        return ScriptedHandle(self, req, events)

    def stats(self) -> EngineStats:
        return EngineStats(state=self.state, slots=2, ctx=self.info.ctx if self.info is not None else 0,
                           requests_finished={"stop": 1}, prompt_tokens=10, generated_tokens=5,
                           prefix_cache_hit_tokens=2)


class InProcessServer:
    """The real app on a free 127.0.0.1 port, in a thread, with a scripted engine."""

    def __init__(self, engine: ScriptedEngine, model_path: str, server_config: Optional[ServerConfig] = None,
                 template_source: Optional[str] = None):
        self.engine = engine
        self.template_source = template_source
        self.server_config = server_config or ServerConfig(host="127.0.0.1", port=0)
        self.engine_config = EngineConfig(model_path=model_path, model_id="scripted",
                                          ctx=engine.info.ctx if engine.info is not None else None)
        self.base_url = ""
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop: Optional[asyncio.Event] = None
        self._thread: Optional[threading.Thread] = None
        self._started = threading.Event()
        self._error: Optional[BaseException] = None

    def __enter__(self) -> "InProcessServer":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._started.wait(60):
            raise RuntimeError("in-process server did not start")
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(30)

    def _run(self) -> None:
        import uvloop

        from mashbox.api.app import serve_async

        async def main():
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()

            def listening(server):
                self.base_url = f"http://127.0.0.1:{server.port}"
                self._started.set()

            from mashbox.text.chat import ChatTemplate
            from mashbox.text.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(self.engine_config.model_path)
            template = ChatTemplate(tokenizer, self.template_source)
            await serve_async(self.server_config, self.engine_config, engine=self.engine, stop=self._stop,
                              on_listening=listening, text=(tokenizer, template))

        try:
            uvloop.run(main())
        except BaseException as e:  # surfaced to the test thread
            self._error = e
            self._started.set()


def server_fixtures(make_script: Callable[[], Callable], ctx: int, template_source: Optional[str] = None):
    """Module-scoped fixtures for a wire test module, by these names:
    `script, engine, app = server_fixtures(Script, ctx=256)`. `script` is make_script()
    (what each request answers), `engine` a ScriptedEngine playing it, `app` the real
    app serving that engine (default model's tokenizer; template_source, if given,
    replaces its chat template)."""

    @pytest.fixture(scope="module")
    def script():
        return make_script()

    @pytest.fixture(scope="module")
    def engine(script):
        return ScriptedEngine(script, ctx=ctx)

    @pytest.fixture(scope="module")
    def app(engine, default_model_path):
        with InProcessServer(engine, default_model_path, template_source=template_source) as s:
            yield s

    return script, engine, app


def _conforms(engine: ScriptedEngine, handle: ScriptedHandle) -> tuple[Engine, GenerationHandle]:
    """Never called: a type checker checks here that the double matches the Protocols."""
    return engine, handle
