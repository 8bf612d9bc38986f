"""/v1/messages and /v1/messages/count_tokens end to end: the real server on the default
model (conftest `server`), the official anthropic SDK, and raw SSE bytes over a socket."""
from __future__ import annotations

import json

import anthropic
import httpx
import pytest

import harness

pytestmark = pytest.mark.slow

WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                     "required": ["city"]},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


def raw_stream(base_url: str, body: dict, path: str = "/v1/messages", headers: dict = None) -> list[tuple[str, dict]]:
    """POST a streamed request and split the raw bytes into (event, data) frames, checking
    the frame layout byte for byte."""
    return harness.raw_stream(base_url, body, path, headers)


def test_plain_and_streamed_agree(client):
    kwargs = dict(model="claude-sonnet-4-5", max_tokens=12, messages=[{"role": "user", "content": "Name three planets."}])
    # Warm the prefix cache first, so both runs below take the same (cached) path.
    client.messages.create(**kwargs)
    msg = client.messages.create(**kwargs)
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == "claude-sonnet-4-5"
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text.strip()
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.output_tokens > 0 and msg.usage.cache_creation_input_tokens == 0
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == msg.content[0].text == final.content[0].text  # greedy: the same answer
    assert final.stop_reason == msg.stop_reason
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        msg.usage.input_tokens + msg.usage.cache_read_input_tokens


def test_raw_stream_event_sequence(base_url):
    frames = raw_stream(base_url, {"model": "m", "max_tokens": 8, "stream": True,
                                   "messages": [{"role": "user", "content": "Count: one, two,"}]})
    names = [n for n, _ in frames]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert frames[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    delta = frames[-2][1]
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 8


def test_stop_sequence(client):
    kwargs = dict(model="m", max_tokens=16, messages=[{"role": "user", "content": "Write a sentence about the sea."}])
    client.messages.create(**kwargs)  # warm the prefix cache: the runs below take the same path
    full = client.messages.create(**kwargs).content[0].text
    words = full.split()
    assert len(words) > 4, full
    stop = words[3]
    cut = client.messages.create(**kwargs, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == full[:full.index(stop)]


def test_same_seed_same_text(client):
    # This SDK version has no temperature argument on create(); the field goes in the body.
    kwargs = dict(model="m", max_tokens=10, messages=[{"role": "user", "content": "Tell me a story."}])
    client.messages.create(**kwargs)  # warm the prefix cache: the runs below take the same path
    a = client.messages.create(**kwargs, extra_body={"seed": 1234, "temperature": 1.5}).content[0].text
    b = client.messages.create(**kwargs, extra_body={"seed": 1234, "temperature": 1.5}).content[0].text
    c = client.messages.create(**kwargs, extra_body={"seed": 4321, "temperature": 1.5}).content[0].text
    assert a == b
    assert a != c  # 10 tokens at temperature 1.5: another seed gives another text


def test_tool_choice_any_gives_a_tool_use_block(client):
    # A 135M model does not always pick a sensible name or finish its call within a small
    # budget; what must hold is that the forced call comes back as a typed tool_use block.
    msg = client.messages.create(model="m", max_tokens=24, tools=[WEATHER], tool_choice={"type": "any"}, messages=ASK)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert uses, msg.content
    assert isinstance(uses[0], anthropic.types.ToolUseBlock)
    assert uses[0].id.startswith("toolu_") and isinstance(uses[0].input, dict)
    assert msg.stop_reason in ("tool_use", "max_tokens")


def test_named_tool_streamed_then_multi_turn(client):
    with client.messages.stream(model="m", max_tokens=40, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"}, messages=ASK) as stream:
        first = stream.get_final_message()
    uses = [b for b in first.content if b.type == "tool_use"]
    assert uses, first.content
    use = uses[0]
    assert isinstance(use, anthropic.types.ToolUseBlock)
    assert use.id.startswith("toolu_") and use.name == "get_weather" and isinstance(use.input, dict)
    assert first.stop_reason in ("tool_use", "max_tokens")
    # Feed the result back; the model answers in text (tool_choice auto).
    history = ASK + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}]},
    ]
    second = client.messages.create(model="m", max_tokens=8, tools=[WEATHER], messages=history)
    assert second.content and second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    n = client.messages.count_tokens(model="m", tools=[WEATHER], messages=history).input_tokens
    assert n == second.usage.input_tokens + second.usage.cache_read_input_tokens
    # The second turn starts with the first one's prompt: the prefix cache served some of it.
    assert second.usage.cache_read_input_tokens > 0


def test_count_tokens_equals_usage(client):
    system = "You are terse."
    n = client.messages.count_tokens(model="m", system=system, messages=ASK, tools=[WEATHER]).input_tokens
    msg = client.messages.create(model="m", max_tokens=5, system=system, messages=ASK, tools=[WEATHER])
    assert n == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    plain = client.messages.count_tokens(model="m", messages=ASK).input_tokens
    assert plain < n


def test_beta_query(client, base_url):
    msg = client.beta.messages.create(model="m", max_tokens=5, messages=ASK, betas=["interleaved-thinking-2025-05-14"])
    assert msg.content and msg.usage.output_tokens > 0
    with httpx.Client(timeout=300) as http:
        r = http.post(base_url + "/v1/messages?beta=true", json={"max_tokens": 3, "messages": ASK})
        assert r.status_code == 200 and r.json()["type"] == "message"
        r = http.post(base_url + "/v1/messages/count_tokens?beta=true", json={"messages": ASK})
        assert r.status_code == 200 and r.json()["input_tokens"] > 0


def claude_code_body(billing: str, turn2: bool = False) -> dict:
    tools = []
    for i in range(25):
        tools.append({
            "name": f"Tool{i}",
            "description": f"Tool number {i}: does thing {i}.",
            "input_schema": {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
                             "properties": {"path": {"type": "string"}, "n": {"type": "integer"}},
                             "required": ["path"], "additionalProperties": False},
        })
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>Be careful.</system-reminder>"},
        {"type": "text", "text": "List the files.", "cache_control": {"type": "ephemeral"}}]}]
    if turn2:
        messages += [
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I will list.", "signature": "mashbox-local"},
                {"type": "tool_use", "id": "toolu_1", "name": "Tool1", "input": {"path": "."}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py b.py"}]},
            {"role": "system", "content": "Mid-conversation note."},
        ]
    return {
        "model": "claude-opus-4-5-20251101",
        "max_tokens": 64000,
        "stream": True,
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "metadata": {"user_id": "user_abc_account_def_session_ghi"},
        "system": [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.3; cch={billing};"},
            {"type": "text", "text": "You are Claude Code, a CLI for coding.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": messages,
        "tools": tools,
    }


CLAUDE_HEADERS = {
    "x-api-key": "sk-ant-unused", "anthropic-version": "2023-06-01",
    "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27",
    "anthropic-dangerous-direct-browser-access": "true", "x-app": "cli",
    "X-Claude-Code-Session-Id": "sess-1", "Accept-Encoding": "gzip, deflate, br, zstd",
}


def first_frames(base_url: str, body: dict, headers: dict, until: str) -> list[tuple[str, dict]]:
    """Read a stream only until the first `until` event, then hang up (the server cancels
    the rest): max_tokens 64000 on a small context would otherwise generate to its end."""
    frames = []
    with httpx.Client(timeout=300) as http:
        with http.stream("POST", base_url + "/v1/messages?beta=true", json=body, headers=headers) as resp:
            assert resp.status_code == 200, resp.read()
            name = None
            for line in resp.iter_lines():
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    frames.append((name, json.loads(line[6:])))
                    if name == until:
                        break
    return frames


def test_claude_code_shaped_request(base_url, client):
    frames = first_frames(base_url, claude_code_body("aaa"), CLAUDE_HEADERS, "content_block_delta")
    names = [n for n, _ in frames]
    # message_start, then pings (one at once, one every 10 s of prefill), then the first block.
    start = names.index("content_block_start")
    assert names[0] == "message_start" and start >= 2 and set(names[1:start]) == {"ping"}
    assert frames[0][1]["message"]["model"] == "claude-opus-4-5-20251101"
    # The billing header changes every turn; the rest of the prompt is the same, so the
    # prefix cache serves it (the header is not in the prompt).
    body = claude_code_body("bbb")
    body["max_tokens"] = 1
    frames = raw_stream(base_url, body, "/v1/messages?beta=true", CLAUDE_HEADERS)
    first_usage = frames[-2][1]["usage"]
    body = claude_code_body("ccc")
    body["max_tokens"] = 1
    frames = raw_stream(base_url, body, "/v1/messages?beta=true", CLAUDE_HEADERS)
    second_usage = frames[-2][1]["usage"]
    total = first_usage["input_tokens"] + first_usage["cache_read_input_tokens"]
    assert second_usage["input_tokens"] + second_usage["cache_read_input_tokens"] == total
    assert second_usage["cache_read_input_tokens"] >= total - 32  # all but the last partial block
    # A later turn: thinking + tool_use + tool_result + a mid-conversation system message.
    body = claude_code_body("ddd", turn2=True)
    body["max_tokens"] = 1
    frames = raw_stream(base_url, body, "/v1/messages?beta=true", CLAUDE_HEADERS)
    assert [n for n, _ in frames][-1] == "message_stop"
    body.pop("stream")
    counted = client.messages.count_tokens(model=body["model"], system=body["system"], messages=body["messages"],
                                           tools=body["tools"], thinking=body["thinking"]).input_tokens
    usage = frames[-2][1]["usage"]
    assert counted == usage["input_tokens"] + usage["cache_read_input_tokens"]
