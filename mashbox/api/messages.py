"""The Anthropic Messages surface: POST /v1/messages (also `?beta=true`) and
POST /v1/messages/count_tokens. The request converter is here; the answer writer is
message_answer.MessageStream.

Rules:
- A request becomes the shared conversation form (`to_conversation`): chat-template
  messages (`system` / `user` / `assistant` with `tool_calls` and `reasoning_content` /
  `tool`), function tools, a tool_choice and enable_thinking. Everything model specific
  (template, tool prompt, forced calls, max_tokens clamping, where system text goes) is
  prompt.py's business.
- `system` is a string or text blocks. A block whose text starts with
  `x-anthropic-billing-header:` is dropped: Claude Code changes it every turn, and the
  prefix cache could never hit past it.
- Content blocks: text, tool_use, tool_result (string or text blocks; is_error marks
  the text), thinking (-> reasoning_content), redacted_thinking (opaque, dropped).
  cache_control is ignored. image / document and any other block type: 400 naming the
  field.
- Tools with a `type` other than "custom" are Anthropic server tools (web search, code
  execution, ...): mashbox cannot run them, so they are skipped, not refused.
- A `role: system` message inside `messages` stays a system message at its place;
  prompt.place_system decides what that means (Messages and Responses keep a later one in place).
- thinking: enabled / adaptive -> enable_thinking true; disabled or absent -> false
  (absent means no thinking in the Messages API).
- output_config.format {"type": "json_schema", "schema"}: the text is JSON valid for
  the schema (closed objects, text/grammar.py's strict_schema), decoded under its grammar;
  tool_choice.disable_parallel_tool_use: at most one tool_use block.
- The model named in the request is echoed in the answer (any model name is accepted;
  a `model` that is not a string is a 400). thinking.budget_tokens must be an integer
  when given (it is not otherwise used).
"""
from __future__ import annotations

from typing import Any, Iterator, Optional

from mashbox.api import common, content, pipeline
from mashbox.api.common import ANTHROPIC, ApiContext
from mashbox.api.message_answer import MessageStream
from mashbox.api.pipeline import ApiRequest
from mashbox.api.prompt import Conversation, OutputFormat, Prompt, ToolChoice, count_chat_tokens
from mashbox.text import grammar
from mashbox.http.response import json_response

BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"

# Block types that carry media the text-only model cannot read.
_MEDIA_BLOCKS = ("image", "document", "search_result", "container_upload")


def bad_request(field: str, message: str):
    return common.bad_request(f"{field}: {message}", field, common.ANTHROPIC)


# ---------------------------------------------------------------- request -> conversation


def _blocks(content: Any, field: str) -> Iterator[tuple[str, Any, dict]]:
    """(field path, type, block) of each block of a content list; anything else is a 400.
    Checked as it is iterated, so the first bad block in order is the one a 400 names."""
    if not isinstance(content, list):
        raise bad_request(field, "must be a string or a list of content blocks")
    for j, block in enumerate(content):
        f = f"{field}[{j}]"
        if not isinstance(block, dict):
            raise bad_request(f, "must be a content block object")
        yield f, block.get("type"), block


def _unsupported_block(field: str, kind: Any, where: str = ""):
    """The 400 for a block of a type this place does not take (media: text-only model)."""
    if kind in _MEDIA_BLOCKS:
        return bad_request(f"{field}.type", f"{kind} blocks are not supported (text-only model)")
    return bad_request(f"{field}.type", f"unsupported content block type {kind!r}{where}")


TEXT_BLOCKS = content.PartRules(
    voice=content.COLON,
    text_keys={"text": "text"},
    media=_MEDIA_BLOCKS,
    media_words="{field}: {kind} blocks are not supported (text-only model)",
    other_words="{field}: unsupported content block type {kind!r} here",
    shape_what="a string or a list of content blocks",
    object_what="a content block object",
)
TOOL_WORDS = content.ToolWords(content.COLON, parameters="input_schema", default_parameters={"type": "object"})
CHOICE_WORDS = content.ChoiceWords(
    no_tools=lambda mode: bad_request("tool_choice.type", "any needs at least one tool in tools"),
    unknown=lambda name: bad_request("tool_choice.name", f"no tool named {name!r} in tools"),
)


def _text_of_blocks(blocks: Any, field: str) -> str:
    """Text of a string or a list of text blocks (tool_result content, system)."""
    return content.text_of(blocks, field, TEXT_BLOCKS)


def _block_text(block: dict, field: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{field}.text", "must be a string")
    return text


def system_text(system: Any) -> Optional[str]:
    """The system prompt from `system` (string or text blocks), billing header dropped."""
    if system is None:
        return None
    if isinstance(system, str):
        return None if system.startswith(BILLING_HEADER_PREFIX) else system
    if not isinstance(system, list):
        raise bad_request("system", "must be a string or a list of text blocks")
    texts = []
    for j, block in enumerate(system):
        f = f"system[{j}]"
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else None
            if kind in _MEDIA_BLOCKS:
                raise _unsupported_block(f, kind)
            raise bad_request(f, "must be a text block")
        text = _block_text(block, f)
        if text.startswith(BILLING_HEADER_PREFIX):
            continue
        texts.append(text)
    return "\n\n".join(texts) if texts else None


def _tool_result_message(block: dict, field: str) -> dict:
    tool_use_id = block.get("tool_use_id")
    if not isinstance(tool_use_id, str):
        raise bad_request(f"{field}.tool_use_id", "must be a string")
    text = _text_of_blocks(block.get("content"), f"{field}.content")
    if block.get("is_error"):
        # The model has no flag to read; say it in words.
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": tool_use_id, "content": text}


def _user_messages(content: Any, field: str) -> list[dict]:
    """One user turn -> tool messages (tool_result blocks) and user messages (text), in order."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[dict] = []
    texts: list[str] = []

    def flush():
        if texts:
            out.append({"role": "user", "content": "\n\n".join(texts)})
            texts.clear()

    for f, kind, block in _blocks(content, field):
        if kind == "text":
            texts.append(_block_text(block, f))
        elif kind == "tool_result":
            flush()
            out.append(_tool_result_message(block, f))
        elif kind in ("thinking", "redacted_thinking"):
            continue  # only meaningful on assistant turns
        else:
            raise _unsupported_block(f, kind)
    flush()
    return out


def _assistant_message(content: Any, field: str) -> dict:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict] = []
    for f, kind, block in _blocks(content, field):
        if kind == "text":
            texts.append(_block_text(block, f))
        elif kind == "thinking":
            t = block.get("thinking")
            if not isinstance(t, str):
                raise bad_request(f"{f}.thinking", "must be a string")
            thinking.append(t)
        elif kind == "redacted_thinking":
            continue  # encrypted by someone else; nothing the model can read
        elif kind == "tool_use":
            name = block.get("name")
            if not isinstance(name, str) or not name:
                raise bad_request(f"{f}.name", "must be a non-empty string")
            args = block.get("input", {})
            if not isinstance(args, dict):
                raise bad_request(f"{f}.input", "must be an object")
            call_id = block.get("id")
            if not isinstance(call_id, str):
                raise bad_request(f"{f}.id", "must be a string")
            calls.append({
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": args},
            })
        else:
            raise _unsupported_block(f, kind)
    msg: dict = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        msg["reasoning_content"] = "\n\n".join(thinking)
    if calls:
        msg["tool_calls"] = calls
    return msg


def conversation_messages(body: dict) -> list[dict]:
    """`system` + `messages` -> chat-template messages."""
    out: list[dict] = []
    system = system_text(body.get("system"))
    if system is not None:
        out.append({"role": "system", "content": system})
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad_request("messages", "is required and must be a list")
    if not messages:
        raise bad_request("messages", "must hold at least one message")
    for i, m in enumerate(messages):
        f = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f, "must be an object")
        role = m.get("role")
        content = m.get("content")
        if role == "user":
            out.extend(_user_messages(content, f"{f}.content"))
        elif role == "assistant":
            out.append(_assistant_message(content, f"{f}.content"))
        elif role == "system":
            out.append({"role": "system", "content": _text_of_blocks(content, f"{f}.content")})
        else:
            raise bad_request(f"{f}.role", "must be user, assistant or system")
    return out


def conversation_tools(tools: Any) -> list[dict]:
    """Client tools -> function tools; server tools (a `type` other than custom) skipped."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_request("tools", "must be a list")
    out = []
    for i, tool in enumerate(tools):
        f = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f, "must be an object")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            continue
        schema = tool.get("input_schema", {"type": "object"})
        if schema is None:
            raise TOOL_WORDS.voice.error(f"{f}.input_schema", "an object")
        out.append(content.function_tool(tool.get("name"), tool.get("description"), schema, f, TOOL_WORDS))
    return out


def conversation_tool_choice(choice: Any, tools: list[dict]) -> ToolChoice:
    """Anthropic tool_choice -> auto / none / required (any) / named (tool)."""
    if choice is None:
        return ToolChoice("auto")
    if not isinstance(choice, dict):
        raise bad_request("tool_choice", "must be an object with a type")
    kind = choice.get("type")
    if kind == "auto":
        return ToolChoice("auto")
    if kind == "none":
        return ToolChoice("none")
    names = {t["function"]["name"] for t in tools}
    if kind == "any":
        return content.checked_choice("required", None, names, CHOICE_WORDS)
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise bad_request("tool_choice.name", "must be a string")
        return content.checked_choice("named", name, names, CHOICE_WORDS)
    raise bad_request("tool_choice.type", "must be auto, any, tool or none")


def enable_thinking(thinking: Any) -> bool:
    if thinking is None:
        return False
    if not isinstance(thinking, dict):
        raise bad_request("thinking", "must be an object")
    kind = thinking.get("type")
    # Read only to refuse a wrong type: the model has no thinking budget to hold to.
    common.get_int(thinking, "budget_tokens", None, param="thinking.budget_tokens")
    if kind in ("enabled", "adaptive"):
        return True
    if kind == "disabled":
        return False
    raise bad_request("thinking.type", "must be enabled, adaptive or disabled")


def output_format(body: dict) -> Optional[OutputFormat]:
    """output_config.format {"type": "json_schema", "schema"}: JSON valid for the schema
    (always strict, as Anthropic's structured outputs are: objects closed)."""
    oc = body.get("output_config")
    if oc is None:
        return None
    if not isinstance(oc, dict):
        raise bad_request("output_config", "must be an object")
    fmt = oc.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("output_config.format", "must be an object")
    if fmt.get("type") != "json_schema":
        raise bad_request("output_config.format.type", "must be json_schema")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise bad_request("output_config.format.schema", "must be an object (a JSON Schema)")
    return OutputFormat(grammar.json_schema_constraint(schema), "output_config.format.schema")


def parallel_tool_calls(choice: Any) -> Optional[bool]:
    """tool_choice.disable_parallel_tool_use true: at most one call (False); else unsaid."""
    if not isinstance(choice, dict):
        return None
    disabled = common.get_bool(choice, "disable_parallel_tool_use", False,
                               param="tool_choice.disable_parallel_tool_use")
    return False if disabled else None


def to_conversation(body: Any) -> Conversation:
    """A Messages (or count_tokens) body -> the shared conversation form."""
    common.require_object(body)
    common.get_str(body, "model", None)  # any model name is accepted, but a name is a string
    fmt = output_format(body)
    tools = conversation_tools(body.get("tools"))
    choice = conversation_tool_choice(body.get("tool_choice"), tools)
    return Conversation(
        messages=conversation_messages(body),
        tools=tools,
        tool_choice=choice,
        enable_thinking=enable_thinking(body.get("thinking")),
        output_format=fmt,
        parallel_tool_calls=parallel_tool_calls(body.get("tool_choice")),
    )


# ---------------------------------------------------------------- the surface


def convert(api: ApiContext, body: Any) -> ApiRequest:
    """A Messages body -> the shared request; the model name given is the one echoed."""
    body = common.require_object(body)
    conv = to_conversation(body)
    stream = common.get_bool(body, "stream", False)
    fields = common.read_sampling(body, ("max_completion_tokens", "max_tokens"))
    model = body.get("model")
    return ApiRequest(fields=fields, stream=stream, conversation=conv,
                      model=model if isinstance(model, str) and model else api.model_id)


def writer(api: ApiContext, request: ApiRequest, prompt: Prompt, answer_id: str) -> MessageStream:
    return MessageStream(answer_id, request.model, len(prompt.ids))


SURFACE = pipeline.Surface("/v1/messages", ANTHROPIC, "msg_", convert, writer, tool_id_prefix="toolu_")


def count_body(api: ApiContext, req: Any) -> int:
    """count_tokens' body -> its prompt tokens (pipeline.off_loop's job)."""
    return count_chat_tokens(api, to_conversation(req.json()))


def routes(api: ApiContext) -> list:
    async def count_tokens(req):
        common.require_ready(api, ANTHROPIC)
        count = await pipeline.off_loop(api, req, count_body)
        return json_response({"input_tokens": count})

    return [
        pipeline.route(api, SURFACE),
        ("POST", "/v1/messages/count_tokens", count_tokens, ANTHROPIC),
    ]
