"""The host memory prompt cache's bookkeeping and the scheduler's use of it, without torch.

`drive` plays the runner (as in test_scheduler.py); a `Pool` plays the host pool's
copies on token ids instead of K/V, so the tests check that what a restore brings back
is what was saved at those positions.
"""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mashbox import native
from mashbox.config import GenerationRequest, SamplingParams
from mashbox.engine.host_cache import ROOT, HostCache
from mashbox.engine.request import Request, State
from mashbox.engine.scheduler import Scheduler

B = 16


def req(rid: str, prompt, max_tokens: int = 4, tenant: str = "t") -> Request:
    return Request(GenerationRequest(id=rid, tenant=tenant, prompt_ids=tuple(prompt),
                                     sampling=SamplingParams(), max_tokens=max_tokens))


def hashes(tokens) -> list:
    return native.block_hashes(np.asarray(tokens, dtype=np.int32), B).tolist()


def arr(tokens) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int32)


class Pool:
    """The runner's copies, on the token ids a slot holds: pool[block] = the ids whose
    K/V a save put there; a restore writes them back into the slot's ids."""

    def __init__(self, s: Scheduler) -> None:
        self.s = s
        self.kv = {}  # slot -> positions' "K/V" (the ids computed there)
        self.pool = {}

    def run(self, plan):
        for save in plan.saves:
            kv = self.kv[save.slot]
            for i, b in enumerate(save.blocks):
                p = save.start + i * B
                self.pool[b] = list(kv[p : p + B])
        for src, dst, n in plan.copies:
            self.kv[dst] = list(self.kv[src][:n])
        for dst, blocks, n in plan.restores:
            self.kv[dst] = [t for b in blocks for t in self.pool[b]][:n]
        for row in plan.rows:
            kv = self.kv.setdefault(row.slot, [])
            del kv[row.start :]
            kv.extend(row.token_ids)


def drive(s: Scheduler, pool: Pool, token: int = 7):
    plan = s.schedule()
    pool.run(plan)
    s.advance(plan)
    for row in plan.rows:
        if row.sample:
            s.append_token(row.request, token)
    return plan


def run_to_end(s: Scheduler, pool: Pool, r: Request, steps: int = 200):
    plans = []
    for _ in range(steps):
        plans.append(drive(s, pool))
        if r.num_generated >= r.req.max_tokens:
            s.finish(r, "length")
            return plans
    raise AssertionError(f"{r} did not end")


def check_invariants(h: HostCache) -> None:
    assert len(h.entries) + len(h.free) == h.num_blocks  # the cap: never more blocks than the pool
    assert len({e.index for e in h.entries.values()} | set(h.free)) == h.num_blocks
    children = {}
    for e in h.entries.values():
        if e.parent != ROOT:
            assert e.parent in h.entries, "every stored chain is reachable from ROOT"
            children[e.parent] = children.get(e.parent, 0) + 1
    for e in h.entries.values():
        assert e.children == children.get(e.key, 0)
    assert h.host_bytes + h.snapshot_bytes <= h.cap_bytes


# -- HostCache ------------------------------------------------------------------------------


def test_a_shared_prefix_is_stored_once():
    h = HostCache(64, B, 100, 4096)
    system = list(range(1, 1 + 4 * B))  # 4 blocks: an agent's system prompt
    a = system + list(range(500, 500 + 2 * B))
    b = system + list(range(700, 700 + 2 * B + 5))  # 2 blocks + a 5-token snapshot
    sa = h.plan_save(0, arr(a), hashes(a))
    sb = h.plan_save(1, arr(b), hashes(b))
    assert (sa.start, len(sa.blocks)) == (0, 6)
    assert (sb.start, len(sb.blocks)) == (4 * B, 3)  # only what a's save did not store
    assert h.host_bytes == (4 + 2 + 2) * 100 and h.snapshot_bytes == 100
    assert h.plan_save(0, arr(a), hashes(a)) is None  # all there: nothing to copy
    check_invariants(h)


def test_match_is_token_exact_past_the_last_full_block():
    h = HostCache(64, B, 1, 4096)
    prompt = list(range(1, 1 + 3 * B + 9))  # 3 blocks + a 9-token snapshot
    h.plan_save(0, arr(prompt), hashes(prompt))
    # a next turn sharing the prompt then 4 more of the old tail, then other tokens
    turn = prompt[: 3 * B + 4] + [900] * 40
    m = h.match(arr(turn), hashes(turn), len(turn) - 1)
    assert m.tokens == 3 * B + 4 and len(m.blocks) == 4
    # the prompt itself: all but its last token (always computed again)
    m = h.match(arr(prompt), hashes(prompt), len(prompt) - 1)
    assert m.tokens == len(prompt) - 1
    # a prompt differing in its first token shares nothing
    other = [999] + prompt[1:]
    assert h.match(arr(other), hashes(other), len(other) - 1).tokens == 0


def test_a_full_block_replaces_the_snapshot_it_covers():
    h = HostCache(64, B, 1, 4096)
    prompt = list(range(1, 1 + B + 5))
    h.plan_save(0, arr(prompt), hashes(prompt))
    assert h.num_snapshots == 1
    longer = prompt + list(range(100, 100 + B))  # prompt + answer: the tail's block is full now
    h.plan_save(0, arr(longer), hashes(longer))
    assert h.num_snapshots == 1  # the old 5-token one went; the new tail is the answer's
    m = h.match(arr(prompt), hashes(prompt), len(prompt) - 1)
    assert m.tokens == len(prompt) - 1
    check_invariants(h)


def test_eviction_is_lru_leaf_first_and_counted():
    h = HostCache(6, B, 1, 4096)
    a = list(range(1, 1 + 3 * B))
    b = list(range(200, 200 + 3 * B))
    h.plan_save(0, arr(a), hashes(a))
    h.plan_save(1, arr(b), hashes(b))
    assert h.evictions == 0
    h.match(arr(a + [5]), hashes(a + [5]), 3 * B)  # a is used again: b is older
    c = list(range(400, 400 + 2 * B))
    h.plan_save(2, arr(c), hashes(c))
    assert h.evictions == 2
    assert h.match(arr(a + [5]), hashes(a + [5]), 3 * B).tokens == 3 * B
    assert h.match(arr(b + [5]), hashes(b + [5]), 3 * B).tokens == B  # its last two blocks went
    check_invariants(h)


def test_a_save_never_evicts_the_chain_it_extends():
    h = HostCache(3, B, 1, 4096)
    a = list(range(1, 1 + 5 * B))
    save = h.plan_save(0, arr(a), hashes(a))
    assert len(save.blocks) == 3  # what fits; the first three blocks, still a chain
    assert h.match(arr(a), hashes(a), len(a) - 1).tokens == 3 * B
    check_invariants(h)


def test_blocks_a_planned_restore_reads_are_not_reused_by_the_same_plan():
    h = HostCache(2, B, 1, 4096)
    a = list(range(1, 1 + 2 * B))
    h.plan_save(0, arr(a), hashes(a))
    m = h.match(arr(a + [3]), hashes(a + [3]), 2 * B)
    b = list(range(300, 300 + 2 * B))
    assert h.plan_save(1, arr(b), hashes(b)) is None  # everything is pinned
    h.unpin()
    assert len(h.plan_save(1, arr(b), hashes(b)).blocks) == 2
    assert m.tokens == 2 * B


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.integers(1, 6 * B + 7)), min_size=1, max_size=40),
       st.integers(1, 12))
def test_the_cap_holds_and_chains_stay_whole_under_any_sequence(ops, num_blocks):
    h = HostCache(num_blocks, B, 10, 4096)
    # 6 conversations sharing a 2-block system prompt, each its own continuation
    convs = [list(range(1, 1 + 2 * B)) + [1000 * (c + 1) + i for i in range(8 * B)] for c in range(6)]
    saved = {}
    for is_save, c, n in ops:
        tokens = convs[c][:n]
        if is_save:
            h.unpin()
            h.plan_save(c, arr(tokens), hashes(tokens))
            saved[c] = max(saved.get(c, 0), n)
        else:
            m = h.match(arr(tokens), hashes(tokens), len(tokens) - 1)
            assert m.tokens <= len(tokens) - 1 and len(m.blocks) == -(-m.tokens // B)
            # what it matched holds those tokens: block by block, the pool's ids agree
            got = [t for b in m.blocks for t in h.tokens[b].tolist()][: m.tokens]
            assert got == tokens[: m.tokens]
        check_invariants(h)


# -- the scheduler --------------------------------------------------------------------------


def sched(slots: int = 1, host_blocks: int = 256) -> Scheduler:
    return Scheduler(slots, 2048, 64, B, host_blocks=host_blocks, host_block_bytes=1, kv_capacity=2048)


def test_a_conversation_pushed_out_of_its_slot_is_restored_from_host_memory():
    s = sched(slots=1)
    pool = Pool(s)
    a = list(range(1, 300))
    b = list(range(300, 1, -1))
    ra = req("a", a)
    s.add(ra)
    run_to_end(s, pool, ra)
    rb = req("b", b)
    s.add(rb)
    plans = run_to_end(s, pool, rb)
    assert plans[0].saves and plans[0].saves[0].slot == 0  # what a's slot held went to host memory
    turn = a + [7, 7, 7] + [11, 12, 13]  # the next turn: the prompt, the answer, a new message
    ra2 = req("a2", turn)
    s.add(ra2)
    plan = drive(s, pool)
    assert plan.restores and ra2.num_cached == len(a) + 3
    assert pool.kv[0][: ra2.num_cached] == turn[: ra2.num_cached]  # the restored K/V are the turn's
    assert s.prefix.hit_tokens == 0 and s.host.hit_tokens == ra2.num_cached


def test_a_turn_that_drops_the_answer_resumes_from_the_prompt_end_snapshot():
    s = sched(slots=1)
    pool = Pool(s)
    a = list(range(1, 1 + 5 * B + 9))
    ra = req("a", a, max_tokens=40)
    s.add(ra)
    run_to_end(s, pool, ra)
    s.add(rb := req("b", list(range(400, 300, -1))))
    run_to_end(s, pool, rb)
    turn = a + [55] * 30  # the answer stripped: a tool result in its place
    s.add(r := req("a2", turn))
    drive(s, pool)
    assert r.num_cached == len(a)  # past the last full block: the snapshot


def test_identical_prompts_sent_together_prefill_once():
    s = Scheduler(2, 2048, 64, B)
    pool = Pool(s)
    prompt = list(range(1, 400))
    r1, r2 = req("1", prompt), req("2", prompt)
    s.add(r1)
    s.add(r2)
    prefilled = {"1": 0, "2": 0}
    for _ in range(100):
        r1_was = r1.state
        plan = drive(s, pool)
        for row in plan.rows:
            if not row.decode:
                prefilled[row.request.id] += len(row.token_ids)
        if r2.state is State.WAITING:
            assert r1_was is not State.DECODING  # r2 waits only while r1 computes its prompt
        if r1.num_generated >= 2 and r2.num_generated >= 2:
            break
    assert prefilled == {"1": len(prompt), "2": 1}
    assert r2.num_cached == len(prompt) - 1 and s.dedupes == 1
    assert pool.kv[r2.slot][: len(prompt)] == prompt


def test_a_held_back_request_does_not_block_other_waiting_ones():
    s = Scheduler(3, 2048, 64, B)
    pool = Pool(s)
    prompt = list(range(1, 41))  # leaves budget in the step for r3
    s.add(req("1", prompt))
    s.add(r2 := req("2", prompt))
    s.add(r3 := req("3", [9, 8, 7]))
    drive(s, pool)
    assert r3.state is not State.WAITING and r2.state is State.WAITING  # r1 computed its prompt in this step
    drive(s, pool)
    assert r2.state is not State.WAITING and r2.num_cached == len(prompt) - 1


def test_a_failed_step_forgets_the_host_pool():
    s = sched(slots=1)
    pool = Pool(s)
    s.add(ra := req("a", list(range(1, 300))))
    run_to_end(s, pool, ra)
    s.add(req("b", list(range(300, 1, -1))))
    plan = s.schedule()
    assert plan.saves
    s.step_failed(plan)
    assert not s.host.entries and len(s.host.free) == s.host.num_blocks
