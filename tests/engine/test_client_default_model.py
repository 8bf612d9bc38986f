"""The engine with the real default model (SmolLM2-135M-Instruct Q4_1), through EngineClient."""
from __future__ import annotations

import asyncio
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from engine_harness import chat, collect, first_event, req, run_default  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tok(default_model_path):
    from mashbox.text.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path)


def test_concurrent_requests_eos_and_seeds(default_model_path, tok):
    question = chat(tok, "What is the capital of France? Answer in one short sentence.")
    others = [chat(tok, "Write a haiku about autumn."),
              chat(tok, "List five prime numbers, separated by commas. " * 3),
              chat(tok, "Hi")]
    seeded = dict(temperature=0.8, top_k=40, seed=4242)

    async def main(client):
        greedy_alone = await collect(client.submit(req("g", question, 64)))
        seeded_alone = [await collect(client.submit(req(f"s{i}", question, 32, **seeded))) for i in range(2)]
        hs = [client.submit(req("g2", question, 64)),
              *(client.submit(req(f"o{i}", p, 24 + 16 * i, **seeded)) for i, p in enumerate(others))]
        crowd = await asyncio.gather(*(collect(h) for h in hs))
        hs = [client.submit(req("s2", question, 32, **seeded)),
              *(client.submit(req(f"p{i}", p, 20 + 10 * i)) for i, p in enumerate(others))]
        crowd2 = await asyncio.gather(*(collect(h) for h in hs))
        return greedy_alone, seeded_alone, crowd, crowd2, client.stats()

    greedy_alone, seeded_alone, crowd, crowd2, stats = run_default(main, default_model_path)
    ids, text, final, _ = greedy_alone
    assert final.finish_reason == "stop", (text, final)  # <|im_end|> ends the turn
    assert "Paris" in text and "<|im_end|>" not in text
    assert ids[-1] in tok.eos_ids
    assert seeded_alone[0][0] == seeded_alone[1][0]  # a seed alone repeats exactly
    for r in crowd + crowd2:  # every request of the mixed batches completes
        assert r[2].finish_reason in ("stop", "length") and r[0]
    assert stats.requests_finished["stop"] + stats.requests_finished.get("length", 0) == 11
    # The decoder is batch invariant: alone and beside 3 others give the same tokens.
    assert crowd[0][0] == ids
    assert crowd2[0][0] == seeded_alone[0][0]


def test_prefix_reuse_of_a_1000_token_prefix(default_model_path, tok):
    text = ("The lighthouse keeper climbed the stairs every evening, counting the steps, "
            "watching the sea change colour as the sun went down over the harbour. ") * 40
    prefix = tok.encode(text)[:1000]
    assert len(prefix) == 1000
    first = prefix + tok.encode(" Question: who climbed the stairs?")
    second = prefix + tok.encode(" Summary in one line:")
    assert first[1000] != second[1000]

    async def main(client):
        a = await collect(client.submit(req("a", first, 8)))
        b = await collect(client.submit(req("b", second, 8)))
        return a, b, client.stats()

    a, b, stats = run_default(main, default_model_path, slots=2, prefill_chunk=512)
    assert a[2].timings.prompt_n == len(first) and a[2].timings.cache_n == 0
    assert b[2].timings.cache_n == 1000
    assert b[2].timings.prompt_n == len(second) - 1000  # only the new tokens
    assert stats.prefix_cache_lookups == 2 and stats.prefix_cache_hit_tokens == 1000


def test_a_retry_after_a_cancelled_prefill_resumes_where_it_stopped(default_model_path, tok):
    """K/V that a request computed before its client went away mid-prefill stays in its
    slot, so the client's identical retry (a new request id) prefills only the rest.
    Request b decodes beside a's prefill: each of b's tokens after a arrived is a step
    that also prefilled a chunk of a, so three of them mean at least two chunks ran."""
    text = ("The lighthouse keeper climbed the stairs every evening, counting the steps, "
            "watching the sea change colour as the sun went down over the harbour. ") * 150
    long = tok.encode(text)[:1800]  # ctx 2048
    assert len(long) == 1800

    async def main(client):
        b = client.submit(req("b", chat(tok, "Count to one hundred."), 200, ignore_eos=True))
        await first_event(b, want_tokens=True)
        a = client.submit(req("a", long, 4))
        seen = 0
        async for ev in b:
            seen += len(ev.token_ids)
            if seen >= 3:
                break
        a.cancel()
        cancelled = await collect(a)
        retry = await collect(client.submit(req("a2", long, 4)))
        b.cancel()
        await collect(b)
        cold = await collect(client.submit(req("a3", long[:-1] + [long[0]], 4)))  # a miss at the end
        return cancelled, retry, cold

    cancelled, retry, cold = run_default(main, default_model_path, slots=3, prefill_chunk=256)
    assert cancelled.final.finish_reason == "cancelled" and cancelled.ids == []
    t = retry.final.timings
    assert t.cache_n >= 256, t  # at least one chunk of the cancelled prefill was kept...
    assert t.cache_n < len(long) and t.prompt_n == len(long) - t.cache_n  # ...and only the rest ran
    assert retry.final.finish_reason == "length" and len(retry.ids) == 4
    assert cold.final.timings.cache_n >= t.cache_n  # the kept K/V serves a later prefix too
