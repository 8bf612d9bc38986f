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
- A big body (BIG_BODY_BYTES and more) is parsed, converted, rendered and tokenized off
  the event loop, in `off_loop` (PROMPT_THREADS threads; more big requests wait their
  turn), so megabytes of prompt do not stall every other connection (/health included).
  The tokenizer releases the GIL while it encodes; the template renders in Python, in
  GIL time slices. Smaller bodies are prepared inline: a thread hop would cost more.
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
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional, Protocol, TypeVar

from mashbox.api import common
from mashbox.api.common import ApiContext, SamplingFields
from mashbox.api.generation import EventStream, Generation, GenerationError, Piece, Result
from mashbox.api.prompt import Conversation, Prompt, chat_prompt, text_prompt
from mashbox.http.response import json_response
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


BIG_BODY_BYTES = 1 << 20
PROMPT_THREADS = 2  # big prompts prepared at once; the server process has few cores to spare
_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None


async def off_loop(req: Any, job: Callable[[], T]) -> T:
    """`job()` in the prompt threads when the request's body is big, else inline."""
    global _pool
    if len(req.body) < BIG_BODY_BYTES:
        return job()
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(PROMPT_THREADS, thread_name_prefix="mashbox-prompt")
    return await asyncio.get_running_loop().run_in_executor(_pool, job)


def build_prompt(api: ApiContext, request: ApiRequest) -> Prompt:
    if request.conversation is not None:
        return chat_prompt(api, request.conversation, request.fields.max_tokens)
    return text_prompt(api, request.text, request.fields.max_tokens)


START_WAIT_S = 1.0  # the longest start_waits_for_engine holds back a stream's first frames


async def frames(gen: Generation, writer: Writer) -> AsyncIterator[bytes]:
    """A streamed answer's frames (see the module rules)."""
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
        async for step in gen.steps(heartbeat_s=tick):
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


def handler(api: ApiContext, surface: Surface):
    """The route handler of a surface (see the module rules)."""

    def prepare(req) -> tuple[ApiRequest, Prompt]:
        body = common.request_body(api, req, surface.family)
        request = surface.convert(api, body)
        return request, build_prompt(api, request)

    async def handle(req):
        common.require_ready(api, surface.family)
        request, prompt = await off_loop(req, lambda: prepare(req))
        answer_id = common.new_id(surface.id_prefix)
        gen = Generation(api, prompt, request.fields, surface.family, tenant=req.tenant, request_id=answer_id,
                         tool_id_prefix=surface.tool_id_prefix)
        gen.submit()
        writer = surface.writer(api, request, prompt, answer_id)
        if request.stream:
            return StreamResponse(EventStream(frames(gen, writer), gen))
        result = await gen.run(writer.collect)
        return json_response(writer.whole(result))

    return handle


def route(api: ApiContext, surface: Surface) -> tuple[str, str, Any, str]:
    """The (method, path, handler, family) tuple app.py registers."""
    return ("POST", surface.path, handler(api, surface), surface.family)
