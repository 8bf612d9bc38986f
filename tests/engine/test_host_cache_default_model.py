"""The host memory prompt cache (--cache-ram) with the real default model, through
EngineClient: a conversation pushed out of its slot comes back from host memory, a shared
prefix is stored once, the cap holds, and identical prompts sent together prefill once."""
from __future__ import annotations

import asyncio
import logging
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from engine_harness import collect, req, run_default  # noqa: E402

pytestmark = pytest.mark.slow
log = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def tok(default_model_path):
    from mashbox.text.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path)


def text(tag: str, n: int) -> str:
    """n sentences that differ from any other tag's from the first word on."""
    return " ".join(f"{tag} log entry {i}: the {tag} service answered request {i * 7 + 3} "
                    f"in {i % 13 + 2} ms." for i in range(n))


def test_an_evicted_conversation_returns_from_host_memory(default_model_path, tok):
    system = tok.encode(text("System", 40))[:512]  # 32 blocks of 16
    b = system + tok.encode(" Bravo: what failed?")
    c = system + tok.encode(" Charlie: what was slow?")
    a = tok.encode(text("Alpha", 100))[:1000]
    d = tok.encode(text("Delta", 20))
    e = tok.encode(text("Echo", 20))
    f = tok.encode(text("Kilo", 20))
    g = tok.encode(text("Lima", 20))
    a_turn = a + tok.encode(" And the slowest one?")

    async def main(client):
        out = {}
        for name, prompt in (("b", b), ("c", c)):
            out[name] = await collect(client.submit(req(name, prompt, 4, ignore_eos=True)))
        out["after_bc"] = client.stats()
        # with 2 slots, d and e push a out; f and g push a2 out
        for name, prompt in (("a", a), ("d", d), ("e", e), ("a2", a), ("f", f), ("g", g), ("a3", a_turn)):
            out[name] = await collect(client.submit(req(name, prompt, 12, ignore_eos=True)))
        out["stats"] = client.stats()
        return out

    out = run_default(main, default_model_path, slots=2, cache_ram_mib=256)
    after_bc, stats = out["after_bc"], out["stats"]
    block = stats.host_cache_block_bytes
    # saved: b's prompt at its end, b's slot (prompt + 3 computed answer tokens) when c took
    # it, c's prompt at its end; the shared system prompt once
    assert after_bc.host_cache_bytes == block * ((len(b) + 3) // 16 + len(c) // 16 - len(system) // 16)
    assert after_bc.snapshot_bytes > 0
    cold, back, turn = out["a"][2].timings, out["a2"][2].timings, out["a3"][2].timings
    assert cold.cache_n == 0 and back.cache_n == len(a) - 1  # all but the last token restored
    assert turn.cache_n >= 0.9 * len(a_turn) and turn.cache_n >= len(a)  # the prompt-end snapshot
    assert out["a2"][0] == out["a"][0]  # restored and cold K/V give the same tokens
    assert stats.host_cache_hits == 2 and stats.host_cache_hit_tokens == back.cache_n + turn.cache_n
    assert stats.host_cache_cap_bytes == (256 << 20) // block * block
    ratio = back.prompt_ms / cold.prompt_ms
    log.warning("TTFT cold %.0f ms, from host memory %.1f ms (%.3f of cold), load %s",
                cold.prompt_ms, back.prompt_ms, ratio, os.getloadavg())
    assert ratio < 0.5, (cold, back)  # the goal is < 0.1 on a quiet machine; noise-proof bound here


def test_the_cap_holds_and_identical_prompts_prefill_once(default_model_path, tok):
    long = tok.encode(text("Foxtrot", 80))[:800]
    others = [tok.encode(text(tag, 12)) for tag in ("Golf", "Hotel", "India", "Juliet")]

    async def main(client):
        seen = []
        h1, h2 = client.submit(req("x1", long, 8)), client.submit(req("x2", long, 8))
        pair = await asyncio.gather(collect(h1), collect(h2))
        seen.append(client.stats())
        for i, p in enumerate(others):
            await collect(client.submit(req(f"o{i}", p, 8)))
            seen.append(client.stats())
        return pair, seen

    (x1, x2), seen = run_default(main, default_model_path, slots=2, cache_ram_mib=8)
    # the two prefilled the prompt once: one waited for the other's chunks and copied them
    prefilled = sorted((x1[2].timings.prompt_n, x2[2].timings.prompt_n))
    assert prefilled == [1, len(long)] and seen[0].prefill_dedupes == 1
    assert x1[0] == x2[0]
    for st in seen:
        cap = st.host_cache_cap_bytes
        assert 0 < cap <= 8 << 20
        assert st.host_cache_bytes + st.snapshot_bytes <= cap
    assert seen[-1].host_cache_evictions > 0
