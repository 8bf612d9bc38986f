"""Stop-string matching: the C matcher against its reference at every split, against a
whole-text oracle, and the promises the stream depends on (never shows a stop nor a
prefix that may still complete, never splits a character)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from mashbox import native, native_ref

# a small alphabet with 1-, 2-, 3- and 4-byte UTF-8 characters, so matches overlap often
ALPHABET = "ab\u00e9\u20ac\U0001f600\n"


def _oracle(text: str, stops: list[str]) -> tuple[str, int]:
    """Whole-text answer: cut at the first end position of any stop, earliest start wins."""
    for end in range(1, len(text) + 1):
        hits = [(end - len(s), i) for i, s in enumerate(stops) if s and end >= len(s) and text.startswith(s, end - len(s))]
        if hits:
            start, index = min(hits)
            return text[:start], index
    return text, -1


def _run(matcher_cls, pieces: list[str], stops: list[str]) -> tuple[list[str], int, str]:
    """Feed the pieces; return each feed's emitted text, the stop index, the flushed text."""
    m = matcher_cls(stops)
    emitted, index = [], -1
    for piece in pieces:
        out, idx = m.feed(piece)
        emitted.append(out)
        if idx >= 0:
            assert index in (-1, idx)
            index = idx
    return emitted, index, m.flush()


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    pieces, prev = [], 0
    for p in points + [len(text)]:
        pieces.append(text[prev:p])
        prev = p
    return pieces


_texts = st.text(alphabet=ALPHABET, max_size=30)
_stops = st.lists(st.text(alphabet=ALPHABET, max_size=4), max_size=4)


@settings(max_examples=500, deadline=None)
@given(_texts, _stops, st.lists(st.integers(0, 30), max_size=8))
def test_c_matches_reference_and_oracle_at_any_split(text, stops, cuts):
    pieces = _split(text, cuts)
    c = _run(native.StopMatcher, pieces, stops)
    ref = _run(native_ref.StopMatcher, pieces, stops)
    assert c == ref
    emitted, index, flushed = c
    expected, expected_index = _oracle(text, stops)
    assert index == expected_index
    assert "".join(emitted) + (flushed if index < 0 else "") == expected
    if index >= 0:
        assert flushed == ""


@settings(max_examples=200, deadline=None)
@given(_texts, _stops)
def test_emitted_text_never_shows_a_stop_or_a_prefix_that_later_completes(text, stops):
    """Character by character: what has been emitted is always a prefix of the final cut
    text, which contains no stop."""
    expected, _ = _oracle(text, stops)
    m = native.StopMatcher(stops)
    shown = ""
    for ch in text:
        out, idx = m.feed(ch)
        shown += out
        assert expected.startswith(shown)
        if idx >= 0:
            break
    for s in stops:
        if s:
            assert s not in expected


def test_the_earliest_ending_stop_wins_and_the_text_ends_before_it():
    m = native.StopMatcher(["abc", "b"])
    assert m.feed("xa") == ("x", -1)  # "a" may start "abc": held
    assert m.feed("bc") == ("a", 1)  # "b" ends first, before "abc" could; "a" is released
    assert m.feed("more") == ("", 1)
    assert m.flush() == ""


def test_among_stops_ending_together_the_longest_wins():
    assert native.StopMatcher(["b", "ab"]).feed("xab") == ("x", 1)
    assert native.StopMatcher(["ab", "ab"]).feed("xab") == ("x", 0)


def test_held_text_is_released_when_it_stops_being_a_prefix_and_flushed_at_the_end():
    m = native.StopMatcher(["</tool>"])
    assert m.feed("hello </to") == ("hello ", -1)
    assert m.feed("p") == ("</top", -1)
    assert m.feed(" <") == (" ", -1)
    assert m.flush() == "<"


def test_multibyte_stops_never_split_a_character():
    m = native.StopMatcher(["\U0001f600!"])
    assert m.feed("caf\u00e9 \U0001f600") == ("caf\u00e9 ", -1)
    assert m.feed("?") == ("\U0001f600?", -1)
    m = native.StopMatcher(["\u00e9t\u00e9"])
    assert m.feed("l'\u00e9t\u00e9 dernier") == ("l'", 0)


def test_no_stops_and_empty_stops_pass_everything_through():
    for stops in ([], [""]):
        m = native.StopMatcher(stops)
        assert m.feed("abc") == ("abc", -1)
        assert m.feed("") == ("", -1)
        assert m.flush() == ""


def test_a_stop_spanning_many_feeds_matches():
    m = native.StopMatcher(["STOP HERE"])
    out = [m.feed(ch) for ch in "go STOP HERE now"]
    assert "".join(o for o, _ in out) == "go "
    assert out[-1] == ("", 0)


def test_a_string_instead_of_a_list_is_refused():
    with pytest.raises(ValueError, match="stops"):
        native.StopMatcher("stop")
