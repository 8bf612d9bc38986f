"""Grammars for constrained decoding: a `Constraint` -> the llguidance grammar it means.

Rules:
- One function makes the llguidance grammar text of a Constraint (`llguidance_grammar`);
  the server checks it (`check`, a 400 before anything is queued) and the worker compiles
  the same text into a matcher, so the two never disagree.
- JSON is written one way: no free whitespace, `", "` between items and `": "` after keys
  (what json.dumps and the models write). Free whitespace would let a small model loop
  on newlines until max_tokens; a schema's own "x-guidance" options still win.
- `strict_schema` closes every object that lists `properties` and says nothing of
  `additionalProperties` (OpenAI's strict mode): a small model otherwise invents keys
  (it copies "type" / "properties" out of the schema it was shown, or writes
  "population_per_family_per_capita" keys until max_tokens). A closed object is still
  valid for the open schema, so every schema is closed: tool arguments and response
  formats alike, whatever `strict` says. allOf branches are left open (closing each
  would forbid the other branches' keys).
- Tool schemas are compiled leniently (keywords llguidance does not implement are
  ignored: agents send uniqueItems, format, ...); a response format's schema is not.
- Tool calls are mashbox's `<tool_call>` form (text/tool_prompt.py); a marker is its
  token when the vocabulary has it as an added token (Qwen), text otherwise. The call body is
  `{"name": N, "arguments": A}` with N one of the declared tools and A that tool's
  schema. Auto mode is lazy: free text, in which the opening marker starts a bound call
  (the text itself may not hold the marker otherwise); forced modes start after the
  prompt's forced opening and allow nothing but the call(s); `none` forbids the marker.
"""
from __future__ import annotations

import json
from typing import Any, Collection, Optional, Sequence

from mashbox.config import Constraint
from mashbox.text import tool_prompt

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# tool schemas come from agents, not from a request for structured output: a keyword
# llguidance does not implement (uniqueItems, ...) is ignored there, never a 400
TOOL_STYLE = {**JSON_STYLE, "lenient": True}
ANY_OBJECT = {"type": "object"}


class GrammarError(ValueError):
    """The constraint cannot be compiled; the message says why (llguidance's words)."""


def _llg():
    import llguidance  # imported on first use: only constrained requests need it

    return llguidance


def styled(schema: Any, style: dict = JSON_STYLE) -> dict:
    """The schema with mashbox's JSON style as its defaults (its own x-guidance wins)."""
    if not isinstance(schema, dict):
        raise GrammarError("the schema must be a JSON object")
    own = schema.get("x-guidance")
    return {**schema, "x-guidance": {**style, **(own if isinstance(own, dict) else {})}}


def strict_schema(schema: Any) -> Any:
    """`schema` with additionalProperties: false on every object that lists properties
    and leaves it unsaid (module rules); other values unchanged."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k == "allOf" else strict_schema(v)) for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def json_schema_constraint(schema: dict) -> Constraint:
    """The Constraint of a response format's schema (closed: module rules)."""
    return Constraint("json_schema", json.dumps(strict_schema(schema)))


def llguidance_grammar(c: Constraint) -> str:
    """The llguidance grammar text of a constraint; GrammarError when it is not one."""
    llg = _llg()
    if c.kind in ("json_schema", "json_object"):
        if c.kind == "json_object":
            schema: Any = ANY_OBJECT
        else:
            try:
                schema = json.loads(c.grammar)
            except json.JSONDecodeError as exc:
                raise GrammarError(f"the schema is not JSON: {exc}") from None
        try:
            return llg.LLMatcher.grammar_from_json_schema(styled(schema))
        except ValueError as exc:
            raise GrammarError(str(exc)) from None
    return llg.LLMatcher.grammar_from_lark(c.grammar)


def ll_tokenizer(tokenizer, n_vocab: Optional[int] = None):
    """llguidance's tokenizer of a mashbox text.tokenizer.Tokenizer (~0.3 s: make it once).
    n_vocab: the model's vocabulary when it is larger than the tokenizer's (padding rows)."""
    llg = _llg()
    return llg.LLTokenizer(tokenizer.hf.to_str(), n_vocab=n_vocab, eos_token=list(tokenizer.eos_ids))


REASON_CHARS = 400  # llguidance's message quotes the grammar around the error: keep its head


def check(c: Constraint, lltok) -> Optional[str]:
    """None when the constraint compiles for this tokenizer, else the reason it does not
    (its first line, at most REASON_CHARS)."""
    try:
        grammar = llguidance_grammar(c)
    except GrammarError as exc:
        return str(exc)
    is_error, messages = _llg().LLMatcher.validate_grammar_with_warnings(grammar, lltok)
    if not is_error:
        return None
    lines = messages[0].strip().splitlines() or ["invalid grammar"]
    return lines[0][:REASON_CHARS]


def matcher(c: Constraint, lltok):
    """A fresh llguidance LLMatcher of the constraint; GrammarError when it does not compile."""
    m = _llg().LLMatcher(lltok, llguidance_grammar(c), log_level=0)
    if m.is_error():
        raise GrammarError(m.get_error())
    return m


# -- reasoning -------------------------------------------------------------------------


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def after_reasoning(c: Constraint, opened: bool, added: Collection[str] = ()) -> Constraint:
    """A JSON constraint for a reasoning model: a thought first (free text up to
    `</think>`: already open when `opened`, else optional), then the value. Without this
    the value would be forced inside the think block the template opened."""
    head, rules = _thought("opened" if opened else "optional", added)
    lark = "\n".join(["%llguidance {}", f"start: {head} answer", *rules, f"answer: {json_lark(c)}"]) + "\n"
    return Constraint("lark", lark)


def _thought(reasoning: str, added: Collection[str]) -> tuple[str, list[str]]:
    """(the head expression, its rules) of a thought before the answer: reasoning
    "opened" (the prompt opened the think block: the thought must be closed first) or
    "optional" (the model may open one)."""
    open_m = _marker(THINK_OPEN, THINK_OPEN in added)
    close_m = _marker(THINK_CLOSE, THINK_CLOSE in added)
    thought = f"THOUGHT {close_m} SPACE"
    head = thought if reasoning == "opened" else f"({open_m} {thought})?"
    return head, [r"THOUGHT: /(.|\n)*/ & ~/(.|\n)*<\/think>(.|\n)*/", r"SPACE: /[ \t\n]*/"]


# -- tool calls --------------------------------------------------------------------------


def call_schema(tools: Sequence[dict]) -> dict:
    """The JSON Schema of one call body: {"name": one tool, "arguments": its parameters}."""
    options = []
    for t in tools:
        spec = tool_prompt.tool_spec(t)
        options.append({
            "type": "object",
            "properties": {"name": {"const": spec["name"]}, "arguments": strict_schema(spec["parameters"])},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    return styled(options[0] if len(options) == 1 else {"anyOf": options}, TOOL_STYLE)


def _marker(text: str, special: bool) -> str:
    """A marker in Lark: the special token `<tool_call>` or the quoted text."""
    return text if special else json.dumps(text)


NO_MARKER_TEXT = r"/(.|\n)*/ & ~/(.|\n)*<tool_call>(.|\n)*/"


def json_lark(c: Constraint) -> str:
    """A JSON constraint as a Lark expression (`%json {...}`), to sit inside a grammar."""
    if c.kind == "json_object":
        return f"%json {json.dumps(styled(ANY_OBJECT))}"
    if c.kind == "json_schema":
        try:
            schema = json.loads(c.grammar)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the schema is not JSON: {exc}") from None
        return f"%json {json.dumps(styled(schema))}"
    raise GrammarError(f"a {c.kind} constraint cannot be combined with tool calls")


def tool_call_grammar(tools: Sequence[dict], mode: str, name: Optional[str], parallel: bool,
                      added: Collection[str] = (), fmt: Optional[Constraint] = None,
                      reasoning: Optional[str] = None) -> str:
    """The Lark grammar of an answer under a tool choice (module rules).

    mode: auto | none | required | named (api/prompt.py's ToolChoice). For required and
    named the prompt already ends with the forced opening (tool_prompt.forced_call_prefix
    of the name or of None): the grammar is what follows it. special: the markers are
    special tokens of the vocabulary.
    """
    open_m = _marker(tool_prompt.CALL_OPEN, tool_prompt.CALL_OPEN in added)
    close_m = _marker(tool_prompt.CALL_CLOSE, tool_prompt.CALL_CLOSE in added)
    special = tool_prompt.CALL_OPEN in added
    lines = ["%llguidance {}"]
    # free text never spells the marker out either (the parser reads text, not ids)
    free = NO_MARKER_TEXT
    if mode == "none":
        lines += ["start: FREE", f"FREE: {free}"]
        return "\n".join(lines) + "\n"
    body = json.dumps(call_schema(tools))
    call = f'call: {open_m} "\\n" %json {body} "\\n" {close_m}'
    more = ' ("\\n" call)*' if parallel else ""
    think, think_rules = "", []
    if mode == "auto" and reasoning is not None and (fmt is not None or THINK_OPEN in added):
        think, think_rules = _thought(reasoning, added)
        think += " "
    if mode == "auto" and fmt is not None:
        calls = "call" + more
        lines += [f"start: {think}({json_lark(fmt)} | {calls})", call, *think_rules]
        return "\n".join(lines) + "\n"
    if mode == "auto":
        # lazy: free text up to the first marker, then a bound call
        if special:
            call = f'call: FREE {open_m} "\\n" %json {body} "\\n" {close_m}'
        else:
            call = f'call_open[lazy]: FREE {open_m}\ncall: call_open "\\n" %json {body} "\\n" {close_m}'
        head = "call* FREE" if parallel else "call? FREE"
        lines += [f"start: {think}{head}", f"FREE: {free}", call, *think_rules]
        return "\n".join(lines) + "\n"
    if mode == "required" and len(tools) == 1:  # forced like a named call (api/prompt.py)
        mode, name = "named", tool_prompt.tool_spec(tools[0])["name"]
    if mode == "named":
        # the prompt ends inside the call, at its arguments; later calls (parallel) are
        # calls of the named tool too
        chosen = [t for t in tools if tool_prompt.tool_spec(t)["name"] == name]
        if not chosen:
            raise ValueError(f"no tool named {name!r}")
        args = json.dumps(styled(strict_schema(tool_prompt.tool_spec(chosen[0])["parameters"]), TOOL_STYLE))
        call = f'call: {open_m} "\\n" %json {json.dumps(call_schema(chosen))} "\\n" {close_m}'
        lines += [f'start: %json {args} "}}\\n" {close_m}{more}', call]
        return "\n".join(lines) + "\n"
    if mode == "required":
        lines += [f'start: %json {body} "\\n" {close_m}{more}', call]
        return "\n".join(lines) + "\n"
    raise ValueError(f"tool choice mode {mode!r}")
