"""A grammar the server has not checked before is compiled on the grammar thread, never
on the event loop: while a request's check is held (the thread is made to wait on an
event), /health and another stream still answer; once released, the request is served,
and a schema that does not compile is still a 400 naming its field. The real app on a
real socket (scripted engine: only the server's loop is under test here; the worker's
compile off the step is tests/engine/test_constraints.py's)."""
from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import httpx

from api_scripted_engine import server_fixtures, text_events
from mashbox.api import prompt

WAIT_S = 60


class Script:
    def __call__(self, req):
        return text_events(req, ['{"n": ', '1}'])


script, engine, app = server_fixtures(Script, ctx=512)


def _schema_body(schema: dict, stream: bool = False) -> dict:
    return {"model": "scripted", "messages": [{"role": "user", "content": "a number"}], "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}


def test_health_and_other_streams_answer_while_a_new_grammar_compiles(app, engine):
    url = app.base_url
    gate = threading.Event()
    held = prompt._grammar_thread().submit(gate.wait, WAIT_S)  # checks queue behind it
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 7,
                                                      "description": "off-loop test"}},
              "required": ["n"]}
    bad = {"type": "object", "properties": {"n": {"$ref": "#/nowhere"}}}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        try:
            waiting = pool.submit(httpx.post, url + "/v1/chat/completions", json=_schema_body(schema), timeout=WAIT_S)
            failing = pool.submit(httpx.post, url + "/v1/chat/completions", json=_schema_body(bad), timeout=WAIT_S)
            queued = prompt._grammar_thread()._work_queue  # both checks reached the grammar thread
            deadline = time.monotonic() + WAIT_S
            while queued.qsize() < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert queued.qsize() == 2
            # the loop is free: /health and a free stream answer while both checks wait
            assert httpx.get(url + "/health", timeout=WAIT_S).status_code == 200
            free = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "stream": True}
            with httpx.stream("POST", url + "/v1/chat/completions", json=free, timeout=WAIT_S) as r:
                assert r.status_code == 200 and "[DONE]" in r.read().decode()
            assert not waiting.done() and not failing.done() and not held.done()
        finally:
            gate.set()
        ok, no = waiting.result(WAIT_S), failing.result(WAIT_S)
    assert ok.status_code == 200, ok.text
    assert json.loads(ok.json()["choices"][0]["message"]["content"]) == {"n": 1}
    assert any(r.constraint is not None and "off-loop test" in r.constraint.grammar for r in engine.submitted)
    assert no.status_code == 400 and no.json()["error"]["param"] == "response_format.json_schema.schema", no.text
