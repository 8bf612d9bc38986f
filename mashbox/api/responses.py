"""The OpenAI Responses surface: POST /v1/responses. The request converter is here; the
answer writer is response_answer.ResponseStream.

Rules:
- `instructions` is the system prompt; `input` is a string (one user message) or items:
  message (system / developer / user / assistant; a string or input_text / output_text
  parts), function_call, function_call_output, custom_tool_call(_output),
  local_shell_call(_output), reasoning. Assistant-side items that follow each other
  (reasoning, assistant message, calls) form one assistant turn; outputs become tool
  messages. A system / developer message stays a system message at its place
  (prompt.place_system's "remind": a later one stays in place). Image, audio and file parts are a
  400 naming the part (text-only model). Other item types carry nothing a text model can
  use and are skipped (logged), except item_reference: nothing is stored here to resolve
  it, so it is a 400.
- Tools: function (strict is accepted; the call's arguments are whatever the model
  wrote), namespace (each inner tool is shown to the model as `<namespace>__<name>`, or
  `<namespace><name>` when the namespace already ends in `_` or `.`, and its calls
  carry `namespace` and the inner name back), custom (shown as a function with one
  string parameter `input`; the call's `input` is that string, raw; a regex grammar
  format becomes that string's pattern, so the input is decoded under it; a lark one
  is shown in the description and the input is decoded under it too: text/grammar.py
  rewrites it for the JSON string the call carries). web_search and
  every other tool type mashbox cannot run are skipped.
- reasoning: no `reasoning` object -> the template's default; effort "none" or
  "minimal" -> thinking off; any other effort, or none given -> thinking on.
- text.format: text, json_object, or json_schema {name, schema, strict}: the output
  text is JSON valid for the schema (decoded under its grammar); parallel_tool_calls
  false: at most one call.
- Refused (400 naming the field): an `include` entry naming logprobs other than
  message.output_text.logprobs.
- Logprobs: `include: ["message.output_text.logprobs"]` and/or `top_logprobs` (0-20):
  the output_text part's `logprobs`, and each output_text.delta's (api/logprobs.py).
- The Response repeats request fields (`echo_fields`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, Optional

from mashbox.api import common, content, logprobs, pipeline
from mashbox.api.common import OPENAI, ApiContext
from mashbox.api.pipeline import ApiRequest
from mashbox.api.prompt import Conversation, OutputFormat, Prompt, ToolChoice
from mashbox.api.response_answer import ResponseStream, ToolRef
from mashbox.config import Constraint
from mashbox.text import grammar

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


def prompt_name(namespace: Optional[str], name: str) -> str:
    if not namespace:
        return name
    if namespace.endswith(("_", ".")):
        return namespace + name
    return namespace + "__" + name


# ---------------------------------------------------------------- tools


TOOL_WORDS = content.ToolWords(content.COLON)
CHOICE_WORDS = content.ChoiceWords(
    no_tools=lambda mode: bad_request("tool_choice", "required needs at least one function or custom tool"),
    unknown=lambda name: bad_request("tool_choice.name", f"no single tool named {name!r} in tools"),
)
PARTS = content.PartRules(
    voice=content.COLON,
    text_keys={kind: "text" for kind in _TEXT_PARTS},
    loose_keys={"refusal": "refusal"},
    media=_MEDIA_PARTS,
    media_words="{field}: {kind} parts are not supported (text-only model)",
    other_words="{field}: unsupported content part type {kind!r}",
    shape_what="a string or an array of content parts",
    object_what="a content part object",
    bare_strings=True,
    strings_joiner="",
)


def _function_tool(tool: dict, field: str, namespace: Optional[str]) -> tuple[dict, ToolRef]:
    name = tool.get("name")
    kind = tool.get("type")
    description = tool.get("description")
    parameters = tool.get("parameters")
    if kind == "custom":
        parameters = CUSTOM_INPUT_PARAMETERS
        fmt = tool.get("format")
        if isinstance(fmt, dict) and fmt.get("type") == "grammar" and fmt.get("syntax") == "regex" and \
                isinstance(fmt.get("definition"), str):
            # the call's input is decoded under the regex (the arguments' schema: grammar.py)
            parameters = {**CUSTOM_INPUT_PARAMETERS, "properties": {"input": {
                **CUSTOM_INPUT_PARAMETERS["properties"]["input"], "pattern": f"^(?:{fmt['definition']})$"}}}
        elif isinstance(description, (str, type(None))) and isinstance(fmt, dict) and \
                fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
            # A Lark grammar cannot hold a JSON string's content; showing it is the next best thing.
            extra = f"The input must follow this {fmt.get('syntax', '')} grammar:\n{fmt['definition']}"
            description = f"{description}\n\n{extra}" if description else extra
    pname = prompt_name(namespace, name) if isinstance(name, str) else None
    fn = content.function_tool(name, description, parameters, field, TOOL_WORDS, prompt_name=pname)
    return fn, ToolRef(kind, name, namespace)


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
        return content.checked_choice("required", None, refs, CHOICE_WORDS)
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "function":
            # Responses shape {"type", "name"}; the Chat shape {"type", "function": {"name"}} too.
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, dict) else choice.get("name")
            pname = _find_tool(name, choice.get("namespace"), refs, "function", "tool_choice")
            return content.checked_choice("named", pname, refs, CHOICE_WORDS)
        if kind == "custom":
            pname = _find_tool(choice.get("name"), choice.get("namespace"), refs, "custom", "tool_choice")
            return content.checked_choice("named", pname, refs, CHOICE_WORDS)
        if kind == "allowed_tools":
            mode = choice.get("mode", "auto")
            if mode not in ("auto", "required"):
                raise bad_request("tool_choice.mode", "must be auto or required")
            return conversation_tool_choice(mode, refs)
        raise bad_request("tool_choice.type", f"{kind!r} tools are not available on this server")
    raise bad_request("tool_choice", "must be auto, none, required or an object naming a tool")


# ---------------------------------------------------------------- input -> messages


def _parts_text(content_value: Any, field: str) -> str:
    """A string, or a list of text parts -> the text. Media parts are a 400."""
    return content.text_of(content_value, field, PARTS)


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
    if not inp:
        raise bad_request("input", "must hold at least one item")
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
                turns.plain("system", text)
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
            if isinstance(entry, str) and "logprobs" in entry and entry != logprobs.RESPONSES_INCLUDE:
                raise bad_request("include", f"{entry!r}: the logprobs entry is {logprobs.RESPONSES_INCLUDE!r}")


def output_format(body: dict) -> Optional[OutputFormat]:
    """text.format: text (None), json_object, or json_schema {name, schema, strict}."""
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("text", "must be an object")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format", "must be an object")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputFormat(Constraint("json_object"), "text.format")
    if kind != "json_schema":
        raise bad_request("text.format.type", f"must be text, json_object or json_schema, not {kind!r}")
    common.get_bool(fmt, "strict", False, param="text.format.strict")  # every schema is closed (grammar.py)
    schema = fmt.get("schema")
    if schema is None:
        return OutputFormat(Constraint("json_object"), "text.format")
    if not isinstance(schema, dict):
        raise bad_request("text.format.schema", "must be an object (a JSON Schema)")
    return OutputFormat(grammar.json_schema_constraint(schema), "text.format.schema")


def _lark_format(tool: dict) -> Optional[str]:
    fmt = tool.get("format")
    if tool.get("type") == "custom" and isinstance(fmt, dict) and fmt.get("type") == "grammar" and \
            fmt.get("syntax") == "lark" and isinstance(fmt.get("definition"), str):
        return fmt["definition"]
    return None


def tool_grammars(tools: Any) -> tuple[tuple[str, str], ...]:
    """(the name the model sees, its Lark definition) of each custom tool with a lark
    grammar format (conversation_tools already checked the tools' shapes)."""
    out = []
    for tool in tools if isinstance(tools, list) else ():
        inner = tool.get("tools") if tool.get("type") == "namespace" else [tool]
        namespace = tool.get("name") if tool.get("type") == "namespace" else None
        for t in inner:
            definition = _lark_format(t)
            if definition is not None:
                out.append((prompt_name(namespace, t["name"]), definition))
    return tuple(out)


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
        output_format=output_format(body),
        parallel_tool_calls=common.get_bool(body, "parallel_tool_calls", None),
        tool_grammars=tool_grammars(body.get("tools")),
    )
    return conv, refs


# ---------------------------------------------------------------- the surface


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
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    echo["text"] = {"format": fmt if isinstance(fmt, dict) else {"type": "text"}}
    echo["truncation"] = "disabled"
    return echo


def convert(api: ApiContext, body: Any) -> ApiRequest:
    body = common.require_object(body)
    model = common.check_model(body, api)
    conv, refs = to_conversation(body)
    stream = common.get_bool(body, "stream", False)
    fields = common.read_sampling(body, ("max_output_tokens", "max_completion_tokens", "max_tokens"))
    fields = dataclasses.replace(fields, logprobs=logprobs.read_responses(body))
    return ApiRequest(fields=fields, stream=stream, conversation=conv, echo=echo_fields(body), tool_refs=refs,
                      model=model)


def writer(api: ApiContext, request: ApiRequest, prompt: Prompt, answer_id: str) -> ResponseStream:
    return ResponseStream(answer_id, request.model or api.model_id, common.now(), request.echo, request.tool_refs,
                          api.tokenizer, request.fields.logprobs is not None)


SURFACE = pipeline.Surface("/v1/responses", OPENAI, "resp_", convert, writer)


def routes(api: ApiContext) -> list:
    return [pipeline.route(api, SURFACE)]
