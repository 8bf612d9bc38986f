"""The output parser: scripted outputs give the expected pieces, and the pieces do not
depend on where the text was split (every boundary, and random multi-splits)."""
from __future__ import annotations

import itertools
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mashbox.text import tool_prompt
from mashbox.text.pieces import PIECE_KINDS
from mashbox.text.parsers import (
    OutputParser,
    ParserError,
    Piece,
    Reasoning,
    State,
    Text,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
    _merged,
    new_call_id,
)


def counter_ids():
    c = itertools.count()
    return lambda: f"call_{next(c)}"


def parse(chunks, **kw) -> list:
    p = OutputParser(call_id=counter_ids(), **kw)
    out = []
    for c in chunks:
        out += p.feed(c)
    out += p.finish()
    return _merged(out)


def splits_at_every_boundary(text: str):
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]


def call(name, args, sep="\n"):
    return f'<tool_call>{sep}{json.dumps({"name": name, "arguments": args})}{sep}</tool_call>'


# (output, parser options, expected pieces)
SCRIPTS = [
    ("Plain answer.\n", dict(tools=True, reasoning=True), [Text("Plain answer.\n")]),
    (
        "<think>\nThe user greets me.\n</think>\n\nHello!",
        dict(reasoning=True),
        [Reasoning("The user greets me."), Text("Hello!")],
    ),
    (
        # The prompt opened <think> (R1-style): the output starts inside reasoning.
        "I should call a tool.\n</think>\n\n" + call("get_weather", {"city": "Paris"}),
        dict(reasoning=True, tools=True, in_reasoning=True),
        [
            Reasoning("I should call a tool."),
            ToolCallStart(0, "call_0", "get_weather"),
            ToolCallArgs(0, '{"city": "Paris"}', "call_0"),
            ToolCallEnd(0, '{"city": "Paris"}', True, "call_0"),
        ],
    ),
    (
        "<think>two calls</think>Checking both.\n"
        + call("get_weather", {"city": "Paris", "days": 2}) + "\n"
        + call("search", {"q": "a \"quoted\" </tool_call> {x}", "n": [1, {"deep": None}]}) + "\n",
        dict(reasoning=True, tools=True),
        [
            Reasoning("two calls"),
            Text("Checking both."),
            ToolCallStart(0, "call_0", "get_weather"),
            ToolCallArgs(0, '{"city": "Paris", "days": 2}', "call_0"),
            ToolCallEnd(0, '{"city": "Paris", "days": 2}', True, "call_0"),
            ToolCallStart(1, "call_1", "search"),
            ToolCallArgs(1, '{"q": "a \\"quoted\\" </tool_call> {x}", "n": [1, {"deep": null}]}', "call_1"),
            ToolCallEnd(1, '{"q": "a \\"quoted\\" </tool_call> {x}", "n": [1, {"deep": null}]}', True, "call_1"),
        ],
    ),
    (
        # Arguments before the name: sent in one piece once the name is known.
        '<tool_call>{"arguments": {"x": [1, 2]}, "name": "late"}</tool_call>',
        dict(tools=True),
        [ToolCallStart(0, "call_0", "late"), ToolCallArgs(0, '{"x": [1, 2]}', "call_0"), ToolCallEnd(0, '{"x": [1, 2]}', True, "call_0")],
    ),
    (
        # Arguments as JSON in a string, "parameters" spelling, no closing tag.
        '<tool_call>{"name": "f", "parameters": "{\\"a\\": 1}"}',
        dict(tools=True),
        [ToolCallStart(0, "call_0", "f"), ToolCallArgs(0, '{"a": 1}', "call_0"), ToolCallEnd(0, '{"a": 1}', True, "call_0")],
    ),
    (
        # No arguments, null arguments; the next call starts without a closing tag.
        '<tool_call>{"name": "a"}<tool_call>{"name": "b", "arguments": null}</tool_call>',
        dict(tools=True),
        [
            ToolCallStart(0, "call_0", "a"), ToolCallArgs(0, "{}", "call_0"), ToolCallEnd(0, "{}", True, "call_0"),
            ToolCallStart(1, "call_1", "b"), ToolCallArgs(1, "{}", "call_1"), ToolCallEnd(1, "{}", True, "call_1"),
        ],
    ),
    (
        # Not JSON: plain text, exactly as written (the space before the tag too).
        "Use the <tool_call> tag like <tool_call>this</tool_call>.",
        dict(tools=True),
        [Text("Use the <tool_call> tag like <tool_call>this</tool_call>.")],
    ),
    (
        # JSON without a name: plain text.
        'x <tool_call>{"arguments": {}}</tool_call> y',
        dict(tools=True),
        [Text('x <tool_call>{"arguments": {}}</tool_call> y')],
    ),
    (
        # Cut off by max_tokens inside the arguments: committed, so a call with
        # arguments that do not parse.
        '<tool_call>\n{"name": "write", "arguments": {"text": "half a sent',
        dict(tools=True),
        [
            ToolCallStart(0, "call_0", "write"),
            ToolCallArgs(0, '{"text": "half a sent', "call_0"),
            ToolCallEnd(0, '{"text": "half a sent', False, "call_0"),
        ],
    ),
    (
        # Broken body after the commit: streaming stops, the rest of the call is dropped.
        '<tool_call>{"name": "f", "arguments": {"a": 1} oops}</tool_call>after',
        dict(tools=True),
        [
            ToolCallStart(0, "call_0", "f"),
            ToolCallArgs(0, '{"a": 1}', "call_0"),
            ToolCallEnd(0, '{"a": 1}', True, "call_0"),
            Text("after"),
        ],
    ),
    (
        '<tool_call>{"name": "f" "arguments": {}}</tool_call>after',
        dict(tools=True),
        [ToolCallStart(0, "call_0", "f"), ToolCallArgs(0, "{}", "call_0"), ToolCallEnd(0, "{}", True, "call_0"), Text("after")],
    ),
    (
        "<think>a</think><tool_call>{}</tool_call>",
        dict(),  # nothing enabled: all text
        [Text("<think>a</think><tool_call>{}</tool_call>")],
    ),
    (
        "<think>thinking about <tool_call>{\"name\": \"x\"}</tool_call></think>answer",
        dict(reasoning=True, tools=True),
        [Reasoning('thinking about <tool_call>{"name": "x"}</tool_call>'), Text("answer")],
    ),
    (
        "<think>never closed, cut by max_tokens  \n",
        dict(reasoning=True),
        [Reasoning("never closed, cut by max_tokens")],
    ),
    ("a < b and c <= d <", dict(tools=True, reasoning=True), [Text("a < b and c <= d <")]),
]


@pytest.mark.parametrize("output,options,pieces", SCRIPTS)
def test_scripted_outputs(output, options, pieces):
    assert parse([output], **options) == pieces


@pytest.mark.parametrize("output,options,pieces", SCRIPTS)
def test_every_boundary_and_char_by_char(output, options, pieces):
    for chunks in splits_at_every_boundary(output):
        assert parse(chunks, **options) == pieces, chunks
    assert parse(list(output), **options) == pieces


@pytest.mark.parametrize("output,options,pieces", SCRIPTS)
def test_random_multi_splits(output, options, pieces):
    @settings(max_examples=60, deadline=None)
    @given(cuts=st.lists(st.integers(0, len(output)), max_size=12))
    def check(cuts):
        points = sorted(set(cuts))
        chunks = [output[a:b] for a, b in zip([0, *points], [*points, len(output)])]
        assert parse(chunks, **options) == pieces

    check()


def test_held_back_text_is_not_streamed():
    p = OutputParser(tools=True, reasoning=True)
    assert p.feed("Hello <tool_ca") == [Text("Hello")]
    assert p.feed("ll") == []
    assert p.feed("ing is what I do") == [Text(" <tool_calling is what I do")]
    assert p.feed("\n\n") == []  # whitespace waits: a tag may follow
    assert p.feed("<thi") == []
    assert p.feed("s") == [Text("\n\n<this")]
    assert p.finish() == []


def test_arguments_stream_before_the_call_ends():
    p = OutputParser(tools=True, call_id=lambda: "call_1")
    assert p.feed('<tool_call>\n{"name": "get_weather", "argu') == [ToolCallStart(0, "call_1", "get_weather")]
    assert p.feed('ments": {"city": "Pa') == [ToolCallArgs(0, '{"city": "Pa', "call_1")]
    assert p.feed('ris"}') == [ToolCallArgs(0, 'ris"}', "call_1")]
    assert p.feed("}\n</tool_") == []
    assert p.feed("call>") == [ToolCallEnd(0, '{"city": "Paris"}', True, "call_1")]
    assert p.state is State.TEXT and p.num_calls == 1


def test_primed_by_the_forced_call_prefix():
    p = OutputParser(tools=True, call_id=lambda: "call_f")
    assert p.feed(tool_prompt.forced_call_prefix("get_weather")) == [ToolCallStart(0, "call_f", "get_weather")]
    out = p.feed('{"city": "Oslo"}}\n</tool_call>\nDone.') + p.finish()
    assert out == [ToolCallArgs(0, '{"city": "Oslo"}', "call_f"), ToolCallEnd(0, '{"city": "Oslo"}', True, "call_f"),
                   Text("Done.")]


def test_call_ids_and_errors():
    assert re.fullmatch(r"call_[0-9a-f]{24}", new_call_id())  # the wire's format: 24 hex characters
    assert re.fullmatch(r"toolu_[0-9a-f]{24}", new_call_id("toolu_"))
    assert new_call_id() != new_call_id()
    p = OutputParser(tools=True)
    p.finish()
    with pytest.raises(ParserError):
        p.feed("more")
    q = OutputParser(tools=True)
    with pytest.raises(ParserError):
        q._goto(State.REASONING, "</tool_call>")  # not in the table


# -- generated outputs --------------------------------------------------------------------------
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
ARGS = st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=4)
NAMES = st.from_regex(r"[a-z_][a-z0-9_.\-]{0,15}", fullmatch=True)
# Text without "<" cannot hold a tag; whitespace at its ends touches the tags.
PLAIN = st.text(alphabet=st.characters(blacklist_characters="<", blacklist_categories=("Cs",)), max_size=20)


@st.composite
def outputs(draw):
    """(output text, expected calls [(name, args)], expected reasoning, expected text)"""
    parts, calls = [], []
    reasoning = draw(st.one_of(st.none(), PLAIN))
    if reasoning is not None:
        parts.append(f"<think>{reasoning}</think>")
    text = draw(PLAIN)
    parts.append(text)
    for _ in range(draw(st.integers(0, 3))):
        name, args = draw(NAMES), draw(ARGS)
        sep = draw(st.sampled_from(["", "\n", " \n "]))
        ensure_ascii = draw(st.booleans())
        body = json.dumps({"name": name, "arguments": args}, ensure_ascii=ensure_ascii)
        parts.append(draw(st.sampled_from(["", "\n", "\n\n"])) + f"<tool_call>{sep}{body}{sep}</tool_call>")
        calls.append((name, args))
    return "".join(parts), calls, reasoning, text


@settings(max_examples=200, deadline=None)
@given(case=outputs(), data=st.data())
def test_generated_outputs_any_split(case, data):
    output, calls, reasoning, text = case
    whole = parse([output], tools=True, reasoning=True)
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(output)), max_size=10))))
    chunks = [output[a:b] for a, b in zip([0, *cuts], [*cuts, len(output)])]
    assert parse(chunks, tools=True, reasoning=True) == whole

    got_calls = [(p.name, p.index) for p in whole if p.kind == "tool_start"]
    ends = [p for p in whole if p.kind == "tool_end"]
    assert [n for n, _ in got_calls] == [n for n, _ in calls]
    assert [json.loads(e.text) for e in ends] == [a for _, a in calls]
    assert all(e.valid for e in ends)
    for e in ends:
        deltas = "".join(p.text for p in whole if p.kind == "tool_args" and p.index == e.index)
        assert deltas == e.text
        assert {p.id for p in whole if p.kind.startswith("tool_") and p.index == e.index} == {f"call_{e.index}"}
    got_reasoning = "".join(p.text for p in whole if p.kind == "reasoning")
    assert got_reasoning == (reasoning or "").strip()
    got_text = "".join(p.text for p in whole if p.kind == "text")
    expect = text.lstrip() if reasoning is not None else text
    if calls:
        expect = expect.rstrip()
    assert got_text == expect


GARBAGE = st.lists(
    st.sampled_from(
        list('<>/{}":, \n\\abtoolcallthinkname')
        + ["<tool_call>", "</tool_call>", "<think>", "</think>", '{"name": "f", "arguments": ', "{", "}"]
    ),
    max_size=30,
).map("".join)


@settings(max_examples=200, deadline=None)
@given(output=GARBAGE, data=st.data())
def test_arbitrary_output_any_split(output, data):
    """Fragments of tags and JSON in any order: the same pieces for any split."""
    whole = parse([output], tools=True, reasoning=True)
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(output)), max_size=10))))
    chunks = [output[a:b] for a, b in zip([0, *cuts], [*cuts, len(output)])]
    assert parse(chunks, tools=True, reasoning=True) == whole
    assert parse(list(output), tools=True, reasoning=True) == whole


def test_model_specific_reasoning_markers():
    output = "[THINK]plan it[/THINK]Answer with <think> kept as text."
    for chunks in splits_at_every_boundary(output):
        assert parse(chunks, reasoning=True, think_tags=("[THINK]", "[/THINK]")) == [
            Reasoning("plan it"),
            Text("Answer with <think> kept as text."),
        ]


def test_pieces_are_frozen_values():
    import dataclasses

    piece = ToolCallStart(0, "call_1", "f")
    with pytest.raises(dataclasses.FrozenInstanceError):
        piece.name = "g"
    assert piece.kind == "tool_start" and Text("x").kind == "text"
    assert [k.kind for k in (Text("a"), Reasoning("b"), ToolCallStart(0, "i", "f"), ToolCallArgs(0, "{}", "i"),
                             ToolCallEnd(0, "{}", True, "i"))] == list(PIECE_KINDS)
    with pytest.raises(ValueError):
        Piece("tool_call_start")  # the old kind names are gone: one vocabulary


def test_ids_carry_the_routes_prefix():
    p = OutputParser(tools=True, id_prefix="toolu_")
    out = p.feed(call("f", {"a": 1})) + p.finish()
    ids = {piece.id for piece in out}
    assert len(ids) == 1 and re.fullmatch(r"toolu_[0-9a-f]{24}", ids.pop())
