"""Agents' first turns at their real sizes (issue 14's done criterion): a real `mashbox
run` on the default model at --ctx 32768 with YaRN (what the README tells agent users to
run), a real socket, and the Claude Code, Codex and Pi requests of
../shared/spec/clients.md built to the measured shapes and sizes (agent_requests.py).

What each test holds the server to is what the client's watchdog holds it to: the first
content (a text / thinking / tool delta, not a ping) within WATCHDOG_S = 300 s
(Claude Code drops a stream with no content block by then, and the others time out
too), and a streamed turn that reaches its terminal event in the client's event order.

Decode length: the clients ask for 32000 (Claude Code), the rest of the context (Codex)
or 16384 (Pi) tokens, and whether the 135M model ends its turn by itself within that is
model quality, not protocol (README, Coding agents; benchmarks/agent_turns.py measures
it). So the long requests go out exactly as the client sends them and are read until
the first content, then hung up, as a client that gave up would; the turn is then sent
again with its output limit capped at TURN_TOKENS (Claude Code resends after a dropped
stream, with a new billing header), and that resend must find the first try's K/V in the
prefix cache (issue 14 item 3) and complete. Pi's small prompts are sent once, capped.
"""
from __future__ import annotations

import os

import httpx
import pytest

import agent_requests as reqs
from agent_stream import read_turn

WATCHDOG_S = 300.0
TURN_TOKENS = 32
CLIENT_TIMEOUT_S = 600.0  # well past the watchdog: a slow answer fails the assertion, not the socket
AGENT_ARGS = ("--ctx", "32768", "--rope-scaling", "yarn", "--slots", "1", "--alias", "mashbox-model",
              "--threads", "2")  # the client only waits: the worker gets both of CI's cores


@pytest.fixture(scope="module")
def agent_url(start_mashbox_module) -> str:
    return start_mashbox_module(*AGENT_ARGS).base_url


def cache_hits(base_url: str) -> float:
    """Prompt tokens the prefix cache served so far (/metrics). A turn's own usage can say
    0 cached: message_start may go out before the engine reports the hit (the 1 s start
    wait), and message_delta repeats it."""
    text = httpx.get(base_url + "/metrics", timeout=30).text
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("mashbox:prefix_cache_hits_total")))


def messages_prompt(usage: dict) -> int:
    return usage["input_tokens"] + usage["cache_read_input_tokens"]


def responses_prompt(usage: dict) -> int:
    return usage["input_tokens"]



def assert_messages_order(events: list) -> None:
    assert events[0] == "message_start" and events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    body = [e for e in events[1:-2] if e != "ping"]
    assert body[0] == "content_block_start" and body.count("content_block_start") == body.count("content_block_stop")


def assert_responses_order(events: list) -> None:
    assert events[:2] == ["response.created", "response.in_progress"]
    assert events[-1] in ("response.completed", "response.incomplete")
    assert events.count("response.output_item.added") == events.count("response.output_item.done") >= 1
    assert "error" not in events and "response.failed" not in events


def test_bodies_have_the_measured_shape():
    """What issue 14 measured of Claude Code's first request, and the other clients'
    fields from clients.md; the bytes are the same on every build (fixed seeds)."""
    cc = reqs.claude_code_body()
    size = reqs.sizes(cc)
    assert len(cc["tools"]) == 24 and 63_000 <= size["tools"] <= 66_000
    assert len(cc["system"]) == 2 and 5_500 <= size["system"] <= 6_500
    assert cc["system"][0]["text"].startswith("x-anthropic-billing-header:")
    assert len(cc["messages"]) == 2 and 6_300 <= size["messages"] <= 7_100
    assert 74_000 <= size["total"] <= 80_000 and cc["max_tokens"] == 32_000
    assert all("type" not in t and t["input_schema"]["additionalProperties"] is False for t in cc["tools"])
    assert reqs.compact(cc) == reqs.compact(reqs.claude_code_body())
    codex = reqs.codex_body()
    assert {t["type"] for t in codex["tools"]} == {"function", "namespace", "web_search", "custom"}
    assert "max_output_tokens" not in codex and codex["include"] == ["reasoning.encrypted_content"]
    assert reqs.pi_chat_body()["stream_options"] == {"include_usage": True}
    assert reqs.pi_messages_body()["thinking"]["type"] == "enabled"


@pytest.mark.timeout(1200)  # the server's start, a 20k-token prefill and the resend
def test_claude_code_first_turn(agent_url):
    body = reqs.claude_code_body("t1")  # max_tokens 32000: clamped to the rest of the context
    first = read_turn(agent_url, "messages", body, reqs.CLAUDE_HEADERS, CLIENT_TIMEOUT_S,
                      stop_after_first_content=True)
    assert first.status == 200, first.error_body
    assert first.events[0] == "message_start" and first.first_content_s is not None, first.events
    print(f"claude code: first content after {first.first_content_s:.1f} s, load {os.getloadavg()}")
    assert first.first_content_s < WATCHDOG_S
    hits = cache_hits(agent_url)
    resend = read_turn(agent_url, "messages", reqs.claude_code_body("t2", max_tokens=TURN_TOKENS),
                       reqs.CLAUDE_HEADERS, CLIENT_TIMEOUT_S)
    assert resend.status == 200, resend.error_body
    assert resend.terminal == "message_stop", resend.events
    assert_messages_order(resend.events)
    assert resend.stop in ("end_turn", "max_tokens", "tool_use")
    n_prompt = messages_prompt(resend.usage)
    assert 19_500 <= n_prompt <= 21_500  # the measured 20.1-20.2k
    served = cache_hits(agent_url) - hits
    print(f"claude code: resend of {n_prompt} tokens, {served:.0f} from the cache, done in {resend.done_s:.1f} s")
    assert served >= n_prompt - 32, (served, n_prompt)  # all but the last partial block: the first try's K/V
    assert resend.done_s < WATCHDOG_S


@pytest.mark.timeout(900)
def test_codex_first_turn(agent_url):
    body = reqs.codex_body()  # no max_output_tokens: the rest of the context
    first = read_turn(agent_url, "responses", body, reqs.CODEX_HEADERS, CLIENT_TIMEOUT_S,
                      stop_after_first_content=True)
    assert first.status == 200, first.error_body
    assert first.events[0] == "response.created" and first.first_content_s is not None, first.events
    print(f"codex: first content after {first.first_content_s:.1f} s, load {os.getloadavg()}")
    assert first.first_content_s < WATCHDOG_S
    body["max_output_tokens"] = TURN_TOKENS
    hits = cache_hits(agent_url)
    again = read_turn(agent_url, "responses", body, reqs.CODEX_HEADERS, CLIENT_TIMEOUT_S)
    assert again.status == 200, again.error_body
    assert_responses_order(again.events)
    assert again.stop in ("completed", "incomplete:max_output_tokens")
    n_prompt = responses_prompt(again.usage)
    assert 8_500 <= n_prompt <= 10_500  # the measured 9.4k
    served = cache_hits(agent_url) - hits
    print(f"codex: again with {n_prompt} tokens, {served:.0f} from the cache, done in {again.done_s:.1f} s")
    assert served >= n_prompt - 32, (served, n_prompt)
    assert again.done_s < WATCHDOG_S


PI = {
    "chat": (reqs.pi_chat_body, "max_completion_tokens"),
    "messages": (reqs.pi_messages_body, "max_tokens"),
    "responses": (reqs.pi_responses_body, "max_output_tokens"),
}


@pytest.mark.parametrize("wire", list(PI))
def test_pi_first_turn(agent_url, wire):
    build, limit = PI[wire]
    body = build()
    body[limit] = TURN_TOKENS  # Pi asks for 16384
    headers = reqs.PI_ANTHROPIC_HEADERS if wire == "messages" else reqs.PI_HEADERS
    turn = read_turn(agent_url, wire, body, headers, CLIENT_TIMEOUT_S)
    assert turn.status == 200, turn.error_body
    assert turn.first_content_s is not None and turn.first_content_s < WATCHDOG_S, turn.events
    if wire == "chat":
        assert turn.terminal == "[DONE]" and turn.stop in ("stop", "length", "tool_calls")
        n_prompt = turn.usage["prompt_tokens"]  # include_usage: the last chunk before [DONE]
    elif wire == "messages":
        assert_messages_order(turn.events)
        assert turn.stop in ("end_turn", "max_tokens", "tool_use")
        n_prompt = messages_prompt(turn.usage)
    else:
        assert_responses_order(turn.events)
        assert turn.stop in ("completed", "incomplete:max_output_tokens")
        n_prompt = responses_prompt(turn.usage)
    print(f"pi {wire}: {n_prompt} tokens, first content after {turn.first_content_s:.1f} s, load {os.getloadavg()}")
    assert 800 <= n_prompt <= 2_500
