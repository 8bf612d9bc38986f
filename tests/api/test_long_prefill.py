"""Long prefills on the real server: what a client queued behind one hears, and how several
at once share the machine (issue 14, item 2).

- A streamed request queued behind a real prefill of a few thousand tokens (--slots 1)
  hears from the server at once on every route: the response head within 1 s;
  Messages' message_start and ping within START_WAIT_S (+ 1 s), then a ping at least
  every PING_S while it waits; Responses' response.created and response.in_progress and
  Chat's role chunk within 1 s; Completions has nothing to say before its first token
  but its head. All of it before the long prefill's first token, which the test checks,
  so the queued requests did arrive while it ran.
- Several long prefills at once (--slots 4) beside a request that decodes: the decoding
  request gets a token at every step of theirs (the scheduler gives decode rows their
  row before prompt chunks), the prefills answer in the order they arrived (a prefill
  is never overtaken by a later one: none starves) and every one is answered.
Assertions count events and order them, never against a clock that a busy machine
stretches, except the head-and-first-frames bounds that are the point of the test (a
reply the server loop writes without the worker).
"""
from __future__ import annotations

import threading
import time
import uuid

import httpx
import orjson

from mashbox.api import message_answer, pipeline

LONG_WORDS = 1400  # ~2.8k prompt tokens: several prefill chunks, seconds of work even on a quiet CPU
JOIN_S = 240.0  # the longest one request thread may take on a busy 2-core machine


def _long_text(words: int) -> str:
    # a fresh nonce first: no prefix cache serves any of it
    return f"[{uuid.uuid4().hex}] " + " ".join(f"item {i} of the list," for i in range(words // 4))


class _Stream(threading.Thread):
    """One streamed POST read line by line; every line stamped with time.monotonic()."""

    def __init__(self, base_url: str, path: str, body: dict, started: threading.Event | None = None,
                 first: str | None = None):
        super().__init__(daemon=True)
        self.url, self.body = base_url + path, body
        self.first, self.started = first, started  # set `started` when a line containing `first` arrives
        self.sent = self.head = 0.0
        self.status = 0
        self.lines: list[tuple[float, str]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.sent = time.monotonic()
            with httpx.stream("POST", self.url, json=self.body, timeout=JOIN_S) as r:
                self.head, self.status = time.monotonic(), r.status_code
                for line in r.iter_lines():
                    self.lines.append((time.monotonic(), line))
                    if self.started is not None and self.first and self.first in line:
                        self.started.set()
        except BaseException as exc:  # reported by the test thread
            self.error = exc
        finally:
            if self.started is not None:
                self.started.set()

    def at(self, needle: str) -> float:
        """When the first line containing `needle` arrived (inf: never)."""
        return next((t for t, line in self.lines if needle in line), float("inf"))

    def events(self) -> list[tuple[float, str]]:
        return [(t, line[len("event: "):]) for t, line in self.lines if line.startswith("event: ")]

    def finish(self) -> None:
        self.join(JOIN_S)
        assert not self.is_alive(), f"{self.url} did not end within {JOIN_S} s"
        assert self.error is None, self.error
        assert self.status == 200, (self.status, self.lines[:3])


def _count_tokens(base_url: str, text: str) -> int:
    r = httpx.post(base_url + "/v1/messages/count_tokens",
                   json={"model": "x", "messages": [{"role": "user", "content": text}]}, timeout=60)
    return orjson.loads(r.content)["input_tokens"]


def test_a_request_queued_behind_a_long_prefill_hears_from_the_server_at_once(start_mashbox):
    server = start_mashbox("--slots", "1", "--ctx", "4096")
    base = server.base_url
    text = _long_text(LONG_WORDS)
    assert _count_tokens(base, text) >= 2000  # the premise: a prefill of several chunks
    started = threading.Event()
    long_job = _Stream(base, "/v1/messages", {"model": "x", "max_tokens": 2, "stream": True,
                                              "messages": [{"role": "user", "content": text}]},
                       started, first="message_start")
    long_job.start()
    assert started.wait(JOIN_S) and long_job.error is None, long_job.error
    hi = [{"role": "user", "content": "Say hi."}]
    queued = {
        "messages": _Stream(base, "/v1/messages", {"model": "x", "max_tokens": 2, "stream": True, "messages": hi}),
        "responses": _Stream(base, "/v1/responses", {"model": server.model_id, "max_output_tokens": 2,
                                                    "stream": True, "input": "Say hi."}),
        "chat": _Stream(base, "/v1/chat/completions", {"model": server.model_id, "max_tokens": 2,
                                                      "stream": True, "messages": hi}),
        "completions": _Stream(base, "/v1/completions", {"model": server.model_id, "max_tokens": 2,
                                                        "stream": True, "prompt": "Hi"}),
    }
    for s in queued.values():
        s.start()
    long_job.finish()
    for s in queued.values():
        s.finish()
    # the long prefill was still running when each queued request was answered
    prefilled = long_job.at("content_block_delta")
    assert prefilled < float("inf"), long_job.lines[-5:]
    for name, s in queued.items():
        assert s.head - s.sent < 1.0, f"{name}: the head took {s.head - s.sent:.2f} s"
        assert s.head < prefilled, f"{name}: the head came after the long prefill"
    m = queued["messages"]
    names = [name for _, name in m.events()]
    assert names[:2] == ["message_start", "ping"], names[:4]
    wait = pipeline.START_WAIT_S + 1.0
    assert m.at("message_start") - m.sent < wait and m.at("message_start") < prefilled
    times = [m.sent] + [t for t, _ in m.events()]
    # waiting on: a ping at least every PING_S (the queue's length decides how many)
    assert max(b - a for a, b in zip(times, times[1:])) < message_answer.PING_S + wait + 1.0
    r = queued["responses"]
    assert [name for _, name in r.events()][:2] == ["response.created", "response.in_progress"]
    assert r.at("response.in_progress") - r.sent < 1.0 and r.at("response.in_progress") < prefilled
    c = queued["chat"]
    assert c.at('"role":"assistant"') - c.sent < 1.0 and c.at('"role":"assistant"') < prefilled
    assert queued["completions"].at("[DONE]") > prefilled  # its tokens came after the prefill


def test_long_prefills_at_once_take_turns_and_keep_a_decoding_request_going(start_mashbox):
    server = start_mashbox("--slots", "4", "--ctx", "2048")
    base = server.base_url
    texts = [_long_text(700) for _ in range(3)]
    assert min(_count_tokens(base, t) for t in texts) > 1000  # the premise: 2 or more chunks each
    # the decoding request: counting goes on past the prefills (~10 steps)
    counting = _Stream(base, "/v1/completions", {"model": server.model_id, "max_tokens": 100, "stream": True,
                                                 "prompt": "1, 2, 3, 4, 5, 6, 7, 8,"},
                       threading.Event(), first="data: {")
    counting.start()
    assert counting.started.wait(JOIN_S) and counting.error is None, counting.error
    prefills = []
    for text in texts:  # in a known order: each one's head before the next is sent
        s = _Stream(base, "/v1/chat/completions", {
            "model": server.model_id, "max_tokens": 1, "stream": True,
            "messages": [{"role": "user", "content": text}]}, threading.Event(), first="assistant")
        s.start()
        assert s.started.wait(JOIN_S) and s.error is None, s.error
        prefills.append(s)
    for s in prefills:
        s.finish()
    counting.finish()
    firsts = [s.at('"finish_reason":"') for s in prefills]  # max_tokens 1: the answer is its one token
    assert all(t < float("inf") for t in firsts), [s.lines[-3:] for s in prefills]
    assert firsts == sorted(firsts), "a later prefill was answered before an earlier one"
    # over 1k prompt tokens each: 6 or more steps of 512 between the first prefill's
    # arrival and the last one's answer, each with a decode row for the counting request
    tokens = [t for t, line in counting.lines if line.startswith("data: {")]
    during = [t for t in tokens if prefills[0].sent <= t <= firsts[-1]]
    assert len(during) >= 4, f"{len(during)} tokens decoded while 3 long prefills ran"
