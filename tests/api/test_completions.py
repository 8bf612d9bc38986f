"""Completions end to end: the real server and model through the openai SDK (its 400 /
404 paths are at handler level, in test_validation.py)."""
from __future__ import annotations

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
