"""Every 400 / 404 path of /v1/chat/completions, against the real server.

Each case is one request a client could send; the answer is 400 in the OpenAI error
shape with `param` naming the field (nothing is generated, so these are fast).
"""
from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

MSGS = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}

CASES = [
    # (extra body fields, param named)
    ({"temperature": 4.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"min_p": 1.0}, "min_p"),
    ({"min_p": -0.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_completion_tokens": -5}, "max_completion_tokens"),
    ({"seed": "abc"}, "seed"),
    ({"stop": ""}, "stop[0]"),
    ({"stop": ["a", 3]}, "stop[1]"),
    ({"stop": 7}, "stop"),
    ({"stop_sequences": "x"}, "stop_sequences"),
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tool_choice": "sometimes", "tools": [TOOL]}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "g"}}, "tools": [TOOL]}, "tool_choice.function.name"),
    ({"model": 5}, "model"),
]

MESSAGE_CASES = [
    (None, "messages"),
    ("Hi", "messages"),
    ([], "messages"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}],
     "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "text", "text": "x"},
                                   {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}}]}],
     "messages[0].content[1].type"),
    ([{"role": "user", "content": [{"type": "file", "file": {"file_id": "f"}}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}],
     "messages[1].tool_calls[0].function"),
]


def post(base_url, body):
    return httpx.post(base_url + "/v1/chat/completions", json=body, timeout=30)


@pytest.mark.parametrize("extra,param", CASES, ids=[p for _, p in CASES])
def test_bad_field_is_400_naming_it(base_url, model_id, extra, param):
    body = {"model": model_id, "messages": MSGS, "max_tokens": 1, **extra}
    r = post(base_url, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert param.split("[")[0].split(".")[0] in err["message"]


@pytest.mark.parametrize("messages,param", MESSAGE_CASES, ids=[p for _, p in MESSAGE_CASES])
def test_bad_messages_are_400_naming_the_part(base_url, messages, param):
    body = {"max_tokens": 1}
    if messages is not None:
        body["messages"] = messages
    r = post(base_url, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_other_model_is_404_model_not_found(openai_client):
    with pytest.raises(openai.NotFoundError) as exc:
        openai_client.chat.completions.create(model="gpt-4o", messages=MSGS, max_tokens=1)
    assert exc.value.code == "model_not_found"
    assert exc.value.status_code == 404


def test_prompt_longer_than_the_context(base_url):
    r = post(base_url, {"messages": [{"role": "user", "content": "hello " * 5000}]})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "4096" in msg and "too many" in msg


def test_not_json_and_not_an_object(base_url):
    r = httpx.post(base_url + "/v1/chat/completions", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = httpx.post(base_url + "/v1/chat/completions", json=[1, 2], timeout=10)
    assert r.status_code == 400


def test_unknown_fields_and_accepted_fields_are_ignored(base_url, model_id):
    body = {"model": model_id, "messages": MSGS, "max_tokens": 1, "merge": True, "store": False,
            "logprobs": False, "response_format": {"type": "text"}, "n": 1, "user": "u", "metadata": {"a": 1},
            "some_future_field": [1, 2, 3], "reasoning_effort": "low", "parallel_tool_calls": True,
            "enable_thinking": False}
    r = post(base_url, body)
    assert r.status_code == 200, r.text
