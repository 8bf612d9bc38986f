"""Responses request -> conversation, and pieces -> Response / stream events, without a server.

Every event is validated against the openai SDK's ResponseStreamEvent union and fed to
the SDK's own stream accumulator (the one `client.responses.stream()` uses), so an
event it would reject, or a sequence it cannot finish, fails here.
"""
from __future__ import annotations

import pydantic
import pytest
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from mashbox.api import response_answer as ra
from mashbox.api import responses as r
from mashbox.api.prompt import place_system
from mashbox.api.generation import Piece
from mashbox.http.response import HTTPError

STREAM_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)


def conv(**body):
    body.setdefault("input", "hi")
    return r.to_conversation(body)


def refused(**body) -> HTTPError:
    body.setdefault("input", "hi")
    with pytest.raises(HTTPError) as info:
        r.to_conversation(body)
    assert info.value.status == 400
    return info.value


CODEX_TOOLS = [
    {"type": "function", "name": "shell", "description": "Run a command", "strict": True,
     "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}},
                    "required": ["command"], "additionalProperties": False}},
    {"type": "namespace", "name": "github", "description": "GitHub tools", "tools": [
        {"type": "function", "name": "create_issue", "parameters": {"type": "object", "properties": {}}},
        {"type": "custom", "name": "comment"}]},
    {"type": "web_search", "external_web_access": False},
    {"type": "custom", "name": "apply_patch", "description": "Apply a patch",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: 'x'"}},
]


# ---------------------------------------------------------------- request side


def test_string_input_and_instructions():
    c, refs = conv(instructions="be brief", input="Name three planets.")
    assert c.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Name three planets."}]
    assert c.tools == [] and refs == {} and c.tool_choice.mode == "auto" and c.enable_thinking is None


def test_items_become_turns():
    c, _ = conv(tools=CODEX_TOOLS, input=[
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
        {"role": "user", "content": "fix it"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "xx",
         "content": [{"type": "reasoning_text", "text": "look first"}]},
        {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": '{"command": ["ls"]}'},
        {"type": "function_call", "call_id": "call_2", "name": "create_issue", "namespace": "github",
         "arguments": "{not json"},
        {"type": "function_call_output", "call_id": "call_1", "output": "a.py"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "created"}]},
        {"type": "custom_tool_call", "call_id": "call_3", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "call_3", "output": "done"},
        {"type": "local_shell_call", "id": "ls_1", "call_id": "call_4", "status": "completed",
         "action": {"type": "exec", "command": ["pwd"], "env": {}}},
        {"type": "local_shell_call_output", "id": "call_4", "output": "/tmp"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Fixed."}]},
        {"type": "compaction_summary", "encrypted_content": "zz"},  # unknown: skipped
        {"type": "message", "role": "developer", "content": "sandbox changed"},  # later: stays in place
    ])
    assert c.messages[-1] == {"role": "system", "content": "sandbox changed"}
    assert place_system(c.messages) == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "fix it"},
        {"role": "assistant", "content": "", "reasoning_content": "look first", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "shell", "arguments": {"command": ["ls"]}}},
            {"id": "call_2", "type": "function", "function": {"name": "github__create_issue",
                                                              "arguments": "{not json"}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.py"},
        {"role": "tool", "tool_call_id": "call_2", "content": "created"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_3", "type": "function", "function": {"name": "apply_patch",
                                                              "arguments": {"input": "*** Begin Patch"}}}]},
        {"role": "tool", "tool_call_id": "call_3", "content": "done"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_4", "type": "function", "function": {"name": "local_shell",
                                                              "arguments": {"type": "exec", "command": ["pwd"],
                                                                            "env": {}}}}]},
        {"role": "tool", "tool_call_id": "call_4", "content": "/tmp"},
        {"role": "assistant", "content": "Fixed."},
        {"role": "user", "content": "<system-reminder>\nsandbox changed\n</system-reminder>"},
    ]


def test_tools_namespace_custom_and_skipped():
    c, refs = conv(tools=CODEX_TOOLS)
    names = [t["function"]["name"] for t in c.tools]
    assert names == ["shell", "github__create_issue", "github__comment", "apply_patch"]
    assert refs["github__create_issue"] == r.ToolRef("function", "create_issue", "github")
    assert refs["github__comment"] == r.ToolRef("custom", "comment", "github")
    patch = c.tools[3]["function"]
    assert patch["parameters"] == r.CUSTOM_INPUT_PARAMETERS
    assert "start: 'x'" in patch["description"]
    # A namespace that already ends in a separator is joined as it is.
    _, refs = conv(tools=[{"type": "namespace", "name": "mcp__fs__", "description": "",
                           "tools": [{"type": "function", "name": "read"}]}])
    assert list(refs) == ["mcp__fs__read"]


def test_tool_choice_forms():
    def choice(tc):
        c, _ = conv(tools=CODEX_TOOLS, tool_choice=tc)
        return c.tool_choice.mode, c.tool_choice.name

    assert choice("auto") == ("auto", None)
    assert choice("none") == ("none", None)
    assert choice("required") == ("required", None)
    assert choice({"type": "function", "name": "shell"}) == ("named", "shell")
    assert choice({"type": "function", "function": {"name": "shell"}}) == ("named", "shell")
    assert choice({"type": "function", "name": "create_issue"}) == ("named", "github__create_issue")
    assert choice({"type": "custom", "name": "apply_patch"}) == ("named", "apply_patch")
    assert choice({"type": "allowed_tools", "mode": "required", "tools": []}) == ("required", None)
    assert refused(tools=CODEX_TOOLS, tool_choice={"type": "function", "name": "nope"}).param == "tool_choice.name"
    assert refused(tools=CODEX_TOOLS, tool_choice={"type": "web_search_preview"}).param == "tool_choice.type"
    assert refused(tool_choice="required").param == "tool_choice"
    assert refused(tool_choice="sometimes").param == "tool_choice"


def test_reasoning_effort_rule():
    assert conv()[0].enable_thinking is None
    assert conv(reasoning={"summary": "auto"})[0].enable_thinking is True
    assert conv(reasoning={"effort": "high"})[0].enable_thinking is True
    assert conv(reasoning={"effort": "minimal"})[0].enable_thinking is False
    assert conv(reasoning={"effort": "none"})[0].enable_thinking is False


@pytest.mark.parametrize("body,param", [
    ({"include": ["message.input_text.logprobs"]}, "include"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": 5}}}, "text.format.schema"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "c",
                 "output": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].output[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": 5}, "input"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
])
def test_refused_fields(body, param):
    err = refused(**body)
    assert err.param == param and param in err.message


def test_accepted_codex_fields():
    c, _ = conv(include=["reasoning.encrypted_content"], text={"format": {"type": "text"}, "verbosity": "low"},
                store=False, parallel_tool_calls=True, prompt_cache_key="k", client_metadata={"a": "b"})
    assert c.messages == [{"role": "user", "content": "hi"}]


# ---------------------------------------------------------------- output side

REFS = {"shell": r.ToolRef("function", "shell"), "github__create_issue": r.ToolRef("function", "create_issue", "github"),
        "apply_patch": r.ToolRef("custom", "apply_patch")}
ECHO = {"parallel_tool_calls": True, "tool_choice": "auto", "tools": CODEX_TOOLS}

PIECES = [
    Piece("reasoning", "Think "), Piece("reasoning", "hard."),
    Piece("text", "Running "), Piece("text", "it."),
    Piece("tool_start", index=0, id="call_a", name="shell"),
    Piece("tool_args", '{"command": ', index=0), Piece("tool_args", '["ls"]}', index=0), Piece("tool_end", index=0),
    Piece("tool_start", index=1, id="call_b", name="github__create_issue"),
    Piece("tool_args", "{}", index=1), Piece("tool_end", index=1),
    Piece("tool_start", index=2, id="call_c", name="apply_patch"),
    Piece("tool_args", '{"input": "*** Begin', index=2), Piece("tool_args", ' Patch"}', index=2),
    Piece("tool_end", index=2),
]


def run_pieces(pieces, finish="stop"):
    rs = ra.ResponseStream("resp_test", "smollm2", 1700000000, dict(ECHO), REFS)
    events = rs.start()
    for p in pieces:
        events.extend(rs.feed(p))
    usage = ra.usage_block(20, 5, 30, 4)
    events.extend(rs.finish(finish, usage))
    rs2 = ra.ResponseStream("resp_test", "smollm2", 1700000000, dict(ECHO), REFS)
    for p in pieces:
        rs2.feed(p)
    return events, rs2.final(finish, usage)


def sdk_final(events, tools=CODEX_TOOLS):
    state = ResponseStreamState(input_tools=tools, text_format=pydantic_omit())
    for name, payload in events:
        assert payload["type"] == name
        ev = STREAM_EVENT.validate_python(payload)
        state.handle_event(ev)
    return state


def pydantic_omit():
    from openai._types import omit

    return omit


def test_event_sequence_exact():
    events, _ = run_pieces(PIECES)
    assert [p["sequence_number"] for _, p in events] == list(range(1, len(events) + 1))
    assert [n for n, _ in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done", "response.output_item.done",
        "response.completed",
    ]
    assert [p.get("output_index") for _, p in events if p["type"] == "response.output_item.added"] == [0, 1, 2, 3, 4]
    created = events[0][1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None


def test_stream_and_response_agree_through_the_sdk():
    events, final = run_pieces(PIECES)
    state = sdk_final(events)
    completed = state._completed_response
    parsed = Response.model_validate(final)
    assert completed.output_text == parsed.output_text == "Running it."
    def without_ids(output):
        # Item ids are random per stream and the SDK adds its parsed_* fields; the rest must agree.
        out = []
        for item in output:
            item = {k: v for k, v in item.items() if k not in ("id", "parsed_arguments")}
            if "content" in item:
                item["content"] = [{k: v for k, v in c.items() if k != "parsed"} for c in item["content"]]
            out.append(item)
        return out

    assert without_ids(completed.to_dict()["output"]) == without_ids(parsed.to_dict()["output"])
    kinds = [o.type for o in parsed.output]
    assert kinds == ["reasoning", "message", "function_call", "function_call", "custom_tool_call"]
    reasoning, message, shell, issue, patch = parsed.output
    assert reasoning.content[0].text == "Think hard." and reasoning.summary == []
    assert shell.call_id == "call_a" and shell.arguments == '{"command": ["ls"]}' and shell.namespace is None
    assert completed.output[2].parsed_arguments == {"command": ["ls"]}  # strict tool: the SDK parsed it
    assert issue.name == "create_issue" and issue.namespace == "github"
    assert patch.name == "apply_patch" and patch.input == "*** Begin Patch"
    assert parsed.status == "completed" and parsed.incomplete_details is None
    assert parsed.usage.input_tokens_details.cached_tokens == 5
    assert parsed.usage.output_tokens_details.reasoning_tokens == 4
    assert parsed.parallel_tool_calls is True and parsed.tool_choice == "auto"


def test_incomplete_when_length():
    events, final = run_pieces([Piece("text", "partial")], finish="length")
    assert events[-1][0] == "response.incomplete"
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    sdk_final(events)  # the SDK accepts the sequence


def test_failure_events():
    rs = ra.ResponseStream("resp_f", "m", 1, dict(ECHO), REFS)
    events = rs.start() + rs.feed(Piece("text", "par")) + rs.fail("device lost")
    assert [n for n, _ in events][-2:] == ["error", "response.failed"]
    assert events[-1][1]["response"]["status"] == "failed"
    assert events[-1][1]["response"]["error"]["message"] == "device lost"
    assert [p["sequence_number"] for _, p in events] == list(range(1, len(events) + 1))
    sdk_final(events)


def test_custom_input_rules():
    assert ra.custom_input('{"input": "raw"}') == "raw"
    assert ra.custom_input("not json") == "not json"
    assert ra.custom_input('{"patch": "x"}') == '{"patch": "x"}'


def test_whitespace_alone_opens_no_message_item():
    events, final = run_pieces([Piece("reasoning", "hm"), Piece("text", "\n\n"),
                                Piece("tool_start", index=0, id="call_1", name="shell"),
                                Piece("tool_args", "{}", index=0), Piece("tool_end", index=0)])
    assert [o["type"] for o in final["output"]] == ["reasoning", "function_call"]
    sdk_final(events)
