"""mashbox's own tool-call format, for chat templates that do not render tools.

The format (the one Qwen / Hermes-style templates use too, so one parser reads both):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, several blocks in a row for several calls. Tool results go back to
the model in a user turn as `<tool_response>\n...\n</tool_response>`, one block per
result. The instruction text below is appended to the system prompt (or becomes the
system prompt) and lists each tool's name, description and JSON Schema.
"""
from __future__ import annotations

import json
from typing import Any, Optional

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"

_INSTRUCTIONS = """\
# Tools

You may call one or more of the tools below to help with the user's request. Each line \
inside <tools></tools> describes one tool as a JSON object: its name, what it does, and the \
JSON Schema of its arguments.

<tools>
{tool_lines}
</tools>

To call a tool, write a block of exactly this form, with the arguments as a JSON object \
that follows the tool's schema:
<tool_call>
{{"name": "<tool name>", "arguments": {{"<argument>": <value>}}}}
</tool_call>
Write one block per call; for several calls write several blocks one after another, \
and write nothing after the last block. The results come back in the next message, \
each inside <tool_response></tool_response>. If no tool is needed, answer directly."""


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def tool_spec(tool: dict) -> dict:
    """{"name", "description", "parameters"} of an HF / OpenAI-style tool (either the
    `{"type": "function", "function": {...}}` wrapper or the bare function object)."""
    fn = tool.get("function", tool) if isinstance(tool, dict) else {}
    spec = {"name": fn.get("name", "")}
    if fn.get("description"):
        spec["description"] = fn["description"]
    spec["parameters"] = fn.get("parameters") or {"type": "object", "properties": {}}
    return spec


def tools_instructions(tools: list) -> str:
    """The system-prompt text that teaches the model the tools and the call format."""
    lines = "\n".join(_dumps(tool_spec(t)) for t in tools)
    return _INSTRUCTIONS.format(tool_lines=lines)


def format_call(name: str, arguments: Any) -> str:
    """One call as the model is told to write it. `arguments` is a dict or JSON text."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass  # keep the model's own (broken) text: it is what it wrote
    args_text = arguments if isinstance(arguments, str) else _dumps(arguments)
    return f'{CALL_OPEN}\n{{"name": {_dumps(name)}, "arguments": {args_text}}}\n{CALL_CLOSE}'


def format_response(content: str) -> str:
    return f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"


def forced_call_prefix(name: Optional[str]) -> str:
    """The assistant-turn opening that forces a call: of `name`, or of any tool (None).

    The prompt ends with it; the parser is fed the same text first (it is model output
    as far as parsing goes), so the call's start is known before the model writes on.
    """
    if name is None:
        return CALL_OPEN + "\n"
    return f'{CALL_OPEN}\n{{"name": {_dumps(name)}, "arguments": '
