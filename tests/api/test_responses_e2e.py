"""/v1/responses end to end: the real server on the default model (conftest `server`), the
official openai SDK (its stream parser accumulates every event), and raw SSE bytes."""
from __future__ import annotations

import json

import pytest
from openai.types.responses import ResponseCustomToolCall, ResponseFunctionToolCall

import harness

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city.",
           "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def client(openai_client):
    return openai_client


def raw_stream(base_url: str, body: dict, headers: dict = None) -> list[tuple[str, dict]]:
    frames = harness.raw_stream(base_url, body, "/v1/responses", headers)
    assert [d["sequence_number"] for _, d in frames] == list(range(1, len(frames) + 1))
    return frames


def final_of(events) -> object:
    """The Response of a stream's last event (completed or incomplete: a small model may run
    out of max_output_tokens inside its call, and the SDK's get_final_response() only
    accepts response.completed)."""
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete"), last.type
    return last.response


def test_plain_and_streamed_agree(client, model_id):
    kwargs = dict(model=model_id, input="Name three planets.", max_output_tokens=24)
    client.responses.create(**kwargs)  # warm the prefix cache: both runs below take the same path
    resp = client.responses.create(**kwargs)
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == model_id
    assert resp.status in ("completed", "incomplete") and resp.output_text.strip()
    assert resp.usage.input_tokens > 0 and resp.usage.output_tokens > 0
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    events = list(client.responses.create(**kwargs, stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    final = final_of(events)
    assert "".join(deltas) == final.output_text == resp.output_text
    assert final.status == resp.status


def test_raw_stream_sequence_and_incomplete(base_url):
    frames = raw_stream(base_url, {"input": "Count: one, two,", "max_output_tokens": 6, "stream": True})
    names = [n for n, _ in frames]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(names[4:-4]) == {"response.output_text.delta"}
    final = frames[-1][1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["usage"]["output_tokens"] == 6


def test_stop_and_seed(client, model_id):
    kwargs = dict(model=model_id, input="Write a sentence about the sea.", max_output_tokens=16)
    client.responses.create(**kwargs)  # warm the prefix cache
    full = client.responses.create(**kwargs).output_text
    words = full.split()
    assert len(words) > 4, full
    stop = words[3]
    cut = client.responses.create(**kwargs, extra_body={"stop": [stop]})
    assert cut.output_text == full[:full.index(stop)] and cut.status == "completed"
    kw = dict(model=model_id, input="Tell me a story.", max_output_tokens=10, temperature=1.5)
    client.responses.create(**kw)  # warm the prefix cache: the runs below take the same path
    a = client.responses.create(**kw, extra_body={"seed": 99}).output_text
    b = client.responses.create(**kw, extra_body={"seed": 99}).output_text
    c = client.responses.create(**kw, extra_body={"seed": 98}).output_text
    assert a == b and a != c


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_forced_function_call(client, model_id, choice):
    resp = client.responses.create(model=model_id, input=ASK, tools=[WEATHER], tool_choice=choice,
                                   max_output_tokens=60)
    calls = [o for o in resp.output if o.type == "function_call"]
    assert calls, resp.output
    call = calls[0]
    assert isinstance(call, ResponseFunctionToolCall)
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    # The 135M model may ramble inside the arguments until the budget ends; then the
    # response says so, and only a finished call must hold valid JSON.
    if resp.status == "completed":
        assert isinstance(json.loads(call.arguments), dict)
    else:
        assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
        assert call.arguments.startswith("{")
    assert resp.tool_choice == choice if isinstance(choice, str) else resp.tool_choice.name == "get_weather"


def test_streamed_call_then_multi_turn(client, model_id):
    events = list(client.responses.create(model=model_id, input=ASK, tools=[WEATHER], stream=True,
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=40))
    first = final_of(events)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    call = [o for o in done if o.type == "function_call"][0]
    assert isinstance(call, ResponseFunctionToolCall) and call.name == "get_weather"
    assert call.model_dump() == [o for o in first.output if o.type == "function_call"][0].model_dump()
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments
    if first.status == "completed":
        assert isinstance(json.loads(call.arguments), dict)
    else:  # cut by max_output_tokens mid-arguments: fed back as the model wrote them
        assert first.incomplete_details.reason == "max_output_tokens" and args.startswith("{")
    history = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    second = client.responses.create(model=model_id, input=history, tools=[WEATHER], max_output_tokens=8)
    assert second.output and second.status in ("completed", "incomplete")
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's prompt was reused


CODEX_TOOLS = [
    {"type": "function", "name": "shell", "description": "Runs a shell command and returns its output.",
     "strict": False, "parameters": {"type": "object", "properties": {
         "command": {"type": "array", "items": {"type": "string"}}, "workdir": {"type": "string"}},
         "required": ["command"], "additionalProperties": False}},
    {"type": "namespace", "name": "mcp__docs__", "description": "Docs server",
     "tools": [{"type": "function", "name": "search", "description": "Search the docs",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}]},
    {"type": "web_search", "external_web_access": False},
    {"type": "custom", "name": "apply_patch", "description": "Apply a patch to files.",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: begin_patch hunk+ end_patch"}},
]


def codex_body(**extra) -> dict:
    body = {
        "model": None, "instructions": "You are Codex, a coding agent.", "stream": True, "store": False,
        "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"summary": "auto", "effort": "medium"},
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "019a-session", "tools": CODEX_TOOLS,
        "client_metadata": {"x": "y"}, "max_output_tokens": 40,
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "<permissions/>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Show the files."}]},
        ],
    }
    body.update(extra)
    return {k: v for k, v in body.items() if v is not None}


CODEX_HEADERS = {"authorization": "Bearer unused", "originator": "codex_cli_rs", "session_id": "019a",
                 "x-codex-turn-metadata": '{"turn": 1}'}


def test_codex_shaped_request(base_url, client, model_id):
    frames = raw_stream(base_url, codex_body(), CODEX_HEADERS)
    names = [n for n, _ in frames]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] in ("response.completed", "response.incomplete") and "error" not in names
    final = frames[-1][1]["response"]
    assert final["parallel_tool_calls"] is True and final["tools"] == CODEX_TOOLS
    # Every item that was added is done, in order, and the final output lists them.
    added = [d["item"]["type"] for n, d in frames if n == "response.output_item.added"]
    done = [d["item"] for n, d in frames if n == "response.output_item.done"]
    assert added == [i["type"] for i in done] == [i["type"] for i in final["output"]]
    # The same request through the SDK's typed stream events.
    body = codex_body()
    body.pop("stream")
    meta = body.pop("client_metadata")
    events = list(client.responses.create(**body, model=model_id, stream=True, extra_body={"client_metadata": meta}))
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    assert final_of(events).id == events[0].response.id


def test_codex_forced_custom_and_namespace_calls(client, model_id):
    body = codex_body(tool_choice={"type": "custom", "name": "apply_patch"}, max_output_tokens=40)
    body.pop("stream")
    body["extra_body"] = {"client_metadata": body.pop("client_metadata")}
    resp = client.responses.create(model=model_id, **body)
    calls = [o for o in resp.output if o.type == "custom_tool_call"]
    assert calls, resp.output
    assert isinstance(calls[0], ResponseCustomToolCall)
    assert calls[0].name == "apply_patch" and isinstance(calls[0].input, str) and calls[0].call_id.startswith("call_")
    body = codex_body(tool_choice={"type": "function", "name": "search"}, max_output_tokens=40)
    body.pop("stream")
    body["extra_body"] = {"client_metadata": body.pop("client_metadata")}
    resp = client.responses.create(model=model_id, **body)
    call = [o for o in resp.output if o.type == "function_call"][0]
    assert (call.namespace, call.name) == ("mcp__docs__", "search")
    # Codex sends the turn back: the calls and their outputs, with a reasoning item.
    history = body["input"] + [
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "look"}],
         "encrypted_content": None},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "found 3 pages"},
        {"type": "custom_tool_call", "call_id": "call_p", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "call_p", "output": "applied"},
    ]
    resp = client.responses.create(model=model_id, **{**body, "input": history, "tool_choice": "auto",
                                                      "max_output_tokens": 8})
    assert resp.status in ("completed", "incomplete")
