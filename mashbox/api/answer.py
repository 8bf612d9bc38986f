"""An answer built piece by piece as a route family's events: the part that
message_answer.MessageStream and response_answer.ResponseStream share.

Rules:
- A subclass of `Answer` turns generation.Pieces into its family's content (Messages
  content blocks, Responses output items) and events, one piece at a time: `feed`
  sends each piece to text / reasoning / tool_start / tool_args / tool_end, and each
  returns the events it causes as (event name, payload) pairs.
- At most one block is open (`_open`, the block's type). Whitespace alone (the newline
  between thoughts and a call) opens no text block: it is held, and goes out in front
  of the next text, or is dropped when another block opens first.
- An `Answer` is a pipeline.Writer: its events become `event: NAME` SSE frames
  (`start_frames` = start(), `step_frames` = each piece's feed(), `end_frames` =
  end(result, usage(result)), ...); non-streamed, `collect` feeds each piece and
  `whole(result)` is the family's final object.
"""
from __future__ import annotations

from typing import Optional

from mashbox.api.generation import Piece, Result
from mashbox.http import sse

Event = tuple[str, dict]  # (SSE event name, payload)


class Answer:
    """Base of a family's answer builder; subclasses name their text and call block types."""

    TEXT_KIND = "text"  # the block type text pieces go into
    CALL_KINDS: tuple[str, ...] = ()  # block types a tool call opens
    heartbeat_s: Optional[float] = None  # seconds of silence before keepalive(); None: never
    start_waits_for_engine = False  # see pipeline.Writer

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

    def usage(self, result: Result) -> dict:
        """The family's usage object of a result."""
        raise NotImplementedError

    def whole(self, result: Result) -> dict:
        """The non-streamed answer, after every piece was collected."""
        raise NotImplementedError

    # -- as a pipeline.Writer

    def start_frames(self, result: Result) -> list[bytes]:
        return _frames(self.start())

    def step_frames(self, pieces: list[Piece]) -> list[bytes]:
        return [sse.event(name, payload) for piece in pieces for name, payload in self.feed(piece)]

    def end_frames(self, result: Result) -> list[bytes]:
        return _frames(self.end(result, self.usage(result)))

    def fail_frames(self, message: str) -> list[bytes]:
        return _frames(self.fail(message))

    def keepalive_frames(self) -> list[bytes]:
        return _frames(self.keepalive())

    def collect(self, piece: Piece) -> None:
        self.feed(piece)

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


def _frames(events: list[Event]) -> list[bytes]:
    return [sse.event(name, payload) for name, payload in events]
