"""Completions end to end: the real server and model through the openai SDK, and every
400 / 404 path of /v1/completions."""
from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

PROMPT = "The three largest planets are"


def test_plain(openai_client, model_id):
    out = openai_client.completions.create(model=model_id, prompt=PROMPT, max_tokens=5)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.model == model_id
    assert out.choices[0].text and out.choices[0].index == 0
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.completion_tokens <= 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.system_fingerprint.startswith("seed-")


def test_stream_equals_plain(openai_client, model_id):
    plain = openai_client.completions.create(model=model_id, prompt=[PROMPT], max_tokens=5)
    chunks = list(openai_client.completions.create(model=model_id, prompt=PROMPT, max_tokens=5, stream=True))
    assert all(c.object == "text_completion" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == plain.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)


def test_stop_and_seed(openai_client, model_id):
    full = openai_client.completions.create(model=model_id, prompt=PROMPT, max_tokens=6).choices[0].text
    stop = full[4:6]
    out = openai_client.completions.create(model=model_id, prompt=PROMPT, max_tokens=6, stop=stop)
    assert out.choices[0].text == full[: full.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    kw = dict(model=model_id, prompt="Once upon a time", max_tokens=4, temperature=1.2, seed=99)
    a = openai_client.completions.create(**kw)  # cold, then served from the prefix cache
    b = openai_client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    assert a.system_fingerprint == b.system_fingerprint == "seed-99"


CASES = [
    ({"prompt": None}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, 2, 3]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"logprobs": 1}, "logprobs"),
    ({"n": 3}, "n"),
    ({"temperature": 9}, "temperature"),
    ({"top_p": -1}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": "many"}, "max_completion_tokens"),
    ({"stop": [""]}, "stop[0]"),
    ({"stream": 1}, "stream"),
]


@pytest.mark.parametrize("extra,param", CASES, ids=[p for _, p in CASES])
def test_bad_field_is_400_naming_it(base_url, extra, param):
    body = {"prompt": PROMPT, "max_tokens": 1, **extra}
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(base_url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_other_model_is_404(openai_client):
    with pytest.raises(openai.NotFoundError) as exc:
        openai_client.completions.create(model="davinci-002", prompt=PROMPT, max_tokens=1)
    assert exc.value.code == "model_not_found"


def test_prompt_longer_than_the_context(base_url):
    r = httpx.post(base_url + "/v1/completions", json={"prompt": "hello " * 5000}, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "prompt" and "4096" in err["message"]
