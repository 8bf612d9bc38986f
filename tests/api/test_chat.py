"""Chat Completions end to end: the real server, the real default model, the openai SDK.

Generations are kept short (a few tokens): the model runs on a shared CPU.
"""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

PLANETS = [{"role": "user", "content": "Name three planets."}]
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]


def test_plain(openai_client, model_id):
    out = openai_client.chat.completions.create(model=model_id, messages=PLANETS, max_tokens=6)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.model == model_id
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    u = out.usage
    assert u.completion_tokens <= 6 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    timings = out.model_extra["timings"]
    # what the usage calls cached is what the timings say the prefix cache served
    assert u.prompt_tokens_details.cached_tokens == timings["cache_n"] < u.prompt_tokens
    assert timings["predicted_n"] == u.completion_tokens
    assert timings["prompt_n"] + timings["cache_n"] == u.prompt_tokens


def test_streamed_equals_plain_and_usage_chunk(openai_client, model_id):
    plain = openai_client.chat.completions.create(model=model_id, messages=PLANETS, max_tokens=6)
    chunks = list(openai_client.chat.completions.create(
        model=model_id, messages=PLANETS, max_tokens=6, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content  # greedy by default: same text
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == plain.choices[0].finish_reason
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == plain.usage.completion_tokens
    assert last.usage.prompt_tokens == plain.usage.prompt_tokens
    # the second run of the same prompt is served from the prefix cache
    assert last.usage.prompt_tokens_details.cached_tokens > 0


def test_stop_sequence(openai_client, model_id):
    full = openai_client.chat.completions.create(model=model_id, messages=PLANETS, max_tokens=8)
    text = full.choices[0].message.content
    assert len(text) > 4
    stop = text[3:5]
    out = openai_client.chat.completions.create(model=model_id, messages=PLANETS, max_tokens=8, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == text[: text.index(stop)]


def test_same_seed_same_text(openai_client, model_id):
    kwargs = dict(model=model_id, messages=[{"role": "user", "content": "Write one word, please."}], max_tokens=5,
                  temperature=1.5)
    openai_client.chat.completions.create(**{**kwargs, "max_tokens": 1})  # the prompt is in the prefix cache now
    a = openai_client.chat.completions.create(**kwargs, seed=1234).choices[0].message.content
    b = openai_client.chat.completions.create(**kwargs, seed=1234).choices[0].message.content
    c = openai_client.chat.completions.create(**kwargs, seed=4321).choices[0].message.content
    assert a == b
    assert c != a  # the seed is what made them equal (at temperature 1.5 five tokens hardly repeat)


def test_same_seed_same_text_cold_and_warm(openai_client, model_id):
    # The decoder is batch invariant: a cold prefill and a prefix-cache hit (last prompt
    # token recomputed alone) give the same bits, so the same seed gives the same text.
    kwargs = dict(model=model_id, messages=[{"role": "user", "content": "Write a word."}], max_tokens=5,
                  temperature=1.5, seed=1234)
    a = openai_client.chat.completions.create(**kwargs).choices[0].message.content
    b = openai_client.chat.completions.create(**kwargs).choices[0].message.content
    assert a == b


def test_tool_choice_named_gives_a_typed_call(openai_client, model_id):
    out = openai_client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=16)
    choice = out.choices[0]
    calls = choice.message.tool_calls
    assert calls and calls[0].type == "function"
    assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    if choice.finish_reason == "tool_calls":
        assert isinstance(json.loads(calls[0].function.arguments), dict)
    else:
        assert choice.finish_reason == "length"


def test_tool_choice_required_streamed(openai_client, model_id):
    stream = openai_client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS, tool_choice="required", max_tokens=20, stream=True)
    starts, args = [], ""
    for chunk in stream:
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if tc.id:
                starts.append((tc.index, tc.id, tc.function.name))
            args += tc.function.arguments or ""
    assert starts and starts[0][0] == 0 and starts[0][1].startswith("call_")
    assert starts[0][2] == "get_weather"  # the only tool: the small model names it


def test_multi_turn_with_tool_results(openai_client, model_id):
    messages = [
        {"role": "developer", "content": "You answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "What is the weather in Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 degrees."},
    ]
    out = openai_client.chat.completions.create(model=model_id, messages=messages, tools=TOOLS, max_tokens=8)
    assert out.choices[0].message.content or out.choices[0].message.tool_calls
    short = openai_client.chat.completions.create(model=model_id, messages=messages[:2], tools=TOOLS, max_tokens=1)
    assert out.usage.prompt_tokens > short.usage.prompt_tokens + 10  # the call and its result are in the prompt


def test_pi_request_shape(base_url, model_id):
    """What Pi sends: max_completion_tokens, reasoning_effort, store, a developer message,
    text parts, function tools, include_usage."""
    import httpx

    body = {
        "model": model_id, "stream": True, "store": False, "reasoning_effort": "medium",
        "max_completion_tokens": 3, "stream_options": {"include_usage": True},
        "messages": [{"role": "developer", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "tools": TOOLS, "prompt_cache_key": "session-1", "parallel_tool_calls": False,
    }
    r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200
    assert r.text.endswith("data: [DONE]\n\n")
