"""Exact wire bytes of /v1/responses for cases the real model cannot be made to produce on
demand (a worker failure mid-stream, max_output_tokens at a known place), with the
scripted engine of api_scripted_engine.py. The real server and SDK: test_responses_e2e.py."""
from __future__ import annotations

import asyncio

import orjson
import pytest

from mashbox.api import responses
from mashbox.http.request import Request
from mashbox.http.response import HTTPError

from test_messages_wire import finish, make_api, replay_engine, sse_frames, stream_bytes, text_layer  # noqa: F401


def handler(api):
    [(method, path, h, family)] = responses.routes(api)
    assert (method, path, family) == ("POST", "/v1/responses", "openai")
    return h


def run(api, body):
    async def go():
        resp = await handler(api)(Request("POST", "/v1/responses", "", {}, orjson.dumps(body)))
        if not body.get("stream"):
            return orjson.loads(resp.body)
        return sse_frames(await stream_bytes(resp))

    return asyncio.run(go())


def test_stream_exact_sequence_incomplete(text_layer):
    engine = replay_engine([{"started": True}, {"token_ids": (5,), "text": "Mercury,"},
                             finish("length", " Venus", n=2)])
    api = make_api(text_layer, engine)
    frames = run(api, {"input": "Name planets.", "max_output_tokens": 2, "stream": True})
    assert [n for n, _ in frames] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.incomplete"]
    assert [d["sequence_number"] for _, d in frames] == list(range(1, 11))
    assert engine.submitted[0].max_tokens == 2
    final = frames[-1][1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["content"][0]["text"] == "Mercury, Venus"
    assert frames[6][1]["text"] == "Mercury, Venus"
    assert final["usage"]["output_tokens"] == 2 and final["usage"]["input_tokens"] == len(engine.submitted[0].prompt_ids)


def test_mid_stream_error_then_failed(text_layer):
    engine = replay_engine([{"started": True}, {"token_ids": (5,), "text": "Mer"},
                             {"finish_reason": "error", "error": "device lost"}])
    api = make_api(text_layer, engine)
    frames = run(api, {"input": "x", "stream": True})
    assert [n for n, _ in frames] == ["response.created", "response.in_progress", "response.output_item.added",
                                      "response.content_part.added", "response.output_text.delta", "error",
                                      "response.failed"]
    assert [d["sequence_number"] for _, d in frames] == list(range(1, 8))
    assert "device lost" in frames[-2][1]["message"]
    failed = frames[-1][1]["response"]
    assert failed["status"] == "failed" and failed["id"] == frames[0][1]["response"]["id"]


def test_mid_stream_error_event_carries_the_request_id(text_layer):
    """The `error` event names the response it ended, as Chat's and Messages' do."""
    engine = replay_engine([{"started": True}, {"token_ids": (5,), "text": "Mer"},
                             {"finish_reason": "error", "error": "device lost"}])
    api = make_api(text_layer, engine)
    frames = run(api, {"input": "x", "stream": True})
    name, error = frames[-2]
    assert name == "error" and error["request_id"] == frames[0][1]["response"]["id"]
    assert error["request_id"] == engine.submitted[0].id


def test_non_streamed_and_echo(text_layer):
    engine = replay_engine([{"started": True, "cached_tokens": 3}, finish("stop", "Hi.", n=2, prompt=20, cached=3)])
    api = make_api(text_layer, engine)
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    out = run(api, {"input": "x", "parallel_tool_calls": True, "tools": tools, "tool_choice": "none",
                    "store": False, "include": ["reasoning.encrypted_content"]})
    assert out["object"] == "response" and out["id"].startswith("resp_") and out["status"] == "completed"
    assert out["parallel_tool_calls"] is True and out["tool_choice"] == "none" and out["tools"] == tools
    assert out["output"][0]["content"][0]["text"] == "Hi."
    assert out["usage"]["input_tokens_details"]["cached_tokens"] == 3


def test_model_mismatch_and_worker_failure(text_layer):
    api = make_api(text_layer, replay_engine([{"finish_reason": "error", "error": "boom"}]))
    with pytest.raises(HTTPError) as info:
        run(api, {"input": "x", "model": "gpt-5"})
    assert info.value.status == 404 and info.value.code == "model_not_found"
    with pytest.raises(HTTPError) as info:
        run(api, {"input": "x", "model": "scripted"})
    assert info.value.status == 500
    api = make_api(text_layer, replay_engine([], state="loading"))
    with pytest.raises(HTTPError) as info:
        run(api, {"input": "x"})
    assert info.value.status == 503


from test_messages_wire import thinking_layer  # noqa: E402,F401  (fixture)


def test_reasoning_text_and_calls_through_the_real_parser(thinking_layer):
    out = ["<think>Check ", "the files.</think>", "On it.\n", "<tool_call>\n{\"name\": \"shell\", \"arguments\": ",
           "{\"command\": [\"ls\"]}}\n</tool_call>\n<tool_call>\n{\"name\": \"apply_patch\", \"arguments\": ",
           "{\"input\": \"*** Begin Patch\"}}\n</tool_call>"]
    engine = replay_engine([{"started": True}] + [{"token_ids": (9,), "text": t} for t in out]
                            + [finish("stop", "", n=12)])
    api = make_api(thinking_layer, engine)
    tools = [{"type": "function", "name": "shell", "parameters": {"type": "object"}},
             {"type": "custom", "name": "apply_patch"}, {"type": "web_search"}]
    frames = run(api, {"input": "fix", "stream": True, "tools": tools, "reasoning": {"effort": "high"},
                       "parallel_tool_calls": True})
    names = [n for n, _ in frames]
    squeezed = [n for i, n in enumerate(names) if i == 0 or n != names[i - 1]]
    assert squeezed == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.custom_tool_call_input.delta", "response.custom_tool_call_input.done",
        "response.output_item.done", "response.completed",
    ]
    final = frames[-1][1]["response"]
    reasoning, message, shell, patch = final["output"]
    assert reasoning["content"][0]["text"].strip() == "Check the files."
    assert message["content"][0]["text"].strip() == "On it."
    assert shell["type"] == "function_call" and orjson.loads(shell["arguments"]) == {"command": ["ls"]}
    assert patch["type"] == "custom_tool_call" and patch["input"] == "*** Begin Patch"
    assert shell["call_id"].startswith("call_") and patch["call_id"] != shell["call_id"]
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
