"""text/grammar.py against llguidance: the grammars accept what they must and nothing else.

Token by token through a real LLMatcher on a Qwen-like tokenizer (conftest `qwen_dir`:
`<tool_call>` an added token), and on the same vocabulary with the markers marked special.
"""
from __future__ import annotations

import json

import pytest

from mashbox.config import Constraint
from mashbox.text import grammar
from mashbox.text.tokenizer import load_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    tok = load_tokenizer(qwen_dir)
    return tok, grammar.ll_tokenizer(tok)


def accepts(tok_ll, constraint: Constraint, text: str) -> bool:
    """Whether the whole text is allowed and leaves the grammar complete."""
    tok, ll = tok_ll
    m = grammar.matcher(constraint, ll)
    ids = tok.encode(text)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


ADDED = ("<tool_call>", "</tool_call>")  # qwen_dir's added tokens


def tools(mode, name=None, parallel=True, fmt=None):
    return Constraint("tool_calls", grammar.tool_call_grammar([WEATHER, TIME], mode, name, parallel, ADDED, fmt))


def test_auto_text_is_free_and_calls_are_bound(qwen):
    auto = tools("auto")
    assert accepts(qwen, auto, "Hello! No tool is needed here.\nBye.")
    assert accepts(qwen, auto, "Let me check.\n" + CALL)
    assert accepts(qwen, auto, CALL + "\n" + CALL.replace("Paris", "Rome"))
    # the placeholder of mashbox's own instructions, an undeclared tool, invented keys
    assert not accepts(qwen, auto, CALL.replace("get_weather", "<tool name>"))
    assert not accepts(qwen, auto, CALL.replace("get_weather", "get_wether"))
    assert not accepts(qwen, auto, CALL.replace('{"city": "Paris"}', '{"city": "Paris", "type": "string"}'))
    assert not accepts(qwen, auto, CALL.replace('{"city": "Paris"}', '{"<argument>": 1}'))
    assert not accepts(qwen, tools("auto", parallel=False), CALL + "\n" + CALL)


def test_forced_modes_allow_only_the_calls(qwen):
    # the prompt ends with the forced opening (tool_prompt.forced_call_prefix)
    after_open = CALL.removeprefix("<tool_call>\n")
    assert accepts(qwen, tools("required", parallel=False), after_open)
    assert not accepts(qwen, tools("required", parallel=False), after_open + "\nDone.")
    assert not accepts(qwen, tools("required", parallel=False), after_open + "\n" + CALL)
    assert accepts(qwen, tools("required", parallel=True), after_open + "\n" + CALL)
    named = tools("named", "get_weather", parallel=False)
    assert accepts(qwen, named, '{"city": "Paris"}}\n</tool_call>')
    assert not accepts(qwen, named, '{"tz": "UTC"}}\n</tool_call>')


def test_none_forbids_the_marker_and_auto_with_a_format_is_either(qwen):
    none = tools("none")
    assert accepts(qwen, none, "Plain answer, <b>html</b> is fine.")
    assert not accepts(qwen, none, "Sure: " + CALL)
    tok, _ = qwen
    spelled = tok.encode("<tool_") + tok.encode("call>")  # the marker spelled out in text
    assert "<tool_call>" in tok.decode(spelled)
    m = grammar.matcher(none, qwen[1])
    assert m.try_consume_tokens(spelled) < len(spelled)
    fmt = grammar.json_schema_constraint({"type": "object", "properties": {"n": {"type": "integer"}},
                                          "required": ["n"]})
    either = tools("auto", fmt=fmt)
    assert accepts(qwen, either, '{"n": 5}')
    assert accepts(qwen, either, CALL)
    assert not accepts(qwen, either, "text first " + CALL)
    assert not accepts(qwen, either, '{"n": 5, "m": 6}')  # closed: module rules


def test_response_formats_and_errors(qwen):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]},
                                               "tags": {"type": "array", "items": {"type": "string"},
                                                        "minItems": 1, "maxItems": 2}},
              "required": ["color", "tags"]}
    c = grammar.json_schema_constraint(schema)
    assert accepts(qwen, c, '{"color": "red", "tags": ["a", "b"]}')
    assert not accepts(qwen, c, '{"color": "green", "tags": ["a"]}')
    assert not accepts(qwen, c, '{"color": "red", "tags": ["a", "b", "c"]}')
    assert not accepts(qwen, c, '{"color": "red",\n\n "tags": ["a"]}')  # one JSON style: no free whitespace
    assert accepts(qwen, Constraint("json_object"), '{"any": [1, {"x": null}]}')
    assert not accepts(qwen, Constraint("json_object"), '[1]')
    _, ll = qwen
    assert grammar.check(c, ll) is None
    assert "nowhere" in grammar.check(grammar.json_schema_constraint({"$ref": "#/nowhere"}), ll)
    assert "uniqueItems" in grammar.check(grammar.json_schema_constraint({"type": "array", "uniqueItems": True}), ll)
    assert grammar.check(Constraint("json_schema", "{not json"), ll).startswith("the schema is not JSON")
    assert grammar.check(Constraint("lark", "start: (((("), ll)
    # agents' tool schemas use keywords llguidance does not implement: compiled leniently
    odd = {"type": "function", "function": {"name": "f", "parameters": {
        "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
        "properties": {"xs": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
                       "url": {"type": "string", "format": "uri"}}}}}
    for mode in ("auto", "required"):
        assert grammar.check(Constraint("tool_calls", grammar.tool_call_grammar([odd], mode, None, True)), ll) is None


def test_special_token_markers(qwen_dir, tmp_path):
    from tokenizers import AddedToken, Tokenizer

    hf = Tokenizer.from_file(f"{qwen_dir}/tokenizer.json")
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    folder = tmp_path / "special"
    folder.mkdir()
    hf.save(str(folder / "tokenizer.json"))
    for name in ("tokenizer_config.json", "generation_config.json"):
        (folder / name).write_text(open(f"{qwen_dir}/{name}").read())
    tok = load_tokenizer(str(folder))
    assert "<tool_call>" in tok.special_tokens
    ll = grammar.ll_tokenizer(tok)
    auto = Constraint("tool_calls", grammar.tool_call_grammar([WEATHER], "auto", None, True, ADDED))
    m = grammar.matcher(auto, ll)
    ids = tok.encode_marked([("Checking.", False), ("<tool_call>", True),
                             ('\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', False),
                             ("</tool_call>", True)])
    assert m.try_consume_tokens(ids) == len(ids) and m.is_accepting()
    m = grammar.matcher(auto, ll)
    bad = tok.encode_marked([("<tool_call>", True), ('\n{"name": "other", "arguments": {}}\n', False)])
    assert m.try_consume_tokens(bad) < len(bad)
    text = grammar.tool_call_grammar([WEATHER], "auto", None, True, ())  # no added markers: quoted text
    assert '"<tool_call>"' in text
    assert json.loads(json.dumps(grammar.call_schema([WEATHER])))["properties"]["name"] == {"const": "get_weather"}


def test_a_reasoning_model_thinks_first(qwen):
    fmt = grammar.json_schema_constraint({"type": "object", "properties": {"n": {"type": "integer"}},
                                          "required": ["n"]})
    opened = grammar.after_reasoning(fmt, True, ("<think>", "</think>"))
    maybe = grammar.after_reasoning(fmt, False, ("<think>", "</think>"))
    _, ll = qwen
    assert grammar.check(opened, ll) is None and grammar.check(maybe, ll) is None
    assert accepts(qwen, opened, 'Five, I think.</think>\n\n{"n": 5}')
    assert not accepts(qwen, opened, '{"n": 5}')  # still inside the think block: not the answer
    assert accepts(qwen, maybe, '{"n": 5}')
    assert accepts(qwen, maybe, '<think>\nhm</think>\n{"n": 5}')
    assert not accepts(qwen, maybe, 'hm</think>{"n": 5}')
    assert not accepts(qwen, opened, 'a</think> b</think>{"n": 5}')


def test_a_reasoning_model_with_tools_thinks_with_its_think_tokens(qwen_dir, tmp_path):
    """Where `<think>` is an added token (llguidance: a special one), free text cannot
    write it: the auto grammar lets the thought come first, with the tokens themselves."""
    tok = load_tokenizer(qwen_dir)
    ll = grammar.ll_tokenizer(tok)
    added = tuple(tok.added_tokens)
    assert "<think>" in added
    for reasoning, thought in (("opened", "Weather: call."), ("optional", "<think>Weather: call.")):
        c = Constraint("tool_calls", grammar.tool_call_grammar([WEATHER], "auto", None, True, added,
                                                                reasoning=reasoning))
        assert grammar.check(c, ll) is None
        m = grammar.matcher(c, ll)
        ids = tok.encode(thought + "</think>\n\nSure.\n" + CALL)  # the added tokens match whole
        assert tok.added_tokens["</think>"] in ids and tok.added_tokens["<tool_call>"] in ids
        assert m.try_consume_tokens(ids) == len(ids) and m.is_accepting(), reasoning


# -- custom tools' Lark grammars, inside the call's JSON string ---------------------------

PATCH = r'''start: begin hunk+ end
begin: "*** Begin Patch" LF
end: "*** End Patch" LF?
hunk: add | update
add: "*** Add File: " filename LF add_line+
update: "*** Update File: " filename LF change+
filename: /(.+)/
add_line: "+" /(.*)/ LF -> line
change: ("@@" | "@@ " /(.+)/) LF (("+" | "-" | " ") /(.*)/ LF)*
%import common.LF  // Lark's own
'''
GOOD_PATCHES = [
    '*** Begin Patch\n*** Add File: a "b".txt\n+hello\t\\world\n*** End Patch\n',
    '*** Begin Patch\n*** Update File: x.py\n@@ def f():\n-    return 1\n+    return "2"\n*** End Patch',
]
BAD_PATCHES = [
    '*** Begin Patch\n*** Add File: a.txt\nhello\n*** End Patch\n',  # a line without +
    '*** Begin Patch\n*** Add File: a.txt\n+x\n',  # not ended
]
APPLY = {"type": "function", "function": {"name": "apply_patch", "parameters": {
    "type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}}}


def _escaped(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


def test_a_lark_grammar_is_rewritten_for_its_json_escaped_text(qwen):
    start, rules = grammar.json_string_lark(PATCH, "g0_")
    c = Constraint("lark", "\n".join([f"start: {start}", *rules]) + "\n")
    for text in GOOD_PATCHES:
        assert accepts(qwen, c, _escaped(text)), text
        assert not accepts(qwen, c, text)  # raw newlines and quotes are not JSON string text
    for text in BAD_PATCHES:
        assert not accepts(qwen, c, _escaped(text)), text
    for pattern, text, ok in [(r"/[^a]+/", 'b"\n\\', True), (r"/[^a]+/", "ba", False), (r"/\d{2,3}/", "123", True),
                              (r"/\d{2,3}/", "1", False), (r'"x\ty"', "x\ty", True), (r"/[a-z\s]*/", "a b\nc", True)]:
        start, rules = grammar.json_string_lark(f"start: {pattern}", "g1_")
        lark = Constraint("lark", "\n".join([f"start: {start}", *rules]) + "\n")
        assert accepts(qwen, lark, _escaped(text)) is ok, (pattern, text)
    for bad in ['start: "a"i', "start: /a/i", "start: A\n%ignore WS", "start: <tool_call>", "start: /(?=a)a/",
                "start: x\n%import common.ESCAPED_STRING"]:
        with pytest.raises(grammar.GrammarError):
            grammar.json_string_lark(bad, "g0_")


def test_custom_tool_calls_follow_their_grammar_in_every_mode(qwen):
    grammars = {"apply_patch": PATCH}

    def call(text: str) -> str:
        body = json.dumps({"name": "apply_patch", "arguments": {"input": text}}, ensure_ascii=False)
        return f"<tool_call>\n{body}\n</tool_call>"

    def choice(mode, name=None):
        return Constraint("tool_calls", grammar.tool_call_grammar(
            [WEATHER, APPLY], mode, name, False, ADDED, None, None, grammars))

    auto, required, named = choice("auto"), choice("required"), choice("named", "apply_patch")
    for text in GOOD_PATCHES:
        assert accepts(qwen, auto, "Patching.\n" + call(text))
        assert accepts(qwen, required, call(text).removeprefix("<tool_call>\n"))
        forced = '<tool_call>\n{"name": "apply_patch", "arguments": '
        assert accepts(qwen, named, call(text).removeprefix(forced))
    for text in BAD_PATCHES:
        assert not accepts(qwen, auto, "Patching.\n" + call(text))
        assert not accepts(qwen, required, call(text).removeprefix("<tool_call>\n"))
    assert accepts(qwen, required, CALL.removeprefix("<tool_call>\n"))  # the function tool is still there
    # a grammar that cannot be rewritten leaves that input a free string (required with
    # one tool is that tool named)
    loose = grammar.tool_call_grammar([APPLY], "required", None, False, ADDED, grammars={"apply_patch": 'start: "a"i'})
    assert accepts(qwen, Constraint("tool_calls", loose), call("anything").removeprefix(forced))
