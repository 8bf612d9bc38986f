"""Structured output and schema-bound tool calls end to end: the real server on the
default model (conftest `server`), the official openai / anthropic SDKs.

The model is small and free text would rarely be valid JSON for these schemas; under
the grammar every answer must validate (jsonschema), on every route, streamed or not,
and end on its own (finish_reason stop / tool_calls, never length). The requests of a
test run concurrently, so the server's slots batch them.
"""
from __future__ import annotations

import concurrent.futures
import json

import anthropic
import jsonschema
import pytest

pytestmark = pytest.mark.slow

MAX_TOKENS = 160
CONCURRENCY = 4  # conftest's SERVER_SLOTS

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": NAME, "country": NAME, "population": {"type": "integer", "minimum": 1,
                                                                                    "maximum": 40000000}},
     "required": ["city", "country", "population"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue", "yellow"]}}, "required": ["color"]},
    {"type": "object", "properties": {"planets": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 4}},
     "required": ["planets"]},
    {"type": "object", "properties": {"scores": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                          "maximum": 10},
                                                "minItems": 3, "maxItems": 3}}, "required": ["scores"]},
    {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 60},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}},
     "required": ["temperature", "unit"]},
    {"type": "object", "properties": {"answer": {"type": "boolean"}, "reason": NAME}, "required": ["answer", "reason"]},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {
        "first": NAME, "last": NAME}, "required": ["first", "last"]}}, "required": ["person"]},
    {"type": "object", "properties": {"book": {"type": "object", "properties": {
        "title": NAME, "author": {"type": "object", "properties": {"name": NAME, "born": {
            "type": "integer", "minimum": 1000, "maximum": 2025}}, "required": ["name", "born"]}},
        "required": ["title", "author"]}}, "required": ["book"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"}},
     "required": ["email"]},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
     "required": ["date"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100},
                                                          {"type": "string", "maxLength": 12}]}},
     "required": ["value"]},
    {"type": "object", "properties": {"shape": {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "radius": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 9}},
         "required": ["kind", "radius"]},
        {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1,
                                                                                "maximum": 9}},
         "required": ["kind", "side"]}]}}, "required": ["shape"]},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                          "y": {"type": "integer", "minimum": -9, "maximum": 9}},
                         "required": ["x", "y"]}},
     "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
     "required": ["start", "end"]},
    {"$defs": {"item": {"type": "object", "properties": {"name": NAME, "qty": {"type": "integer", "minimum": 1,
                                                                               "maximum": 99}},
                        "required": ["name", "qty"]}},
     "type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"},
                                                "minItems": 1, "maxItems": 3}}, "required": ["items"]},
    {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 5},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["news", "sport", "tech", "art"]},
                                               "minItems": 1, "maxItems": 3},
                                      "priority": {"enum": [1, 2, 3]}}, "required": ["tags", "priority"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": ["string", "null"],
                                                                          "maxLength": 20}},
     "required": ["ok", "note"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
     "required": ["matrix"]},
    {"type": "object", "properties": {"price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                                      "currency": {"type": "string", "pattern": "^[A-Z]{3}$"}},
     "required": ["price", "currency"]},
    {"type": "object", "properties": {"status": {"const": "done"}, "count": {"type": "integer", "minimum": 0,
                                                                             "maximum": 5}},
     "required": ["status", "count"], "additionalProperties": False},
]
PROMPTS = [
    "Answer with JSON only.",
    "Describe something you like, as JSON.",
    "Make up an example record for a database, in JSON.",
]


def _concurrently(fn, jobs):
    with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
        return list(pool.map(fn, jobs))


@pytest.fixture(scope="module")
def anthropic_client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


def test_twenty_schemas_three_prompts_all_validate(openai_client, model_id):
    assert len(SCHEMAS) >= 20
    jobs = [(i, j) for i in range(len(SCHEMAS)) for j in range(len(PROMPTS))]

    def ask(job):
        i, j = job
        sampling = {"temperature": 0.8, "seed": 100 + i} if j == 2 else {}
        r = openai_client.chat.completions.create(
            model=model_id, max_tokens=MAX_TOKENS, **sampling,
            messages=[{"role": "user", "content": PROMPTS[j]}],
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i],
                                                                    "strict": i % 2 == 0}})
        return job, r.choices[0].finish_reason, r.choices[0].message.content

    for (i, j), finish, text in _concurrently(ask, jobs):
        assert finish == "stop", (i, j, text)
        jsonschema.validate(json.loads(text), SCHEMAS[i])


def test_every_route_streamed_equals_whole(openai_client, anthropic_client, model_id):
    schema = SCHEMAS[1]
    ask = "Give a city, its country and its population as JSON."

    def chat(stream):
        kw = dict(model=model_id, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": ask}],
                  response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
        if not stream:
            return openai_client.chat.completions.create(**kw).choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in openai_client.chat.completions.create(
            stream=True, **kw) if c.choices)

    def responses(stream):
        kw = dict(model=model_id, max_output_tokens=MAX_TOKENS, input=ask,
                  text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
        if not stream:
            return openai_client.responses.create(**kw).output_text
        return "".join(e.delta for e in openai_client.responses.create(stream=True, **kw)
                       if e.type == "response.output_text.delta")

    def messages(stream):
        kw = dict(model="m", max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": ask}],
                  extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}})
        if not stream:
            msg = anthropic_client.messages.create(**kw)
            assert msg.stop_reason == "end_turn"
            return msg.content[0].text
        with anthropic_client.messages.stream(**kw) as s:
            return "".join(s.text_stream)

    def json_object(stream):
        kw = dict(model=model_id, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": ask}],
                  response_format={"type": "json_object"})
        if not stream:
            return openai_client.chat.completions.create(**kw).choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in openai_client.chat.completions.create(
            stream=True, **kw) if c.choices)

    routes = {"chat": chat, "responses": responses, "messages": messages, "json_object": json_object}
    jobs = [(name, stream) for name in routes for stream in (False, True)]
    got = dict(zip(jobs, _concurrently(lambda job: routes[job[0]](job[1]), jobs)))
    for name in routes:
        whole, streamed = got[name, False], got[name, True]
        assert streamed == whole, name
        value = json.loads(whole)
        if name == "json_object":
            assert isinstance(value, dict)
        else:
            jsonschema.validate(value, schema)


WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"]}
TIME_PARAMS = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
               "required": ["timezone"]}
ASK = "What is the weather in Paris?"


def test_forced_tool_calls_end_with_the_call_and_validate(openai_client, anthropic_client, model_id):
    chat_tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                    "parameters": WEATHER_PARAMS}},
                  {"type": "function", "function": {"name": "get_time", "description": "Time in a timezone",
                                                    "parameters": TIME_PARAMS}}]
    schemas = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}

    def chat(choice):
        r = openai_client.chat.completions.create(model=model_id, max_tokens=MAX_TOKENS, tools=chat_tools,
                                                  tool_choice=choice, messages=[{"role": "user", "content": ASK}])
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and not c.message.content, c
        assert len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0]
        return call.function.name, json.loads(call.function.arguments)

    def responses(choice):
        tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
                 for t in chat_tools]
        r = openai_client.responses.create(model=model_id, max_output_tokens=MAX_TOKENS, tools=tools,
                                           tool_choice=choice, input=ASK)
        assert [o.type for o in r.output] == ["function_call"], r.output
        return r.output[0].name, json.loads(r.output[0].arguments)

    def messages(choice):
        tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in chat_tools]
        msg = anthropic_client.messages.create(model="m", max_tokens=MAX_TOKENS, tools=tools, tool_choice=choice,
                                               messages=[{"role": "user", "content": ASK}])
        assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["tool_use"], msg.content
        return msg.content[0].name, msg.content[0].input

    jobs = [(chat, "required"), (chat, {"type": "function", "function": {"name": "get_time"}}),
            (responses, "required"), (responses, {"type": "function", "name": "get_time"}),
            (messages, {"type": "any"}), (messages, {"type": "tool", "name": "get_time"})]
    for (fn, choice), (name, args) in zip(jobs, _concurrently(lambda job: job[0](job[1]), jobs)):
        if "get_time" in json.dumps(choice):  # the named choices
            assert name == "get_time", (fn.__name__, name)
        jsonschema.validate(args, schemas[name])


def test_auto_calls_are_bound_and_none_forbids_the_marker(openai_client, model_id):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": WEATHER_PARAMS}}]
    asks = [ASK, "Call the tool for London.", "Use get_weather for Tokyo in celsius.", "Hi there"]

    def auto(ask):
        return openai_client.chat.completions.create(
            model=model_id, max_tokens=MAX_TOKENS, tools=tools, messages=[{"role": "user", "content": ask}])

    def none(ask):
        return openai_client.chat.completions.create(
            model=model_id, max_tokens=48, tools=tools, tool_choice="none",
            messages=[{"role": "user", "content": ask + " Reply with a <tool_call> block."}])

    for r in _concurrently(auto, asks):
        for call in r.choices[0].message.tool_calls or []:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)
    # (the default model seldom calls on its own; test_grammar.py holds the lazy grammar to the tools)
    for r in _concurrently(none, asks):
        m = r.choices[0].message
        assert not m.tool_calls and "<tool_call>" not in (m.content or "")


def test_responses_custom_tool_with_a_regex_grammar(openai_client, model_id):
    import re

    tool = {"type": "custom", "name": "set_code", "description": "Set the access code.",
            "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9]{3}-[a-z]{2}"}}
    r = openai_client.responses.create(model=model_id, max_output_tokens=MAX_TOKENS, tools=[tool],
                                       tool_choice={"type": "custom", "name": "set_code"},
                                       input="Set the access code to something.")
    assert [o.type for o in r.output] == ["custom_tool_call"], r.output
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.output[0].input), r.output[0].input


NOTE_GRAMMAR = r'''start: "*** Begin Note" LF entry{1,3} "*** End Note"
entry: "+ " NAME ": " /[^\n]{0,30}/ LF
NAME: /[a-z]{1,10}/
%import common.LF
'''


def test_responses_custom_tool_with_a_lark_grammar(openai_client, model_id, default_model_path):
    """The call's input follows the tool's Lark grammar (checked by llguidance on the raw
    grammar, not the rewritten one the server decoded under), forced and required."""
    from mashbox.config import Constraint
    from mashbox.text import grammar
    from mashbox.text.tokenizer import load_tokenizer

    tool = {"type": "custom", "name": "write_note", "description": "Write a note.",
            "format": {"type": "grammar", "syntax": "lark", "definition": NOTE_GRAMMAR}}
    weather = {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMS}
    asks = [("Write a note about the shopping list.", {"type": "custom", "name": "write_note"}, [tool]),
            ("Write a note about your day.", "required", [tool, weather])]

    def ask(case):
        text, choice, tools = case
        return openai_client.responses.create(model=model_id, max_output_tokens=MAX_TOKENS, tools=tools,
                                              tool_choice=choice, input=text)

    tok = load_tokenizer(default_model_path)
    raw = grammar.ll_tokenizer(tok)
    for (text, choice, _), r in zip(asks, _concurrently(ask, asks)):
        calls = [o for o in r.output if o.type in ("custom_tool_call", "function_call")]
        assert calls, r.output
        for call in calls:
            if call.type == "function_call":  # required with two tools: the model may pick the other
                jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
                continue
            m = grammar.matcher(Constraint("lark", NOTE_GRAMMAR), raw)
            ids = tok.encode(call.input)
            assert m.try_consume_tokens(ids) == len(ids) and m.is_accepting(), call.input
