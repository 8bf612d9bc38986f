"""Scheduler, slots, prefix cache and request lifecycle, without torch or a model.

`drive` plays the runner: it marks the plan computed and feeds each sampling row a
token, so the tests walk real step sequences.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from mashbox.config import GenerationRequest, SamplingParams
from mashbox.engine.request import IllegalTransition, Request, State
from mashbox.engine.scheduler import Scheduler


def req(rid: str, prompt, max_tokens: int = 8, tenant: str = "t") -> Request:
    return Request(GenerationRequest(id=rid, tenant=tenant, prompt_ids=tuple(prompt),
                                     sampling=SamplingParams(), max_tokens=max_tokens))


def drive(s: Scheduler, token: int = 7):
    """One step: plan, 'run' it, append `token` to each sampling row; returns the plan."""
    plan = s.schedule()
    s.advance(plan)
    for row in plan.rows:
        if row.sample:
            s.append_token(row.request, token)
    return plan


def rows_by_id(plan):
    return {row.request.id: row for row in plan.rows}


def test_policy_and_client_modules_do_not_import_torch():
    code = (
        "import sys, mashbox.engine.scheduler, mashbox.engine.client, mashbox.engine.frames; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# -- lifecycle ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, bad",
    [
        ([], State.DECODING),  # waiting cannot decode without a slot
        ([State.PREFILLING], State.WAITING),
        ([State.PREFILLING, State.DECODING], State.PREFILLING),
        ([State.FINISHED], State.PREFILLING),
        ([State.PREFILLING, State.FINISHED], State.FINISHED),
    ],
)
def test_illegal_transitions_raise(path, bad):
    r = req("a", [1, 2, 3])
    for st in path:
        r.move(st)
    with pytest.raises(IllegalTransition):
        r.move(bad)


def test_legal_path():
    r = req("a", [1, 2, 3])
    for st in (State.PREFILLING, State.DECODING, State.FINISHED):
        r.move(st)
    assert r.finished


def test_add_rejects_empty_and_too_long_prompts():
    s = Scheduler(num_slots=2, ctx=32, prefill_chunk=16, prefix_block=4)
    with pytest.raises(ValueError, match="at least one"):
        s.add(req("a", []))
    with pytest.raises(ValueError, match="33 tokens"):
        s.add(req("b", range(33)))


# -- continuous batching -------------------------------------------------------------------


def test_new_request_joins_running_batch_next_step():
    s = Scheduler(num_slots=4, ctx=256, prefill_chunk=64, prefix_block=4)
    a = req("a", range(10, 20))
    s.add(a)
    p1 = drive(s)
    assert [r.request.id for r in p1.rows] == ["a"] and p1.rows[0].sample
    assert a.state is State.DECODING and p1.admitted == (a,)
    b = req("b", range(100, 130))
    s.add(b)
    p2 = drive(s)
    rows = rows_by_id(p2)
    assert rows["a"].token_ids == (7,) and rows["a"].start == 10  # decode: last sampled id
    assert rows["b"].token_ids == tuple(range(100, 130)) and rows["b"].start == 0
    assert a.state is State.DECODING and b.state is State.DECODING
    assert a.slot != b.slot


def test_chunked_prefill_within_token_budget():
    s = Scheduler(num_slots=4, ctx=256, prefill_chunk=16, prefix_block=4)
    a = req("a", range(3))
    s.add(a)
    drive(s)  # a decodes from now on
    b, c = req("b", range(100, 130)), req("c", range(200, 210))
    s.add(b)
    s.add(c)
    seen = []
    for _ in range(6):
        plan = drive(s)
        assert plan.num_tokens <= 16
        seen.append({r.request.id: len(r.token_ids) for r in plan.rows})
    # b gets what a's decode row leaves (15), then the rest; c only once b is done
    assert seen[0] == {"a": 1, "b": 15}
    assert seen[1] == {"a": 1, "b": 15}
    assert seen[2] == {"a": 1, "b": 1, "c": 10}
    assert b.state is State.DECODING and c.state is State.DECODING
    assert b.num_computed == len(b.token_ids) - 1


def test_sampling_row_only_when_prompt_completes():
    s = Scheduler(num_slots=1, ctx=256, prefill_chunk=8, prefix_block=4)
    a = req("a", range(20))
    s.add(a)
    samples = [drive(s).rows[0].sample for _ in range(3)]
    assert samples == [False, False, True]
    assert a.num_generated == 1 and a.num_computed == 20
    row = drive(s).rows[0]  # the sampled token goes in: a decode row
    assert row.decode and row.token_ids == (7,) and row.start == 20


def test_only_rows_of_generated_tokens_are_decode_rows():
    """Prompt chunks, a 1-token last chunk and a prompt's last token recomputed after a
    prefix hit are prompt rows (the decoder gives them SDPA's bits); a row feeding a
    sampled token is a decode row."""
    s = Scheduler(num_slots=1, ctx=256, prefill_chunk=9, prefix_block=4)
    a = req("a", range(10))
    s.add(a)
    kinds = [(r.token_ids, r.decode) for _ in range(4) for r in drive(s).rows]
    assert kinds == [(tuple(range(9)), False), ((9,), False), ((7,), True), ((7,), True)]
    s.finish(a, "length")
    b = req("b", range(10))
    s.add(b)
    row = drive(s).rows[0]
    assert b.num_cached == 9 and row.token_ids == (9,) and not row.decode


def test_waits_for_free_slot_then_takes_it():
    s = Scheduler(num_slots=2, ctx=64, prefill_chunk=32, prefix_block=4)
    a, b, c = req("a", [1, 2]), req("b", [3, 4]), req("c", [5, 6])
    for r in (a, b, c):
        s.add(r)
    drive(s)
    assert c.state is State.WAITING and list(s.waiting) == [c]
    s.finish(a, "stop")
    plan = drive(s)
    assert c in plan.admitted and c.slot == a.slot


# -- cancel -----------------------------------------------------------------------------


def test_cancel_queued_prefilling_and_decoding_requests_frees_slots():
    s = Scheduler(num_slots=2, ctx=256, prefill_chunk=8, prefix_block=4)
    dec, pre, queued = req("dec", [1, 2, 3]), req("pre", range(10, 60)), req("q", [9, 9])
    s.add(dec)
    drive(s)
    s.add(pre)
    s.add(queued)
    drive(s)
    assert dec.state is State.DECODING and pre.state is State.PREFILLING
    assert queued.state is State.WAITING and s.slots.num_used == 2

    assert s.cancel("q") is queued and queued.finish_reason == "cancelled"
    assert not s.waiting and queued.slot is None

    assert s.cancel("pre") is pre and pre.finished
    assert s.slots.is_free(pre.slot)
    assert s.cancel("dec") is dec and s.slots.is_free(dec.slot)
    assert s.slots.num_used == 0 and not s.has_work
    assert s.cancel("dec") is None  # idempotent: already finished

    # the freed slots are taken at the next step
    n = req("n", [4, 5, 6])
    s.add(n)
    assert drive(s).admitted == (n,)


def test_cancelled_prefill_keeps_its_computed_tokens_cached():
    s = Scheduler(num_slots=1, ctx=256, prefill_chunk=16, prefix_block=4)
    a = req("a", range(40))
    s.add(a)
    drive(s)
    drive(s)
    s.cancel("a")
    b = req("b", range(40))
    s.add(b)
    drive(s)
    assert b.num_cached == 32  # two chunks of 16 were computed before the cancel


# -- prefix reuse -------------------------------------------------------------------------


def finish_after(s: Scheduler, r: Request, steps: int) -> None:
    s.add(r)
    for _ in range(steps):
        drive(s, token=500 + r.num_generated)
    s.finish(r, "length")


def test_second_request_reuses_finished_conversation():
    s = Scheduler(num_slots=3, ctx=2048, prefill_chunk=2048, prefix_block=16)
    base = list(range(1000, 2000))  # a 1,000-token prefix
    a = req("a", base + [5, 6])
    finish_after(s, a, steps=4)  # prompt + 4 sampled ids; the last one has no K/V
    assert s.slots.kv_len[a.slot] == 1002 + 3
    lookups = s.prefix.lookups
    b = req("b", a.token_ids[:-1] + [42, 43, 44])
    s.add(b)
    plan = drive(s)
    assert b.slot == a.slot
    assert b.num_cached == 1005
    assert rows_by_id(plan)["b"].token_ids == (42, 43, 44)  # only the new tokens
    assert s.prefix.lookups == lookups + 1 and s.prefix.hit_tokens == 1005


def test_identical_prompt_recomputes_last_token():
    s = Scheduler(num_slots=1, ctx=256, prefill_chunk=256, prefix_block=4)
    a = req("a", range(50))
    finish_after(s, a, steps=2)
    b = req("b", range(50))
    s.add(b)
    plan = drive(s)
    assert b.num_cached == 49 and plan.rows[0].token_ids == (49,) and plan.rows[0].sample


def test_picks_slot_with_longest_prefix_and_extends_past_blocks():
    s = Scheduler(num_slots=3, ctx=512, prefill_chunk=512, prefix_block=8)
    short = req("short", list(range(20)) + [900] * 10)
    long_ = req("long", list(range(45)) + [901] * 10)
    finish_after(s, short, 1)
    finish_after(s, long_, 1)
    c = req("c", list(range(43)) + [7, 7, 7])
    s.add(c)
    drive(s)
    assert c.slot == long_.slot
    assert c.num_cached == 43  # 5 full blocks of 8, then 3 more token by token


def test_unmatched_prompt_takes_empty_slot_then_least_recently_used():
    s = Scheduler(num_slots=3, ctx=256, prefill_chunk=256, prefix_block=4)
    a = req("a", range(100, 120))
    b = req("b", range(200, 220))
    finish_after(s, a, 1)
    finish_after(s, b, 1)
    empty = ({0, 1, 2} - {a.slot, b.slot}).pop()
    c = req("c", range(300, 320))
    finish_after(s, c, 1)
    assert c.slot == empty and c.num_cached == 0
    d = req("d", range(400, 420))
    s.add(d)
    drive(s)
    assert d.slot == a.slot  # a was released first
    # b's conversation is still cached
    e = req("e", list(range(200, 220)) + [1])
    s.add(e)
    drive(s)
    assert e.slot == b.slot and e.num_cached == 20


def test_prefix_counters_count_every_admission():
    s = Scheduler(num_slots=1, ctx=128, prefill_chunk=128, prefix_block=4)
    finish_after(s, req("a", range(30)), 1)
    finish_after(s, req("b", range(60, 90)), 1)
    finish_after(s, req("c", range(60, 100)), 1)
    assert s.prefix.lookups == 3
    # b's 30 prompt tokens; its one sampled id never got K/V
    assert s.prefix.hits == 1 and s.prefix.hit_tokens == 30


def test_slot_tokens_hold_prompt_and_generated_ids():
    s = Scheduler(num_slots=1, ctx=64, prefill_chunk=64, prefix_block=4)
    a = req("a", [3, 4, 5])
    s.add(a)
    drive(s, token=11)
    drive(s, token=12)
    n = len(a.token_ids)
    assert list(s.slots.tokens[a.slot, :n]) == [3, 4, 5, 11, 12]
    assert s.slots.kv_len[a.slot] == 4
    assert np.array_equal(s.slots.tokens[a.slot, :n], np.asarray(a.token_ids))


def test_waiting_tenants_take_turns():
    s = Scheduler(num_slots=2, ctx=64, prefill_chunk=64, prefix_block=4)
    burst = [req(f"a{i}", [1, 2, i], tenant="alice") for i in range(5)]
    for r in burst:
        s.add(r)
    bob = req("b0", [3, 4], tenant="bob")
    s.add(bob)
    first = drive(s).admitted
    assert first == (burst[0], bob)  # bob holds no slot: he goes before alice's second
    s.finish(burst[0], "stop")
    assert drive(s).admitted == (burst[1],)  # then FIFO within alice
    s.finish(bob, "stop")
    s.add(req("b1", [5], tenant="bob"))
    assert [r.id for r in drive(s).admitted] == ["b1"]  # alice holds 1 slot, bob none


# -- prefix copies from running slots ------------------------------------------------------


def test_prefix_held_by_a_running_request_is_copied_to_a_free_slot():
    s = Scheduler(num_slots=3, ctx=256, prefill_chunk=256, prefix_block=8)
    shared = list(range(500, 540))  # a 40-token system prompt
    a = req("a", shared + [1, 2], max_tokens=50)
    s.add(a)
    drive(s)
    drive(s)  # a decodes; its slot holds the shared prompt
    b = req("b", shared + [7, 8, 9])
    s.add(b)
    plan = drive(s)
    assert b.slot != a.slot and b.num_cached == 40
    assert plan.copies == ((a.slot, b.slot, 40),)
    assert rows_by_id(plan)["b"].token_ids == (7, 8, 9) and rows_by_id(plan)["b"].start == 40
    assert list(s.slots.tokens[b.slot, :43]) == shared + [7, 8, 9]
    assert s.prefix.copies == 1 and s.prefix.hit_tokens == 40
    assert a.state is State.DECODING  # the source keeps running


def test_no_copy_when_a_free_slot_matches_as_well_or_the_gain_is_small():
    s = Scheduler(num_slots=3, ctx=256, prefill_chunk=256, prefix_block=8)
    shared = list(range(500, 540))
    done = req("done", shared + [1])
    s.add(done)
    drive(s)
    runner_ = req("run", shared + [2], max_tokens=50)
    s.add(runner_)
    drive(s)
    s.finish(done, "stop")  # its slot is free and holds the shared prompt
    c = req("c", shared + [3])
    s.add(c)
    plan = drive(s)
    assert c.slot == done.slot and c.num_cached == 40 and plan.copies == ()
    # 5 shared tokens are fewer than one block: not worth a copy
    s2 = Scheduler(num_slots=2, ctx=256, prefill_chunk=256, prefix_block=8)
    x = req("x", [1, 2, 3, 4, 5, 6, 7], max_tokens=50)
    s2.add(x)
    drive(s2)
    y = req("y", [1, 2, 3, 4, 5, 9, 9])
    s2.add(y)
    assert drive(s2).copies == () and y.num_cached == 0
