"""Logprobs on the wire with a scripted engine: the real app, the default model's
tokenizer and detokenizer, and a known model output, so the cases the real model will
not produce on demand are exact: a tool call (the parser holds text back and drops its
tags), an emoji split over byte tokens, trailing whitespace held before a tag. Every
token's logprob goes out once, in order, and never before its text; streamed equals
whole. The values themselves are checked against torch in test_logprobs_e2e.py's
neighbours (tests/engine/test_logprobs_tiny.py, tests/test_native_logprobs.py)."""
from __future__ import annotations

import json

import pytest

import harness
from api_scripted_engine import server_fixtures
from mashbox.config import StepEvent, Timings, TokenLogprob
from mashbox.text.detok import IncrementalDetokenizer
from mashbox.text.token_bytes import TokenBytes
from mashbox.text.tokenizer import load_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = 'Let me check 🌦.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
EMOJI = "Sure 🎉🎉 done  \u00e9t\u00e9!"


class Script:
    """Plays `text` token by token as the worker would: real ids, the real incremental
    detokenizer, logprob -(i+1)/100 for token i, top alternatives (the token, id 7)."""

    tok = None

    def __init__(self):
        self.text = EMOJI

    def __call__(self, req):
        ids = self.tok.encode(self.text)
        self.ids = ids
        detok = IncrementalDetokenizer(self.tok, list(req.prompt_ids))
        n = len(req.prompt_ids)
        events = [StepEvent(id=req.id, started=True, prompt_tokens=n)]
        for i, t in enumerate(ids):
            lp = TokenLogprob(-(i + 1) / 100, (t, 7)[: req.logprobs or 0], (-(i + 1) / 100, -9.0)[: req.logprobs or 0])
            last = i == len(ids) - 1
            text = detok.push([t]) + (detok.flush() if last else "")
            events.append(StepEvent(id=req.id, token_ids=(t,), text=text, prompt_tokens=n,
                                    logprobs=(lp,) if req.logprobs is not None else (),
                                    finish_reason="stop" if last else None,
                                    timings=Timings(predicted_n=len(ids)) if last else None))
        return events


script, engine, app = server_fixtures(Script, ctx=4096)


@pytest.fixture(autouse=True)
def reset(script, default_model_path):
    if Script.tok is None:
        Script.tok = load_tokenizer(default_model_path)
    script.__init__()


def _stream(app, body, path="/v1/chat/completions"):
    r = harness.post(app.base_url, {**body, "stream": True}, path, timeout=30)
    assert r.status_code == 200, r.text
    return [json.loads(d) for _, d in harness.sse_frames(r.content) if d != "[DONE]"]


def _whole(app, body, path="/v1/chat/completions"):
    r = harness.post(app.base_url, body, path, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _expected(script):
    tb = TokenBytes(Script.tok)
    return [(tb.text(t), -(i + 1) / 100, list(tb.of(t))) for i, t in enumerate(script.ids)]


@pytest.mark.parametrize("text", [EMOJI, CALL])
def test_chat_every_token_once_in_order_never_early(app, script, text):
    script.text = text
    body = {"messages": [{"role": "user", "content": "Weather?"}], "logprobs": True, "top_logprobs": 2,
            "tools": [WEATHER]}
    chunks = _stream(app, body)
    want = _expected(script)
    got, sent, shown = [], b"", b""
    for c in chunks:
        if not c["choices"]:
            continue
        ch = c["choices"][0]
        delta = ch["delta"]
        shown += (delta.get("content") or "").encode()
        if ch["logprobs"] is not None:
            for e in ch["logprobs"]["content"]:
                got.append((e["token"], e["logprob"], e["bytes"]))
                assert [t["logprob"] for t in e["top_logprobs"]] == [e["logprob"], -9.0]
                sent += bytes(e["bytes"])
        if not delta.get("tool_calls") and "<tool_call>" not in sent.decode(errors="replace"):
            assert shown.startswith(sent)  # content tokens: never before their text
    assert got == want
    whole = _whole(app, body)
    content = whole["choices"][0]["logprobs"]["content"]
    assert [(e["token"], e["logprob"], e["bytes"]) for e in content] == want
    if text == CALL:
        assert whole["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
        assert whole["choices"][0]["message"]["content"] == "Let me check 🌦."
    else:
        assert b"".join(bytes(e["bytes"]) for e in content).decode() == whole["choices"][0]["message"]["content"]


def test_completions_text_offset_counts_characters(app, script):
    body = {"prompt": "x", "logprobs": 1}
    whole = _whole(app, body, "/v1/completions")["choices"][0]
    lp = whole["logprobs"]
    assert whole["text"] == EMOJI and len(lp["tokens"]) == len(script.ids)
    tb = TokenBytes(Script.tok)
    before = [b"".join(tb.of(t) for t in script.ids[:i]) for i in range(len(script.ids))]
    # characters complete before each token: one inside an emoji starts where the emoji does
    assert lp["text_offset"] == [len(x.decode("utf-8", "ignore")) for x in before]
    assert len(set(lp["text_offset"])) < len(script.ids)  # the emoji really is split over tokens
    assert [list(d.values()) for d in lp["top_logprobs"]] == [[v] for v in lp["token_logprobs"]]
    streamed = _stream(app, body, "/v1/completions")
    offs = [o for c in streamed if c["choices"][0]["logprobs"] for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offs == lp["text_offset"]
    assert "".join(c["choices"][0]["text"] for c in streamed) == EMOJI


def test_responses_delta_logprobs_and_part(app, script):
    body = {"input": "x", "include": ["message.output_text.logprobs"]}
    want = [(t, v, b) for t, v, b in _expected(script)]
    part = _whole(app, body, "/v1/responses")["output"][0]["content"][0]
    assert [(e["token"], e["logprob"], e["bytes"]) for e in part["logprobs"]] == want
    assert all(e["top_logprobs"] == [] for e in part["logprobs"])  # include alone: top 0
    events = _stream(app, body, "/v1/responses")
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [(x["token"], x["logprob"], x["bytes"]) for e in deltas for x in e["logprobs"]] == want
    sent = b""
    shown = b""
    for e in deltas:
        shown += e["delta"].encode()
        sent += b"".join(bytes(x["bytes"]) for x in e["logprobs"])
        assert shown.startswith(sent)


def test_no_logprobs_asked_none_sent(app, engine):
    chunks = _stream(app, {"messages": [{"role": "user", "content": "hi"}]})
    assert all(c["choices"][0]["logprobs"] is None for c in chunks if c["choices"])
    assert engine.submitted[-1].logprobs is None
    assert _whole(app, {"prompt": "x"}, "/v1/completions")["choices"][0]["logprobs"] is None
