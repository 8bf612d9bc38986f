"""A Messages answer: generation pieces -> content blocks and their stream events
(`MessageStream`), and the non-streamed Message built by the same object.

Rules:
- Pieces become content blocks in the order they come: thinking (closed by a
  signature_delta `mashbox-local`), text, tool_use (the id is the piece's, minted once
  by the generation with the `toolu_` prefix; input as one input_json_delta).
- The stream opens with message_start, then ping, once the engine answers (its first
  event carries the prefix-cache hit, so message_start's usage is true), or after PING_S
  without an answer (then it counts no cache hit). message_delta repeats message_start's
  input_tokens / cache_read_input_tokens, so one stream never says two things; the
  non-streamed Message uses the result's. A ping goes out every PING_S while nothing
  else does (a long prefill would otherwise leave the stream silent, and agents drop
  silent streams). An error after the stream
  started is an `error` event carrying the message id as request_id, and the stream
  ends there.
"""
from __future__ import annotations

import json
import logging
from typing import Optional

from mashbox.api.answer import Answer
from mashbox.api.generation import Result

log = logging.getLogger("mashbox.api.messages")

SIGNATURE = "mashbox-local"
PING_S = 10.0

# Engine finish reason -> stop_reason ("stop" becomes tool_use when the answer called a tool).
STOP_REASONS = {"stop": "end_turn", "stop_sequence": "stop_sequence", "length": "max_tokens"}


def usage_block(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    """MessageUsage: input_tokens counts only the prompt tokens not served from the cache."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
        "output_tokens": output_tokens,
    }


class MessageStream(Answer):
    """One answer as Messages content blocks and stream events.

    Each method takes one parsed piece and returns the events it causes, as
    (event name, payload) pairs; `blocks` holds the finished content. States of the open
    block, and what a piece does in each:

        open \\ piece   reasoning        text             tool start
        None           open thinking    open text        open tool_use
        thinking       delta            close, open text close, open tool_use
        text           close, thinking  delta            close, open tool_use
        tool_use       (tool_end closes it; any other piece first closes it)

    Closing a thinking block sends signature_delta `mashbox-local` before
    content_block_stop. A tool call's arguments are held until the call ends and go
    out as one input_json_delta of the parsed object: the SDK parses every partial
    input as JSON, so only text that is known to parse may be sent.
    """

    TEXT_KIND = "text"
    CALL_KINDS = ("tool_use",)

    def __init__(self, message_id: str, model: str, prompt_tokens: int):
        super().__init__(message_id)  # _open: "thinking" | "text" | "tool_use" | None
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.cached_tokens: Optional[int] = None  # what message_start said was cached (streams)
        self.blocks: list[dict] = []

    @property
    def heartbeat_s(self) -> float:
        return PING_S  # read at run time: tests shorten it

    @property
    def called_tool(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.blocks)

    def start(self) -> list[tuple[str, dict]]:
        message = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage_block(self.prompt_tokens, self.cached_tokens or 0, 0),
        }
        return [("message_start", {"type": "message_start", "message": message}), ping()]

    # -- blocks

    def _open_block(self, block: dict) -> list[tuple[str, dict]]:
        events = self._close()
        self._pending_space = ""
        self.blocks.append(block)
        self._open = block["type"]
        start = dict(block)
        if block["type"] == "tool_use":
            start["input"] = {}
        elif block["type"] == "thinking":
            start["signature"] = ""
        events.append(("content_block_start", {
            "type": "content_block_start", "index": len(self.blocks) - 1, "content_block": start,
        }))
        return events

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return ("content_block_delta", {
            "type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta,
        })

    def _close(self) -> list[tuple[str, dict]]:
        if self._open is None:
            return []
        events = []
        index = len(self.blocks) - 1
        block = self.blocks[index]
        if self._open == "thinking":
            block["signature"] = SIGNATURE
            events.append(self._delta({"type": "signature_delta", "signature": SIGNATURE}))
        elif self._open == "tool_use":
            block["input"] = parse_tool_input("".join(self._args))
            self._args = []
            events.append(self._delta({
                "type": "input_json_delta",
                "partial_json": json.dumps(block["input"], ensure_ascii=False),
            }))
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        self._open = None
        return events

    # -- pieces

    def reasoning(self, text: str) -> list[tuple[str, dict]]:
        if not text:
            return []
        events = [] if self._open == "thinking" else self._open_block(
            {"type": "thinking", "thinking": ""})
        self.blocks[-1]["thinking"] += text
        events.append(self._delta({"type": "thinking_delta", "thinking": text}))
        return events

    def text(self, text: str) -> list[tuple[str, dict]]:
        text = self._unheld_text(text)
        if not text:
            return []
        events = [] if self._open == "text" else self._open_block({"type": "text", "text": ""})
        self.blocks[-1]["text"] += text
        events.append(self._delta({"type": "text_delta", "text": text}))
        return events

    def tool_start(self, name: str, call_id: str = "") -> list[tuple[str, dict]]:
        return self._open_block({"type": "tool_use", "id": call_id, "name": name, "input": {}})

    def tool_args(self, delta: str) -> list[tuple[str, dict]]:
        self._require_call()
        self._args.append(delta)
        return []

    # -- the end

    def stop_reason(self, finish_reason: str) -> str:
        if finish_reason == "stop" and self.called_tool:
            return "tool_use"
        return STOP_REASONS.get(finish_reason, "end_turn")

    def finish(self, finish_reason: str, stop_sequence: Optional[str], usage: dict) -> list[tuple[str, dict]]:
        events = self._close()
        reason = self.stop_reason(finish_reason)
        events.append(("message_delta", {
            "type": "message_delta",
            "delta": {
                "stop_reason": reason,
                "stop_sequence": stop_sequence if reason == "stop_sequence" else None,
            },
            "usage": usage,
        }))
        events.append(("message_stop", {"type": "message_stop"}))
        return events

    def end(self, result: Result, usage: dict) -> list[tuple[str, dict]]:
        return self.finish(result.finish_reason, result.stop_sequence, usage)

    def fail(self, message: str) -> list[tuple[str, dict]]:
        return [error_event(message, request_id=self.id)]

    def keepalive(self) -> list[tuple[str, dict]]:
        return [ping()]

    start_waits_for_engine = True

    def start_frames(self, result: Result) -> list[bytes]:
        self.cached_tokens = result.cached_tokens
        return super().start_frames(result)

    def usage(self, result: Result) -> dict:
        if self.cached_tokens is None:  # not streamed: the result's counts
            return result_usage(result)
        return usage_block(result.prompt_tokens, self.cached_tokens, result.completion_tokens)

    def whole(self, result: Result) -> dict:
        return self.message(result.finish_reason, result.stop_sequence, self.usage(result))

    def message(self, finish_reason: str, stop_sequence: Optional[str], usage: dict) -> dict:
        self._close()
        reason = self.stop_reason(finish_reason)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self.blocks,
            "stop_reason": reason,
            "stop_sequence": stop_sequence if reason == "stop_sequence" else None,
            "usage": usage,
        }


def ping() -> tuple[str, dict]:
    return ("ping", {"type": "ping"})


def error_event(message: str, kind: str = "api_error", request_id: Optional[str] = None) -> tuple[str, dict]:
    payload: dict = {"type": "error", "error": {"type": kind, "message": message}}
    if request_id is not None:
        payload["request_id"] = request_id
    return ("error", payload)


def parse_tool_input(arguments: str) -> dict:
    """A finished call's argument text -> the tool_use input object."""
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        log.warning("tool call arguments are not JSON; sent as {}: %.200r", arguments)
        return {}
    if not isinstance(value, dict):
        log.warning("tool call arguments are not a JSON object; sent as {}: %.200r", arguments)
        return {}
    return value



def result_usage(result: Result) -> dict:
    return usage_block(result.prompt_tokens, result.cached_tokens, result.completion_tokens)
