"""An answer built piece by piece as a route family's events: the part that
messages.MessageStream and responses.ResponseStream share, and the loop that streams one.

Rules:
- A subclass of `Answer` turns generation.Pieces into its family's content (Messages
  content blocks, Responses output items) and events, one piece at a time: `feed`
  sends each piece to text / reasoning / tool_start / tool_args / tool_end, and each
  returns the events it causes as (event name, payload) pairs.
- At most one block is open (`_open`, the block's type). Whitespace alone (the newline
  between thoughts and a call) opens no text block: it is held, and goes out in front
  of the next text, or is dropped when another block opens first.
- `frames` drives a streamed answer: `start()`, the events of every step, `end()` after
  the last step, as SSE frames; `gen.output_sent` is set once model output was sent
  (the one retry is only allowed before that). With a `heartbeat_s`, `keepalive()`
  goes out when nothing else did for that long. A failure after the stream started
  becomes the `fail()` events, and the stream ends there.
- A non-streamed answer is driven by `Generation.run(answer.feed)`.
"""
from __future__ import annotations

import logging
import time
from typing import AsyncIterator, Callable, Optional

from mashbox.api.generation import Generation, GenerationError, Result
from mashbox.http import sse

log = logging.getLogger(__name__)

Event = tuple[str, dict]  # (SSE event name, payload)


class Answer:
    """Base of a family's answer builder; subclasses name their text and call block types."""

    NAME = ""  # the route, for the log
    TEXT_KIND = "text"  # the block type text pieces go into
    CALL_KINDS: tuple[str, ...] = ()  # block types a tool call opens
    heartbeat_s: Optional[float] = None  # seconds of silence before keepalive(); None: never

    def __init__(self, answer_id: str):
        self.id = answer_id
        self._open: Optional[str] = None  # the open block's type, None between blocks
        self._args: list[str] = []  # the open tool call's argument text
        self._pending_space = ""  # whitespace that may yet start a text block

    # -- what a family defines

    def start(self) -> list[Event]:
        raise NotImplementedError

    def text(self, text: str) -> list[Event]:
        raise NotImplementedError

    def reasoning(self, text: str) -> list[Event]:
        raise NotImplementedError

    def tool_start(self, name: str, call_id: str = "") -> list[Event]:
        raise NotImplementedError

    def tool_args(self, delta: str) -> list[Event]:
        raise NotImplementedError

    def _close(self) -> list[Event]:
        raise NotImplementedError

    def end(self, result: Result, usage: dict) -> list[Event]:
        """The events after the last piece."""
        raise NotImplementedError

    def fail(self, message: str) -> list[Event]:
        """The events of a failure after the stream started."""
        raise NotImplementedError

    def keepalive(self) -> list[Event]:
        return []

    # -- shared

    def feed(self, piece) -> list[Event]:
        """One generation.Piece -> its events."""
        kind = piece.kind
        if kind == "text":
            return self.text(piece.text)
        if kind == "reasoning":
            return self.reasoning(piece.text)
        if kind == "tool_start":
            return self.tool_start(piece.name, piece.id)
        if kind == "tool_args":
            return self.tool_args(piece.text)
        if kind == "tool_end":
            return self.tool_end()
        raise ValueError(f"unknown piece kind {kind!r}")

    def tool_end(self) -> list[Event]:
        if self._open not in self.CALL_KINDS:
            raise RuntimeError("tool call end without an open tool call")
        return self._close()

    def _require_call(self) -> None:
        if self._open not in self.CALL_KINDS:
            raise RuntimeError("tool arguments without an open tool call")

    def _unheld_text(self, text: str) -> str:
        """The text a text piece adds: "" while only whitespace has come since the last
        block (held in _pending_space), else the held whitespace and the text."""
        if self._open == self.TEXT_KIND:
            return text
        text = self._pending_space + text
        if not text.strip():
            self._pending_space = text
            return ""
        self._pending_space = ""
        return text


def _frame(pair: Event) -> bytes:
    return sse.event(pair[0], pair[1])


async def frames(gen: Generation, answer: Answer, usage: Callable[[Result], dict]) -> AsyncIterator[bytes]:
    """A streamed answer's SSE frames; `usage` gives the family's usage object of a result."""
    last_sent = time.monotonic()
    heartbeat_s = answer.heartbeat_s
    try:
        for pair in answer.start():
            yield _frame(pair)
        async for step in gen.steps(heartbeat_s=heartbeat_s):
            events: list[Event] = []
            if step is not None:
                for piece in step.pieces:
                    events.extend(answer.feed(piece))
                if step.finished:
                    events.extend(answer.end(gen.result, usage(gen.result)))
            if events:
                gen.output_sent = True
            elif heartbeat_s is not None and time.monotonic() - last_sent >= heartbeat_s:
                # Nothing to say (prefill, or a long tool call held back): keep the stream alive.
                events = answer.keepalive()
            for pair in events:
                yield _frame(pair)
            if events:
                last_sent = time.monotonic()
            if step is not None and step.finished:
                return
    except GenerationError as exc:
        for pair in answer.fail(f"The request failed on the device: {exc}"):
            yield _frame(pair)
    except Exception as exc:  # a bug here must still end the stream the way the API says
        log.exception("%s stream %s failed", answer.NAME, answer.id)
        for pair in answer.fail(f"The server failed while streaming: {exc}"):
            yield _frame(pair)

