"""/v1/completions on the wire with a scripted engine: the exact stream, finish reasons,
a worker failure mid-stream, the max_tokens fields."""
from __future__ import annotations

import json

import httpx
import pytest

import harness
from api_scripted_engine import server_fixtures, text_events


class Script:
    def __init__(self):
        self.pieces, self.finish, self.error, self.stop_sequence = ["Jupiter", ",", " Saturn"], "length", None, None

    def __call__(self, req):
        return text_events(req, self.pieces, self.finish, self.stop_sequence, self.error)


script, engine, app = server_fixtures(Script, ctx=128)


@pytest.fixture(autouse=True)
def reset(script):
    script.__init__()


def frames_of(r) -> list[tuple[str, str]]:
    return harness.sse_frames(r.content)


def test_stream_exact(app):
    r = httpx.post(app.base_url + "/v1/completions", json={"prompt": "The planets", "stream": True, "seed": 5},
                   timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = frames_of(r)
    assert frames[-1] == ("", "[DONE]")
    objs = [json.loads(d) for _, d in frames[:-1]]
    cid = objs[0]["id"]
    assert cid.startswith("cmpl-")
    for o in objs:
        assert o.pop("id") == cid and isinstance(o.pop("created"), int)
    head = {"object": "text_completion", "model": "scripted", "system_fingerprint": "seed-5"}

    def choice(text, finish=None):
        return [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]

    assert objs == [{**head, "choices": choice("Jupiter")}, {**head, "choices": choice(",")},
                    {**head, "choices": choice(" Saturn")}, {**head, "choices": choice("", "length")}]


def test_plain_object(app, engine):
    r = httpx.post(app.base_url + "/v1/completions", json={"prompt": ["The planets"], "max_tokens": 500,
                                                           "max_completion_tokens": 3}, timeout=30)
    obj = r.json()
    assert obj["choices"] == [{"text": "Jupiter, Saturn", "index": 0, "logprobs": None, "finish_reason": "length"}]
    assert obj["usage"]["completion_tokens"] == 3
    assert engine.submitted[-1].max_tokens == 3  # max_completion_tokens wins


def test_stop_sequence_is_stop(app, script):
    script.finish, script.stop_sequence = "stop_sequence", "!"
    obj = httpx.post(app.base_url + "/v1/completions", json={"prompt": "x", "stop": "!"}, timeout=30).json()
    assert obj["choices"][0]["finish_reason"] == "stop"


def test_no_template_and_no_parsing(app, engine, script):
    script.pieces = ["<think>", "not reasoning", "</think>"]
    obj = httpx.post(app.base_url + "/v1/completions", json={"prompt": "<|im_start|>user"}, timeout=30).json()
    assert obj["choices"][0]["text"] == "<think>not reasoning</think>"
    # client text never becomes a control token
    from mashbox.text.tokenizer import load_tokenizer

    ids = engine.submitted[-1].prompt_ids
    assert load_tokenizer(app.engine_config.model_path).special_tokens["<|im_start|>"] not in ids


def test_error_mid_stream(app, script):
    script.finish, script.error = "error", "device lost"
    r = httpx.post(app.base_url + "/v1/completions", json={"prompt": "x", "stream": True}, timeout=30)
    frames = frames_of(r)
    first = json.loads(frames[0][1])
    assert frames[-2][0] == "error"
    assert json.loads(frames[-2][1])["error"]["request_id"] == first["id"]
    assert frames[-1] == ("", "[DONE]")
