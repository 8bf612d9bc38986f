"""One answer pipeline for the four generating APIs: the request value a surface's
converter makes, the writer protocol its answer follows, the frame loop of a streamed
answer and the one route handler.

Rules:
- A surface (chat.py, completions.py, messages.py, responses.py) is a `Surface`: a
  converter `convert(api, body) -> ApiRequest` (every field read and checked; the
  conversation or plain prompt, the sampling fields, the stream flag, what the writer
  needs) and a writer factory `writer(api, request, prompt, answer_id) -> Writer`.
- `handler(api, surface)` serves every generating route the same way:
      not ready -> the family's 503 / 529;  body -> convert -> prompt (the chat template
      for a conversation, plain for a text) -> answer id -> submit (429 / 503 / 529 are
      plain HTTP errors: nothing was answered yet) -> the writer;
      streamed: `frames(gen, writer)`;  whole: `gen.run(writer.collect)`, `writer.whole(result)`.
- A big body is parsed, converted, rendered and tokenized off the event loop, by
  `off_loop` in the ApiContext's PromptPool (api/prompt_pool.py), so megabytes of
  prompt do not stall every other connection (/health included); smaller bodies are
  prepared inline. The job is `prepare(surface, api, req)`.
- `frames` writes `start_frames(result)`, then per engine step `step_frames(pieces)` and,
  after the last, `end_frames(result)`. A writer whose opening must say what only the
  engine knows (Messages' message_start carries the prefix-cache hit) sets
  `start_waits_for_engine`: its start frames go out with the engine's first event, or
  after START_WAIT_S (1 s, heartbeat_s if shorter) without one, whichever comes first,
  so a request queued behind a long prefill still hears from the server within a second; frames of pieces made before
  (a forced tool-call opening) wait behind them. `gen.output_sent` is set once a step's frames went out
  (start frames are not model output: the one retry is still allowed after them). With
  a `heartbeat_s`, `keepalive_frames()` goes out after that long without a frame. A
  failure after the stream started becomes `fail_frames(message)` and the stream ends
  there: a worker failure says "failed on the device", a bug here "failed while
  streaming" (and is logged).
- Shutdown (`api.shutdown`, one api/shutdown.py Shutdown per ApiContext; app.py drives it):
  `drain()` at SIGTERM / SIGINT: a generating request that arrives after it gets the
  family's 503 server_error (code server_shutting_down) / 529 overloaded_error, with
  x-should-retry; running ones go on. `end()` when the grace period is over: each open
  stream's frames stop at once and end with `fail_frames("The server is shutting
  down ...")` (behind its start frames when these had not gone out), and each
  non-streamed request still running answers that same 503 / 529; their engine
  requests are cancelled. A stream races each engine step against `end()`.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, AsyncIterator, Callable, Optional, Protocol, TypeVar

from mashbox.api import common
from mashbox.api.common import ApiContext, SamplingFields
from mashbox.api.generation import EventStream, Generation, GenerationError, Piece, Result
from mashbox.api.prompt import Conversation, Prompt, chat_prompt, settled, text_prompt
from mashbox.http.response import HTTPError, json_response
from mashbox.http.sse import StreamResponse

log = logging.getLogger("mashbox.api")

T = TypeVar("T")


@dataclass(frozen=True)
class ApiRequest:
    """One generating request, whatever API it came in by."""

    fields: SamplingFields
    stream: bool = False
    conversation: Optional[Conversation] = None  # the chat routes: rendered by the template
    text: Optional[str] = None  # Completions: the plain prompt
    include_usage: bool = False  # Chat streams: a usage chunk at the end
    model: Optional[str] = None  # the model name the answer repeats (None: the served id)
    echo: dict = field(default_factory=dict)  # Responses: request fields the Response repeats
    tool_refs: dict = field(default_factory=dict)  # Responses: prompt name -> responses.ToolRef

    def __post_init__(self):
        if (self.conversation is None) == (self.text is None):
            raise ValueError("a request has a conversation or a text, exactly one")


class Writer(Protocol):
    """An API's answer: pieces in, that API's SSE frames (streamed) or JSON object (whole) out."""

    heartbeat_s: Optional[float]  # seconds of silence before keepalive_frames(); None: never
    start_waits_for_engine: bool  # start_frames wait for the engine's first event (module rules)

    def start_frames(self, result: Result) -> list[bytes]: ...

    def step_frames(self, pieces: list[Piece]) -> list[bytes]: ...

    def end_frames(self, result: Result) -> list[bytes]: ...

    def fail_frames(self, message: str) -> list[bytes]: ...

    def keepalive_frames(self) -> list[bytes]: ...

    def collect(self, piece: Piece) -> None: ...

    def whole(self, result: Result) -> dict: ...


@dataclass(frozen=True)
class Surface:
    """One API on one path."""

    path: str
    family: str  # common.OPENAI | common.ANTHROPIC: the error shape
    id_prefix: str  # the answer's id: chatcmpl- / cmpl- / msg_ / resp_
    convert: Callable[[ApiContext, Any], ApiRequest]
    writer: Callable[[ApiContext, ApiRequest, Prompt, str], Writer]
    tool_id_prefix: str = "call_"


SHUTTING_DOWN = "The server is shutting down; retry later."
def shutting_down_error(family: str) -> HTTPError:
    """503 server_error (OpenAI) / 529 overloaded_error (Anthropic), with x-should-retry."""
    headers = {"retry-after": str(common.RETRY_AFTER_LOADING_S), "x-should-retry": "true"}
    if family == common.ANTHROPIC:
        return HTTPError(529, SHUTTING_DOWN, "overloaded_error", headers=headers)
    return HTTPError(503, SHUTTING_DOWN, "server_error", code="server_shutting_down", headers=headers)


class _Ended(Exception):
    """Shutdown.end() came while a request was running."""


async def _until_ended(steps: AsyncGenerator[T, None], ended: asyncio.Future) -> AsyncGenerator[T, None]:
    """`steps`, each item raced against `ended` (which raises _Ended and closes `steps`)."""
    it = steps
    try:
        while True:
            if ended.done():
                raise _Ended()
            pending = asyncio.ensure_future(it.__anext__())
            try:
                await asyncio.wait((pending, ended), return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not pending.done():
                    pending.cancel()
                    try:
                        await pending
                    except BaseException:  # the cancellation (or what the cancelled step raised)
                        pass
            if not pending.done() or pending.cancelled():
                raise _Ended()
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        await it.aclose()


async def off_loop(api: ApiContext, req: Any, job: Callable[[ApiContext, Any], T]) -> T:
    """`job(api, req)` in the api's PromptPool (inline without one, or for a small body)."""
    if api.prompt_pool is None:
        return job(api, req)
    return await api.prompt_pool.run(api, req, job)


def build_prompt(api: ApiContext, request: ApiRequest) -> Prompt:
    if request.conversation is not None:
        return chat_prompt(api, request.conversation, request.fields.max_tokens)
    return text_prompt(api, request.text, request.fields.max_tokens)


START_WAIT_S = 1.0  # the longest start_waits_for_engine holds back a stream's first frames


async def frames(gen: Generation, writer: Writer, ended: Optional[asyncio.Future] = None) -> AsyncIterator[bytes]:
    """A streamed answer's frames (see the module rules); `ended`: Shutdown.ended()."""
    last_sent = time.monotonic()
    heartbeat_s = writer.heartbeat_s
    started = not writer.start_waits_for_engine
    held: list[bytes] = []  # frames of pieces made before the start frames went out
    # A waiting start gives up after START_WAIT_S (heartbeat_s if shorter): a client
    # queued behind a long prefill still hears from the server within a second. The
    # ticks stay that short; keep-alives still go out by heartbeat_s of silence.
    tick = heartbeat_s if started else min(START_WAIT_S, heartbeat_s or START_WAIT_S)
    try:
        if started:
            for frame in writer.start_frames(gen.result):
                yield frame
        steps = gen.steps(heartbeat_s=tick)
        if ended is not None:
            steps = _until_ended(steps, ended)
        async for step in steps:
            out: list[bytes] = []
            if step is not None:
                out = writer.step_frames(step.pieces)
                if step.finished:
                    out = out + writer.end_frames(gen.result)
            if not started:
                if step is not None and step.event is None:
                    held += out  # the forced opening, parsed before the engine said anything
                    continue
                # The engine answered (its event is in gen.result), or START_WAIT_S passed.
                started = True
                for frame in writer.start_frames(gen.result):
                    yield frame
                last_sent = time.monotonic()
                out, held = held + out, []
                if step is None:
                    continue  # the start frames were this heartbeat's frames
            if out:
                gen.output_sent = True
            elif heartbeat_s is not None and time.monotonic() - last_sent >= heartbeat_s:
                # Nothing to say (prefill, or a long tool call held back): keep the stream alive.
                out = writer.keepalive_frames()
            for frame in out:
                yield frame
            if out:
                last_sent = time.monotonic()
            if step is not None and step.finished:
                return
    except _Ended:
        gen.cancel()
        for frame in _failed(writer, started, gen, SHUTTING_DOWN):
            yield frame
    except GenerationError as exc:
        for frame in _failed(writer, started, gen, f"The request failed on the device: {exc}"):
            yield frame
    except Exception as exc:  # a bug here must still end the stream the way the API says
        log.exception("stream %s failed", gen.id)
        for frame in _failed(writer, started, gen, f"The server failed while streaming: {exc}"):
            yield frame


def _failed(writer: Writer, started: bool, gen: Generation, message: str) -> list[bytes]:
    """The failure frames, behind the start frames when these had not gone out yet (a
    stream always opens the same way)."""
    opening = [] if started else writer.start_frames(gen.result)
    return opening + writer.fail_frames(message)


def prepare(surface: Surface, api: ApiContext, req: Any) -> tuple[ApiRequest, Prompt]:
    """A generating request's body -> its request value and prompt (off_loop's job)."""
    body = common.request_body(api, req, surface.family)
    request = surface.convert(api, body)
    return request, build_prompt(api, request)


def handler(api: ApiContext, surface: Surface):
    """The route handler of a surface (see the module rules)."""
    job = functools.partial(prepare, surface)
    shutdown = api.shutdown

    async def handle(req):
        if shutdown.draining:
            raise shutting_down_error(surface.family)
        common.require_ready(api, surface.family)
        request, prompt = await off_loop(api, req, job)
        prompt = await settled(api, prompt)  # a new grammar is checked off the loop
        if shutdown.draining:
            raise shutting_down_error(surface.family)
        answer_id = common.new_id(surface.id_prefix)
        gen = Generation(api, prompt, request.fields, surface.family, tenant=req.tenant, request_id=answer_id,
                         tool_id_prefix=surface.tool_id_prefix)
        gen.submit()
        writer = surface.writer(api, request, prompt, answer_id)
        ended = shutdown.ended()
        if request.stream:
            return StreamResponse(EventStream(frames(gen, writer, ended), gen))
        run = asyncio.ensure_future(gen.run(writer.collect))
        try:
            await asyncio.wait((run, ended), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not run.done():  # the shutdown's end, or this handler was cancelled
                run.cancel()
                try:
                    await run
                except BaseException:
                    pass
                gen.cancel()
        if run.cancelled():
            raise shutting_down_error(surface.family)
        return json_response(writer.whole(run.result()))

    return handle


def route(api: ApiContext, surface: Surface) -> tuple[str, str, Any, str]:
    """The (method, path, handler, family) tuple app.py registers."""
    return ("POST", surface.path, handler(api, surface), surface.family)
