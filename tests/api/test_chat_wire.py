"""Chat Completions on the wire, byte for byte, with a scripted engine.

The real app (router, guard, routes, SSE pump) on a real socket; only the engine is
scripted, because these cases need a known model output: the exact chunk sequence,
reasoning, tool calls split at odd places, a worker failure mid-stream, full queues, a
model still loading. The real-model tests are in test_chat.py.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest

import harness
from api_scripted_engine import NotReady, QueueFull, server_fixtures, text_events

THINK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)


class Script:
    """What the next request answers; records nothing (the engine records requests)."""

    def __init__(self):
        self.pieces = ["Hello", ",", " world"]
        self.finish = "stop"
        self.stop_sequence = None
        self.error = None
        self.raise_on_submit = None

    def __call__(self, req):
        if self.raise_on_submit is not None:
            return [self.raise_on_submit]
        return text_events(req, self.pieces, self.finish, self.stop_sequence, self.error)


script, engine, app = server_fixtures(Script, ctx=256, template_source=THINK_TEMPLATE)


@pytest.fixture(autouse=True)
def reset(script, engine):
    script.__init__()
    engine.delay_s = 0.0
    engine.state = "ok"
    yield


def post(app, body, path="/v1/chat/completions"):
    return harness.post(app.base_url, body, path, timeout=30)


def stream_frames(app, body, path="/v1/chat/completions"):
    r = post(app, body, path)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    return harness.sse_frames(r.content)


def user(text="Hi"):
    return [{"role": "user", "content": text}]


def without_volatile(chunk: dict) -> dict:
    chunk = dict(chunk)
    assert chunk.pop("id").startswith("chatcmpl-")
    assert isinstance(chunk.pop("created"), int)
    return chunk


def test_stream_exact_chunk_sequence(app):
    frames = stream_frames(app, {"messages": user(), "stream": True, "stream_options": {"include_usage": True}})
    assert [name for name, _ in frames] == [""] * len(frames)
    assert frames[-1][1] == "[DONE]"
    chunks = [json.loads(d) for _, d in frames[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    chunks = [without_volatile(c) for c in chunks]
    head = {"object": "chat.completion.chunk", "model": "scripted"}

    def choice(delta, finish=None):
        return [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]

    timings = {"prompt_n": chunks[-1]["usage"]["prompt_tokens"] - 2, "prompt_ms": 20.0, "prompt_per_second": None,
               "predicted_n": 3, "predicted_ms": 40.0, "predicted_per_second": 50.0, "cache_n": 2, "queue_ms": 1.5}
    timings["prompt_per_second"] = timings["prompt_n"] * 1000.0 / 20.0
    n_prompt = chunks[-1]["usage"]["prompt_tokens"]
    assert chunks == [
        {**head, "choices": choice({"role": "assistant"})},
        {**head, "choices": choice({"content": "Hello"})},
        {**head, "choices": choice({"content": ","})},
        {**head, "choices": choice({"content": " world"})},
        {**head, "choices": choice({}, "stop"), "timings": timings},
        {**head, "choices": [], "timings": timings,
         "usage": {"prompt_tokens": n_prompt, "completion_tokens": 3, "total_tokens": n_prompt + 3,
                   "prompt_tokens_details": {"cached_tokens": 2}}},
    ]


def test_stream_without_include_usage_has_no_usage_chunk(app):
    frames = stream_frames(app, {"messages": user(), "stream": True})
    chunks = [json.loads(d) for _, d in frames[:-1]]
    assert all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert frames[-1] == ("", "[DONE]")


def test_plain_completion_object(app, engine):
    r = post(app, {"messages": user(), "max_tokens": 7, "stop": ["END"], "seed": 42, "temperature": 0.5})
    assert r.status_code == 200
    obj = r.json()
    assert obj["object"] == "chat.completion" and obj["id"].startswith("chatcmpl-")
    assert obj["model"] == "scripted"
    assert obj["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello, world"},
                               "finish_reason": "stop", "logprobs": None}]
    assert obj["usage"]["completion_tokens"] == 3
    assert obj["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    assert set(obj["timings"]) == {"prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms",
                                   "predicted_per_second", "cache_n", "queue_ms"}
    req = engine.submitted[-1]
    assert req.max_tokens == 7 and req.stops == ("END",)
    assert req.sampling.seed == 42 and req.sampling.temperature == 0.5


def test_sampling_fields_reach_the_engine(app, engine):
    body = {"messages": user(), "max_completion_tokens": 5, "max_tokens": 9, "top_p": 0.9, "top_k": 40,
            "min_p": 0.05, "repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": -0.5,
            "stop_sequences": ["a", "b"]}
    assert post(app, body).status_code == 200
    req = engine.submitted[-1]
    s = req.sampling
    assert (req.max_tokens, s.top_p, s.top_k, s.min_p) == (5, 0.9, 40, 0.05)
    assert (s.repetition_penalty, s.frequency_penalty, s.presence_penalty) == (1.1, 0.5, -0.5)
    assert req.stops == ("a", "b")
    assert s.temperature == 0.0  # the default: greedy


def test_max_tokens_default_and_clamp_to_the_context(app, engine):
    assert post(app, {"messages": user()}).status_code == 200
    req = engine.submitted[-1]
    assert req.max_tokens == 256 - len(req.prompt_ids)
    assert post(app, {"messages": user(), "max_tokens": 64000}).status_code == 200
    assert engine.submitted[-1].max_tokens == 256 - len(engine.submitted[-1].prompt_ids)


def test_prompt_longer_than_the_context_says_by_how_much(app):
    r = post(app, {"messages": user("word " * 400)})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "messages"
    n = int(err["message"].split("The prompt is ")[1].split(" ")[0])
    assert f"{n - 256 + 1} too many" in err["message"]


def test_stop_sequence_finish_is_stop(app, script):
    script.pieces = ["Hello"]
    script.finish, script.stop_sequence = "stop_sequence", "END"
    obj = post(app, {"messages": user(), "stop": "END"}).json()
    assert obj["choices"][0]["finish_reason"] == "stop"
    assert obj["choices"][0]["message"]["content"] == "Hello"


def test_length_finish(app, script):
    script.finish = "length"
    obj = post(app, {"messages": user(), "max_tokens": 3}).json()
    assert obj["choices"][0]["finish_reason"] == "length"


def test_reasoning_in_message_and_deltas(app, script):
    script.pieces = ["<th", "ink>Let me", " think.</th", "ink>", "Paris."]
    obj = post(app, {"messages": user()}).json()
    msg = obj["choices"][0]["message"]
    assert msg["content"] == "Paris."
    assert msg["reasoning_content"] == "Let me think." and msg["reasoning"] == "Let me think."

    frames = stream_frames(app, {"messages": user(), "stream": True})
    deltas = [json.loads(d)["choices"][0]["delta"] for _, d in frames[:-1]]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    assert reasoning == "Let me think."
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == "Paris."
    # never a tag fragment in the content
    assert all("<" not in (d.get("content") or "") for d in deltas)


def test_enable_thinking_false_reaches_the_template(app, engine, script):
    script.pieces = ["Paris."]
    post(app, {"messages": user(), "chat_template_kwargs": {"enable_thinking": False}})
    ids_off = engine.submitted[-1].prompt_ids
    post(app, {"messages": user(), "enable_thinking": True})
    ids_on = engine.submitted[-1].prompt_ids
    assert len(ids_off) > len(ids_on)  # the closed empty think block was rendered


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


def test_tool_call_stream_by_index(app, script):
    pytest.importorskip("mashbox.text.parsers")
    script.pieces = ["<tool", "_call>\n{\"name\": \"get_", "weather\", \"arguments\": {\"city\": ",
                     "\"Paris\"}}\n</tool_call>", "\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": ",
                     "{\"city\": \"Rome\"}}\n</tool_call>"]
    frames = stream_frames(app, {"messages": user(), "tools": TOOLS, "stream": True})
    chunks = [json.loads(d) for _, d in frames[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    calls: dict = {}
    for c in chunks[1:-1]:
        delta = c["choices"][0]["delta"]
        assert "content" not in delta or not delta["content"].strip()
        for tc in delta.get("tool_calls", []):
            if tc["index"] not in calls:
                assert tc["id"].startswith("call_") and tc["type"] == "function"
                assert tc["function"]["name"] == "get_weather"
                calls[tc["index"]] = {"id": tc["id"], "args": tc["function"].get("arguments", "")}
            else:
                assert "id" not in tc and "name" not in tc["function"]
                calls[tc["index"]]["args"] += tc["function"]["arguments"]
    assert sorted(calls) == [0, 1]
    assert json.loads(calls[0]["args"]) == {"city": "Paris"}
    assert json.loads(calls[1]["args"]) == {"city": "Rome"}
    assert calls[0]["id"] != calls[1]["id"]
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "tool_calls", "logprobs": None}


def test_named_tool_choice_forces_the_call_opening(app, engine, script, default_model_path):
    pytest.importorskip("mashbox.text.parsers")
    script.pieces = ["{\"city\": \"Oslo\"}}", "\n</tool_call>"]
    client = openai.OpenAI(base_url=app.base_url + "/v1", api_key="x", max_retries=0)
    out = client.chat.completions.create(
        model="scripted", messages=user("Weather in Oslo?"), tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    from mashbox.text.tokenizer import load_tokenizer

    prompt_text = load_tokenizer(default_model_path).decode(engine.submitted[-1].prompt_ids)
    assert prompt_text.endswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}


def test_error_mid_stream_is_an_error_event_with_the_response_id(app, script):
    script.finish, script.error = "error", "the engine worker stopped"
    frames = stream_frames(app, {"messages": user(), "stream": True})
    first = json.loads(frames[0][1])
    assert frames[-2][0] == "error"
    err = json.loads(frames[-2][1])["error"]
    assert err["request_id"] == first["id"]
    assert err["type"] == "server_error" and "the engine worker stopped" in err["message"]
    assert frames[-1] == ("", "[DONE]")


def test_error_before_output_not_streamed_is_500_after_one_retry(app, engine, script):
    script.finish, script.error = "error", "boom"
    before = len(engine.submitted)
    r = post(app, {"messages": user()})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    assert "retry failed too" in r.json()["error"]["message"] or "boom" in r.json()["error"]["message"]
    assert len(engine.submitted) == before + 2  # the first run and its one retry


class FailOnce:
    """The first run fails after some tokens (a worker fault); the retry answers."""

    def __init__(self, first_pieces=("Hel", "lo")):
        self.calls = 0
        self.first_pieces = list(first_pieces)

    def __call__(self, req):
        self.calls += 1
        if self.calls == 1:
            return text_events(req, self.first_pieces, "error", error="the engine worker stopped")
        return text_events(req, ["Hello", "!"])


def test_failure_before_the_client_got_output_is_run_again(app, engine, script, monkeypatch):
    monkeypatch.setattr(engine, "script", FailOnce())
    obj = post(app, {"messages": user()}).json()
    assert obj["choices"][0]["message"]["content"] == "Hello!"
    assert obj["usage"]["completion_tokens"] == 2  # counted for the run that answered
    assert engine.submitted[-1].prompt_ids == engine.submitted[-2].prompt_ids


def test_stream_retried_when_nothing_but_the_role_chunk_was_sent(app, engine, monkeypatch):
    # The failed run's only text is "<th": the parser holds it back (it may become <think>),
    # so the client got the role chunk and no model output.
    monkeypatch.setattr(engine, "script", FailOnce(["<th"]))
    frames = stream_frames(app, {"messages": user(), "stream": True})
    deltas = [json.loads(d)["choices"][0]["delta"] for n, d in frames[:-1] if n == ""]
    assert "".join(d.get("content") or "" for d in deltas) == "Hello!"
    assert all(n != "error" for n, _ in frames)


def test_queue_full_is_429_with_retry_after(app, script):
    for scope in ("tenant", "total"):
        script.raise_on_submit = QueueFull(scope)
        r = post(app, {"messages": user()})
        assert r.status_code == 429
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"


def test_not_ready_is_503_with_retry_after(app, engine, script):
    engine.state = "loading"
    r = post(app, {"messages": user()})
    assert r.status_code == 503
    assert int(r.headers["retry-after"]) >= 1 and r.headers["x-should-retry"] == "true"
    engine.state = "ok"
    script.raise_on_submit = NotReady()
    assert post(app, {"messages": user()}).status_code == 503


def test_disconnect_mid_stream_cancels_the_engine_request(app, engine, script):
    script.pieces = ["x"] * 200
    engine.delay_s = 0.02
    with httpx.stream("POST", app.base_url + "/v1/chat/completions",
                      json={"messages": user(), "stream": True}, timeout=30) as r:
        it = r.iter_bytes()
        next(it)
    rid = engine.submitted[-1].id
    import time

    deadline = time.monotonic() + 10
    while rid not in engine.cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rid in engine.cancelled


def test_sdk_parses_stream_and_usage(app):
    client = openai.OpenAI(base_url=app.base_url + "/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(model="scripted", messages=user(), stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello, world"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 2


def test_sdk_stream_accumulator_builds_the_typed_completion(app, script):
    """The SDK's own stream helper accumulates our deltas (content, reasoning, tool calls
    by index) into a ChatCompletion; it is strict about the delta shapes."""
    script.pieces = ["Let me check.", "\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": ",
                     "\"Paris\"}}\n</tool_call>"]
    client = openai.OpenAI(base_url=app.base_url + "/v1", api_key="x", max_retries=0)
    with client.chat.completions.stream(model="scripted", messages=user(), tools=TOOLS) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in events
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_system_messages_follow_the_one_rule(app, engine, default_model_path):
    """System / developer messages join the system prompt, a later one too (the spec's
    rule for Chat; prompt.place_system's "join"), in order."""
    from mashbox.text.tokenizer import load_tokenizer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Use French."},
                {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Salut"},
                {"role": "system", "content": "The user is tired."}, {"role": "user", "content": "Bye"}]
    assert post(app, {"messages": messages}).status_code == 200
    text = load_tokenizer(default_model_path).decode(engine.submitted[-1].prompt_ids)
    # (decoded without the special tokens: <|im_start|> / <|im_end|> are not in the text)
    assert text == ("system\nBe brief.\n\nUse French.\n\nThe user is tired.\nuser\nHi\nassistant\nSalut\n"
                    "user\nBye\nassistant\n")
