"""POST /v1/chat/completions: the OpenAI Chat Completions surface (tools, thinking,
streaming). The request converter is here; the answer writer is chat_answer.ChunkWriter.

Rules:
- Request -> `Conversation`: system / developer messages join the system prompt, later
  ones too, as the spec says (prompt.place_system's "join"); content is a string, null or text
  parts (`text`, and `refusal` on assistant turns); image_url / input_audio / file
  parts are 400 naming the part's type (text-only model). Assistant `tool_calls` carry
  arguments as JSON text; they are parsed into objects for the template (text that is
  not JSON stays a string). A tool message gets the called function's name from the
  assistant turn that made the call.
- Tools other than `function` are skipped (mashbox cannot run them). tool_choice: auto
  (default), none, required, or {"type": "function", "function": {"name"}}; required and
  named need tools, and a named one must be among them.
- Not supported, 400 naming the field: n != 1.
- response_format: text, json_object (any JSON object) or json_schema {name, schema,
  strict}: the answer is JSON valid for the schema (objects closed whatever strict
  says, see text/grammar.py), decoded under that grammar, and ends when the value is complete.
  parallel_tool_calls false: at most one call.
- `logprobs: true` with `top_logprobs` (0-20): each choice's `logprobs.content`, per
  chunk when streamed (api/logprobs.py).
- stream_options.include_usage adds the usage chunk to a stream.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import orjson

from mashbox.api import common, content, logprobs, pipeline
from mashbox.api.chat_answer import ChunkWriter
from mashbox.api.common import OPENAI, ApiContext, bad_request
from mashbox.api.pipeline import ApiRequest
from mashbox.api.prompt import Conversation, OutputFormat, Prompt, ToolChoice
from mashbox.config import Constraint
from mashbox.text import grammar

ROLES = ("system", "developer", "user", "assistant", "tool")
MEDIA_PARTS = ("image_url", "input_audio", "file", "image", "audio", "input_image", "input_file")


# ---------------------------------------------------------------------------------------
# Request -> conversation
# ---------------------------------------------------------------------------------------


_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text"}
_PARTS = dict(
    voice=content.OPENAI_CHAT,
    media=MEDIA_PARTS,
    media_words="{field}: {kind} parts are not supported (this model reads text only).",
    other_words="{field} must be text, not {kind!r}.",
    shape_what="a string, null or an array of content parts",
    object_what="a content part object",
    joiner="\n",
    bare_strings=True,
)
PARTS = content.PartRules(text_keys=_TEXT_PARTS, **_PARTS)
ASSISTANT_PARTS = content.PartRules(text_keys={**_TEXT_PARTS, "refusal": "refusal"}, **_PARTS)
TOOL_WORDS = content.ToolWords(content.OPENAI_CHAT, name="function.name", description="function.description",
                               parameters="function.parameters", empty_description=True)
CHOICE_WORDS = content.ChoiceWords(
    no_tools=lambda mode: bad_request("tool_choice is required but no function tools were given.", "tool_choice"),
    unknown=lambda name: bad_request(f"tool_choice names the function {name!r}, which is not among the tools.",
                                     "tool_choice.function.name"),
)


def _content_text(content_value: Any, param: str, role: str) -> str:
    """A message's content as text: string, null, or a list of text parts."""
    return content.text_of(content_value, param, ASSISTANT_PARTS if role == "assistant" else PARTS)


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
        tools.append(content.function_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), p,
                                           TOOL_WORDS))
    return tools


def to_tool_choice(raw: Any, tools: list) -> ToolChoice:
    names = {t["function"]["name"] for t in tools}
    if raw is None:
        return ToolChoice("auto")
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise bad_request(f"tool_choice must be auto, none, required or a function, not {raw!r}.", "tool_choice")
        return content.checked_choice(raw, None, names, CHOICE_WORDS)
    if not isinstance(raw, dict):
        raise bad_request("tool_choice must be a string or an object.", "tool_choice")
    if raw.get("type") != "function":
        raise bad_request("tool_choice.type must be function.", "tool_choice.type")
    fn = raw.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise bad_request("tool_choice.function.name must be a non-empty string.", "tool_choice.function.name")
    return content.checked_choice("named", name, names, CHOICE_WORDS)


def to_output_format(body: dict) -> Optional[OutputFormat]:
    """response_format: text (None), json_object, or json_schema {name, schema, strict}."""
    fmt = common.get_object(body, "response_format", None)
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputFormat(Constraint("json_object"), "response_format")
    if kind != "json_schema":
        raise bad_request(f"response_format.type must be text, json_object or json_schema, not {kind!r}.",
                          "response_format.type")
    spec = common.get_object(fmt, "json_schema", None, param="response_format.json_schema")
    if spec is None:
        raise bad_request("response_format.json_schema is required when the type is json_schema.",
                          "response_format.json_schema")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise bad_request("response_format.json_schema.name must be a string.", "response_format.json_schema.name")
    # strict is read and checked; every schema is decoded closed (text/grammar.py)
    common.get_bool(spec, "strict", False, param="response_format.json_schema.strict")
    schema = common.get_object(spec, "schema", None, param="response_format.json_schema.schema")
    if schema is None:
        return OutputFormat(Constraint("json_object"), "response_format.json_schema")
    return OutputFormat(grammar.json_schema_constraint(schema), "response_format.json_schema.schema")


def read_enable_thinking(body: dict) -> Optional[bool]:
    kwargs = common.get_object(body, "chat_template_kwargs", None)
    if kwargs is not None and kwargs.get("enable_thinking") is not None:
        return common.get_bool(kwargs, "enable_thinking", None, param="chat_template_kwargs.enable_thinking")
    return common.get_bool(body, "enable_thinking", None)


# ---------------------------------------------------------------------------------------
# The surface
# ---------------------------------------------------------------------------------------


def convert(api: ApiContext, body: Any) -> ApiRequest:
    body = common.require_object(body)
    model = common.check_model(body, api)
    stream = common.get_bool(body, "stream", False)
    opts = common.get_object(body, "stream_options", None)
    include_usage = bool(opts and common.get_bool(opts, "include_usage", False, param="stream_options.include_usage"))
    messages = to_messages(body.get("messages"))
    tools = to_tools(body.get("tools"))
    choice = to_tool_choice(body.get("tool_choice"), tools)
    conv = Conversation(messages=messages, tools=tools, tool_choice=choice,
                        enable_thinking=read_enable_thinking(body), later_system="join",
                        output_format=to_output_format(body),
                        parallel_tool_calls=common.get_bool(body, "parallel_tool_calls", None))
    fields = common.read_sampling(body, ("max_completion_tokens", "max_tokens"))
    fields = dataclasses.replace(fields, logprobs=logprobs.read_chat(body))
    return ApiRequest(fields=fields, stream=stream, conversation=conv, include_usage=include_usage, model=model)


def writer(api: ApiContext, request: ApiRequest, prompt: Prompt, answer_id: str) -> ChunkWriter:
    return ChunkWriter(answer_id, common.now(), request.model or api.model_id, request.include_usage,
                       request.fields.logprobs is not None)


SURFACE = pipeline.Surface("/v1/chat/completions", OPENAI, "chatcmpl-", convert, writer)


def routes(api: ApiContext) -> list:
    return [pipeline.route(api, SURFACE)]
