"""Messages request -> conversation, and pieces -> Message / stream events, without a server.

The event checks validate every payload against the anthropic SDK's own types and run
them through the SDK's stream accumulator, so a shape the SDK would reject fails here.
"""
from __future__ import annotations

import pydantic
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent

from mashbox.api import message_answer as ma
from mashbox.api import messages as m
from mashbox.api.prompt import place_system
from mashbox.api.generation import Piece
from mashbox.http.response import HTTPError

STREAM_EVENT = pydantic.TypeAdapter(RawMessageStreamEvent)


def conv(**body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return m.to_conversation(body)


def refused(body) -> HTTPError:
    with pytest.raises(HTTPError) as info:
        m.to_conversation(body)
    assert info.value.status == 400
    return info.value


# ---------------------------------------------------------------- request side


def test_system_string_and_blocks_billing_header_dropped():
    c = conv(system="be brief")
    assert c.messages[0] == {"role": "system", "content": "be brief"}
    c = conv(system=[
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.3; cch=abc;"},
        {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Be careful."},
    ])
    assert c.messages[0] == {"role": "system", "content": "You are Claude Code.\n\nBe careful."}
    # Only the billing header: no system message at all.
    c = conv(system=[{"type": "text", "text": "x-anthropic-billing-header: x"}])
    assert c.messages == [{"role": "user", "content": "hi"}]


def test_billing_header_changes_do_not_change_the_conversation():
    a = conv(system=[{"type": "text", "text": "x-anthropic-billing-header: cch=1"}, {"type": "text", "text": "S"}])
    b = conv(system=[{"type": "text", "text": "x-anthropic-billing-header: cch=2"}, {"type": "text", "text": "S"}])
    assert a == b


def test_user_blocks_tool_results_and_mid_conversation_system():
    c = conv(messages=[
        {"role": "user", "content": [{"type": "text", "text": "list files", "cache_control": {"type": "ephemeral"}},
                                     {"type": "text", "text": "<system-reminder>x</system-reminder>"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should call ls.", "signature": "sig=="},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py\nb.py"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "denied"}]},
            {"type": "text", "text": "thanks"},
        ]},
        {"role": "system", "content": "The user switched to plan mode."},
    ])
    assert c.messages[-1] == {"role": "system", "content": "The user switched to plan mode."}  # left in place
    assert place_system(c.messages) == [
        {"role": "user", "content": "list files\n\n<system-reminder>x</system-reminder>"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "I should call ls.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "Bash", "arguments": {"command": "ls"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a.py\nb.py"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: denied"},
        {"role": "user", "content": "thanks\n\n<system-reminder>\nThe user switched to plan mode.\n</system-reminder>"},
    ]


def test_system_messages_in_the_list_keep_their_place():
    c = conv(system="S", messages=[
        {"role": "system", "content": "early note"},  # before any turn: joins the system prompt
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "system", "content": [{"type": "text", "text": "late note"}]},
        {"role": "user", "content": "next"},
    ])
    assert c.messages[:2] == [{"role": "system", "content": "S"}, {"role": "system", "content": "early note"}]
    assert place_system(c.messages) == [
        {"role": "system", "content": "S\n\nearly note"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "<system-reminder>\nlate note\n</system-reminder>"},
        {"role": "user", "content": "next"},
    ]


@pytest.mark.parametrize("block,param", [
    ({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}},
     "messages[0].content[1].type"),
    ({"type": "document", "source": {"type": "text", "data": "x"}}, "messages[0].content[1].type"),
    ({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]},
     "messages[0].content[1].content[0].type"),
    ({"type": "wat"}, "messages[0].content[1].type"),
    ({"type": "text"}, "messages[0].content[1].text"),
])
def test_refused_blocks_name_the_field(block, param):
    err = refused({"messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, block]}]})
    assert err.param == param
    assert param in err.message


def test_refused_request_shapes():
    assert refused({"messages": []}).param == "messages"
    assert refused({}).param == "messages"
    assert refused({"messages": [{"role": "tool", "content": "x"}]}).param == "messages[0].role"
    assert refused({"messages": [{"role": "user", "content": "x"}],
                    "output_config": {"format": {"type": "json_schema", "schema": []}}}).param == \
        "output_config.format.schema"
    assert refused({"messages": [{"role": "user", "content": "x"}], "system": 5}).param == "system"
    assert refused({"messages": [{"role": "user", "content": "x"}],
                    "thinking": {"type": "sometimes"}}).param == "thinking.type"


def test_tools_server_tools_skipped_and_choice():
    tools = [
        {"name": "Read", "description": "Read a file",
         "input_schema": {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
                          "properties": {"path": {"type": "string"}}, "additionalProperties": False},
         "cache_control": {"type": "ephemeral"}},
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        {"type": "custom", "name": "Write", "input_schema": {"type": "object"}},
    ]
    c = conv(tools=tools)
    assert [t["function"]["name"] for t in c.tools] == ["Read", "Write"]
    assert c.tools[0]["function"]["parameters"]["additionalProperties"] is False
    assert c.tools[0]["function"]["description"] == "Read a file"
    assert c.tool_choice.mode == "auto"
    assert conv(tools=tools, tool_choice={"type": "any"}).tool_choice.mode == "required"
    named = conv(tools=tools, tool_choice={"type": "tool", "name": "Write", "disable_parallel_tool_use": True})
    assert (named.tool_choice.mode, named.tool_choice.name) == ("named", "Write")
    assert conv(tools=tools, tool_choice={"type": "none"}).tool_choice.mode == "none"
    body = {"messages": [{"role": "user", "content": "x"}], "tools": tools}
    assert refused({**body, "tool_choice": {"type": "tool", "name": "web_search"}}).param == "tool_choice.name"
    assert refused({**body, "tool_choice": {"type": "tool"}}).param == "tool_choice.name"
    assert refused({**body, "tool_choice": {"type": "sometimes"}}).param == "tool_choice.type"
    assert refused({"messages": body["messages"], "tool_choice": {"type": "any"}}).param == "tool_choice.type"
    assert refused({**body, "tools": [{"description": "no name"}]}).param == "tools[0].name"


def test_thinking_types():
    assert conv().enable_thinking is False
    assert conv(thinking={"type": "enabled", "budget_tokens": 8192, "display": "summarized"}).enable_thinking
    assert conv(thinking={"type": "adaptive"}).enable_thinking
    assert conv(thinking={"type": "disabled"}).enable_thinking is False


# ---------------------------------------------------------------- output side


def run_pieces(pieces, finish="stop", stop_sequence=None):
    ms = ma.MessageStream("msg_test", "claude-x", prompt_tokens=12)
    events = ms.start()
    for p in pieces:
        events.extend(ms.feed(p))
    usage = ma.usage_block(12, 4, 9)
    events.extend(ms.finish(finish, stop_sequence, usage))
    ms2 = ma.MessageStream("msg_test", "claude-x", prompt_tokens=12)
    for p in pieces:
        ms2.feed(p)
    return events, ms2.message(finish, stop_sequence, usage)


def sdk_snapshot(events) -> Message:
    snapshot, bufs = None, {}
    for name, payload in events:
        assert payload["type"] == name
        if name == "ping":
            continue
        ev = STREAM_EVENT.validate_python(payload)  # strict: the SDK's own schema
        snapshot = accumulate_event(event=ev, current_snapshot=snapshot, json_bufs=bufs)
    return snapshot


THINK_TEXT_TOOL = [
    Piece("reasoning", "Let me "), Piece("reasoning", "think."),
    Piece("text", "I will read it."),
    Piece("tool_start", index=0, id="toolu_abc", name="Read"),
    Piece("tool_args", '{"path": ', index=0), Piece("tool_args", '"a.py"}', index=0),
    Piece("tool_end", index=0),
]


def test_stream_event_sequence_exact():
    events, _ = run_pieces(THINK_TEXT_TOOL)
    assert [(n, p.get("index"), (p.get("delta") or {}).get("type")) for n, p in events] == [
        ("message_start", None, None), ("ping", None, None),
        ("content_block_start", 0, None),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, None), ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, None), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("message_delta", None, None), ("message_stop", None, None),
    ]
    start = events[0][1]["message"]
    assert start["stop_reason"] is None and start["content"] == [] and start["usage"]["input_tokens"] == 12
    assert events[2][1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert events[10][1]["content_block"] == {"type": "tool_use", "id": "toolu_abc", "name": "Read", "input": {}}
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2][1]["usage"] == {"input_tokens": 8, "cache_creation_input_tokens": 0,
                                      "cache_read_input_tokens": 4, "output_tokens": 9}


def test_stream_and_message_agree_through_the_sdk():
    events, message = run_pieces(THINK_TEXT_TOOL)
    snapshot = sdk_snapshot(events)
    parsed = Message.model_validate(message)
    streamed = snapshot.to_dict()
    streamed.pop("stop_details", None)  # set by message_delta only when the API has details
    assert streamed == parsed.to_dict()
    assert [b.type for b in parsed.content] == ["thinking", "text", "tool_use"]
    assert parsed.content[0].signature == "mashbox-local"
    assert parsed.content[0].thinking == "Let me think."
    assert parsed.content[2].input == {"path": "a.py"}
    assert parsed.stop_reason == "tool_use"
    assert parsed.usage.cache_read_input_tokens == 4 and parsed.usage.input_tokens == 8


@pytest.mark.parametrize("finish,seq,reason", [
    ("stop", None, "end_turn"), ("length", None, "max_tokens"), ("stop_sequence", "END", "stop_sequence"),
])
def test_stop_reasons(finish, seq, reason):
    events, message = run_pieces([Piece("text", "hello")], finish, seq)
    assert message["stop_reason"] == reason
    assert message["stop_sequence"] == seq
    assert events[-2][1]["delta"] == {"stop_reason": reason, "stop_sequence": seq}
    assert sdk_snapshot(events).stop_reason == reason


def test_empty_answer_and_bad_tool_arguments():
    events, message = run_pieces([])
    assert message["content"] == [] and [n for n, _ in events] == [
        "message_start", "ping", "message_delta", "message_stop"]
    # Arguments that do not parse still give the SDK a valid (empty) input.
    events, message = run_pieces([Piece("tool_start", index=0, id="toolu_x", name="Bash"),
                                  Piece("tool_args", '{"command": "l', index=0), Piece("tool_end", index=0)])
    assert message["content"][0]["input"] == {}
    assert sdk_snapshot(events).content[0].input == {}


def test_error_event_shape():
    name, payload = ma.error_event("boom", request_id="msg_1")
    assert name == "error" and payload["error"] == {"type": "api_error", "message": "boom"}


def test_whitespace_alone_opens_no_text_block():
    events, message = run_pieces([Piece("reasoning", "hm"), Piece("text", "\n"), Piece("text", "\n"),
                                  Piece("tool_start", index=0, id="toolu_1", name="Read"),
                                  Piece("tool_args", "{}", index=0), Piece("tool_end", index=0),
                                  Piece("text", "\n"), Piece("text", "Done.")])
    assert [b["type"] for b in message["content"]] == ["thinking", "tool_use", "text"]
    assert message["content"][2]["text"] == "\nDone."  # kept once real text follows
    assert sdk_snapshot(events).content[2].text == "\nDone."
