"""A Responses answer: generation pieces -> output items and their stream events
(`ResponseStream`), and the non-streamed Response built by the same object.

Rules:
- Pieces become output items in the order they come: reasoning (reasoning_text part),
  message (output_text part), function_call, custom_tool_call (a name the model calls
  is looked up in the request's `ToolRef`s: custom tools and namespaces go back to the
  client as it named them). A call's call_id is the piece's, minted once by the
  generation with the `call_` prefix; the items' own ids (rs_ / msg_ / fc_ / ctc_) are
  made here.
- Every stream event has a sequence_number rising from 1: response.created,
  response.in_progress, per item output_item.added, its part / text / arguments events,
  output_item.done, then response.completed (or response.incomplete when
  max_output_tokens ran out). An error after the stream started is `error` (carrying the
  response id as request_id, as Chat's and Messages' error events do), then
  `response.failed`.
- Logprobs (when asked for): the tokens of text pieces go into the output_text part's
  `logprobs` and the output_text.delta that carries their text (held whitespace keeps
  them until its delta goes out); the tokens of reasoning and tool calls are not
  reported (they are not output_text).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from mashbox.api import common
from mashbox.api.answer import Answer
from mashbox.api.logprobs import entry_json
from mashbox.api.generation import Result


@dataclass(frozen=True)
class ToolRef:
    """What a name the model calls stands for."""

    kind: str  # "function" | "custom"
    name: str  # the name the client gave (inside its namespace)
    namespace: Optional[str] = None


def usage_block(prompt_tokens: int, cached_tokens: int, output_tokens: int, reasoning_tokens: int) -> dict:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + output_tokens,
    }


def custom_input(arguments: str) -> str:
    """A custom tool call's raw input: the `input` string of the arguments the model wrote,
    or the whole argument text when the model did not write that shape."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return value["input"]
    return arguments


class ResponseStream(Answer):
    """One answer as Responses output items and stream events.

    Methods take one parsed piece and return the events it causes, as (type, payload)
    pairs, each payload already carrying its sequence_number. The open item:

        open \\ piece   reasoning          text               tool start
        None           open reasoning     open message       open call item
        reasoning      reasoning delta    close, message     close, call
        message        close, reasoning   output_text delta  close, call
        call           (tool_end closes it; any other piece first closes it)

    An item closes with its .done events and output_item.done. function_call
    arguments stream as they come (the SDK only concatenates them); a custom tool's
    input is known only when the call ends (it is the `input` string of the arguments),
    so it goes out as one delta then.
    """

    TEXT_KIND = "message"
    CALL_KINDS = ("function_call", "custom_tool_call")

    def __init__(self, response_id: str, model: str, created_at: int, echo: dict, refs: dict[str, ToolRef],
                 tokenizer: Any = None, logprobs: bool = False):
        super().__init__(response_id)
        self.logprobs = logprobs
        self._lp_pending: list[dict] = []  # text tokens whose delta has not gone out
        self.tokenizer = tokenizer  # counts the reasoning tokens of the usage
        self.model = model
        self.created_at = created_at
        self.echo = echo  # request fields the Response repeats (tools, tool_choice, ...)
        self.refs = refs
        self.items: list[dict] = []
        self._seq = 0

    # -- events

    def _event(self, kind: str, **fields) -> tuple[str, dict]:
        self._seq += 1
        payload = {"type": kind, "sequence_number": self._seq}
        payload.update(fields)
        return kind, payload

    def response(self, status: str, usage: Optional[dict] = None, incomplete_reason: Optional[str] = None,
                 error: Optional[dict] = None) -> dict:
        obj = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
            "model": self.model,
            "output": [dict(item) for item in self.items] if status != "in_progress" else [],
            "usage": usage,
        }
        obj.update(self.echo)
        return obj

    def start(self) -> list[tuple[str, dict]]:
        return [
            self._event("response.created", response=self.response("in_progress")),
            self._event("response.in_progress", response=self.response("in_progress")),
        ]

    # -- items

    def _index(self) -> int:
        return len(self.items) - 1

    def _open_item(self, item: dict) -> list[tuple[str, dict]]:
        events = self._close()
        self._pending_space = ""
        self.items.append(item)
        self._open = item["type"]
        added = dict(item)
        added["status"] = "in_progress"
        if item["type"] == "message":
            added["content"] = []
        elif item["type"] == "reasoning":
            added["content"] = []
        events.append(self._event("response.output_item.added", output_index=self._index(), item=added))
        if item["type"] in ("message", "reasoning"):
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []} \
                if item["type"] == "message" else {"type": "reasoning_text", "text": ""}
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=self._index(), content_index=0, part=part))
        return events

    def _close(self) -> list[tuple[str, dict]]:
        if self._open is None:
            return []
        item = self.items[-1]
        index = self._index()
        events = []
        if self._open == "message":
            part = item["content"][0]
            events.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"], logprobs=list(part["logprobs"])))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=dict(part)))
        elif self._open == "reasoning":
            part = item["content"][0]
            events.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"]))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=dict(part)))
        elif self._open == "function_call":
            item["arguments"] = "".join(self._args)
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, arguments=item["arguments"]))
        elif self._open == "custom_tool_call":
            item["input"] = custom_input("".join(self._args))
            if item["input"]:
                events.append(self._event("response.custom_tool_call_input.delta", item_id=item["id"],
                                          output_index=index, delta=item["input"]))
            events.append(self._event("response.custom_tool_call_input.done", item_id=item["id"],
                                      output_index=index, input=item["input"]))
        self._args = []
        item["status"] = "completed"
        events.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        self._open = None
        return events

    # -- pieces

    def reasoning(self, text: str) -> list[tuple[str, dict]]:
        if not text:
            return []
        events = [] if self._open == "reasoning" else self._open_item({
            "id": common.new_id("rs_"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress",
        })
        item = self.items[-1]
        item["content"][0]["text"] += text
        events.append(self._event("response.reasoning_text.delta", item_id=item["id"], output_index=self._index(),
                                  content_index=0, delta=text))
        return events

    def text(self, text: str) -> list[tuple[str, dict]]:
        text = self._unheld_text(text)
        if not text:
            return []
        events = [] if self._open == "message" else self._open_item({
            "id": common.new_id("msg_"), "type": "message", "role": "assistant", "status": "in_progress",
            "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}],
        })
        item = self.items[-1]
        item["content"][0]["text"] += text
        lps, self._lp_pending = self._lp_pending, []
        item["content"][0]["logprobs"].extend(lps)
        events.append(self._event("response.output_text.delta", item_id=item["id"], output_index=self._index(),
                                  content_index=0, delta=text, logprobs=lps))
        return events

    def feed(self, piece) -> list[tuple[str, dict]]:
        if piece.logprobs and piece.kind == "text":
            self._lp_pending.extend(entry_json(e) for e in piece.logprobs)
        return super().feed(piece)

    def tool_start(self, name: str, call_id: str = "") -> list[tuple[str, dict]]:
        ref = self.refs.get(name, ToolRef("function", name))
        if ref.kind == "custom":
            item = {"id": common.new_id("ctc_"), "type": "custom_tool_call", "call_id": call_id,
                    "name": ref.name, "input": "", "status": "in_progress"}
        else:
            item = {"id": common.new_id("fc_"), "type": "function_call", "call_id": call_id,
                    "name": ref.name, "arguments": "", "status": "in_progress"}
        if ref.namespace:
            item["namespace"] = ref.namespace
        return self._open_item(item)

    def tool_args(self, delta: str) -> list[tuple[str, dict]]:
        self._require_call()
        if not delta:
            return []
        self._args.append(delta)
        if self._open == "custom_tool_call":
            return []
        return [self._event("response.function_call_arguments.delta", item_id=self.items[-1]["id"],
                            output_index=self._index(), delta=delta)]

    # -- the end

    def finish(self, finish_reason: str, usage: dict) -> list[tuple[str, dict]]:
        events = self._close()
        obj = self.final(finish_reason, usage)
        kind = "response.incomplete" if obj["status"] == "incomplete" else "response.completed"
        events.append(self._event(kind, response=obj))
        return events

    def end(self, result: Result, usage: dict) -> list[tuple[str, dict]]:
        return self.finish(result.finish_reason, usage)

    def usage(self, result: Result) -> dict:
        return result_usage(self.tokenizer, result)

    def whole(self, result: Result) -> dict:
        return self.final(result.finish_reason, self.usage(result))

    def final(self, finish_reason: str, usage: dict) -> dict:
        self._close()
        if finish_reason == "length":
            return self.response("incomplete", usage, incomplete_reason="max_output_tokens")
        return self.response("completed", usage)

    def fail(self, message: str, code: str = "server_error") -> list[tuple[str, dict]]:
        """An error after the stream started: `error`, then response.failed. Open items
        are left as they were (in progress): they did not finish."""
        error = {"code": code, "message": message}
        return [
            self._event("error", code=code, message=message, param=None, request_id=self.id),
            self._event("response.failed", response=self.response("failed", None, error=error)),
        ]




def result_usage(tokenizer: Any, result: Result) -> dict:
    reasoning_tokens = 0
    if result.reasoning:
        # The engine counts tokens, not which of them were thoughts: re-encode the thoughts.
        reasoning_tokens = min(len(tokenizer.encode(result.reasoning)), result.completion_tokens)
    return usage_block(result.prompt_tokens, result.cached_tokens, result.completion_tokens, reasoning_tokens)
