"""One streamed agent turn read off the wire, the way the agent's stream watchdog sees it.

`read_turn(base_url, wire, body, headers)` POSTs a streamed request on one of the three
wire APIs and reads SSE frames until the stream's terminal event, noting when the first
frame came (the server heard the request), when the first content came (a text,
thinking or tool-argument delta: what Claude Code's watchdog waits for; pings and
message_start do not count), and when the turn ended. `stop_after_first_content`
hangs up there instead (the server cancels the rest), as a client that gives up would.

Per wire:
- "messages": `event: NAME` / `data: JSON` frames; content = content_block_delta;
  terminal = message_stop; stop_reason and usage from message_delta.
- "responses": the same framing; content = any `response.*.delta`; terminal =
  response.completed / response.incomplete / response.failed; usage and status from it.
- "chat": `data:` frames ending with `data: [DONE]`; content = a chunk whose delta has
  content, reasoning_content or tool_calls; finish_reason from the last choice; usage
  from the include_usage chunk.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx

PATHS = {"messages": "/v1/messages?beta=true", "responses": "/v1/responses", "chat": "/v1/chat/completions"}
RESPONSES_TERMINAL = ("response.completed", "response.incomplete", "response.failed")


@dataclass
class Turn:
    status: int = 0
    events: list = field(default_factory=list)  # event names in order ("chunk" per chat chunk)
    first_frame_s: Optional[float] = None
    first_content_s: Optional[float] = None
    done_s: Optional[float] = None
    terminal: Optional[str] = None  # message_stop | response.completed | ... | [DONE]
    stop: Optional[str] = None  # stop_reason / status (+ incomplete reason) / finish_reason
    usage: dict = field(default_factory=dict)
    text: str = ""  # text, thinking and tool-argument deltas, joined
    error_body: bytes = b""


def _messages_frame(turn: Turn, name: str, data: dict) -> bool:
    if name == "content_block_delta":
        d = data["delta"]
        turn.text += d.get("text") or d.get("thinking") or d.get("partial_json") or ""
        return True
    if name == "message_delta":
        turn.stop = data["delta"].get("stop_reason")
        turn.usage = data.get("usage", {})
    if name == "message_start":
        turn.usage = data["message"].get("usage", {})
    return False


def _responses_frame(turn: Turn, name: str, data: dict) -> bool:
    if name.endswith(".delta"):
        turn.text += data.get("delta") or ""
        return True
    if name in RESPONSES_TERMINAL:
        r = data["response"]
        turn.stop = r["status"] + (f":{r['incomplete_details']['reason']}" if r.get("incomplete_details") else "")
        turn.usage = r.get("usage") or {}
    return False


def _chat_frame(turn: Turn, data: dict) -> bool:
    if data.get("usage"):
        turn.usage = data["usage"]
    content = False
    for choice in data.get("choices", []):
        d = choice.get("delta", {})
        piece = d.get("content") or d.get("reasoning_content") or ""
        for call in d.get("tool_calls") or []:
            piece += call.get("function", {}).get("arguments") or ""
        if piece or d.get("tool_calls"):
            turn.text += piece
            content = True
        if choice.get("finish_reason"):
            turn.stop = choice["finish_reason"]
    return content


def read_turn(base_url: str, wire: str, body: dict, headers: dict, timeout: float = 600.0,
              stop_after_first_content: bool = False) -> Turn:
    turn = Turn()
    t0 = time.monotonic()
    with httpx.Client(timeout=httpx.Timeout(timeout)) as http:
        with http.stream("POST", base_url + PATHS[wire], json=body, headers=headers) as resp:
            turn.status = resp.status_code
            if resp.status_code != 200:
                turn.error_body = resp.read()
                return turn
            name = ""
            for line in resp.iter_lines():
                if line.startswith("event: "):
                    name = line[len("event: "):]
                    continue
                if not line.startswith("data: "):
                    continue
                now = time.monotonic() - t0
                if turn.first_frame_s is None:
                    turn.first_frame_s = now
                payload = line[len("data: "):]
                if wire == "chat":
                    if payload == "[DONE]":
                        turn.events.append("[DONE]")
                        turn.terminal, turn.done_s = "[DONE]", now
                        break
                    turn.events.append("chunk")
                    content = _chat_frame(turn, json.loads(payload))
                else:
                    turn.events.append(name)
                    data = json.loads(payload)
                    content = (_messages_frame if wire == "messages" else _responses_frame)(turn, name, data)
                    if name == "message_stop" or name in RESPONSES_TERMINAL or name == "error":
                        turn.terminal, turn.done_s = name, now
                        break
                if content and turn.first_content_s is None:
                    turn.first_content_s = now
                    if stop_after_first_content:
                        break
    return turn
