"""Exact wire bytes of /v1/messages for cases the real model cannot be made to produce
on demand: a worker failure mid-stream, a prefill long enough to need pings, a stop
sequence at a known place, a full queue, a loading model.

The engine is the scripted double of api_scripted_engine.py (the EngineClient surface,
replaying StepEvents; `replay_engine` here gives it one script for every request); tokenizer and chat template are the real default model's. Handlers are
called directly and their StreamResponse iterated, so the bytes checked are exactly
what the protocol would write. The real server and SDKs are in test_messages_e2e.py.
"""
from __future__ import annotations

import asyncio

import orjson
import pytest

from mashbox.api import common, message_answer, messages, pipeline
from mashbox.api.app import load_text
from mashbox.config import EngineConfig, ServerConfig, StepEvent, Timings
from mashbox.engine.client import NotReady, QueueFull
from mashbox.http.request import Request
from mashbox.http.response import HTTPError

import harness
from api_scripted_engine import ScriptedEngine


def replay_engine(script: list, ctx: int = 2048, state: str = "ok", refuse: Exception = None) -> ScriptedEngine:
    """The shared ScriptedEngine answering every request with `script`: a dict is one
    StepEvent's fields, a number that many seconds without an event (a long prefill).
    `refuse` makes submit raise it (NotReady() or QueueFull(scope)); state "loading" is a
    model still loading."""

    def answer(request):
        if refuse is not None:
            return [refuse]
        return [StepEvent(id=request.id, **item) if isinstance(item, dict) else item for item in script]

    engine = ScriptedEngine(answer, ctx=ctx)
    engine.state = state
    return engine


def finish(reason: str, text: str = "", stop_sequence=None, n: int = 3, prompt: int = 0, cached: int = 0) -> dict:
    return {"token_ids": (1,) if text else (), "text": text, "finish_reason": reason, "stop_sequence": stop_sequence,
            "timings": Timings(prompt_n=prompt - cached, cache_n=cached, predicted_n=n)}


@pytest.fixture(scope="module")
def text_layer(default_model_path):
    return load_text(EngineConfig(model_path=default_model_path, model_id="smollm2-scripted"))


def make_api(text_layer, engine) -> common.ApiContext:
    tokenizer, template = text_layer
    return common.ApiContext(server_config=ServerConfig(), engine_config=EngineConfig(
        model_path="unused", model_id="scripted", ctx=engine.info.ctx),
        engine=engine, tokenizer=tokenizer, template=template)


def handler(api, path: str):
    for method, p, h, family in messages.routes(api):
        if p == path:
            assert family == "anthropic"
            return h
    raise AssertionError(path)


def post(api, body: dict, path: str = "/v1/messages"):
    req = Request("POST", path, "beta=true", {"content-type": "application/json"}, orjson.dumps(body))
    return asyncio.run(handler(api, path)(req))


async def stream_bytes(stream) -> bytes:
    """Every frame of a StreamResponse, then its close (as the protocol does)."""
    out = []
    try:
        async for chunk in stream.events:
            out.append(chunk)
    finally:
        await stream.events.aclose()
    return b"".join(out)


sse_frames = harness.sse_events  # strict `event: NAME\ndata: JSON` frames, name == data's type


def stream_body(**extra) -> dict:
    body = {"model": "claude-sonnet-4-5", "max_tokens": 50, "stream": True,
            "messages": [{"role": "user", "content": "Say hello."}]}
    body.update(extra)
    return body


def run_stream(api, body) -> list[tuple[str, dict]]:
    async def go():
        resp = await handler(api, "/v1/messages")(
            Request("POST", "/v1/messages", "beta=true", {}, orjson.dumps(body)))
        return await stream_bytes(resp)

    return sse_frames(asyncio.run(go()))


def test_stream_exact_sequence_with_stop_sequence(text_layer):
    engine = replay_engine([{"started": True}, {"token_ids": (5,), "text": "Hello"},
                             finish("stop_sequence", " there", "END", n=2)])
    api = make_api(text_layer, engine)
    frames = run_stream(api, stream_body(stop_sequences=["END"]))
    assert [n for n, _ in frames] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                      "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    start = frames[0][1]["message"]
    n_prompt = len(engine.submitted[0].prompt_ids)
    assert start["model"] == "claude-sonnet-4-5" and start["id"].startswith("msg_")
    assert start["usage"]["input_tokens"] == n_prompt and start["stop_reason"] is None
    assert engine.submitted[0].stops == ("END",)
    assert [f[1]["delta"]["text"] for f in frames[3:5]] == ["Hello", " there"]
    assert frames[6][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert frames[6][1]["usage"]["output_tokens"] == 2


def test_message_start_goes_out_before_a_silent_engine_answers_and_pings_keep_it_alive(text_layer, monkeypatch):
    """An engine silent for longer than PING_S: message_start does not wait for it (its
    usage counts no cache hit, though the engine's late answer would say 3), then pings."""
    monkeypatch.setattr(message_answer, "PING_S", 0.1)
    engine = replay_engine([0.55, {"started": True, "cached_tokens": 3}, finish("stop", "Hi", n=1, cached=3)])
    api = make_api(text_layer, engine)
    frames = run_stream(api, stream_body())
    assert frames[0][0] == "message_start"
    assert frames[0][1]["message"]["usage"]["cache_read_input_tokens"] == 0
    names = [n for n, _ in frames]
    assert names[1] == "ping"
    # 0.55 s of silence at one ping per 0.1 s: several pings before the first block.
    assert names[:names.index("content_block_start")].count("ping") >= 4
    assert names[-2:] == ["message_delta", "message_stop"]


def test_message_start_waits_for_a_silent_engine_a_second_not_a_ping_interval(text_layer):
    """At the shipped PING_S (10 s), an engine that says nothing for 3 s (a request queued
    behind a long prefill): message_start goes out after pipeline.START_WAIT_S without the
    engine's cache hit, instead of waiting for the engine; message_delta agrees with it."""
    assert message_answer.PING_S > 3.0 > pipeline.START_WAIT_S
    engine = replay_engine([3.0, {"started": True, "cached_tokens": 3}, finish("stop", "Hi", n=1, cached=3)])
    api = make_api(text_layer, engine)
    frames = run_stream(api, stream_body())
    assert frames[0][0] == "message_start"
    assert frames[0][1]["message"]["usage"]["cache_read_input_tokens"] == 0
    assert frames[-2][0] == "message_delta" and frames[-2][1]["usage"]["cache_read_input_tokens"] == 0


def test_mid_stream_error_is_an_error_event(text_layer):
    engine = replay_engine([{"started": True}, {"token_ids": (5,), "text": "Hel"},
                             {"finish_reason": "error", "error": "CUDA error: device lost"}])
    api = make_api(text_layer, engine)
    frames = run_stream(api, stream_body())
    assert [n for n, _ in frames] == ["message_start", "ping", "content_block_start", "content_block_delta", "error"]
    err = frames[-1][1]
    assert err["error"]["type"] == "api_error" and "device lost" in err["error"]["message"]
    assert err["request_id"] == frames[0][1]["message"]["id"]


def test_non_streamed_worker_failure_is_a_500(text_layer):
    engine = replay_engine([{"finish_reason": "error", "error": "boom"}])
    api = make_api(text_layer, engine)
    with pytest.raises(HTTPError) as info:
        post(api, {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})
    assert info.value.status == 500 and info.value.error_type("anthropic") == "api_error"


@pytest.mark.parametrize("refuse,state,status", [
    (NotReady(), "ok", 529), (QueueFull("total"), "ok", 529), (QueueFull("tenant"), "ok", 429), (None, "loading", 529),
])
def test_overloaded_and_loading(text_layer, refuse, state, status):
    engine = replay_engine([], state=state, refuse=refuse)
    api = make_api(text_layer, engine)
    with pytest.raises(HTTPError) as info:
        post(api, {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})
    assert info.value.status == status
    body = info.value.body("anthropic")
    assert body["type"] == "error"
    headers = dict(info.value.headers)
    assert "retry-after" in headers
    if status == 529:
        assert body["error"]["type"] == "overloaded_error" and headers["x-should-retry"] == "true"


def test_non_streamed_message_and_clamped_max_tokens(text_layer):
    engine = replay_engine([{"started": True, "cached_tokens": 4},
                             finish("length", "abc", n=7, prompt=30, cached=4)], ctx=256)
    api = make_api(text_layer, engine)
    resp = post(api, {"model": "claude-opus-4", "max_tokens": 64000, "messages": [{"role": "user", "content": "x"}]})
    msg = orjson.loads(resp.body)
    n_prompt = len(engine.submitted[0].prompt_ids)
    assert engine.submitted[0].max_tokens == 256 - n_prompt  # clamped to the context, not refused
    assert msg["stop_reason"] == "max_tokens" and msg["content"] == [{"type": "text", "text": "abc"}]
    assert msg["usage"] == {"input_tokens": n_prompt - 4, "cache_creation_input_tokens": 0,
                            "cache_read_input_tokens": 4, "output_tokens": 7}


def test_client_going_away_cancels_the_engine_request(text_layer):
    engine = replay_engine([{"started": True}, 30.0, finish("stop", "late")])
    api = make_api(text_layer, engine)

    async def go():
        resp = await handler(api, "/v1/messages")(Request("POST", "/v1/messages", "", {}, orjson.dumps(stream_body())))
        it = resp.events.__aiter__()
        await it.__anext__()  # message_start
        await resp.events.aclose()  # what the protocol does on a disconnect

    asyncio.run(asyncio.wait_for(go(), 5))
    assert engine.cancelled == [engine.submitted[0].id]


# A ChatML template that knows thinking (a `<think>` marker): the route then parses
# reasoning, as it would for a Qwen3-style model.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def thinking_layer(text_layer):
    from mashbox.text.chat import ChatTemplate

    tokenizer, _ = text_layer
    template = ChatTemplate(tokenizer, source=THINKING_TEMPLATE)
    assert template.reasoning
    return tokenizer, template


def test_thinking_text_and_tool_call_through_the_real_parser(thinking_layer):
    out = ["<thi", "nk>Paris is ", "in France.</think>", "Let me check.\n", "<tool_call>\n{\"name\": \"get_",
           "weather\", \"arguments\": {\"city\": ", "\"Paris\"}}\n</tool_call>"]
    engine = replay_engine([{"started": True}] + [{"token_ids": (9,), "text": t} for t in out]
                            + [finish("stop", "", n=len(out))])
    api = make_api(thinking_layer, engine)
    tools = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    frames = run_stream(api, stream_body(thinking={"type": "enabled", "budget_tokens": 1024}, tools=tools))
    shape = [(n, d.get("index"), (d.get("delta") or {}).get("type") or (d.get("content_block") or {}).get("type"))
             for n, d in frames]
    # Deltas may be split differently by the parser; squeeze repeats of the same delta.
    squeezed = [s for i, s in enumerate(shape) if i == 0 or s != shape[i - 1]]
    assert squeezed == [
        ("message_start", None, None), ("ping", None, None),
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("message_delta", None, None), ("message_stop", None, None),
    ]
    thinking = "".join(d["delta"]["thinking"] for n, d in frames if (d.get("delta") or {}).get("type") == "thinking_delta")
    assert thinking.strip() == "Paris is in France."
    text = "".join(d["delta"]["text"] for n, d in frames if (d.get("delta") or {}).get("type") == "text_delta")
    assert text.strip() == "Let me check."
    tool_start = [d for n, d in frames if n == "content_block_start" and d["index"] == 2][0]["content_block"]
    assert tool_start["name"] == "get_weather" and tool_start["id"].startswith("toolu_") and tool_start["input"] == {}
    args = [d for n, d in frames if (d.get("delta") or {}).get("type") == "input_json_delta"]
    assert [orjson.loads(a["delta"]["partial_json"]) for a in args] == [{"city": "Paris"}]
    assert frames[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert engine.submitted[0].prompt_ids  # the prompt rendered with thinking on


def test_usage_agrees_within_one_stream(text_layer):
    """message_start and message_delta say the same input_tokens / cache_read_input_tokens:
    message_start waits for the engine's first answer, which carries the prefix-cache hit."""
    engine = replay_engine([{"started": True, "cached_tokens": 5}, {"token_ids": (5,), "text": "Hi"},
                            {**finish("stop", n=1, cached=5), "cached_tokens": 5}])
    api = make_api(text_layer, engine)
    frames = run_stream(api, stream_body())
    n_prompt = len(engine.submitted[0].prompt_ids)
    start = frames[0][1]["message"]["usage"]
    delta = frames[-2][1]["usage"]
    assert frames[0][0] == "message_start" and frames[-2][0] == "message_delta"
    assert (start["input_tokens"], start["cache_read_input_tokens"]) == (n_prompt - 5, 5)
    assert (delta["input_tokens"], delta["cache_read_input_tokens"]) == (n_prompt - 5, 5)
    assert delta["output_tokens"] == 1


def test_usage_agrees_when_message_start_could_not_wait(text_layer, monkeypatch):
    """An engine silent for PING_S: message_start goes out without the cache hit, and
    message_delta repeats the input counts it said."""
    monkeypatch.setattr(message_answer, "PING_S", 0.1)
    engine = replay_engine([0.3, {"started": True, "cached_tokens": 5}, {"token_ids": (5,), "text": "Hi"},
                            {**finish("stop", n=1, cached=5), "cached_tokens": 5}])
    api = make_api(text_layer, engine)
    frames = run_stream(api, stream_body())
    n_prompt = len(engine.submitted[0].prompt_ids)
    start = frames[0][1]["message"]["usage"]
    delta = frames[-2][1]["usage"]
    assert (start["input_tokens"], start["cache_read_input_tokens"]) == (n_prompt, 0)
    assert (delta["input_tokens"], delta["cache_read_input_tokens"]) == (n_prompt, 0)


def test_a_stream_that_fails_before_the_engine_answered_still_opens_with_message_start(text_layer):
    """The worker fails the request and its retry before any event: the stream is
    message_start, ping, error, as any other failed stream begins."""
    engine = replay_engine([{"finish_reason": "error", "error": "worker lost"}])
    api = make_api(text_layer, engine)
    frames = run_stream(api, stream_body())
    assert [n for n, _ in frames] == ["message_start", "ping", "error"]
    assert frames[-1][1]["request_id"] == frames[0][1]["message"]["id"]
    assert len(engine.submitted) == 2  # the one retry


def test_the_constraint_the_engine_gets(text_layer, thinking_layer):
    """output_config.format: the schema's grammar (for a reasoning template: after a thought);
    a forced tool: the tool-call grammar; neither: no constraint."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    tools = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    cases = [
        (text_layer, {"output_config": {"format": {"type": "json_schema", "schema": schema}}}, "json_schema"),
        (thinking_layer, {"output_config": {"format": {"type": "json_schema", "schema": schema}}}, "lark"),
        (text_layer, {"tools": tools, "tool_choice": {"type": "any"}}, "tool_calls"),
        (text_layer, {"tools": [{"name": "odd", "input_schema": {"type": "object", "properties": {
            "xs": {"type": "array", "uniqueItems": True}}}}]}, "tool_calls"),  # lenient: never a 400
        (text_layer, {}, None),
    ]
    for layer, extra, kind in cases:
        engine = replay_engine([{"started": True}, finish("stop", "{}", n=1)])
        run_stream(make_api(layer, engine), stream_body(**extra))
        constraint = engine.submitted[0].constraint
        assert (constraint.kind if constraint else None) == kind, extra
        if kind == "json_schema":
            assert orjson.loads(constraint.grammar)["additionalProperties"] is False  # closed
        if kind == "lark":
            assert "</think>" in constraint.grammar and '"n"' in constraint.grammar
        if kind == "tool_calls":
            assert "</tool_call>" in constraint.grammar
