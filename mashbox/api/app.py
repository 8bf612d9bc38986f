"""The server process: router + guard + engine client + every route, on uvloop.

How routes are registered (the convention every api module follows):

    # in mashbox/api/<surface>.py
    def routes(api: ApiContext) -> list[tuple[str, str, Handler, str]]:
        return [("POST", "/v1/chat/completions", handler, "openai"), ...]

  each tuple is (method, path, handler, family): `handler` is `async def h(req) ->
  Response | StreamResponse` (a closure over `api`), `family` is "openai" or
  "anthropic" (the error shape the router answers in). `ROUTE_MODULES` lists the
  modules in registration order; app.py imports each and adds what `routes(api)`
  returns. The generating routes build theirs with pipeline.route (one handler for all
  four surfaces).

Readiness: the engine client starts the worker in the background; until its ready
frame, health answers 503 `loading` and every generating route 503 (OpenAI) / 529
(Anthropic) with Retry-After (common.require_ready). The tokenizer and chat template
load in this process from the same model path (no torch here).

Shutdown (SIGTERM / SIGINT, or `stop` set): the listener closes at once (new
connections are refused) and generating requests that still arrive on open connections
get 503 / 529 (api.shutdown.drain(), api/shutdown.py); running requests have
ServerConfig.shutdown_grace_s to finish; then open streams end with their route's error
event and terminator and non-streamed requests answer 503 / 529 (Shutdown.end, called by
http/server.py's close; a second SIGTERM / SIGINT calls it at once); then the engine
stops and serve_async returns 0.
"""
from __future__ import annotations

import asyncio
import importlib
import logging
import signal
from typing import Any, Callable, Optional

from mashbox.api.common import ApiContext
from mashbox.api.prompt import warm_grammar
from mashbox.api.prompt_pool import PromptPool
from mashbox.config import EngineConfig, ServerConfig

log = logging.getLogger("mashbox.api")

ROUTE_MODULES = (
    "mashbox.api.health",
    "mashbox.api.metrics",
    "mashbox.api.openapi",
    "mashbox.api.chat",
    "mashbox.api.completions",
    "mashbox.api.messages",
    "mashbox.api.responses",
)


def load_text(engine_config: EngineConfig) -> tuple[Any, Any]:
    """The tokenizer and chat template of the model, loaded in the server process."""
    from mashbox.text.chat import ChatTemplate
    from mashbox.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(engine_config.model_path)
    return tokenizer, ChatTemplate(tokenizer)


def make_context(server_config: ServerConfig, engine_config: EngineConfig, engine: Any,
                 tokenizer: Any = None, template: Any = None) -> ApiContext:
    if tokenizer is None or template is None:
        tokenizer, template = load_text(engine_config)
    return ApiContext(
        server_config=server_config,
        engine_config=engine_config,
        engine=engine,
        tokenizer=tokenizer,
        template=template,
        prompt_pool=PromptPool(server_config, engine_config, template.source),
    )


def build_router(api: ApiContext, guard: Any = None):
    """A Router holding every route of every module in ROUTE_MODULES."""
    from mashbox.http.router import Router

    router = Router(guard)
    for name in ROUTE_MODULES:
        module = importlib.import_module(name)
        for method, path, handler, family in module.routes(api):
            router.add(method, path, handler, family)
    return router


def make_guard(server_config: ServerConfig) -> Any:
    from mashbox.http.security import Guard

    return Guard(server_config)


async def serve_async(server_config: ServerConfig, engine_config: EngineConfig,
                      engine: Any = None, stop: Optional[asyncio.Event] = None,
                      on_listening: Optional[Callable[[Any], None]] = None,
                      text: Optional[tuple[Any, Any]] = None) -> int:
    """Run until `stop` is set (SIGINT / SIGTERM set it when it is None). Returns the exit code.

    `engine`: an EngineClient-like object; None starts the real worker. `text`: a loaded
    (tokenizer, template) pair; None loads them from engine_config.model_path.
    `on_listening(server)` is called once the socket listens (server.port is bound).
    """
    from mashbox.http.server import serve as listen

    loop = asyncio.get_running_loop()
    if engine is None:
        from mashbox.engine.client import EngineClient

        engine = EngineClient(engine_config, server_config)
    tokenizer, template = text if text is not None else (None, None)
    api = make_context(server_config, engine_config, engine, tokenizer, template)
    router = build_router(api, make_guard(server_config))
    warm_grammar(api.tokenizer)  # the grammar checks' tokenizer, while the model loads (api/prompt.py)


    shutdown = api.shutdown

    def on_signal() -> None:
        # The first signal starts the shutdown; a second one ends the grace period now.
        if stop.is_set():
            shutdown.end()
        stop.set()

    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, on_signal)
            except (NotImplementedError, RuntimeError):  # pragma: no cover - not the main thread
                pass

    server = await listen(router, server_config)
    log.info("listening on http://%s:%d", server_config.host, server.port)
    if on_listening is not None:
        on_listening(server)
    exit_code = 0

    async def start_engine() -> None:
        # A model the worker cannot load is fatal: say why and exit 1 (the CLI's code for a
        # server that failed after it started) rather than answer "loading" forever.
        nonlocal exit_code
        try:
            await engine.start()
            await engine.wait_ready()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.error("the model could not be loaded: %s", exc)
            exit_code = 1
            stop.set()

    engine_task = asyncio.ensure_future(start_engine())
    try:
        await stop.wait()
    finally:
        shutdown.drain()
        log.info("shutting down: running requests have %g s to finish", server_config.shutdown_grace_s)
        await server.close(server_config.shutdown_grace_s, end=shutdown.end)
        if not engine_task.done():
            engine_task.cancel()
        try:
            await engine.stop()
        except Exception:  # shutting down: log it and go on
            log.exception("engine stop failed")
        if api.prompt_pool is not None:
            api.prompt_pool.shutdown()
    return exit_code


def serve(server_config: ServerConfig, engine_config: EngineConfig) -> int:
    """Run the server on uvloop until SIGINT / SIGTERM; the process exit code."""
    import uvloop

    return uvloop.run(serve_async(server_config, engine_config))
