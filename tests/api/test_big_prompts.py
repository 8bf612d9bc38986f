"""Big prompts do not stall the server (issue 10 item 3), on a real socket.

The real app with the scripted engine, the real tokenizer and template, a 4096-token
context. While one client sends megabytes of prompt, another polls GET /health; every
poll must be answered promptly. Before, the event loop rendered and tokenized the
prompt itself: a 20 MB chat body held every connection for 30+ s on a busy 2-core
machine. Now a far too long prompt is refused before it is tokenized
(prompt.refuse_far_too_long), and a big body is prepared in the prompt threads
(pipeline.off_loop, in the ApiContext's PromptPool).
"""
from __future__ import annotations

import threading
import time

import httpx
import orjson
import pytest

from api_scripted_engine import server_fixtures, text_events

HEALTH_MAX_S = 2.0  # the slowest /health answer allowed meanwhile (was 30+ s, then 3 s while HF encode held the GIL); p50 is milliseconds


def script():
    return lambda req: text_events(req, ["ok"])


script, engine, app = server_fixtures(script, ctx=4096)


def while_polling_health(app, path: str, body: dict, senders: int = 1) -> tuple[httpx.Response, list[float]]:
    """POST `body` from `senders` threads at once; poll /health until every answer came;
    (the first answer, latencies)."""
    data = orjson.dumps(body)
    answers: list = []
    left = [senders]
    lock = threading.Lock()
    done = threading.Event()

    def send():
        try:
            answers.append(httpx.post(app.base_url + path, content=data, timeout=300,
                                      headers={"content-type": "application/json", "anthropic-version": "2023-06-01"}))
        finally:
            with lock:
                left[0] -= 1
                if not left[0]:
                    done.set()

    latencies = []
    with httpx.Client(timeout=300) as client:
        client.get(app.base_url + "/health")
        threads = [threading.Thread(target=send) for _ in range(senders)]
        for sender in threads:
            sender.start()
        while not done.wait(0.02):
            t = time.monotonic()
            assert client.get(app.base_url + "/health").status_code == 200
            latencies.append(time.monotonic() - t)
        for sender in threads:
            sender.join()
    assert len(answers) == senders
    return answers[0], latencies


def words(n_chars: int) -> str:
    return "hello world " * (n_chars // 12)


def test_a_20mb_chat_body_is_refused_early_and_health_stays_responsive(app, engine):
    before = len(engine.submitted)
    t = time.monotonic()
    r, latencies = while_polling_health(app, "/v1/chat/completions",
                                        {"messages": [{"role": "user", "content": words(20_000_000)}]})
    elapsed = time.monotonic() - t
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and "is at least" in err["message"] and "4096" in err["message"]
    assert len(engine.submitted) == before
    assert max(latencies, default=0.0) < HEALTH_MAX_S, latencies
    assert elapsed < 20, elapsed  # no tokenizing of 20 MB (that alone took 30 s here)


def test_two_20mb_messages_bodies_at_once_leave_health_responsive(app, engine):
    """Parsed in the parse processes (api/prompt_pool.py): orjson.loads of 20 MB alone held
    the GIL ~60 ms in a thread of the server; on the loop, every connection waited."""
    before = len(engine.submitted)
    r, latencies = while_polling_health(app, "/v1/messages", {
        "model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": words(20_000_000)}]}, senders=2)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "is at least" in err["message"]
    assert len(engine.submitted) == before
    assert max(latencies, default=0.0) < HEALTH_MAX_S, latencies


@pytest.mark.parametrize("path,body", [
    ("/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": words(5_000_000)}]}),
    # Under the early bound: rendered and tokenized (off the loop) to the exact count.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": words(1_200_000)}]}),
])
def test_a_big_prompt_is_prepared_off_the_loop(app, path, body):
    r, latencies = while_polling_health(app, path, body)
    if path.endswith("count_tokens"):
        assert r.status_code == 200, r.text
        assert r.json()["input_tokens"] > 4096
    else:
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "The prompt is at least" not in message and "too many for the context of 4096" in message
    assert latencies, "the big request was answered before /health could be asked"
    assert max(latencies) < HEALTH_MAX_S, latencies
