"""Golden wire bytes of every generating route, whole and streamed.

Each case sends one request on a plain socket to the real app (router, guard, routes,
SSE pump) with a scripted engine (a known model output: text, reasoning, tool calls, a
stop sequence, max_tokens, a worker failure mid-stream) and the real default model's
tokenizer under a thinking chat template, and compares the response's head and body
with tests/api/golden/<route>-<case>-<mode>.http.

What varies between runs is normalised, nothing else: the Date header, `created` /
`created_at` times, and the random ids, which become PREFIX<n> numbered in order of first
appearance, so an id that must appear twice (a call's id in its start and in the final
object) still has to be the same id. A chunked body is de-chunked (its framing is the
http layer's and is checked there).

MASHBOX_UPDATE_GOLDEN=1 rewrites the files instead of comparing (only for a wire change
that is meant).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import orjson
import pytest

from api_scripted_engine import server_fixtures, text_events
from harness import raw_exchange

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("MASHBOX_UPDATE_GOLDEN") == "1"

THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


class Script:
    def __init__(self):
        self.outputs = ["Hello", ",", " world"]
        self.finish = "stop"
        self.stop_sequence = None
        self.error = None

    def __call__(self, req):
        return text_events(req, self.outputs, self.finish, self.stop_sequence, self.error)


script, engine, app = server_fixtures(Script, ctx=2048, template_source=THINKING_TEMPLATE)

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL_OUTPUT = ["Let me check.\n", "<tool_call>\n{\"name\": \"get_weather\", ",
               "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n",
               "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>"]

BASE = {
    "chat": ("/v1/chat/completions", {"messages": USER, "seed": 42}),
    "completions": ("/v1/completions", {"prompt": "Once upon a time", "seed": 42}),
    "responses": ("/v1/responses", {"input": USER, "seed": 42}),
    "messages": ("/v1/messages", {"model": "claude-sonnet-4-5", "max_tokens": 64, "messages": USER, "seed": 42}),
}

TOOLS = {
    "chat": {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
                       {"type": "function", "function": {"name": "get_time"}}]},
    "completions": {},
    "responses": {"tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER},
                            {"type": "function", "name": "get_time"}]},
    "messages": {"tools": [{"name": "get_weather", "input_schema": WEATHER},
                           {"name": "get_time", "input_schema": {"type": "object"}}]},
}
THINKING = {
    "chat": {},
    "completions": {},
    "responses": {"reasoning": {"effort": "high"}},
    "messages": {"thinking": {"type": "enabled", "budget_tokens": 1024}},
}
STOP = {"chat": {"stop": ["END"]}, "completions": {"stop": "END"}, "responses": {"stop": ["END"]},
        "messages": {"stop_sequences": ["END"]}}
LENGTH = {"chat": {"max_tokens": 3}, "completions": {"max_tokens": 3}, "responses": {"max_output_tokens": 3},
          "messages": {"max_tokens": 3}}

# case -> (outputs, finish, stop_sequence, error, extra body fields per route)
CASES = {
    "text": (["Hello", ",", " world"], "stop", None, None, {}),
    "reasoning": (["<think>", "The user wants ", "weather.</think>", "It is sunny."], "stop", None, None, THINKING),
    "tools": (TOOL_OUTPUT, "stop", None, None, TOOLS),
    "stop": (["Hello", " there"], "stop_sequence", "END", None, STOP),
    "length": (["One", " two", " three"], "length", None, None, LENGTH),
    "failure": (["Hel", "lo"], "error", None, "the worker exited", {}),
}

ID = re.compile(rb"\b(chatcmpl-|cmpl-|call_|msg_|toolu_|resp_|rs_|fc_|ctc_|req_)([0-9a-f]{24})\b")
TIME = re.compile(rb'"(created|created_at)":\d+')
DATE = re.compile(rb"\r\ndate: [^\r]*")


def normalise(data: bytes) -> bytes:
    seen: dict[bytes, int] = {}

    def one(m):
        n = seen.setdefault(m.group(0), len(seen) + 1)
        return m.group(1) + b"<%d>" % n

    data = ID.sub(one, data)
    data = TIME.sub(lambda m: b'"' + m.group(1) + b'":<T>', data)
    return DATE.sub(b"\r\ndate: <DATE>", data)


def check(name: str, head: bytes, body: bytes) -> None:
    got = normalise(head + b"\r\n\r\n" + body)
    path = GOLDEN / f"{name}.http"
    if UPDATE:
        GOLDEN.mkdir(exist_ok=True)
        path.write_bytes(got)
        return
    assert path.exists(), f"no golden file {path.name} (MASHBOX_UPDATE_GOLDEN=1 writes it)"
    want = path.read_bytes()
    if got != want:
        # Line by line, so the first difference is readable.
        for g, w in zip(got.split(b"\n"), want.split(b"\n")):
            assert g == w
        assert got == want


@pytest.fixture(autouse=True)
def reset(script):
    script.__init__()


@pytest.mark.parametrize("mode", ["whole", "stream"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("route", list(BASE))
def test_golden(app, script, route, case, mode):
    outputs, finish, stop_sequence, error, extra = CASES[case]
    script.outputs, script.finish, script.stop_sequence, script.error = outputs, finish, stop_sequence, error
    path, body = BASE[route]
    body = {**body, **extra.get(route, {})}
    if mode == "stream":
        body["stream"] = True
        if route == "chat":
            body["stream_options"] = {"include_usage": True}
    head, data = raw_exchange(app.base_url, "POST", path, orjson.dumps(body))
    check(f"{route}-{case}-{mode}", head, data)


COUNT_TOKENS = {
    "plain": {"model": "claude-sonnet-4-5", "messages": USER},
    "tools": {"model": "claude-sonnet-4-5", "messages": USER, "system": "Be brief.", **TOOLS["messages"]},
    "bad": {"model": "claude-sonnet-4-5", "messages": "hi"},
}


@pytest.mark.parametrize("case", list(COUNT_TOKENS))
def test_golden_count_tokens(app, case):
    head, data = raw_exchange(app.base_url, "POST", "/v1/messages/count_tokens", orjson.dumps(COUNT_TOKENS[case]))
    check(f"count_tokens-{case}", head, data)


BAD = {
    "chat": {"messages": []},
    "completions": {"prompt": 7},
    "responses": {"input": 7},
    "messages": {"model": "claude-sonnet-4-5", "max_tokens": 64, "messages": [{"role": "robot", "content": "x"}]},
}


@pytest.mark.parametrize("route", list(BAD))
def test_golden_bad_request(app, route):
    path, _ = BASE[route]
    head, data = raw_exchange(app.base_url, "POST", path, orjson.dumps(BAD[route]))
    check(f"{route}-bad-whole", head, data)
