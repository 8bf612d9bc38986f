"""The OpenAI Responses route: POST /v1/responses.

Rules:
- `instructions` is the system prompt; `input` is a string (one user message) or items:
  message (system / developer / user / assistant; a string or input_text / output_text
  parts), function_call, function_call_output, custom_tool_call(_output),
  local_shell_call(_output), reasoning. Assistant-side items that follow each other
  (reasoning, assistant message, calls) form one assistant turn; outputs become tool
  messages. A system / developer message after the first turn stays at its place as
  user text in <system-reminder> tags (messages.add_system_note: the prompt's start,
  and so the prefix cache, stays the same turn to turn). Image, audio and file parts are a 400 naming the part (text-only model).
  Other item types carry nothing a text model can use and are skipped (logged), except
  item_reference: nothing is stored here to resolve it, so it is a 400.
- Tools: function (strict is accepted; the call's arguments are whatever the model
  wrote), namespace (each inner tool is shown to the model as `<namespace>__<name>`, or
  `<namespace><name>` when the namespace already ends in `_` or `.`, and its calls
  carry `namespace` and the inner name back), custom (shown as a function with one
  string parameter `input`; the call's `input` is that string, raw). web_search and
  every other tool type mashbox cannot run are skipped.
- reasoning: no `reasoning` object -> the template's default; effort "none" or
  "minimal" -> thinking off; any other effort, or none given -> thinking on.
- Refused (400 naming the field): an `include` entry naming logprobs, top_logprobs,
  text.format other than {"type": "text"}.
- Output (`ResponseStream`): pieces become output items in the order they come:
  reasoning (reasoning_text part), message (output_text part), function_call,
  custom_tool_call. The same object builds the non-streamed Response. Every stream
  event has a sequence_number rising from 1: response.created, response.in_progress,
  per item output_item.added, its part / text / arguments events, output_item.done,
  then response.completed (or response.incomplete when max_output_tokens ran out).
  An error after the stream started is `error`, then `response.failed`.
"""
from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from typing import Any, Optional

from mashbox.api import answer, common
from mashbox.api.answer import Answer
from mashbox.api.common import OPENAI, ApiContext
from mashbox.api.generation import EventStream, Generation, Result
from mashbox.api.messages import add_system_note
from mashbox.api.prompt import Conversation, ToolChoice, chat_prompt
from mashbox.http.response import json_response
from mashbox.http.sse import StreamResponse

log = logging.getLogger(__name__)

CUSTOM_INPUT_PARAMETERS = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "The tool's input, as raw text."}},
    "required": ["input"],
}
LOCAL_SHELL = "local_shell"

_MEDIA_PARTS = ("input_image", "input_file", "input_audio", "image", "file", "audio")
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def bad_request(field: str, message: str):
    return common.bad_request(f"{field}: {message}", field, common.OPENAI)


@dataclass(frozen=True)
class ToolRef:
    """What a name the model calls stands for."""

    kind: str  # "function" | "custom"
    name: str  # the name the client gave (inside its namespace)
    namespace: Optional[str] = None


def prompt_name(namespace: Optional[str], name: str) -> str:
    if not namespace:
        return name
    if namespace.endswith(("_", ".")):
        return namespace + name
    return namespace + "__" + name


# ---------------------------------------------------------------- tools


def _function_tool(tool: dict, field: str, namespace: Optional[str]) -> tuple[dict, ToolRef]:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{field}.name", "must be a non-empty string")
    kind = tool.get("type")
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{field}.description", "must be a string")
    if kind == "custom":
        parameters = CUSTOM_INPUT_PARAMETERS
        fmt = tool.get("format")
        if isinstance(fmt, dict) and fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
            # The model cannot be held to the grammar; showing it is the next best thing.
            extra = f"The input must follow this {fmt.get('syntax', '')} grammar:\n{fmt['definition']}"
            description = f"{description}\n\n{extra}" if description else extra
    else:
        parameters = tool.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise bad_request(f"{field}.parameters", "must be an object")
    fn = {"name": prompt_name(namespace, name), "parameters": parameters}
    if description:
        fn["description"] = description
    return {"type": "function", "function": fn}, ToolRef(kind, name, namespace)


def conversation_tools(tools: Any) -> tuple[list[dict], dict[str, ToolRef]]:
    """Request tools -> HF function tools and a map from the name the model sees to the tool."""
    if tools is None:
        return [], {}
    if not isinstance(tools, list):
        raise bad_request("tools", "must be an array")
    out: list[dict] = []
    refs: dict[str, ToolRef] = {}

    def add(tool: dict, field: str, namespace: Optional[str]):
        fn, ref = _function_tool(tool, field, namespace)
        pname = fn["function"]["name"]
        if pname in refs:
            raise bad_request(f"{field}.name", f"tool name {pname!r} is used twice")
        out.append(fn)
        refs[pname] = ref

    for i, tool in enumerate(tools):
        f = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f, "must be an object")
        kind = tool.get("type")
        if kind in ("function", "custom"):
            add(tool, f, None)
        elif kind == "namespace":
            ns = tool.get("name")
            if not isinstance(ns, str) or not ns:
                raise bad_request(f"{f}.name", "must be a non-empty string")
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise bad_request(f"{f}.tools", "must be an array")
            for j, t in enumerate(inner):
                g = f"{f}.tools[{j}]"
                if not isinstance(t, dict):
                    raise bad_request(g, "must be an object")
                if t.get("type") in ("function", "custom"):
                    add(t, g, ns)
        # web_search, file_search, local_shell, mcp, ...: mashbox cannot run them.
    return out, refs


def _find_tool(name: Any, namespace: Any, refs: dict[str, ToolRef], kind: str, field: str) -> str:
    if not isinstance(name, str):
        raise bad_request(f"{field}.name", "must be a string")
    candidates = [p for p, r in refs.items() if r.kind == kind and (
        p == name or (r.name == name and (namespace is None or r.namespace == namespace)))]
    if len(candidates) != 1:
        raise bad_request(f"{field}.name", f"no single {kind} tool named {name!r} in tools")
    return candidates[0]


def conversation_tool_choice(choice: Any, refs: dict[str, ToolRef]) -> ToolChoice:
    if choice is None or choice == "auto":
        return ToolChoice("auto")
    if choice == "none":
        return ToolChoice("none")
    if choice == "required":
        if not refs:
            raise bad_request("tool_choice", "required needs at least one function or custom tool")
        return ToolChoice("required")
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "function":
            # Responses shape {"type", "name"}; the Chat shape {"type", "function": {"name"}} too.
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, dict) else choice.get("name")
            return ToolChoice("named", _find_tool(name, choice.get("namespace"), refs, "function", "tool_choice"))
        if kind == "custom":
            return ToolChoice("named", _find_tool(choice.get("name"), choice.get("namespace"), refs, "custom",
                                                  "tool_choice"))
        if kind == "allowed_tools":
            mode = choice.get("mode", "auto")
            if mode not in ("auto", "required"):
                raise bad_request("tool_choice.mode", "must be auto or required")
            return conversation_tool_choice(mode, refs)
        raise bad_request("tool_choice.type", f"{kind!r} tools are not available on this server")
    raise bad_request("tool_choice", "must be auto, none, required or an object naming a tool")


# ---------------------------------------------------------------- input -> messages


def _parts_text(content: Any, field: str) -> str:
    """A string, or a list of text parts -> the text. Media parts are a 400."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise bad_request(field, "must be a string or an array of content parts")
    texts = []
    for j, part in enumerate(content):
        f = f"{field}[{j}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise bad_request(f, "must be a content part object")
        kind = part.get("type")
        if kind in _MEDIA_PARTS:
            raise bad_request(f"{f}.type", f"{kind} parts are not supported (text-only model)")
        if kind == "refusal":
            texts.append(str(part.get("refusal", "")))
        elif kind in _TEXT_PARTS:
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"{f}.text", "must be a string")
            texts.append(text)
        else:
            raise bad_request(f"{f}.type", f"unsupported content part type {kind!r}")
    return "".join(texts) if all(isinstance(p, str) for p in content) else "\n\n".join(texts)


def _arguments(raw: Any, field: str):
    """A function_call's arguments string -> a dict for the template; raw text if it is not
    a JSON object (a model's broken call fed back must not break the conversation)."""
    if isinstance(raw, dict):
        return raw
    if raw is None:
        return {}
    if not isinstance(raw, str):
        raise bad_request(field, "must be a string")
    try:
        value = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return raw
    return value if isinstance(value, dict) else raw


class _Turns:
    """Builds the message list; consecutive assistant-side items share one assistant turn."""

    def __init__(self):
        self.messages: list[dict] = []

    def plain(self, role: str, content: str):
        self.messages.append({"role": role, "content": content})

    def assistant(self) -> dict:
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": ""}
            self.messages.append(last)
        return last

    def assistant_text(self, text: str):
        msg = self.assistant()
        msg["content"] = msg["content"] + ("\n\n" if msg["content"] and text else "") + text

    def reasoning(self, text: str):
        msg = self.assistant()
        if msg.get("tool_calls") or msg["content"]:
            # A thought after this turn's answer starts the next assistant turn.
            msg = {"role": "assistant", "content": ""}
            self.messages.append(msg)
        prev = msg.get("reasoning_content")
        msg["reasoning_content"] = f"{prev}\n\n{text}" if prev else text

    def call(self, call_id: str, name: str, arguments):
        self.assistant().setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})

    def output(self, call_id: str, text: str):
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": text})


def _call_id(item: dict, field: str) -> str:
    call_id = item.get("call_id")
    if call_id is None:
        call_id = item.get("id")
    if not isinstance(call_id, str):
        raise bad_request(f"{field}.call_id", "must be a string")
    return call_id


def conversation_messages(body: dict) -> list[dict]:
    turns = _Turns()
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("instructions", "must be a string")
        if instructions:
            turns.plain("system", instructions)
    inp = body.get("input")
    if isinstance(inp, str):
        turns.plain("user", inp)
        return turns.messages
    if not isinstance(inp, list):
        raise bad_request("input", "is required: a string or an array of items")
    for i, item in enumerate(inp):
        f = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f, "must be an object")
        kind = item.get("type")
        if kind is None and "role" in item:
            kind = "message"
        if kind == "message":
            role = item.get("role")
            text = _parts_text(item.get("content"), f"{f}.content")
            if role in ("system", "developer"):
                add_system_note(turns.messages, text)
            elif role == "user":
                turns.plain("user", text)
            elif role == "assistant":
                turns.assistant_text(text)
            else:
                raise bad_request(f"{f}.role", "must be system, developer, user or assistant")
        elif kind == "function_call":
            name = item.get("name")
            if not isinstance(name, str):
                raise bad_request(f"{f}.name", "must be a string")
            ns = item.get("namespace")
            turns.call(_call_id(item, f), prompt_name(ns if isinstance(ns, str) else None, name),
                       _arguments(item.get("arguments"), f"{f}.arguments"))
        elif kind == "custom_tool_call":
            name = item.get("name")
            if not isinstance(name, str):
                raise bad_request(f"{f}.name", "must be a string")
            raw = item.get("input", "")
            if not isinstance(raw, str):
                raise bad_request(f"{f}.input", "must be a string")
            ns = item.get("namespace")
            turns.call(_call_id(item, f), prompt_name(ns if isinstance(ns, str) else None, name), {"input": raw})
        elif kind == "local_shell_call":
            action = item.get("action", {})
            turns.call(_call_id(item, f), LOCAL_SHELL, action if isinstance(action, dict) else {})
        elif kind in ("function_call_output", "custom_tool_call_output", "local_shell_call_output"):
            turns.output(_call_id(item, f), _parts_text(item.get("output"), f"{f}.output"))
        elif kind == "reasoning":
            text = _parts_text(item.get("content"), f"{f}.content") or _parts_text(
                item.get("summary"), f"{f}.summary")
            if text:
                turns.reasoning(text)
        elif kind == "item_reference":
            raise bad_request(f"{f}.type", "item_reference is not supported: this server stores no responses")
        else:
            log.info("skipping a %r input item (nothing a text model can use)", kind)
    return turns.messages


# ---------------------------------------------------------------- the whole request


def enable_thinking(reasoning: Any) -> Optional[bool]:
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise bad_request("reasoning", "must be an object")
    effort = reasoning.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise bad_request("reasoning.effort", "must be a string")
    return effort not in ("none", "minimal")


def check_unsupported(body: dict) -> None:
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list):
            raise bad_request("include", "must be an array")
        for j, entry in enumerate(include):
            if isinstance(entry, str) and "logprobs" in entry:
                raise bad_request("include", f"{entry!r}: log probabilities are not supported")
    if body.get("top_logprobs") is not None:
        raise bad_request("top_logprobs", "log probabilities are not supported")
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict):
            raise bad_request("text", "must be an object")
        fmt = text.get("format")
        if fmt is not None:
            kind = fmt.get("type") if isinstance(fmt, dict) else None
            if kind != "text":
                raise bad_request("text.format", f"only {{\"type\": \"text\"}} is supported, not {kind!r} "
                                                 "(structured output is not supported)")


def to_conversation(body: Any) -> tuple[Conversation, dict[str, ToolRef]]:
    common.require_object(body)
    check_unsupported(body)
    tools, refs = conversation_tools(body.get("tools"))
    choice = conversation_tool_choice(body.get("tool_choice"), refs)
    conv = Conversation(
        messages=conversation_messages(body),
        tools=tools,
        tool_choice=choice,
        enable_thinking=enable_thinking(body.get("reasoning")),
    )
    return conv, refs


# ---------------------------------------------------------------- pieces -> Response / events


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

    NAME = "responses"
    TEXT_KIND = "message"
    CALL_KINDS = ("function_call", "custom_tool_call")

    def __init__(self, response_id: str, model: str, created_at: int, echo: dict, refs: dict[str, ToolRef]):
        super().__init__(response_id)
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
                                      content_index=0, text=part["text"], logprobs=[]))
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
        events.append(self._event("response.output_text.delta", item_id=item["id"], output_index=self._index(),
                                  content_index=0, delta=text, logprobs=[]))
        return events

    def tool_start(self, name: str, call_id: str = "") -> list[tuple[str, dict]]:
        ref = self.refs.get(name, ToolRef("function", name))
        call_id = call_id or common.new_id("call_")
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
            self._event("error", code=code, message=message, param=None),
            self._event("response.failed", response=self.response("failed", None, error=error)),
        ]


# ---------------------------------------------------------------- the handler

# Request fields the Response object repeats, with their defaults.
ECHOED = (
    ("instructions", None),
    ("max_output_tokens", None),
    ("metadata", {}),
    ("previous_response_id", None),
    ("prompt_cache_key", None),
    ("reasoning", None),
    ("store", False),
    ("temperature", 0.0),
    ("top_p", 1.0),
)


def echo_fields(body: dict) -> dict:
    echo = {name: body.get(name, default) if body.get(name) is not None else default for name, default in ECHOED}
    echo["parallel_tool_calls"] = common.get_bool(body, "parallel_tool_calls", False)
    echo["tool_choice"] = body.get("tool_choice") if body.get("tool_choice") is not None else "auto"
    echo["tools"] = body.get("tools") or []
    echo["text"] = {"format": {"type": "text"}}
    echo["truncation"] = "disabled"
    return echo


def parse_request(api: ApiContext, body: Any):
    body = common.require_object(body)
    common.check_model(body, api)
    conv, refs = to_conversation(body)
    stream = common.get_bool(body, "stream", False)
    fields = common.read_sampling(body, ("max_output_tokens", "max_completion_tokens", "max_tokens"))
    return conv, refs, fields, stream, echo_fields(body)


def result_usage(api: ApiContext, result: Result) -> dict:
    reasoning_tokens = 0
    if result.reasoning:
        # The engine counts tokens, not which of them were thoughts: re-encode the thoughts.
        reasoning_tokens = min(len(api.tokenizer.encode(result.reasoning)), result.completion_tokens)
    return usage_block(result.prompt_tokens, result.cached_tokens, result.completion_tokens, reasoning_tokens)


def routes(api: ApiContext) -> list:
    async def create_response(req):
        body = common.request_body(api, req, OPENAI)
        conv, refs, fields, stream, echo = parse_request(api, body)
        prompt = chat_prompt(api, conv, fields.max_tokens)
        rid = common.new_id("resp_")
        gen = Generation(api, prompt, fields, OPENAI, tenant=req.tenant, request_id=rid, tool_id_prefix="call_")
        gen.submit()
        rs = ResponseStream(rid, api.model_id, common.now(), echo, refs)
        usage = functools.partial(result_usage, api)
        if stream:
            return StreamResponse(EventStream(answer.frames(gen, rs, usage), gen))
        r = await gen.run(rs.feed)
        return json_response(rs.final(r.finish_reason, usage(r)))

    return [("POST", "/v1/responses", create_response, OPENAI)]
