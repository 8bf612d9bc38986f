"""A Chat Completions answer: generation pieces -> chat.completion.chunk frames
(`ChunkWriter`), or the whole chat.completion object.

Rules:
- finish_reason: tool_calls when the answer made a call and ended on its own; length
  when max_tokens or the context ran out; stop otherwise (EOS or a stop string).
- The stream: a role-only first chunk; then content, reasoning (`reasoning_content`
  and `reasoning`) and tool-call deltas (by index; a call's first delta has its id,
  type and name, later ones only argument text); consecutive text / reasoning pieces of
  one engine step share one delta. Then a finish chunk with an empty delta and timings;
  with stream_options.include_usage a chunk with empty choices and usage; then
  `data: [DONE]`.
- Logprobs (when asked for): a chunk carries the tokens its delta completes in
  `choices[0].logprobs.content` (api/logprobs.py: never before their text; a step whose
  tokens show no text sends them in a chunk with empty content); the whole completion
  has them all. Without them, `logprobs` is null as before.
- An error after the stream started is `event: error` carrying the response id as
  request_id, then `data: [DONE]` (Completions streams end the same way: `stream_error`).
"""
from __future__ import annotations

from typing import Optional

from mashbox.api import logprobs as logprobs_mod
from mashbox.api.generation import Piece, Result, timings_json
from mashbox.http import sse


def finish_reason(result: Result) -> str:
    if result.finish_reason == "length":
        return "length"
    if result.tool_calls:
        return "tool_calls"
    return "stop"


def usage_json(result: Result) -> dict:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.total_tokens,
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
    }


def tool_call_json(call) -> dict:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments.strip() or "{}"},
    }


def completion_json(cid: str, created: int, model: str, result: Result, logprobs: bool = False) -> dict:
    message: dict = {"role": "assistant", "content": result.text}
    if result.tool_calls and not result.text.strip():
        message["content"] = None
    if result.reasoning:
        message["reasoning_content"] = result.reasoning
        message["reasoning"] = result.reasoning
    if result.tool_calls:
        message["tool_calls"] = [tool_call_json(c) for c in result.tool_calls]
    return {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason(result),
                     "logprobs": logprobs_mod.chat_json(result.logprobs) if logprobs else None}],
        "usage": usage_json(result),
        "timings": timings_json(result.timings),
    }


class OpenAIWriter:
    """What the Chat and Completions writers share: no keep-alive frames, no start wait, a
    failure as `event: error` then [DONE], and the whole answer built from the result."""

    heartbeat_s: Optional[float] = None
    start_waits_for_engine = False
    id: str

    def fail_frames(self, message: str) -> list[bytes]:
        return [stream_error(message, self.id), sse.DONE]

    def keepalive_frames(self) -> list[bytes]:
        return []

    def collect(self, piece: Piece) -> None:
        pass  # the whole answer is built from the result


class ChunkWriter(OpenAIWriter):
    """The pipeline.Writer of a Chat answer: chunk frames streamed, the completion whole."""

    def __init__(self, cid: str, created: int, model: str, include_usage: bool = False, logprobs: bool = False):
        self.id = cid
        self.logprobs = logprobs
        self.created = created
        self.model = model
        self.include_usage = include_usage
        self.head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}

    def chunk(self, delta: dict, finish: Optional[str] = None, logprobs: tuple = (), **extra) -> bytes:
        obj = dict(self.head)
        lp = logprobs_mod.chat_json(logprobs) if logprobs else None
        obj["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}]
        obj.update(extra)
        return sse.data(obj)

    def role(self) -> bytes:
        return self.chunk({"role": "assistant"})

    def pieces(self, pieces: list) -> list:
        """Frames for a step's pieces: consecutive text / reasoning pieces share one delta."""
        frames = []
        buf_kind, buf = None, []
        lps: tuple = ()  # the tokens of the buffered delta

        def flush():
            nonlocal buf_kind, buf, lps
            if buf_kind == "text":
                frames.append(self.chunk({"content": "".join(buf)}, logprobs=lps))
            elif buf_kind == "reasoning":
                text = "".join(buf)
                frames.append(self.chunk({"reasoning_content": text, "reasoning": text}, logprobs=lps))
            buf_kind, buf, lps = None, [], ()

        for p in pieces:
            if p.kind in ("text", "reasoning"):
                if buf_kind != p.kind:
                    flush()
                    buf_kind = p.kind
                buf.append(p.text)
                lps += p.logprobs
                continue
            flush()
            if p.kind == "tool_start":
                frames.append(self.chunk({"tool_calls": [{
                    "index": p.index, "id": p.id, "type": "function",
                    "function": {"name": p.name, "arguments": ""},
                }]}, logprobs=p.logprobs))
            elif p.kind == "tool_args" and (p.text or p.logprobs):
                frames.append(self.chunk({"tool_calls": [{"index": p.index, "function": {"arguments": p.text}}]},
                                         logprobs=p.logprobs))
            elif p.logprobs:  # tool_end: the closing tag's tokens
                frames.append(self.chunk({}, logprobs=p.logprobs))
        flush()
        return frames

    def finish(self, result: Result) -> bytes:
        return self.chunk({}, finish_reason(result), timings=timings_json(result.timings))

    def usage(self, result: Result) -> bytes:
        obj = dict(self.head)
        obj["choices"] = []
        obj["usage"] = usage_json(result)
        obj["timings"] = timings_json(result.timings)
        return sse.data(obj)

    # -- as a pipeline.Writer

    def start_frames(self, result: Result) -> list[bytes]:
        return [self.role()]

    def step_frames(self, pieces: list[Piece]) -> list[bytes]:
        return self.pieces(pieces)

    def end_frames(self, result: Result) -> list[bytes]:
        frames = [self.finish(result)]
        if self.include_usage:
            frames.append(self.usage(result))
        frames.append(sse.DONE)
        return frames

    def whole(self, result: Result) -> dict:
        return completion_json(self.id, self.created, self.model, result, self.logprobs)


def stream_error(message: str, response_id: str, code: str = "internal_error") -> bytes:
    return sse.event("error", {"error": {"message": message, "type": "server_error", "param": None,
                                         "code": code, "request_id": response_id}})
