"""The Anthropic Messages route: POST /v1/messages (also `?beta=true`) and
POST /v1/messages/count_tokens.

Rules:
- A request becomes the shared conversation form (`to_conversation`): chat-template
  messages (`system` / `user` / `assistant` with `tool_calls` and `reasoning_content` /
  `tool`), function tools, a tool_choice and enable_thinking. Everything model specific
  (template, tool prompt, forced calls, max_tokens clamping) is prompt.py's business.
- `system` is a string or text blocks. A block whose text starts with
  `x-anthropic-billing-header:` is dropped: Claude Code changes it every turn, and the
  prefix cache could never hit past it.
- Content blocks: text, tool_use, tool_result (string or text blocks; is_error marks
  the text), thinking (-> reasoning_content), redacted_thinking (opaque, dropped).
  cache_control is ignored. image / document and any other block type: 400 naming the
  field.
- Tools with a `type` other than "custom" are Anthropic server tools (web search, code
  execution, ...): mashbox cannot run them, so they are skipped, not refused.
- A `role: system` message inside `messages` stays at its place as user text in
  <system-reminder> tags (see add_system_note): joining it to the system prompt would
  defeat the prefix cache for the whole conversation.
- thinking: enabled / adaptive -> enable_thinking true; disabled or absent -> false
  (absent means no thinking in the Messages API).
- Output (`MessageStream`): pieces from generation.py become content blocks in the
  order they come: thinking (closed by a signature_delta `mashbox-local`), text,
  tool_use (`toolu_` ids, input as input_json_delta). The same object builds the
  non-streamed Message, so both shapes say the same thing.
- The stream opens with message_start as soon as the prompt is counted, then ping; a
  ping goes out every PING_S while nothing else does (a long prefill would otherwise
  leave the stream silent, and agents drop silent streams). An error after the stream
  started is an `error` event, and the stream ends there.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Iterator, Optional

from mashbox.api import answer, common
from mashbox.api.answer import Answer
from mashbox.api.common import ANTHROPIC, ApiContext
from mashbox.api.generation import EventStream, Generation, Result
from mashbox.api.prompt import Conversation, ToolChoice, chat_prompt, count_chat_tokens
from mashbox.http.response import json_response
from mashbox.http.sse import StreamResponse

log = logging.getLogger(__name__)

BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"
SIGNATURE = "mashbox-local"
PING_S = 10.0

# Block types that carry media the text-only model cannot read.
_MEDIA_BLOCKS = ("image", "document", "search_result", "container_upload")


def bad_request(field: str, message: str):
    return common.bad_request(f"{field}: {message}", field, common.ANTHROPIC)


def new_message_id() -> str:
    return common.new_id("msg_")


def new_tool_use_id() -> str:
    return common.new_id("toolu_")


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


def _text_of_blocks(blocks: Any, field: str, *, allow_tool_blocks: bool = False) -> str:
    """Text of a string or a list of text blocks (tool_result content, system)."""
    if isinstance(blocks, str):
        return blocks
    if blocks is None:
        return ""
    texts = []
    for f, kind, block in _blocks(blocks, field):
        if kind != "text":
            raise _unsupported_block(f, kind, " here")
        texts.append(_block_text(block, f))
    return "\n\n".join(texts)


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


def add_system_note(out: list[dict], text: str) -> None:
    """A system message inside the conversation. Before any turn it joins the system
    prompt. After one, it stays where it stands, as user text in <system-reminder> tags
    (Claude Code's own convention for such notes): moving it into the system prompt
    would change the prompt's first tokens, and the prefix cache could not serve any of
    a long conversation again."""
    if all(m["role"] == "system" for m in out):
        out.append({"role": "system", "content": text})
        return
    note = f"<system-reminder>\n{text}\n</system-reminder>"
    last = out[-1]
    if last["role"] == "user":
        last["content"] = f"{last['content']}\n\n{note}" if last["content"] else note
    else:
        out.append({"role": "user", "content": note})


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
            add_system_note(out, _text_of_blocks(content, f"{f}.content"))
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
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{f}.name", "must be a non-empty string")
        schema = tool.get("input_schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise bad_request(f"{f}.input_schema", "must be an object")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise bad_request(f"{f}.description", "must be a string")
        fn = {"name": name, "parameters": schema}
        if description:
            fn["description"] = description
        out.append({"type": "function", "function": fn})
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
    if kind == "any":
        if not tools:
            raise bad_request("tool_choice.type", "any needs at least one tool in tools")
        return ToolChoice("required")
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise bad_request("tool_choice.name", "must be a string")
        if name not in {t["function"]["name"] for t in tools}:
            raise bad_request("tool_choice.name", f"no tool named {name!r} in tools")
        return ToolChoice("named", name)
    raise bad_request("tool_choice.type", "must be auto, any, tool or none")


def enable_thinking(thinking: Any) -> bool:
    if thinking is None:
        return False
    if not isinstance(thinking, dict):
        raise bad_request("thinking", "must be an object")
    kind = thinking.get("type")
    if kind in ("enabled", "adaptive"):
        return True
    if kind == "disabled":
        return False
    raise bad_request("thinking.type", "must be enabled, adaptive or disabled")


def check_unsupported(body: dict) -> None:
    oc = body.get("output_config")
    if oc is not None:
        if not isinstance(oc, dict):
            raise bad_request("output_config", "must be an object")
        if oc.get("format") is not None:
            raise bad_request("output_config.format", "structured output is not supported")


def to_conversation(body: Any) -> Conversation:
    """A Messages (or count_tokens) body -> the shared conversation form."""
    common.require_object(body)
    check_unsupported(body)
    tools = conversation_tools(body.get("tools"))
    choice = conversation_tool_choice(body.get("tool_choice"), tools)
    return Conversation(
        messages=conversation_messages(body),
        tools=tools,
        tool_choice=choice,
        enable_thinking=enable_thinking(body.get("thinking")),
    )


# ---------------------------------------------------------------- pieces -> Message / events

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

    NAME = "messages"
    TEXT_KIND = "text"
    CALL_KINDS = ("tool_use",)

    def __init__(self, message_id: str, model: str, prompt_tokens: int):
        super().__init__(message_id)  # _open: "thinking" | "text" | "tool_use" | None
        self.model = model
        self.prompt_tokens = prompt_tokens
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
            "usage": usage_block(self.prompt_tokens, 0, 0),
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
        return self._open_block({"type": "tool_use", "id": call_id or new_tool_use_id(), "name": name, "input": {}})

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


# ---------------------------------------------------------------- the handlers


def parse_request(api: ApiContext, body: Any):
    """A Messages body -> (conversation, sampling fields, stream?, model name to echo)."""
    body = common.require_object(body)
    conv = to_conversation(body)
    stream = common.get_bool(body, "stream", False)
    fields = common.read_sampling(body, ("max_completion_tokens", "max_tokens"))
    model = body.get("model")
    return conv, fields, stream, model if isinstance(model, str) and model else api.model_id


def result_usage(result: Result) -> dict:
    return usage_block(result.prompt_tokens, result.cached_tokens, result.completion_tokens)


def routes(api: ApiContext) -> list:
    async def create_message(req):
        body = common.request_body(api, req, ANTHROPIC)
        conv, fields, stream, model = parse_request(api, body)
        prompt = chat_prompt(api, conv, fields.max_tokens)
        mid = new_message_id()
        gen = Generation(api, prompt, fields, ANTHROPIC, tenant=req.tenant, request_id=mid,
                         tool_id_prefix="toolu_")
        gen.submit()
        ms = MessageStream(mid, model, len(prompt.ids))
        if stream:
            return StreamResponse(EventStream(answer.frames(gen, ms, result_usage), gen))
        r = await gen.run(ms.feed)
        return json_response(ms.message(r.finish_reason, r.stop_sequence, result_usage(r)))

    async def count_tokens(req):
        common.require_ready(api, ANTHROPIC)
        conv = to_conversation(req.json())
        return json_response({"input_tokens": count_chat_tokens(api, conv)})

    return [
        ("POST", "/v1/messages", create_message, ANTHROPIC),
        ("POST", "/v1/messages/count_tokens", count_tokens, ANTHROPIC),
    ]
