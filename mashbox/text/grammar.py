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
import logging
from typing import Any, Collection, Mapping, Optional, Sequence

from mashbox.config import Constraint
from mashbox.text import tool_prompt

log = logging.getLogger("mashbox.text.grammar")

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


def _custom_calls(tools: Sequence[dict], grammars: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(the Lark alternatives of the custom tools with a grammar, their rules): a custom
    tool's arguments are {"input": S} with S's text in its grammar, JSON-escaped. A
    grammar this cannot rewrite leaves that tool's input a free string (logged), like
    the other tools' arguments: None in the alternatives."""
    alts: list[Optional[str]] = []
    rules: list[str] = []
    for t in tools:
        spec = tool_prompt.tool_spec(t)
        definition = grammars.get(spec["name"])
        if definition is None:
            alts.append(None)
            continue
        prefix = f"g{sum(1 for a in alts if a)}_"
        try:
            start, own = json_string_lark(definition, prefix)
        except GrammarError as exc:
            log.warning("custom tool %s: its grammar is not enforced: %s", spec["name"], exc)
            alts.append(None)
            continue
        alts.append(f"{json.dumps(INPUT_OPEN)} {start} {json.dumps(INPUT_CLOSE)}")
        rules += own
    return alts, rules


def _call_body(tools: Sequence[dict], grammars: Mapping[str, str]) -> tuple[str, list[str]]:
    """(the Lark expression of one call body, the rules it needs). Without custom
    grammars, the JSON Schema of call_schema; with them, the body is spelt out by name:
    `{"name": ` then, per tool, `"NAME", "arguments": ` and its arguments (a schema, or
    a custom tool's input grammar) then `}` -- never one literal for a whole head, which
    a lexer taking the longest match could not tell from JSON's `{` once they differ."""
    alts, rules = _custom_calls(tools, grammars)
    if not any(alts):
        return f"%json {json.dumps(call_schema(tools))}", []
    options = []
    for t, custom in zip(tools, alts):
        spec = tool_prompt.tool_spec(t)
        args = custom or "%json " + json.dumps(styled(strict_schema(spec["parameters"]), TOOL_STYLE))
        head = json.dumps(spec["name"], ensure_ascii=False) + ', "arguments": '
        options.append(f"{json.dumps(head, ensure_ascii=False)} {args}")
    rules.append("call_body: " + json.dumps('{"name": ') + " (" + " | ".join(options) + ') "}"')
    return "call_body", rules


INPUT_OPEN, INPUT_CLOSE = '{"input": "', '"}'  # a custom tool's arguments around its text


def tool_call_grammar(tools: Sequence[dict], mode: str, name: Optional[str], parallel: bool,
                      added: Collection[str] = (), fmt: Optional[Constraint] = None,
                      reasoning: Optional[str] = None, grammars: Mapping[str, str] = {}) -> str:
    """The Lark grammar of an answer under a tool choice (module rules).

    mode: auto | none | required | named (api/prompt.py's ToolChoice). For required and
    named the prompt already ends with the forced opening (tool_prompt.forced_call_prefix
    of the name or of None): the grammar is what follows it. special: the markers are
    special tokens of the vocabulary. grammars: custom tools' Lark grammars by the name
    the model sees (their input must follow them: _custom_calls).
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
    body, body_rules = _call_body(tools, grammars)
    lines += body_rules
    call = f'call: {open_m} "\\n" {body} "\\n" {close_m}'
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
            call = f'call: FREE {open_m} "\\n" {body} "\\n" {close_m}'
        else:
            call = f'call_open[lazy]: FREE {open_m}\ncall: call_open "\\n" {body} "\\n" {close_m}'
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
        (custom,), _ = _custom_calls(chosen, grammars)
        one, body_rules = _call_body(chosen, grammars)
        args = custom or "%json " + json.dumps(styled(strict_schema(tool_prompt.tool_spec(chosen[0])["parameters"]),
                                                      TOOL_STYLE))
        lines = ["%llguidance {}", *body_rules]
        call = f'call: {open_m} "\\n" {one} "\\n" {close_m}'
        lines += [f'start: {args} "}}\\n" {close_m}{more}', call]
        return "\n".join(lines) + "\n"
    if mode == "required":
        lines += [f'start: {body} "\\n" {close_m}{more}', call]
        return "\n".join(lines) + "\n"
    raise ValueError(f"tool choice mode {mode!r}")


# -- custom tools' Lark grammars inside a JSON string --------------------------------------

# What the tool-call body is: JSON, so a custom tool's input is a JSON string. A Lark
# grammar of the raw input becomes the grammar of its JSON-escaped text: every terminal
# (string literal, regex) is rewritten to match its characters as json.dumps writes them
# (`"`, `\\` and control characters escaped, the rest raw); rules, names and structure
# stay. Names get a prefix so several grammars and mashbox's own rules never meet.
JSON_SPECIALS = [chr(c) for c in range(0x20)] + ['"', "\\"]
COMMON_TERMINALS = {  # Lark's common.* that grammars import, as definitions of our own
    "LF": r'"\n"', "CR": r'"\r"', "NEWLINE": r'/(\r?\n)+/', "WS": r'/[ \t\f\r\n]+/',
    "WS_INLINE": r'/[ \t]+/', "DIGIT": r'/[0-9]/', "INT": r'/[0-9]+/', "LETTER": r'/[a-zA-Z]/',
    "WORD": r'/[a-zA-Z]+/', "CNAME": r'/[a-zA-Z_][a-zA-Z0-9_]*/',
}


def _esc_char(c: str) -> str:
    """c as json.dumps writes it inside a string."""
    return json.dumps(c, ensure_ascii=False)[1:-1]


def _rx_char(c: str) -> str:
    """c as a regex atom (llguidance's regex syntax), safe inside and outside classes."""
    return c if c.isalnum() and c.isascii() else f"\\x{{{ord(c):X}}}"


def _rx_text(s: str) -> str:
    return "".join(_rx_char(c) for c in s)


def _class_text(items) -> str:
    """sre_parse IN items -> the body of a regex class (NEGATE first, if any)."""
    import re._constants as k

    cats = {k.CATEGORY_DIGIT: r"\d", k.CATEGORY_NOT_DIGIT: r"\D", k.CATEGORY_SPACE: r"\s",
            k.CATEGORY_NOT_SPACE: r"\S", k.CATEGORY_WORD: r"\w", k.CATEGORY_NOT_WORD: r"\W"}
    out = []
    for op, av in items:
        if op is k.NEGATE:
            out.append("^")
        elif op is k.LITERAL:
            out.append(_rx_char(chr(av)))
        elif op is k.RANGE:
            out.append(f"{_rx_char(chr(av[0]))}-{_rx_char(chr(av[1]))}")
        elif op is k.CATEGORY and av in cats:
            out.append(cats[av])
        else:
            raise GrammarError(f"the regex class item {op} is not supported in a custom tool's grammar")
    return "".join(out)


_SPECIALS_CLASS = "\\x00-\\x1F\\x{22}\\x{5C}"


def _escaped_set(body: str, matches, run: bool = False) -> str:
    """A Lark expression of one character of the class [body], JSON-escaped: its
    characters that need no escape raw (a run of them when `run`), each special one
    (`matches(c)`) as its escape, a literal of its own."""
    if body.startswith("^"):
        raw = f"[{body}{_SPECIALS_CLASS}]"  # neither in the negated set nor special
    else:
        raw = f"[{body}&&[^{_SPECIALS_CLASS}]]"
    alts = [f"/{raw}{'+' if run else ''}/"]
    alts += [json.dumps(_esc_char(c)) for c in JSON_SPECIALS if matches(c)]
    return "(" + " | ".join(alts) + ")"


def _escaped_regex(pattern: str) -> str:
    """A regex of raw text -> a Lark expression of its JSON-escaped text (GrammarError
    when it uses what this cannot rewrite). Rules, not one regex: an escape starts with
    a backslash that could also start the next terminal's escape (`\n` after a file
    name), and a lexer that takes the longest match cannot split there, a parser can.
    Runs of raw characters stay one lexeme under * and +."""
    import re
    import re._constants as k
    import re._parser as sre

    try:
        parsed = sre.parse(pattern)
    except re.error as exc:
        raise GrammarError(f"the regex /{pattern}/ does not parse: {exc}") from None

    def seq(items) -> str:
        return "(" + " ".join(node(op, av) for op, av in items) + ")" if items else '""'

    def one(op, av, run: bool = False) -> Optional[str]:
        """A one-character node as a Lark expression, or None."""
        if op is k.NOT_LITERAL:
            return _escaped_set(f"^{_rx_char(chr(av))}", lambda c: c != chr(av), run)
        if op is k.ANY:
            return _escaped_set("^\\n", lambda c: c != "\n", run)
        if op is k.IN:
            body = _class_text(av)
            cls = re.compile(f"[{body}]")
            return _escaped_set(body, lambda c: cls.fullmatch(c) is not None, run)
        return None

    def node(op, av) -> str:
        if op is k.LITERAL:
            return json.dumps(_esc_char(chr(av)), ensure_ascii=False)
        single = one(op, av)
        if single is not None:
            return single
        if op is k.BRANCH:
            return "(" + " | ".join(seq(b) for b in av[1]) + ")"
        if op is k.SUBPATTERN:
            return seq(av[3])
        if op in (k.MAX_REPEAT, k.MIN_REPEAT):
            lo, hi, inner = av
            if hi is k.MAXREPEAT and lo in (0, 1) and len(inner) == 1 and one(*inner[0]) is not None:
                return one(*inner[0], run=True) + ("*" if lo == 0 else "+")
            body = seq(inner)
            if hi is k.MAXREPEAT:
                return body + ("*" if lo == 0 else "+" if lo == 1 else "{%d,}" % lo)
            return body + "{%d,%d}" % (lo, hi)
        raise GrammarError(f"the regex /{pattern}/ uses {op}, which a custom tool's grammar cannot have")

    return seq(list(parsed))


def _lark_string(text: str, i: int) -> tuple[str, int]:
    """The value of the Lark string literal starting at text[i] == '"', and where it ends."""
    import ast

    j = i + 1
    while j < len(text) and text[j] != '"':
        j += 2 if text[j] == "\\" else 1
    if j >= len(text):
        raise GrammarError("a string literal is not closed")
    try:
        return ast.literal_eval(text[i : j + 1]), j + 1
    except (ValueError, SyntaxError) as exc:
        raise GrammarError(f"the string literal {text[i : j + 1]} does not parse: {exc}") from None


def json_string_lark(definition: str, prefix: str) -> tuple[str, list[str]]:
    """A custom tool's Lark grammar (its raw input) -> (the name of the rule matching the
    input's JSON-escaped text, the rules, each name prefixed with `prefix`)."""
    import re

    lines = []
    for line in definition.splitlines():
        m = re.fullmatch(r"\s*%import\s+common\.([A-Z_]+)\s*(?://.*)?", line)
        if m:
            if m.group(1) not in COMMON_TERMINALS:
                raise GrammarError(f"%import common.{m.group(1)} is not supported in a custom tool's grammar")
            lines.append(f"{m.group(1)}: {COMMON_TERMINALS[m.group(1)]}")
        elif line.lstrip().startswith("%"):
            raise GrammarError(f"the directive {line.strip()!r} is not supported in a custom tool's grammar")
        else:
            lines.append(line)
    text = "\n".join(lines)
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = len(text) if j < 0 else j
        elif c == '"':
            value, i = _lark_string(text, i)
            if i < len(text) and text[i] == "i":
                raise GrammarError("case-insensitive literals are not supported in a custom tool's grammar")
            out.append(json.dumps(json.dumps(value, ensure_ascii=False)[1:-1], ensure_ascii=False))
        elif c == "/":
            j = i + 1
            while j < len(text) and text[j] != "/":
                j += 2 if text[j] == "\\" else 1
            if j >= len(text):
                raise GrammarError("a regex is not closed")
            pattern = text[i + 1 : j].replace("\\/", "/")
            i = j + 1
            if i < len(text) and text[i].isalpha():
                raise GrammarError("regex flags are not supported in a custom tool's grammar")
            out.append(_escaped_regex(pattern))
        elif c == "<":
            raise GrammarError("special tokens are not supported in a custom tool's grammar")
        elif c.isalpha() or c == "_":
            j = i
            while j < len(text) and (text[j].isalnum() or text[j] == "_"):
                j += 1
            name = text[i:j]
            # every terminal becomes a rule (its regexes are rules now: _escaped_regex)
            out.append(prefix + ("t_" + name.lower() if name[0].isupper() else name))
            i = j
        else:
            out.append(c)
            i += 1
    rules = [r for r in "".join(out).split("\n") if r.strip()]
    return prefix + "start", rules
