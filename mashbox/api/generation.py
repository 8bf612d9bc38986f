"""One engine request, driven for a route: submit, read StepEvents, parse, account.

Rules:
- `Generation.submit()` runs before a route answers anything, so QueueFull / NotReady
  become the family's 429 / 503 / 529 as plain HTTP errors (never mid-stream).
- `steps()` yields one `Step` per engine event (its parsed pieces may be empty: the
  first event only says the request got a slot) and, with `heartbeat_s`, `None` after
  that long without an event so a route can send a keep-alive (Messages' ping). The
  parser's held-back text comes out in the last Step, after the engine's final event.
- The engine request is cancelled in `finally`: a client that goes away (the stream's
  iterator is closed, or a non-streamed handler task is cancelled) frees its slot at
  once, whether queued, prefilling or decoding. cancel() is idempotent.
- The one retry lives here. A request the engine failed (finish_reason "error": its
  worker died, or failed it) is run again once, from the start (fresh parser and
  result, same request), while its client has received no model output (routes set
  `output_sent` when they send some). This layer holds it because "has the client
  received anything" is known only here: the engine client sees tokens, not what
  reached a socket (the parser may still hold them back). The engine never resends a
  request itself (engine/interface.py). Otherwise, or when the retry fails too,
  `GenerationError` is raised: the route answers 500 before output (`run()` raises that
  500 itself), or its stream's error event after.
- Pieces are text/pieces.py's `Piece` values as the parser emits them (kind text |
  reasoning | tool_start | tool_args | tool_end); the parser mints each tool call's id
  once, with the route's prefix (`tool_id_prefix`: call_ / toolu_ / fc_).
- Engine refusals are matched by type (engine/interface.py's NotReady / QueueFull).
- Logprobs (fields.logprobs not None): the events' per-token logprobs wait in an
  api/logprobs.py TokenQueue until the parser has given out (or dropped) their text,
  then ride on the last piece of that step (an empty text piece when it has none); the
  rest goes with the final step. `Result.logprobs` holds them all, in order.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, AsyncIterator, Callable, Optional

from mashbox.api.common import (
    ApiContext,
    SamplingFields,
    device_error,
    engine_error,
    new_id,
    require_ready,
)
from mashbox.api.logprobs import TokenQueue
from mashbox.api.prompt import Prompt
from mashbox.config import GenerationRequest, StepEvent, Timings
from mashbox.engine.interface import GenerationHandle, NotReady, QueueFull
from mashbox.text.parsers import OutputParser
from mashbox.text.pieces import PIECE_KINDS, Piece, TokenLogprobs
from mashbox.text.token_bytes import TokenBytes

__all__ = ["PIECE_KINDS", "Piece", "ToolCall", "Step", "GenerationError", "Result", "Generation",
           "EventStream", "timings_json", "finish_failure"]

log = logging.getLogger("mashbox.api")

RETRY_READY_TIMEOUT_S = 300.0  # a restarted worker reloads the model before the retry can run

@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str = ""  # JSON text as the model wrote it
    done: bool = False
    valid: bool = False  # closed, and its arguments parse as a JSON object


@dataclass
class Step:
    pieces: list[Piece]
    event: Optional[StepEvent]  # None for the parser's final flush
    finished: bool = False


class GenerationError(Exception):
    """The worker failed this request."""


@dataclass
class Result:
    """Everything parsed so far; complete once `finished`."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list = field(default_factory=list)  # list[ToolCall]
    finish_reason: Optional[str] = None  # the engine's: stop | stop_sequence | length | cancelled | error
    stop_sequence: Optional[str] = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    timings: Optional[Timings] = None
    finished: bool = False
    logprobs: list = field(default_factory=list)  # list[TokenLogprobs], when asked for: every token's

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def timings_json(t: Optional[Timings]) -> dict:
    """llama-server's timings block."""
    t = t or Timings()
    return {
        "prompt_n": t.prompt_n,
        "prompt_ms": round(t.prompt_ms, 3),
        "prompt_per_second": (t.prompt_n * 1000.0 / t.prompt_ms) if t.prompt_ms > 0 else None,
        "predicted_n": t.predicted_n,
        "predicted_ms": round(t.predicted_ms, 3),
        "predicted_per_second": ((t.predicted_n - 1) * 1000.0 / t.predicted_ms)
        if t.predicted_ms > 0 and t.predicted_n > 1 else None,
        "cache_n": t.cache_n,
        "queue_ms": round(t.queue_ms, 3),
    }


# ---------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------


class Generation:
    """One request's run: `submit()`, then `async for step in steps()`; `result` builds up."""

    def __init__(
        self,
        api: ApiContext,
        prompt: Prompt,
        fields: SamplingFields,
        family: str,
        tenant: str = "",
        request_id: Optional[str] = None,
        tool_id_prefix: str = "call_",
        ignore_eos: bool = False,
    ):
        self.api = api
        self.prompt = prompt
        self.family = family
        self.id = request_id or new_id("req_")
        self.request = GenerationRequest(
            id=self.id,
            tenant=tenant,
            prompt_ids=prompt.ids,
            sampling=fields.sampling,
            stops=fields.stops,
            max_tokens=prompt.max_tokens,
            ignore_eos=ignore_eos,
            logprobs=fields.logprobs,
            constraint=prompt.constraint,
        )
        self._tool_id_prefix = tool_id_prefix
        self._token_bytes = TokenBytes(api.tokenizer) if fields.logprobs is not None else None
        self._logprobs = self._new_token_queue()
        self._parser = self._new_parser()
        self._retried = False
        self.result = Result(prompt_tokens=len(prompt.ids))
        self._calls: dict[int, ToolCall] = {}
        self._handle: Optional[GenerationHandle] = None
        self.output_sent = False  # set by a route once a client has received model output

    def _new_token_queue(self) -> Optional[TokenQueue]:
        return TokenQueue(self._token_bytes) if self._token_bytes is not None else None

    def _new_parser(self) -> OutputParser:
        p = self.prompt
        return OutputParser(reasoning=p.parse_reasoning, tools=p.parse_tools, in_reasoning=p.starts_in_reasoning,
                            id_prefix=self._tool_id_prefix)

    # -- lifecycle -----------------------------------------------------------------------

    def submit(self) -> None:
        """Admit the request to the engine; raises the family's 429 / 503 / 529 HTTPError."""
        require_ready(self.api, self.family)
        try:
            self._handle = self.api.engine.submit(self.request)
        except (QueueFull, NotReady) as exc:
            raise engine_error(exc, self.family) from None

    def cancel(self) -> None:
        """Stop the engine request (idempotent); a run cut short counts as aborted."""
        if self._handle is not None and not self.result.finished:
            self._handle.cancel()
            self.result.finish_reason = "cancelled"
            self.result.finished = True

    async def steps(self, heartbeat_s: Optional[float] = None) -> AsyncGenerator[Optional[Step], None]:
        if self._handle is None:
            self.submit()
        it = self._handle.__aiter__()
        pending: Optional[asyncio.Future] = None
        try:
            # The forced tool-call opening is part of the answer: parse it first.
            if self.prompt.forced_text:
                pieces = self._apply(self._parser.feed(self.prompt.forced_text))
                if pieces:
                    yield Step(pieces, None)
            while True:
                try:
                    if heartbeat_s is None:
                        ev: StepEvent = await it.__anext__()
                    else:
                        # The pending read survives a heartbeat: waiting on it again loses nothing.
                        if pending is None:
                            pending = asyncio.ensure_future(it.__anext__())
                        done, _ = await asyncio.wait({pending}, timeout=heartbeat_s)
                        if not done:
                            yield None
                            continue
                        ev, pending = pending.result(), None
                except StopAsyncIteration:
                    raise GenerationError("the engine ended the request without a finish reason") from None
                if ev.finish_reason == "error" and self._may_retry():
                    log.warning("request %s failed before any output reached its client (%s); running it "
                                "again", self.id, ev.error)
                    await self._resubmit(ev.error)
                    it = self._handle.__aiter__()
                    continue
                step = self._on_event(ev)
                if step.finished:
                    tail = self._apply(self._parser.finish())
                    step.pieces.extend(tail)
                    if self._logprobs is not None:
                        step.pieces = self._with_logprobs(step.pieces, self._logprobs.flush())
                    self._finish(ev)
                    yield step
                    return
                yield step
        finally:
            if pending is not None and not pending.done():
                pending.cancel()
            self.cancel()

    # -- the one retry -----------------------------------------------------------------------

    def _may_retry(self) -> bool:
        """Once, and only while the client has received no model output."""
        return not (self.output_sent or self._retried)

    async def _resubmit(self, error: Optional[str]) -> None:
        """Run the request again from the start: fresh parser and result, same request."""
        self._retried = True
        try:
            if not self.api.ready:  # its worker died: a new one is loading the model
                await self.api.engine.wait_ready(RETRY_READY_TIMEOUT_S)
            self._handle = self.api.engine.submit(self.request)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.result.finish_reason, self.result.finished = "error", True
            raise GenerationError(f"{error or 'the request failed on the device'}; its retry failed too: "
                                  f"{exc or type(exc).__name__}") from None
        self._parser = self._new_parser()
        self._logprobs = self._new_token_queue()
        self._calls = {}
        self.result = Result(prompt_tokens=len(self.prompt.ids))
        if self.prompt.forced_text:
            self._apply(self._parser.feed(self.prompt.forced_text))

    async def run(self, feed: Optional[Callable[[Piece], Any]] = None) -> Result:
        """Non-streamed: drive to the end (each piece to `feed`, when given) and return the
        result. A failed request raises the family's 500 HTTPError (`finish_failure`)."""
        try:
            async for step in self.steps():
                if feed is not None:
                    for piece in step.pieces:
                        feed(piece)
        except GenerationError as exc:
            raise finish_failure(exc, self.family) from None
        return self.result

    # -- events -> pieces ------------------------------------------------------------------

    def _on_event(self, ev: StepEvent) -> Step:
        r = self.result
        if ev.token_ids:
            r.completion_tokens += len(ev.token_ids)
        if ev.cached_tokens:
            r.cached_tokens = ev.cached_tokens
        if ev.finish_reason == "error":
            self.result.finish_reason = "error"
            self.result.finished = True
            raise GenerationError(ev.error or "the request failed on the device")
        if self._logprobs is not None:
            self._logprobs.push(ev)
        pieces = self._apply(self._parser.feed(ev.text)) if ev.text else []
        if self._logprobs is not None:
            pieces = self._with_logprobs(pieces, self._logprobs.release(self._parser.held_text))
        return Step(pieces, ev, finished=ev.finish_reason is not None)

    def _with_logprobs(self, pieces: list[Piece], entries: tuple[TokenLogprobs, ...]) -> list[Piece]:
        """The step's pieces with its released tokens on the last one (an empty text piece
        when the step has none: tokens whose text the parser dropped, or showed none)."""
        if not entries:
            return pieces
        self.result.logprobs.extend(entries)
        if not pieces:
            return [Piece("text", "", logprobs=entries)]
        last = pieces[-1]
        return pieces[:-1] + [dataclasses.replace(last, logprobs=last.logprobs + entries)]

    def _apply(self, pieces: list[Piece]) -> list[Piece]:
        r = self.result
        for p in pieces:
            if p.kind == "text":
                r.text += p.text
            elif p.kind == "reasoning":
                r.reasoning += p.text
            elif p.kind == "tool_start":
                call = ToolCall(index=p.index, id=p.id, name=p.name)
                self._calls[p.index] = call
                r.tool_calls.append(call)
            elif p.kind == "tool_args":
                self._calls[p.index].arguments += p.text
            elif p.kind == "tool_end":
                call = self._calls[p.index]
                call.done, call.valid = True, p.valid
                if p.text:
                    call.arguments = p.text
        return pieces

    def _finish(self, ev: StepEvent) -> None:
        r = self.result
        r.finish_reason = ev.finish_reason
        r.stop_sequence = ev.stop_sequence
        r.timings = ev.timings
        if ev.timings is not None:
            r.cached_tokens = ev.timings.cache_n
            if ev.timings.predicted_n:
                r.completion_tokens = max(r.completion_tokens, ev.timings.predicted_n)
        r.finished = True


def finish_failure(exc: GenerationError, family: str):
    """The 500 a non-streamed route answers when the worker failed its request."""
    return device_error(f"The request failed on the device: {exc}", family)


class EventStream:
    """The iterator a route hands to StreamResponse: its frames, plus a close that always
    cancels the engine request, even when the stream is closed before its first frame (an
    async generator that never started runs no `finally`)."""

    def __init__(self, frames: AsyncIterator[bytes], generation: Generation):
        self._frames = frames
        self._generation = generation

    def __aiter__(self) -> "EventStream":
        return self

    async def __anext__(self) -> bytes:
        return await self._frames.__anext__()

    async def aclose(self) -> None:
        try:
            close = getattr(self._frames, "aclose", None)
            if close is not None:
                await close()
        finally:
            self._generation.cancel()
