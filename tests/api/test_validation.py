"""Every 400 / 404 path of the four generating routes, at handler level.

The real app on a real socket with the scripted engine (api_scripted_engine.py), the
real default model's tokenizer and template and a 4096-token context: validation
happens before the engine is asked anything, so these need no real model and run in
seconds. Each case is one request a client could send; the answer is 400 in the
route family's error shape with `param` (OpenAI) or the message (Anthropic) naming the
field. The real-model tests (test_chat.py, test_*_e2e.py) keep only what the model
must show.
"""
from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from api_scripted_engine import server_fixtures, text_events
from harness import post

MSGS = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
WEATHER_ANTHROPIC = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
WEATHER_RESPONSES = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PROMPT = "The three largest planets are"
CTX = 4096


def script():
    return lambda req: text_events(req, ["ok"])


script, engine, app = server_fixtures(script, ctx=CTX)


@pytest.fixture(scope="module")
def openai_client(app):
    return openai.OpenAI(base_url=app.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def anthropic_client(app):
    return anthropic.Anthropic(base_url=app.base_url, api_key="unused", max_retries=0, timeout=60)


ACCEPTED = ("test_chat_unknown_fields_and_accepted_fields_are_ignored",)  # the one case that is answered


@pytest.fixture(autouse=True)
def nothing_reaches_the_engine(request, engine):
    """A refused request is refused before it is submitted."""
    before = len(engine.submitted)
    yield
    if request.function.__name__ not in ACCEPTED:
        assert len(engine.submitted) == before


# ---------------------------------------------------------------------------------------
# /v1/chat/completions
# ---------------------------------------------------------------------------------------

CHAT_CASES = [
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
    ({"logprobs": "yes"}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 1.5}, "top_logprobs"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes", "schema": {}}}},
     "response_format.json_schema.strict"),
    ({"parallel_tool_calls": "no", "tools": [TOOL]}, "parallel_tool_calls"),
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

CHAT_MESSAGE_CASES = [
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


@pytest.mark.parametrize("extra,param", CHAT_CASES, ids=[p for _, p in CHAT_CASES])
def test_chat_bad_field_is_400_naming_it(app, extra, param):
    body = {"model": "scripted", "messages": MSGS, "max_tokens": 1, **extra}
    r = post(app.base_url, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert param.split("[")[0].split(".")[0] in err["message"]


@pytest.mark.parametrize("messages,param", CHAT_MESSAGE_CASES, ids=[p for _, p in CHAT_MESSAGE_CASES])
def test_chat_bad_messages_are_400_naming_the_part(app, messages, param):
    body = {"max_tokens": 1}
    if messages is not None:
        body["messages"] = messages
    r = post(app.base_url, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_chat_other_model_is_404_model_not_found(openai_client):
    with pytest.raises(openai.NotFoundError) as exc:
        openai_client.chat.completions.create(model="gpt-4o", messages=MSGS, max_tokens=1)
    assert exc.value.code == "model_not_found"
    assert exc.value.status_code == 404


def test_chat_prompt_longer_than_the_context(app):
    r = post(app.base_url, {"messages": [{"role": "user", "content": "hello " * 5000}]})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert str(CTX) in msg and "too many" in msg


def test_chat_not_json_and_not_an_object(app):
    r = httpx.post(app.base_url + "/v1/chat/completions", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = httpx.post(app.base_url + "/v1/chat/completions", json=[1, 2], timeout=10)
    assert r.status_code == 400


def test_chat_unknown_fields_and_accepted_fields_are_ignored(app, engine):
    body = {"model": "scripted", "messages": MSGS, "max_tokens": 1, "merge": True, "store": False,
            "logprobs": False, "response_format": {"type": "text"}, "n": 1, "user": "u", "metadata": {"a": 1},
            "some_future_field": [1, 2, 3], "reasoning_effort": "low", "parallel_tool_calls": True,
            "enable_thinking": False}
    r = post(app.base_url, body)
    assert r.status_code == 200, r.text
    assert engine.submitted[-1].max_tokens == 1


# ---------------------------------------------------------------------------------------
# /v1/completions
# ---------------------------------------------------------------------------------------

COMPLETION_CASES = [
    ({"prompt": None}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, 2, 3]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"n": 3}, "n"),
    ({"temperature": 9}, "temperature"),
    ({"top_p": -1}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": "many"}, "max_completion_tokens"),
    ({"stop": [""]}, "stop[0]"),
    ({"stream": 1}, "stream"),
]


@pytest.mark.parametrize("extra,param", COMPLETION_CASES, ids=[p for _, p in COMPLETION_CASES])
def test_completions_bad_field_is_400_naming_it(app, extra, param):
    body = {"prompt": PROMPT, "max_tokens": 1, **extra}
    body = {k: v for k, v in body.items() if v is not None}
    r = post(app.base_url, body, "/v1/completions")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_completions_other_model_is_404(openai_client):
    with pytest.raises(openai.NotFoundError) as exc:
        openai_client.completions.create(model="davinci-002", prompt=PROMPT, max_tokens=1)
    assert exc.value.code == "model_not_found"


def test_completions_prompt_longer_than_the_context(app):
    r = post(app.base_url, {"prompt": "hello " * 5000}, "/v1/completions")
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "prompt" and str(CTX) in err["message"]


# ---------------------------------------------------------------------------------------
# /v1/messages
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64",
      "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "text",
      "media_type": "text/plain", "data": "x"}}]}]}, "messages[0].content[0].type"),
    ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format.type"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"$ref": "#/nowhere"}}}},
     "output_config.format.schema"),
    ({"temperature": 5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop_sequences": [""]}, "stop_sequences[0]"),
    ({"stop_sequences": "END"}, "stop_sequences"),
    ({"n": 2}, "n"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER_ANTHROPIC]}, "tool_choice.name"),
    ({"thinking": {"type": "maybe"}}, "thinking.type"),
    ({"stream": "yes"}, "stream"),
])
def test_messages_every_400_in_anthropic_shape(app, body, param):
    full = {"model": "m", "max_tokens": 5, "messages": ASK, **body}
    r = post(app.base_url, full, "/v1/messages")
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert param in err["error"]["message"]


def test_messages_400_through_the_sdk_and_prompt_too_long(anthropic_client):
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert "messages[0].content[0].type" in str(info.value)
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "word " * 5000}])
    assert "too many" in str(info.value)


# ---------------------------------------------------------------------------------------
# /v1/responses
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra,param", [
    ({"include": ["message.input_text.logprobs"]}, "include"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": "3"}, "top_logprobs"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#/nowhere"}}}},
     "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "minProperties": "x"}}}},
     "text.format.schema"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]},
     "input[0].content[0].type"),
    ({"temperature": 9}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER_RESPONSES]}, "tool_choice.name"),
    ({"n": 3}, "n"),
    ({"stop": [""]}, "stop[0]"),
    ({"input": 7}, "input"),
])
def test_responses_every_400_in_openai_shape(app, extra, param):
    body = {"input": "hi", "max_output_tokens": 5, **extra}
    r = post(app.base_url, body, "/v1/responses")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and param in err["message"]


def test_responses_model_not_found_and_sdk_error(openai_client):
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.create(model="gpt-5", input="hi")
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.responses.create(model="scripted", input="hi", top_logprobs=21)
    assert "top_logprobs" in str(info.value)


# ---------------------------------------------------------------------------------------
# Holes found by issue 10 (each answered 200 before)
# ---------------------------------------------------------------------------------------


def test_responses_empty_input_is_400(app):
    r = post(app.base_url, {"input": [], "max_output_tokens": 5}, "/v1/responses")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "input" and "input" in err["message"]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("extra,param", [
    ({"model": 1}, "model"),
    ({"model": ["claude"]}, "model"),
    ({"thinking": {"type": "enabled", "budget_tokens": "x"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1.5}}, "thinking.budget_tokens"),
])
def test_messages_model_and_budget_types_are_400(app, path, extra, param):
    body = {"model": "m", "max_tokens": 5, "messages": ASK, **extra}
    r = post(app.base_url, body, path)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert param in err["error"]["message"]
