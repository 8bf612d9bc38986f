"""POST /v1/chat/completions: OpenAI Chat Completions with tools, thinking and streaming.

Rules:
- Request -> `Conversation`: system / developer messages join the system prompt
  (prompt.join_system); content is a string, null or text parts (`text`, and `refusal`
  on assistant turns); image_url / input_audio / file parts are 400 naming the part's
  type (text-only model). Assistant `tool_calls` carry arguments as JSON text; they are
  parsed into objects for the template (text that is not JSON stays a string). A tool
  message gets the called function's name from the assistant turn that made the call.
- Tools other than `function` are skipped (mashbox cannot run them). tool_choice: auto
  (default), none, required, or {"type": "function", "function": {"name"}}; required and
  named need tools, and a named one must be among them.
- Not supported, 400 naming the field: n != 1, logprobs true, top_logprobs,
  response_format other than text.
- finish_reason: tool_calls when the answer made a call and ended on its own; length
  when max_tokens or the context ran out; stop otherwise (EOS or a stop string).
- The stream: a role-only first chunk; then content, reasoning (`reasoning_content`
  and `reasoning`) and tool-call deltas (by index; a call's first delta has its id,
  type and name, later ones only argument text); a finish chunk with an empty delta and
  timings; with stream_options.include_usage a chunk with empty choices and usage; then
  `data: [DONE]`. An error after the stream started is `event: error` carrying the
  response id as request_id, then `data: [DONE]`.
"""
from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Optional

import orjson

from mashbox.api import common
from mashbox.api.common import OPENAI, ApiContext, bad_request
from mashbox.api.generation import EventStream, Generation, GenerationError, Result, timings_json
from mashbox.api.prompt import Conversation, ToolChoice, chat_prompt
from mashbox.http import sse
from mashbox.http.response import json_response
from mashbox.http.sse import StreamResponse

log = logging.getLogger("mashbox.api")

ROLES = ("system", "developer", "user", "assistant", "tool")
MEDIA_PARTS = ("image_url", "input_audio", "file", "image", "audio", "input_image", "input_file")


# ---------------------------------------------------------------------------------------
# Request -> conversation
# ---------------------------------------------------------------------------------------


def _content_text(content: Any, param: str, role: str) -> str:
    """A message's content as text: string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string, null or an array of content parts.", param)
    texts = []
    for j, part in enumerate(content):
        p = f"{param}[{j}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise bad_request(f"{p} must be a content part object.", p)
        kind = part.get("type")
        if kind in ("text", "input_text", "output_text") or (kind == "refusal" and role == "assistant"):
            key = "refusal" if kind == "refusal" else "text"
            text = part.get(key)
            if not isinstance(text, str):
                raise bad_request(f"{p}.{key} must be a string.", f"{p}.{key}")
            texts.append(text)
        elif kind in MEDIA_PARTS:
            raise bad_request(f"{p}.type: {kind} parts are not supported (this model reads text only).",
                              f"{p}.type")
        else:
            raise bad_request(f"{p}.type must be text, not {kind!r}.", f"{p}.type")
    return "\n".join(texts)


def _arguments_object(arguments: Any, param: str) -> Any:
    if arguments is None:
        return {}
    if isinstance(arguments, dict):
        return arguments
    if not isinstance(arguments, str):
        raise bad_request(f"{param} must be a string of JSON.", param)
    if not arguments.strip():
        return {}
    try:
        return orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return arguments  # the model wrote broken JSON earlier: show it as it was


def _tool_calls(calls: Any, param: str) -> list:
    if not isinstance(calls, list):
        raise bad_request(f"{param} must be an array.", param)
    out = []
    for k, call in enumerate(calls):
        p = f"{param}[{k}]"
        if not isinstance(call, dict):
            raise bad_request(f"{p} must be an object.", p)
        fn = common.get_object(call, "function", None, param=f"{p}.function")
        if fn is None:
            raise bad_request(f"{p}.function is required.", f"{p}.function")
        name = common.get_str(fn, "name", None, param=f"{p}.function.name")
        if not name:
            raise bad_request(f"{p}.function.name is required.", f"{p}.function.name")
        call_id = common.get_str(call, "id", "", param=f"{p}.id")
        out.append({
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": _arguments_object(fn.get("arguments"), f"{p}.function.arguments")},
        })
    return out


def to_messages(raw: Any) -> list:
    """OpenAI chat messages -> HF-style template messages (system ones left in place)."""
    if raw is None:
        raise bad_request("messages is required.", "messages")
    if not isinstance(raw, list):
        raise bad_request("messages must be an array of messages.", "messages")
    if not raw:
        raise bad_request("messages must hold at least one message.", "messages")
    out = []
    call_names: dict[str, str] = {}
    for i, m in enumerate(raw):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{p} must be an object.", p)
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"{p}.role must be one of {', '.join(ROLES)}, not {role!r}.", f"{p}.role")
        text = _content_text(m.get("content"), f"{p}.content", role)
        msg: dict = {"role": role, "content": text}
        if role == "assistant":
            if m.get("tool_calls") is not None:
                calls = _tool_calls(m["tool_calls"], f"{p}.tool_calls")
                if calls:
                    msg["tool_calls"] = calls
                    for c in calls:
                        if c["id"]:
                            call_names[c["id"]] = c["function"]["name"]
            reasoning = m.get("reasoning_content")
            if reasoning is None:
                reasoning = m.get("reasoning")
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise bad_request(f"{p}.reasoning_content must be a string.", f"{p}.reasoning_content")
                if reasoning:
                    msg["reasoning_content"] = reasoning
        elif role == "tool":
            call_id = common.get_str(m, "tool_call_id", "", param=f"{p}.tool_call_id")
            msg["tool_call_id"] = call_id
            name = call_names.get(call_id) or (m.get("name") if isinstance(m.get("name"), str) else None)
            if name:
                msg["name"] = name
        out.append(msg)
    return out


def to_tools(raw: Any) -> list:
    """Function tools in HF shape; other tool types are skipped."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad_request("tools must be an array.", "tools")
    tools = []
    for i, t in enumerate(raw):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad_request(f"{p} must be an object.", p)
        kind = t.get("type", "function")
        if kind != "function":
            continue
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{p}.function must be an object.", f"{p}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{p}.function.name must be a non-empty string.", f"{p}.function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"{p}.function.parameters must be an object.", f"{p}.function.parameters")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise bad_request(f"{p}.function.description must be a string.", f"{p}.function.description")
        tool_fn = {"name": name, "description": desc or "",
                   "parameters": params if params is not None else {"type": "object", "properties": {}}}
        tools.append({"type": "function", "function": tool_fn})
    return tools


def to_tool_choice(raw: Any, tools: list) -> ToolChoice:
    names = {t["function"]["name"] for t in tools}
    if raw is None:
        return ToolChoice("auto")
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise bad_request(f"tool_choice must be auto, none, required or a function, not {raw!r}.", "tool_choice")
        if raw == "required" and not tools:
            raise bad_request("tool_choice is required but no function tools were given.", "tool_choice")
        return ToolChoice(raw)
    if not isinstance(raw, dict):
        raise bad_request("tool_choice must be a string or an object.", "tool_choice")
    if raw.get("type") != "function":
        raise bad_request("tool_choice.type must be function.", "tool_choice.type")
    fn = raw.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise bad_request("tool_choice.function.name must be a non-empty string.", "tool_choice.function.name")
    if name not in names:
        raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools.",
                          "tool_choice.function.name")
    return ToolChoice("named", name)


def read_unsupported(body: dict) -> None:
    """Fields whose use the spec refuses with a 400 naming them."""
    logprobs = common.get_bool(body, "logprobs", None)
    if logprobs:
        raise bad_request("logprobs is not supported (log probabilities are not computed).", "logprobs")
    if body.get("top_logprobs") is not None:
        common.get_int(body, "top_logprobs", None)
        raise bad_request("top_logprobs is not supported (log probabilities are not computed).", "top_logprobs")
    fmt = common.get_object(body, "response_format", None)
    if fmt is not None:
        kind = fmt.get("type")
        if kind in ("json_object", "json_schema"):
            raise bad_request(f"response_format {kind} is not supported (no structured output); only text.",
                              "response_format")
        if kind != "text":
            raise bad_request(f"response_format.type must be text, not {kind!r}.", "response_format.type")


def read_enable_thinking(body: dict) -> Optional[bool]:
    kwargs = common.get_object(body, "chat_template_kwargs", None)
    if kwargs is not None and kwargs.get("enable_thinking") is not None:
        return common.get_bool(kwargs, "enable_thinking", None, param="chat_template_kwargs.enable_thinking")
    return common.get_bool(body, "enable_thinking", None)


# ---------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------


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


def completion_json(cid: str, created: int, model: str, result: Result) -> dict:
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
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason(result), "logprobs": None}],
        "usage": usage_json(result),
        "timings": timings_json(result.timings),
    }


class ChunkWriter:
    """Builds the chat.completion.chunk frames of one stream."""

    def __init__(self, cid: str, created: int, model: str):
        self.head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}

    def chunk(self, delta: dict, finish: Optional[str] = None, **extra) -> bytes:
        obj = dict(self.head)
        obj["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
        obj.update(extra)
        return sse.data(obj)

    def role(self) -> bytes:
        return self.chunk({"role": "assistant"})

    def pieces(self, pieces: list) -> list:
        """Frames for a step's pieces: consecutive text / reasoning pieces share one delta."""
        frames = []
        buf_kind, buf = None, []

        def flush():
            nonlocal buf_kind, buf
            if buf_kind == "text":
                frames.append(self.chunk({"content": "".join(buf)}))
            elif buf_kind == "reasoning":
                text = "".join(buf)
                frames.append(self.chunk({"reasoning_content": text, "reasoning": text}))
            buf_kind, buf = None, []

        for p in pieces:
            if p.kind in ("text", "reasoning"):
                if buf_kind != p.kind:
                    flush()
                    buf_kind = p.kind
                buf.append(p.text)
                continue
            flush()
            if p.kind == "tool_start":
                frames.append(self.chunk({"tool_calls": [{
                    "index": p.index, "id": p.id, "type": "function",
                    "function": {"name": p.name, "arguments": ""},
                }]}))
            elif p.kind == "tool_args" and p.text:
                frames.append(self.chunk({"tool_calls": [{"index": p.index, "function": {"arguments": p.text}}]}))
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


def stream_error(message: str, response_id: str, code: str = "internal_error") -> bytes:
    return sse.event("error", {"error": {"message": message, "type": "server_error", "param": None,
                                         "code": code, "request_id": response_id}})


def failed_stream(exc: GenerationError, response_id: str) -> tuple[bytes, bytes]:
    """The last frames of a Chat or Completions stream whose request failed on the device."""
    return stream_error(f"The request failed on the device: {exc}", response_id), sse.DONE


# ---------------------------------------------------------------------------------------
# The handler
# ---------------------------------------------------------------------------------------


def parse_request(api: ApiContext, body: Any):
    body = common.require_object(body)
    common.check_model(body, api)
    read_unsupported(body)
    stream = common.get_bool(body, "stream", False)
    opts = common.get_object(body, "stream_options", None)
    include_usage = bool(opts and common.get_bool(opts, "include_usage", False, param="stream_options.include_usage"))
    messages = to_messages(body.get("messages"))
    tools = to_tools(body.get("tools"))
    choice = to_tool_choice(body.get("tool_choice"), tools)
    conv = Conversation(messages=messages, tools=tools, tool_choice=choice,
                        enable_thinking=read_enable_thinking(body))
    fields = common.read_sampling(body, ("max_completion_tokens", "max_tokens"))
    return conv, fields, stream, include_usage


async def _stream(gen: Generation, writer: ChunkWriter, include_usage: bool, cid: str) -> AsyncIterator[bytes]:
    try:
        yield writer.role()
        async for step in gen.steps():
            frames = writer.pieces(step.pieces)
            if frames:
                gen.output_sent = True
                for f in frames:
                    yield f
            if step.finished:
                yield writer.finish(gen.result)
                if include_usage:
                    yield writer.usage(gen.result)
                yield sse.DONE
                return
    except GenerationError as exc:
        for frame in failed_stream(exc, cid):
            yield frame


def routes(api: ApiContext) -> list:
    async def chat_completions(req):
        body = common.request_body(api, req, OPENAI)
        conv, fields, stream, include_usage = parse_request(api, body)
        prompt = chat_prompt(api, conv, fields.max_tokens)
        cid = common.new_id("chatcmpl-")
        gen = Generation(api, prompt, fields, OPENAI, tenant=req.tenant, request_id=cid, tool_id_prefix="call_")
        gen.submit()
        created = common.now()
        if stream:
            frames = _stream(gen, ChunkWriter(cid, created, api.model_id), include_usage, cid)
            return StreamResponse(EventStream(frames, gen))
        result = await gen.run()
        return json_response(completion_json(cid, created, api.model_id, result))

    return [("POST", "/v1/chat/completions", chat_completions, OPENAI)]
