"""Constrained decoding in the engine (a real worker process, the tiny random Llama).

Random weights write garbage, which is the point: whatever the model prefers, every
constrained output must be valid for its grammar, and must end (finish "stop") the
step its value is complete. Batch invariance: a row's tokens are the same alone or
beside rows with other grammars (or none), and unconstrained rows are untouched.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys

import jsonschema

from mashbox.config import Constraint, GenerationRequest, SamplingParams

sys.path.insert(0, os.path.dirname(__file__))
from engine_harness import collect, req, run_client, tiny_config  # noqa: E402

SCHEMAS = [
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "ok": {"type": "boolean"}}, "required": ["n", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["color", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["code"], "additionalProperties": False},
]


def constrained(rid: str, ids, schema: dict, seed: int, max_tokens: int = 160) -> GenerationRequest:
    return GenerationRequest(id=rid, tenant="t", prompt_ids=tuple(ids), max_tokens=max_tokens,
                             sampling=SamplingParams(temperature=1.0, seed=seed),
                             constraint=Constraint("json_schema", json.dumps(schema)))


def test_constrained_rows_validate_end_when_complete_and_are_batch_invariant(tiny, tiny_tok):
    """One worker: each request alone, then all together (other grammars and a free row
    beside each), then a grammar that does not compile beside a Lark one."""
    prompt = tiny_tok.encode("hello there")

    def free(rid):
        return req(rid, prompt, 24, ignore_eos=True, temperature=1.0, seed=7)

    async def main(client):
        solo = {}
        for i, schema in enumerate(SCHEMAS):
            solo[i] = await collect(client.submit(constrained(f"c{i}", prompt, schema, seed=i)))
        solo["free"] = await collect(client.submit(free("free")))
        hs = {i: client.submit(constrained(f"t{i}", prompt, schema, seed=i)) for i, schema in enumerate(SCHEMAS)}
        hs["free"] = client.submit(free("tfree"))
        crowd = dict(zip(hs, await asyncio.gather(*(collect(h) for h in hs.values()))))
        bad = GenerationRequest(id="bad", tenant="t", prompt_ids=tuple(prompt), max_tokens=8,
                                sampling=SamplingParams(),
                                constraint=Constraint("json_schema", json.dumps({"$ref": "#/nowhere"})))
        lark = GenerationRequest(id="lark", tenant="t", prompt_ids=tuple(prompt), max_tokens=40,
                                 sampling=SamplingParams(temperature=1.0, seed=3),
                                 constraint=Constraint("lark", 'start: ("yes" | "no") "!"'))
        got_bad, got_lark = await asyncio.gather(collect(client.submit(bad)), collect(client.submit(lark)))
        return solo, crowd, got_bad, got_lark

    solo, crowd, got_bad, got_lark = run_client(main, tiny_config(tiny))
    for i, schema in enumerate(SCHEMAS):
        got = solo[i]
        assert got.final.finish_reason == "stop", (i, got.text)
        jsonschema.validate(json.loads(got.text), schema)
        assert crowd[i].ids == got.ids, i
    assert solo["free"].final.finish_reason == "length"
    assert crowd["free"].ids == solo["free"].ids
    # a grammar that does not compile fails its request only
    assert got_bad.final.finish_reason == "error" and "nowhere" in got_bad.final.error
    assert got_lark.text in ("yes!", "no!") and got_lark.final.finish_reason == "stop"


def test_a_new_grammar_compiles_off_the_step_while_other_rows_decode(tiny, tiny_tok):
    """In process: the grammar thread is held (an event) so the compile cannot have
    finished; the free row keeps getting a token every step, the constrained one waits
    unscheduled; once released, it decodes under its grammar. A cancel while compiling
    ends it at once."""
    import threading

    from mashbox.engine.worker import Engine

    engine = Engine(tiny_config(tiny))
    gate = threading.Event()
    engine.constraints._grammar_thread.submit(gate.wait)  # the compile queues behind it
    prompt = tiny_tok.encode("hello there")
    engine.submit(req("free", prompt, 30, ignore_eos=True))
    engine.submit(constrained("json", prompt, SCHEMAS[0], seed=1))
    engine.submit(constrained("gone", prompt, SCHEMAS[1], seed=2))
    got: dict[str, list] = {"free": [], "json": [], "gone": []}
    for _ in range(6):
        for ev in engine.step():
            got[ev.id].append(ev)
    assert engine.constraints.compiling and engine.scheduler.get("json") is None
    assert sum(len(e.token_ids) for e in got["free"]) >= 5 and not got["json"]
    engine.cancel("gone")
    (ev,) = [e for e in engine.step() if e.id == "gone"]
    assert ev.finish_reason == "cancelled"
    gate.set()
    while engine.has_work:
        for ev in engine.step():
            got[ev.id].append(ev)
    text = "".join(e.text for e in got["json"])
    assert got["json"][-1].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMAS[0])
    # the same grammar again is compiled already: the matcher is there at submit
    assert engine.constraints.add("again", Constraint("json_schema", json.dumps(SCHEMAS[0])))


def test_rows_checked_after_sampling_draw_what_masked_rows_draw(tiny, tiny_tok):
    """In process, one batch: each schema greedy twice, once sampled unmasked and checked
    after (no logprobs) and once masked first (logprobs asked: constraints.checks_after
    says no). Random weights prefer refused tokens, so the redraw path runs all the time;
    the two rows must still pick the same ids, valid and complete."""
    from mashbox.engine.constraints import checks_after
    from mashbox.engine.worker import Engine

    assert checks_after(SamplingParams(), None) and checks_after(SamplingParams(temperature=0.7), None)
    assert not checks_after(SamplingParams(), 0)
    assert not checks_after(SamplingParams(temperature=0.7, top_p=0.9), None)
    assert not checks_after(SamplingParams(repetition_penalty=1.1), None)
    engine = Engine(tiny_config(tiny))
    prompt = tiny_tok.encode("hello there")
    for i, schema in enumerate(SCHEMAS):
        for rid, logprobs in ((f"after{i}", None), (f"first{i}", 0)):
            engine.submit(GenerationRequest(id=rid, tenant="t", prompt_ids=tuple(prompt), max_tokens=160,
                                            sampling=SamplingParams(), logprobs=logprobs,
                                            constraint=Constraint("json_schema", json.dumps(schema))))
    got: dict[str, list] = {}
    while engine.has_work:
        for ev in engine.step():
            got.setdefault(ev.id, []).append(ev)
    for i, schema in enumerate(SCHEMAS):
        after, first = got[f"after{i}"], got[f"first{i}"]
        assert [t for e in after for t in e.token_ids] == [t for e in first for t in e.token_ids], i
        text = "".join(e.text for e in after)
        assert after[-1].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
    table = engine.constraints
    assert table.refused > 0 and table.checked > table.refused
