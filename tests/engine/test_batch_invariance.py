"""The same request gives the same tokens however the engine schedules it (default model).

Through the real EngineClient (worker process, scheduler, prefix cache, native sampler)
in the default dtype: one greedy and one seeded (temperature 0.8) request, 64 tokens
each (ignore_eos), are run
- cold and alone, their prompts prefilled whole;
- warm and alone: the same prompts again, served from the prefix cache (only the last
  prompt token recomputed, alone);
- in a second engine with an 8-token prefill budget, submitted after 3 other requests of
  different lengths: prefilled in chunks that share steps with the others' chunks, then
  decoded beside them (the seeded request, second in that engine, is served from the
  prefix cache there and decoded beside the others).
All must give identical token ids.
"""
from __future__ import annotations

import asyncio
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from engine_harness import chat, collect, req, run_default  # noqa: E402

pytestmark = pytest.mark.slow
TOKENS = 64
CHUNK = 8  # the crowded engine's prefill budget per step
GREEDY = dict(temperature=0.0)
SEEDED = dict(temperature=0.8, top_p=0.95, seed=1234)


def test_cold_warm_and_crowded_requests_give_identical_tokens(default_model_path):
    from mashbox.text.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path)
    question = chat(tok, "Name three planets.")
    others = [chat(tok, "Write a haiku about autumn."),
              chat(tok, "List five prime numbers, separated by commas. " * 6),
              chat(tok, "Hi")]
    assert len({len(p) for p in others}) == 3 and len(question) > 2 * CHUNK

    async def alone(client):
        out = {}
        for phase in ("cold", "warm"):
            for name, sampling in (("greedy", GREEDY), ("seeded", SEEDED)):
                out[phase, name] = await collect(client.submit(
                    req(f"{phase}-{name}", question, TOKENS, ignore_eos=True, **sampling)))
        return out

    async def crowded(client):
        results = {}
        for name, sampling in (("greedy", GREEDY), ("seeded", SEEDED)):
            hs = [client.submit(req(f"{name}-o{i}", p, 40 + 8 * i, ignore_eos=True, **SEEDED))
                  for i, p in enumerate(others)]
            hs.append(client.submit(req(f"crowd-{name}", question, TOKENS, ignore_eos=True, **sampling)))
            done = await asyncio.gather(*(collect(h) for h in hs))
            results[name] = done[-1]
        return results

    single = run_default(alone, default_model_path, ctx=1024)
    crowd = run_default(crowded, default_model_path, ctx=1024, prefill_chunk=CHUNK)
    for name in ("greedy", "seeded"):
        cold_ids, _, cold_final, _ = single["cold", name]
        warm_ids, _, warm_final, _ = single["warm", name]
        crowd_ids, _, crowd_final, _ = crowd[name]
        assert len(cold_ids) == TOKENS
        if name == "greedy":  # the first request of each engine; the seeded ones find the prompt cached
            assert cold_final.timings.cache_n == 0
            assert crowd_final.timings.cache_n == 0, "the crowded run prefills in chunks"
        assert warm_final.timings.cache_n > 0, "the warm run must be served from the prefix cache"
        assert warm_ids == cold_ids, f"{name}: warm (prefix cache) differs from cold"
        assert crowd_ids == cold_ids, f"{name}: chunked beside 3 others differs from alone"
