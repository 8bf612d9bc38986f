"""POST /v1/messages/count_tokens: the prompt tokens of the same request after the
template, tools and tool_choice included. Handler-level here (the engine is not
involved in counting); test_messages_e2e.py checks it against a real run's usage."""
from __future__ import annotations

import asyncio

import orjson
import pytest

from mashbox.api import messages
from mashbox.api.prompt import chat_prompt
from mashbox.http.request import Request
from mashbox.http.response import HTTPError

from test_messages_wire import make_api, replay_engine, text_layer  # noqa: F401  (fixture)

TOOLS = [{"name": "get_weather", "description": "Weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def count(api, body) -> int:
    h = [h for _, p, h, _ in messages.routes(api) if p == "/v1/messages/count_tokens"][0]
    resp = asyncio.run(h(Request("POST", "/v1/messages/count_tokens", "", {}, orjson.dumps(body))))
    out = orjson.loads(resp.body)
    assert list(out) == ["input_tokens"]
    return out["input_tokens"]


@pytest.mark.parametrize("extra", [
    {},
    {"system": [{"type": "text", "text": "x-anthropic-billing-header: a"}, {"type": "text", "text": "Be brief."}]},
    {"tools": TOOLS},
    {"tools": TOOLS, "tool_choice": {"type": "any"}},
    {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_weather"}},
    {"tools": TOOLS, "tool_choice": {"type": "none"}},
])
def test_count_equals_the_prompt_the_same_request_runs(text_layer, extra):
    api = make_api(text_layer, replay_engine([]))
    body = {"model": "claude-x", "messages": [{"role": "user", "content": "Weather in Paris?"}], **extra}
    n = count(api, body)
    ids = chat_prompt(api, messages.to_conversation(body), None).ids
    assert n == len(ids)


def test_tools_and_forcing_count(text_layer):
    api = make_api(text_layer, replay_engine([]))
    base = {"messages": [{"role": "user", "content": "Weather in Paris?"}]}
    plain = count(api, base)
    with_tools = count(api, {**base, "tools": TOOLS})
    forced = count(api, {**base, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_weather"}})
    assert plain < with_tools < forced
    assert count(api, {**base, "tools": TOOLS, "tool_choice": {"type": "none"}}) == plain


def test_count_refusals_and_loading(text_layer):
    api = make_api(text_layer, replay_engine([]))
    with pytest.raises(HTTPError) as info:
        count(api, {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]})
    assert info.value.status == 400 and info.value.param == "messages[0].content[0].type"
    api = make_api(text_layer, replay_engine([], state="loading"))
    with pytest.raises(HTTPError) as info:
        count(api, {"messages": [{"role": "user", "content": "x"}]})
    assert info.value.status == 529
