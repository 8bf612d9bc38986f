"""Logprobs end to end: the real server on the default model (conftest `server`), the
official openai SDK, on Chat, Completions and Responses, streamed and whole.

What is checked: the shapes the SDK parses; for greedy decoding the chosen token is the
best of its top_logprobs (same value), top_logprobs are sorted and their probabilities
sum to at most 1; the tokens' bytes join up to the text; a stream never sends a token's
logprob before its text, and its logprobs equal the whole answer's; Chat and Responses
(the same prompt) report the same values. That the values are log-softmax of the
sampler's logits is checked against torch on the tiny model
(tests/engine/test_logprobs_tiny.py, tests/test_native_logprobs.py)."""
from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Name three planets, with an emoji for each."}]
MAX = 20


@pytest.fixture(scope="module")
def client(openai_client):
    return openai_client


def _check_tops(token, logprob, tops, n, greedy=True):
    assert len(tops) == n
    values = [t.logprob for t in tops]
    assert values == sorted(values, reverse=True)
    assert sum(math.exp(v) for v in values) <= 1 + 1e-6
    assert -9999.0 <= logprob <= 0
    if greedy and n:
        assert tops[0].token == token and abs(tops[0].logprob - logprob) < 1e-6


def _text(b: bytes) -> str:
    """Tokens' bytes as the answer's text shows them: a character that max_tokens cut open
    (the tail of an emoji) is one U+FFFD there, as detok's flush writes it."""
    return b.decode("utf-8", "replace")


def _key(e):
    return (e.token, round(e.logprob, 5), tuple(e.bytes), tuple((t.token, round(t.logprob, 5)) for t in e.top_logprobs))


def test_chat_whole_and_streamed(client, model_id):
    kw = dict(model=model_id, messages=MESSAGES, max_tokens=MAX, temperature=0, logprobs=True, top_logprobs=5)
    client.chat.completions.create(**kw)  # warm the prefix cache: both runs below take the same path
    whole = client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for e in content:
        _check_tops(e.token, e.logprob, e.top_logprobs, 5)
        assert bytes(e.bytes).decode("utf-8", "backslashreplace") == e.token
        assert all(bytes(t.bytes).decode("utf-8", "backslashreplace") == t.token for t in e.top_logprobs)
    text = whole.choices[0].message.content
    assert _text(b"".join(bytes(e.bytes) for e in content)) == text

    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed, shown, sent = [], b"", b""
    for c in chunks:
        if not c.choices:
            continue
        ch = c.choices[0]
        shown += (ch.delta.content or "").encode()
        if ch.logprobs is not None:
            streamed += ch.logprobs.content
            sent += b"".join(bytes(e.bytes) for e in ch.logprobs.content)
        assert shown.decode().startswith(_text(sent))  # never a token's logprob before its text
    assert shown.decode() == text
    assert [_key(e) for e in streamed] == [_key(e) for e in content]


def test_chat_without_logprobs_is_null_and_top_zero(client, model_id):
    plain = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=4)
    assert plain.choices[0].logprobs is None
    zero = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=4, logprobs=True)
    assert [e.top_logprobs for e in zero.choices[0].logprobs.content] == [[]] * zero.usage.completion_tokens


def test_chat_sampled_logprobs_are_before_temperature(client, model_id):
    kw = dict(model=model_id, messages=MESSAGES, max_tokens=8, logprobs=True, top_logprobs=20, seed=7)
    hot = client.chat.completions.create(**kw, temperature=1.5).choices[0].logprobs.content
    cold = client.chat.completions.create(**kw, temperature=0).choices[0].logprobs.content
    # the first position has the same logits whatever the temperature: the same values
    assert _key(hot[0])[3] == _key(cold[0])[3]
    for e in hot:
        _check_tops(e.token, e.logprob, e.top_logprobs, 20, greedy=False)


def test_completions_legacy_shape(client, model_id):
    kw = dict(model=model_id, prompt="The three primary colours are", max_tokens=MAX, temperature=0, logprobs=3)
    client.completions.create(**kw)
    whole = client.completions.create(**kw)
    lp = whole.choices[0].logprobs
    n = len(lp.tokens)
    assert n == whole.usage.completion_tokens and len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert "".join(lp.tokens) == whole.choices[0].text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(n)]
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(v, abs=1e-6) and top[tok] == v
    chunks = list(client.completions.create(**kw, stream=True))
    tokens, values, offsets, text = [], [], [], ""
    for c in chunks:
        text += c.choices[0].text
        if c.choices[0].logprobs is not None:
            tokens += c.choices[0].logprobs.tokens
            values += c.choices[0].logprobs.token_logprobs
            offsets += c.choices[0].logprobs.text_offset
    assert text == whole.choices[0].text and tokens == lp.tokens and offsets == lp.text_offset
    assert values == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_responses_whole_streamed_and_like_chat(client, model_id):
    kw = dict(model=model_id, input=MESSAGES[0]["content"], max_output_tokens=MAX, temperature=0,
              top_logprobs=4, include=["message.output_text.logprobs"])
    client.responses.create(**kw)
    whole = client.responses.create(**kw)
    part = whole.output[0].content[0]
    assert part.type == "output_text" and part.logprobs
    for e in part.logprobs:
        _check_tops(e.token, e.logprob, e.top_logprobs, 4)
    assert _text(b"".join(bytes(e.bytes) for e in part.logprobs)) == part.text
    events = list(client.responses.create(**kw, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    streamed = [x for e in deltas for x in e.logprobs]
    assert [_key(e) for e in streamed] == [_key(e) for e in part.logprobs]
    done = [e for e in events if e.type == "response.output_text.done"][0]
    assert [_key(e) for e in done.logprobs] == [_key(e) for e in part.logprobs]
    # the same prompt through Chat: the same tokens and values (prefill paths may differ in the last bits)
    chat = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=MAX, temperature=0,
                                          logprobs=True, top_logprobs=4).choices[0].logprobs.content
    common = [(a, b) for a, b in zip(part.logprobs, chat)]
    assert common and all(a.token == b.token and abs(a.logprob - b.logprob) < 1e-2 for a, b in common[:3])
