"""Logprobs through a real worker process on the tiny random Llama, against
torch.log_softmax of transformers' own logits: per token the chosen id's logprob and the
top-N, one per token; a neighbour without logprobs gets none."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from engine_harness import collect, req, run_client, tiny_config  # noqa: E402
from tiny_model import _cached_model  # noqa: E402

TIMEOUT = 120


def _hf_logprobs(folder: str, prompt_ids, out_ids) -> torch.Tensor:
    """log_softmax of transformers' logits at each generated position: [n, vocab] float64."""
    model = _cached_model(folder)
    ids = list(prompt_ids) + list(out_ids)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()  # [len, vocab]
    return torch.log_softmax(logits[len(prompt_ids) - 1 : len(ids) - 1], dim=-1)


def test_logprobs_match_torch_log_softmax(tiny, tiny_tok):
    prompt = tiny_tok.encode("hello world, the logprobs")
    other = tiny_tok.encode("another row in the same batch")

    async def main(client):
        with_lp = dataclasses.replace(req("lp", prompt, max_tokens=6, ignore_eos=True), logprobs=5)
        sampled = dataclasses.replace(req("hot", prompt, max_tokens=6, ignore_eos=True, temperature=0.9, seed=3),
                                      logprobs=0)
        plain = req("plain", other, max_tokens=6, ignore_eos=True)
        handles = [client.submit(r) for r in (with_lp, sampled, plain)]
        return await asyncio.gather(*(collect(h) for h in handles))

    got_lp, got_hot, got_plain = run_client(main, tiny_config(tiny), timeout=TIMEOUT)
    assert all(not ev.logprobs for ev in got_plain.events)
    for got, top_n in ((got_lp, 5), (got_hot, 0)):
        lps = [lp for ev in got.events for lp in ev.logprobs]
        assert len(lps) == len(got.ids) == 6
        assert all(len(ev.logprobs) == len(ev.token_ids) for ev in got.events)
        want = _hf_logprobs(tiny, prompt, got.ids)
        for i, (tok, lp) in enumerate(zip(got.ids, lps)):
            assert abs(lp.logprob - want[i, tok].item()) < 1e-4  # before temperature, also at 0.9
            vals, idx = torch.topk(want[i], top_n)
            assert list(lp.top_ids) == idx.tolist()
            assert max((abs(a - b) for a, b in zip(lp.top_logprobs, vals.tolist())), default=0) < 1e-4
        if top_n:
            assert all(lp.top_ids[0] == tok for tok, lp in zip(got.ids, lps))  # greedy: the best
