"""The chat template: messages -> the prompt text and ids, the way HF renders it.

Rules:
- The template is compiled once, in a jinja2 ImmutableSandboxedEnvironment set up as HF
  transformers sets up its own (trim_blocks, lstrip_blocks, loop controls, the
  `{% generation %}` tag, `raise_exception`, `strftime_now`, a `tojson` that keeps
  non-ASCII characters and key order), so `render()` gives HF's `apply_chat_template(...,
  tokenize=False)` text.
- Messages are HF-style dicts: {"role", "content": str | None, "tool_calls": [{"id",
  "type": "function", "function": {"name", "arguments": dict | str}}], "tool_call_id",
  "name", "reasoning_content"}; tools are `{"type": "function", "function": {"name",
  "description", "parameters"}}`. `content: None` is rendered as "".
- Only the template's own markers become special tokens. Before rendering, every
  special-token string inside client data (messages, tools, extra kwargs) is swapped for
  a private-use character that occurs nowhere in that data; the rendered text is split
  at the special-token strings left (all of them the template's own), the pieces are
  encoded as plain text with the swapped strings put back, and each marker becomes its
  id. So "<|im_end|><|im_start|>system" in a message stays those characters, and text
  without such strings gets exactly HF's ids.
- When the template does not use the `tools` variable (`renders_tools` False; SmolLM2's
  does not), mashbox renders tools itself (tool_prompt.py): the instructions go at the
  end of the system message (or become one), earlier assistant tool calls become
  `<tool_call>` blocks in the assistant's content, and tool results become a user turn of
  `<tool_response>` blocks.
"""
from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Optional

import jinja2
from jinja2 import meta, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mashbox.text import tool_prompt
from mashbox.text.tokenizer import Tokenizer

# Used when the model has no template of its own.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# Private-use characters that stand in for special-token strings inside client data
# (Supplementary Private Use Area-A: no tokenizer gives these a meaning).
_PLACEHOLDER_BASE = 0xF0000


class TemplateError(ValueError):
    """The template raised (raise_exception) or could not render these messages."""


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation ready to generate from."""

    text: str  # the prompt text, assistant_prefix included
    ids: tuple[int, ...]
    in_reasoning: bool  # the prompt ends inside an opened <think> block
    assistant_prefix: str = ""  # text the assistant turn already starts with (a forced call)


class _GenerationTag(Extension):
    """HF's `{% generation %}...{% endgeneration %}` (it marks assistant tokens for
    training masks); rendering just keeps the body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # HF's tojson: unlike jinja's built-in it neither escapes HTML nor sorts keys.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message):
    raise TemplateError(str(message))


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace(), refusing underscore names (no way in to CPython internals)."""

    def __init__(*args, **kwargs):  # noqa: N805 - jinja's own signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _make_dict(*args, **kwargs):
    return dict(*args, **kwargs)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = _make_dict
    return env


# A message's earlier reasoning may come under any of these names; templates read
# `reasoning_content` (Qwen, DeepSeek) or `thinking` (gpt-oss). HF fills both.
_REASONING_NAMES = ("reasoning_content", "thinking", "reasoning")


def _with_reasoning_aliases(message: dict) -> dict:
    reasoning = next(
        (message[k] for k in _REASONING_NAMES if message.get(k) is not None), None
    )
    if reasoning is None:
        return message
    out = {"thinking": reasoning, **message}
    out["reasoning_content"] = reasoning
    return out


class ChatTemplate:
    """One model's chat template, compiled once; renders and encodes conversations."""

    def __init__(self, tokenizer: Tokenizer, source: Optional[str] = None):
        self.tokenizer = tokenizer
        self.source = source or tokenizer.chat_template or CHATML_TEMPLATE
        env = _environment()
        try:
            ast = env.parse(self.source)
            self._template = env.from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"the chat template does not compile: {e}") from e
        variables = meta.find_undeclared_variables(ast)
        # Does the template show tools to the model? If not, mashbox does (tool_prompt).
        self.renders_tools = "tools" in variables
        self.uses_enable_thinking = "enable_thinking" in variables
        added = tokenizer.added_tokens
        self.reasoning = THINK_OPEN in self.source or THINK_OPEN in added
        # Longest first, so a marker that contains another wins.
        self._markers = sorted(tokenizer.special_tokens, key=len, reverse=True)
        self._marker_re = (
            re.compile("|".join(re.escape(m) for m in self._markers)) if self._markers else None
        )
        decoder = tokenizer.hf.get_added_tokens_decoder()
        self._strip = {
            t.content: (bool(t.lstrip), bool(t.rstrip)) for t in decoder.values() if t.special
        }

    # -- rendering ----------------------------------------------------------------------
    def render(
        self,
        messages: list,
        tools: Optional[list] = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt text, as HF's apply_chat_template(..., tokenize=False) gives it."""
        text, table = self._render_protected(messages, tools, add_generation_prompt, kwargs)
        return self._restore(text, table)

    def encode(
        self,
        messages: list,
        tools: Optional[list] = None,
        add_generation_prompt: bool = True,
        assistant_prefix: str = "",
        **kwargs: Any,
    ) -> list[int]:
        """The prompt ids; only the template's own markers are special tokens."""
        return list(
            self.build(messages, tools, add_generation_prompt, assistant_prefix, **kwargs).ids
        )

    def build(
        self,
        messages: list,
        tools: Optional[list] = None,
        add_generation_prompt: bool = True,
        assistant_prefix: str = "",
        **kwargs: Any,
    ) -> ChatPrompt:
        """Render and encode. `assistant_prefix` (e.g. `tool_prompt.forced_call_prefix`)
        is appended after the generation prompt as plain text."""
        # The prefix joins the protected data so a special-token string in it (a client's
        # tool name) stays plain text too.
        extra = dict(kwargs)
        text, table = self._render_protected(
            messages, tools, add_generation_prompt, extra, prefix=assistant_prefix
        )
        in_reasoning = self.reasoning and _ends_in_open_think(self._restore(text, table))
        ids = self.tokenizer.encode_marked(self._split(text, table))
        return ChatPrompt(
            text=self._restore(text, table),
            ids=tuple(ids),
            in_reasoning=in_reasoning and not assistant_prefix,
            assistant_prefix=assistant_prefix,
        )

    # -- internals ----------------------------------------------------------------------
    def _render_protected(self, messages, tools, add_generation_prompt, kwargs, prefix=""):
        """(rendered text with placeholders, {placeholder: special string}); `prefix` is
        appended to the rendered text, protected the same way."""
        messages = [_with_reasoning_aliases(dict(m)) for m in messages]
        for m in messages:
            if m.get("content") is None:
                m["content"] = ""
        if not self.renders_tools:
            messages = _mashbox_tools(messages, tools)
            tools = None
        data = {"messages": messages, "tools": tools, "kwargs": kwargs, "prefix": prefix}
        table: dict[str, str] = {}
        if self._marker_re is not None and _contains(data, self._marker_re):
            used = _chars(data)
            swap: dict[str, str] = {}
            code = _PLACEHOLDER_BASE
            for marker in self._markers:
                while chr(code) in used:
                    code += 1
                swap[marker] = chr(code)
                table[chr(code)] = marker
                code += 1
            data = _substitute(data, self._marker_re, swap)
        variables = dict(self.tokenizer.special_tokens_map)
        variables.update(data["kwargs"])
        variables["messages"] = data["messages"]
        variables["tools"] = data["tools"]
        variables.setdefault("documents", None)
        variables["add_generation_prompt"] = add_generation_prompt
        try:
            text = self._template.render(**variables)
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template failed: {e}") from e
        except (TypeError, KeyError, AttributeError, IndexError, ValueError) as e:
            raise TemplateError(f"the chat template failed on these messages: {e!r}") from e
        return text + data["prefix"], table

    @staticmethod
    def _restore(text: str, table: dict[str, str]) -> str:
        for ch, marker in table.items():
            text = text.replace(ch, marker)
        return text

    def _split(self, text: str, table: dict[str, str]) -> list[tuple[str, bool]]:
        """The rendered text as (piece, is_marker); placeholders restored in the text
        pieces. A marker whose AddedToken strips whitespace takes it off its neighbour,
        as HF's added-token splitting does."""
        pieces: list[tuple[str, bool]] = []
        if self._marker_re is None:
            return [(self._restore(text, table), False)]
        pos = 0
        strip_next = False
        for m in self._marker_re.finditer(text):
            before = text[pos : m.start()]
            marker = m.group(0)
            lstrip, rstrip = self._strip.get(marker, (False, False))
            if strip_next:
                before = before.lstrip()
            if lstrip:
                before = before.rstrip()
            if before:
                pieces.append((self._restore(before, table), False))
            pieces.append((marker, True))
            strip_next = rstrip
            pos = m.end()
        rest = text[pos:]
        if strip_next:
            rest = rest.lstrip()
        if rest:
            pieces.append((self._restore(rest, table), False))
        return pieces


def _ends_in_open_think(text: str) -> bool:
    """The prompt opened a think block the model is to continue (R1-style templates)."""
    return text.rstrip().endswith(THINK_OPEN)


def _mashbox_tools(messages: list, tools: Optional[list]) -> list:
    """Messages with tools rendered in mashbox's format (tool_prompt), for templates that
    do not render tools, tool calls or tool results themselves."""
    out: list = []
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = call.get("function", call)
                calls.append(tool_prompt.format_call(fn.get("name", ""), fn.get("arguments", {})))
            text = m.get("content") or ""
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = (text + "\n" if text else "") + "\n".join(calls)
            out.append(m)
        elif role == "tool":
            block = tool_prompt.format_response(_as_text(m.get("content")))
            prev = out[-1] if out else None
            if prev is not None and prev.get("_tool_results"):
                prev["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append(m)
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        instructions = tool_prompt.tools_instructions(tools)
        if out and out[0].get("role") == "system":
            system = dict(out[0])
            system["content"] = (system.get("content") or "") + "\n\n" + instructions
            out[0] = system
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out


def _as_text(content) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    return json.dumps(content, ensure_ascii=False)


def _contains(value, pattern: re.Pattern) -> bool:
    if isinstance(value, str):
        return pattern.search(value) is not None
    if isinstance(value, dict):
        return any(_contains(k, pattern) or _contains(v, pattern) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_contains(v, pattern) for v in value)
    return False


def _chars(value, acc: Optional[set] = None) -> set:
    acc = set() if acc is None else acc
    if isinstance(value, str):
        acc.update(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _chars(k, acc)
            _chars(v, acc)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _chars(v, acc)
    return acc


def _substitute(value, pattern: re.Pattern, swap: dict[str, str]):
    """A copy of `value` with every special-token string in every string (keys too)
    replaced by its placeholder."""
    if isinstance(value, str):
        return pattern.sub(lambda m: swap[m.group(0)], value)
    if isinstance(value, dict):
        return {_substitute(k, pattern, swap): _substitute(v, pattern, swap) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, pattern, swap) for v in value]
    if isinstance(value, tuple):
        return tuple(_substitute(v, pattern, swap) for v in value)
    return copy.copy(value)
