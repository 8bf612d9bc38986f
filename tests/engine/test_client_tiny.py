"""The engine end to end through EngineClient: a real worker process, a tiny random Llama.

Every test starts its own worker (`python -m mashbox.engine.worker`) over the real
socket pipe, so what is checked is what the server will see.
"""
from __future__ import annotations

import asyncio
import functools
import os
import signal
import sys
import time

import pytest

from mashbox.config import EngineConfig, GenerationRequest, SamplingParams, ServerConfig
from mashbox.engine.client import EngineClient
from mashbox.engine.interface import EngineStartError, NotReady, QueueFull

sys.path.insert(0, os.path.dirname(__file__))
from engine_harness import collect, first_event, req, run_client, tiny_config  # noqa: E402
from tiny_model import hf_greedy  # noqa: E402

TIMEOUT = 120


def run(coro_fn, cfg: EngineConfig, server: ServerConfig = ServerConfig(), **client_kw):
    return run_client(coro_fn, cfg, server, timeout=TIMEOUT, **client_kw)


greq = functools.partial(req, ignore_eos=True)  # random weights: every request runs to max_tokens


def test_ready_info_and_not_ready_while_loading(tiny):
    async def main():
        client = EngineClient(tiny_config(tiny), ServerConfig())
        await client.start()
        try:
            assert client.state == "loading"
            with pytest.raises(NotReady):
                client.submit(greq("early", [5, 6]))
            await client.wait_ready(timeout=TIMEOUT)
            assert client.state == "ok"
            info = client.info
            assert info.model_id == "tiny" and info.ctx == 2048 and info.slots == 4
            assert info.vocab_size == 320 and info.arch == "llama"
            assert info.dtype == "float32" and info.device == "cpu"
            assert info.weights_file.endswith(".safetensors") and info.gb > 0 and info.bpw == 32
            assert client.worker_pid == info.pid
        finally:
            await client.stop()
    asyncio.run(main())


def test_concurrent_requests_match_transformers_greedy(tiny, tiny_tok):
    prompts = [
        tiny_tok.encode("hello world"),
        tiny_tok.encode("the quick brown fox jumps over the lazy dog, " * 6),  # > 1 prefill chunk
        tiny_tok.encode("a"),
        tiny_tok.encode("prefix caching reuses the keys and values"),
        tiny_tok.encode("emoji and accents: café 😀"),
        tiny_tok.encode("numbers: 0123456789 " * 3),
    ]
    lengths = [12, 5, 20, 9, 15, 7]
    want = [hf_greedy(tiny, p, n) for p, n in zip(prompts, lengths)]

    async def main(client):
        # 6 requests on 4 slots: two wait, all join as slots free up
        handles = [client.submit(greq(f"r{i}", p, n)) for i, (p, n) in enumerate(zip(prompts, lengths))]
        results = await asyncio.gather(*(collect(h) for h in handles))
        return results, client.stats()

    results, stats = run(main, tiny_config(tiny))
    for i, (ids, text, final, events) in enumerate(results):
        assert ids == want[i], f"request {i}"
        assert final.finish_reason == "length"
        assert sum(ev.started for ev in events) == 1 and events[0].started
        assert final.timings.predicted_n == lengths[i]
        assert final.timings.prompt_n + final.timings.cache_n == len(prompts[i])
        # the text is the incremental decode of the ids (what a client would show)
        assert text == tiny_tok.decode(prompts[i] + ids)[len(tiny_tok.decode(prompts[i])):]
    assert stats.requests_finished == {"length": 6}
    assert stats.generated_tokens == sum(lengths)
    assert stats.prompt_tokens == sum(map(len, prompts))
    assert stats.running == 0 and stats.waiting == 0 and stats.slots_used == 0
    assert stats.prefix_cache_lookups == 6
    h = stats.histograms
    assert h["time_to_first_token_seconds"].count == 6
    assert h["e2e_request_latency_seconds"].count == 6
    assert h["queue_time_seconds"].count == 6
    assert h["time_per_output_token_seconds"].count == 6
    assert h["e2e_request_latency_seconds"].buckets[-1][1] <= 6


def test_seeded_sampling_repeats_and_batch_neighbours(tiny, tiny_tok, record_property):
    """The same seeded request twice alone gives the same tokens; beside 3 others is recorded."""
    prompt = tiny_tok.encode("continuous batching lets a new request join")
    others = [tiny_tok.encode(t) for t in ("hello", "the lazy dog " * 5, "numbers: 01234")]
    sampled = dict(temperature=1.0, top_p=0.95, seed=1234)

    async def main(client):
        alone1, _, _, _ = await collect(client.submit(greq("s1", prompt, 24, **sampled)))
        alone2, _, _, _ = await collect(client.submit(greq("s2", prompt, 24, **sampled)))
        other_seed, _, _, _ = await collect(client.submit(greq("s3", prompt, 24, **{**sampled, "seed": 99})))
        hs = [client.submit(greq(f"o{i}", p, 30, temperature=0.8, seed=i)) for i, p in enumerate(others)]
        crowd = client.submit(greq("s4", prompt, 24, **sampled))
        greedy_alone, _, _, _ = await collect(client.submit(greq("g0", prompt, 24)))
        rest = await asyncio.gather(collect(crowd), *(collect(h) for h in hs))
        hs = [client.submit(greq(f"p{i}", p, 30)) for i, p in enumerate(others)]
        greedy_crowd = client.submit(greq("g1", prompt, 24))
        rest2 = await asyncio.gather(collect(greedy_crowd), *(collect(h) for h in hs))
        return alone1, alone2, other_seed, rest[0][0], greedy_alone, rest2[0][0]

    alone1, alone2, other_seed, crowd, greedy_alone, greedy_crowd = run(main, tiny_config(tiny))
    assert alone1 == alone2
    assert other_seed != alone1  # the seed matters
    # Recorded, not asserted: the batch's make-up changes low bits of the logits (MKL
    # picks a different GEMM kernel for 1, 2-3 and 4+ rows; the decoder's batched decode
    # attention is another kernel than the single-row one), which may or may not flip a
    # token. In float32 at this size they have come out the same.
    record_property("seeded_alone_equals_beside_3", crowd == alone1)
    record_property("greedy_alone_equals_beside_3", greedy_crowd == greedy_alone)


def _sharing_a_prefix(seed: int) -> tuple[list[int], list[int]]:
    """Two prompts that share a random 1,000-token prefix: + 3 tokens, + 5 others."""
    import random

    rnd = random.Random(seed)
    prefix = [rnd.randrange(2, 320) for _ in range(1000)]
    return prefix + [11, 12, 13], prefix + [21, 22, 23, 24, 25]


def test_prefix_reuse_prefills_only_new_tokens(tiny, tiny_tok):
    first, second = _sharing_a_prefix(7)

    async def main(client):
        a = await collect(client.submit(greq("a", first, 4)))
        before = client.stats()
        b = await collect(client.submit(greq("b", second, 6)))
        return a, b, before, client.stats()

    a, b, before, after = run(main, tiny_config(tiny, slots=2, prefill_chunk=256))
    ta, tb = a[2].timings, b[2].timings
    assert ta.prompt_n == 1003 and ta.cache_n == 0
    assert tb.cache_n == 1000 and tb.prompt_n == 5  # only the new tokens were prefilled
    assert b[2].cached_tokens == 1000
    assert after.prefix_cache_lookups == before.prefix_cache_lookups + 1
    assert after.prefix_cache_hit_tokens == before.prefix_cache_hit_tokens + 1000
    # the reused K/V gives the same tokens as a full forward pass
    assert b[0] == hf_greedy(tiny, second, 6)


def test_running_request_prefix_is_copied_not_recomputed(tiny, tiny_tok):
    first, second = _sharing_a_prefix(11)

    async def main(client):
        a = client.submit(greq("a", first, 300))
        await first_event(a, want_tokens=True)  # a is decoding: its slot holds the prefix
        b = await collect(client.submit(greq("b", second, 6)))
        a.cancel()
        await collect(a)
        return b, client.stats()

    b, stats = run(main, tiny_config(tiny, slots=2, prefill_chunk=256))
    assert b[2].timings.cache_n == 1000 and b[2].timings.prompt_n == 5
    assert stats.prefix_cache_copies == 1
    assert b[0] == hf_greedy(tiny, second, 6)  # the copied K/V give the right tokens


def test_cancel_queued_prefilling_and_decoding(tiny, tiny_tok):
    long_prompt = [(i * 7) % 300 + 2 for i in range(1800)]

    async def main(client):
        dec = client.submit(greq("dec", tiny_tok.encode("hello"), 1500))
        seen_dec = await first_event(dec, want_tokens=True)
        assert seen_dec[-1].token_ids and seen_dec[-1].finish_reason is None
        pre = client.submit(greq("pre", long_prompt, 5))
        seen_pre = await first_event(pre, want_tokens=False)
        assert seen_pre[-1].started and not seen_pre[-1].token_ids  # has a slot, prefilling
        queued = client.submit(greq("q", tiny_tok.encode("queued"), 5))
        assert client.stats().waiting == 1 and client.stats().slots_used == 2
        for h in (queued, pre, dec):
            h.cancel()
            h.cancel()  # idempotent
        finals = [(await collect(h))[2] for h in (queued, pre, dec)]
        stats = client.stats()
        # the freed slots take new work at once
        after = await asyncio.gather(*(collect(client.submit(greq(f"n{i}", [3, 4, 5], 3)))
                                       for i in range(2)))
        return finals, stats, after

    finals, stats, after = run(main, tiny_config(tiny, slots=2, prefill_chunk=8))
    q, pre, dec = finals
    assert [f.finish_reason for f in finals] == ["cancelled"] * 3
    assert not q.started and q.timings.predicted_n == 0 and q.timings.prompt_n == 0
    assert pre.timings.predicted_n == 0 and 0 < pre.timings.prompt_n < len(long_prompt)
    assert 0 < dec.timings.predicted_n < 1500
    assert stats.slots_used == 0 and stats.running == 0 and stats.waiting == 0
    assert stats.requests_finished == {"cancelled": 3}
    assert all(r[2].finish_reason == "length" and len(r[0]) == 3 for r in after)


def test_queue_caps_per_tenant_and_total(tiny, tiny_tok):
    server = ServerConfig(max_waiting_per_tenant=2, max_waiting_total=3)

    async def main(client):
        busy = client.submit(greq("busy", [5, 6, 7], 1900))
        await first_event(busy, want_tokens=True)  # the only slot is taken
        w = [client.submit(greq(f"x{i}", [8, 9], 2, tenant="x")) for i in range(2)]
        with pytest.raises(QueueFull) as e1:
            client.submit(greq("x2", [8, 9], 2, tenant="x"))
        w.append(client.submit(greq("y0", [8, 9], 2, tenant="y")))
        with pytest.raises(QueueFull) as e2:
            client.submit(greq("z0", [8, 9], 2, tenant="z"))
        waiting = client.stats().waiting
        busy.cancel()
        done = await asyncio.gather(*(collect(h) for h in w))
        await collect(busy)
        return e1.value.scope, e2.value.scope, waiting, done

    s1, s2, waiting, done = run(main, tiny_config(tiny, slots=1), server)
    assert (s1, s2, waiting) == ("tenant", "total", 3)
    assert all(d[2].finish_reason == "length" for d in done)


def test_a_cancelled_request_stops_counting_toward_the_caps_at_once(tiny):
    """Clients that disconnect free their place in the queue before the worker has seen
    the cancel (issue 10: under a disconnect storm, new requests of the tenant got 429)."""
    server = ServerConfig(max_waiting_per_tenant=2, max_waiting_total=3)

    async def main(client):
        busy = client.submit(greq("busy", [5, 6, 7], 1900))
        await first_event(busy, want_tokens=True)  # the only slot is taken
        gone = [client.submit(greq(f"x{i}", [8, 9], 2, tenant="x")) for i in range(2)]
        for h in gone:
            h.cancel()  # no await in between: the worker cannot have acknowledged it
        stats = client.stats()
        fresh = [client.submit(greq(f"x{i}", [8, 9], 2, tenant="x")) for i in range(2, 4)]
        more = client.submit(greq("y0", [8, 9], 2, tenant="y"))
        busy.cancel()
        done = await asyncio.gather(*(collect(h) for h in gone + fresh + [more, busy]))
        return stats, [d.final.finish_reason for d in done], client.stats()

    stats, reasons, after = run(main, tiny_config(tiny, slots=1), server)
    assert stats.waiting == 0 and stats.running == 1
    assert reasons == ["cancelled", "cancelled", "length", "length", "length", "cancelled"]
    assert after.waiting == 0 and after.running == 0


def test_killed_worker_is_restarted_and_its_requests_end(tiny, tiny_tok):
    async def main(client):
        running = client.submit(greq("run", [5, 6, 7], 1900))
        await first_event(running, want_tokens=True)
        queued = client.submit(greq("wait", tiny_tok.encode("hello world"), 6))  # no slot, no tokens
        pid = client.worker_pid
        os.kill(pid, signal.SIGKILL)
        r_final = (await collect(running)).final
        q = await collect(queued)
        assert client.state == "loading"
        await client.wait_ready(timeout=TIMEOUT)
        assert client.worker_pid != pid and client.stats().worker_restarts == 1
        fresh = await collect(client.submit(greq("fresh", [5, 6, 7], 4)))
        return r_final, q, fresh.final, client.stats()

    r_final, q, f_final, stats = run(main, tiny_config(tiny, slots=1))
    # The engine never sends a request twice (the api's Generation holds the one retry,
    # test_retry.py): both requests of the dead worker end with the error.
    assert r_final.finish_reason == "error" and "worker" in r_final.error
    assert q.final.finish_reason == "error" and "worker" in q.final.error and q.ids == []
    assert f_final.finish_reason == "length"
    assert stats.requests_finished == {"error": 2, "length": 1}
    assert stats.waiting == 0 and stats.running == 0


def test_a_frozen_worker_is_killed_and_restarted(tiny):
    """SIGSTOP: the worker lives but sends nothing. The watchdog notices (here after 2 s,
    WATCHDOG_S in the server), kills it, ends its requests and starts another."""
    watchdog_s = 2.0

    async def main(client):
        busy = client.submit(greq("busy", [5, 6, 7], 1900))
        await first_event(busy, want_tokens=True)
        pid = client.worker_pid
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        final = (await collect(busy)).final  # ends only when the watchdog acts
        noticed_after = time.monotonic() - t0
        state_then = client.state
        await client.wait_ready(timeout=TIMEOUT)
        fresh = await collect(client.submit(greq("fresh", [5, 6, 7], 4)))
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # the frozen worker was killed and reaped
        return final, noticed_after, state_then, pid, client.worker_pid, fresh.final, client.stats()

    final, noticed_after, state_then, pid, new_pid, f_final, stats = run(
        main, tiny_config(tiny, slots=1), watchdog_s=watchdog_s)
    assert final.finish_reason == "error" and "no progress for 2 s" in final.error
    assert noticed_after >= watchdog_s  # not before its time
    assert state_then == "loading" and new_pid != pid
    assert stats.worker_stalls == 1 and stats.worker_restarts == 1
    assert f_final.finish_reason == "length"


def test_an_idle_worker_is_not_taken_for_a_frozen_one(tiny):
    """The watchdog counts silence only while there is work: an idle worker sends nothing,
    and a request after a long idle is not taken for a stall."""
    watchdog_s = 1.5

    async def main(client):
        await collect(client.submit(greq("a", [5, 6, 7], 2)))
        pid = client.worker_pid
        await asyncio.sleep(2 * watchdog_s)  # idle past the watchdog: the time is what is tested
        b = client.submit(greq("b", [5, 6, 7], 2))
        client._check_progress(client._gen)  # a check at once, before the worker can answer
        return (await collect(b)).final, pid, client.worker_pid, client.stats()

    b, pid, pid_after, stats = run(main, tiny_config(tiny, slots=1), watchdog_s=watchdog_s)
    assert b.finish_reason == "length"
    assert pid_after == pid and stats.worker_stalls == 0


def test_stop_sequence_ends_text_before_it(tiny, tiny_tok):
    prompt = tiny_tok.encode("hello world, hello")
    ref = hf_greedy(tiny, prompt, 30)
    ref_text = tiny_tok.decode(prompt + ref)[len(tiny_tok.decode(prompt)):]
    # a stop string the greedy output contains, away from its start, with whole characters
    at = next(i for i in range(3, len(ref_text) - 3) if "\ufffd" not in ref_text[i - 1 : i + 3])
    stop = ref_text[at : at + 3]
    at = ref_text.index(stop)

    async def main(client):
        s = await collect(client.submit(GenerationRequest(
            id="s", tenant="t", prompt_ids=tuple(prompt), sampling=SamplingParams(),
            stops=(stop, "never-there"), max_tokens=30)))
        return s

    ids, text, final, _ = run(main, tiny_config(tiny))
    assert final.finish_reason == "stop_sequence" and final.stop_sequence == stop
    assert text == ref_text[:at]
    assert ids == ref[: len(ids)] and len(ids) < 30


def test_context_end_oversized_prompt_and_bad_ids(tiny):
    async def main(client):
        fits = await collect(client.submit(greq("fits", [(i % 300) + 2 for i in range(60)], 100)))
        too_long = await collect(client.submit(greq("long", [5] * 65, 4)))
        bad_id = await collect(client.submit(greq("bad", [5, 320, 6], 4)))
        return fits, too_long, bad_id

    fits, too_long, bad_id = run(main, tiny_config(tiny, ctx=64, prefill_chunk=16))
    assert bad_id[2].finish_reason == "error" and "vocabulary" in bad_id[2].error
    assert fits[2].finish_reason == "length" and len(fits[0]) == 4  # 60 + 4 = the whole slot
    assert too_long[2].finish_reason == "error" and "65 tokens" in too_long[2].error


def hf_greedy_penalized(folder: str, prompt, n: int, rep: float, freq: float, pres: float) -> list[int]:
    """transformers logits, penalties applied by hand: repetition (HF rule) on prompt +
    generated ids, frequency / presence (OpenAI rule) on generated ids only."""
    import torch
    from tiny_model import _cached_model

    model = _cached_model(folder)
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            x = model(torch.tensor([ids])).logits[0, -1].clone()
            seen = torch.tensor(sorted(set(ids)))
            v = x[seen]
            x[seen] = torch.where(v > 0, v / rep, v * rep)
            for t in set(out):
                x[t] -= freq * out.count(t) + pres
            t = int(torch.argmax(x))
            out.append(t)
            ids.append(t)
    return out


def test_penalties_read_prompt_and_generated_history(tiny, tiny_tok):
    prompt = tiny_tok.encode("hello hello world, the quick brown fox")
    plain = hf_greedy(tiny, prompt, 16)
    want = hf_greedy_penalized(tiny, prompt, 16, rep=1.8, freq=0.6, pres=0.4)
    assert want != plain  # the penalties change this output, so the test can tell

    async def main(client):
        pen = client.submit(greq("pen", prompt, 16, repetition_penalty=1.8,
                                 frequency_penalty=0.6, presence_penalty=0.4))
        other = client.submit(greq("plain", prompt, 16))  # same batch, no penalties
        return await asyncio.gather(collect(pen), collect(other))

    pen, other = run(main, tiny_config(tiny))
    assert pen[0] == want
    assert other[0] == plain


def test_model_that_cannot_load_is_reported_not_restarted(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)  # a header and nothing that parses

    async def main():
        client = EngineClient(tiny_config(str(bad)), ServerConfig())
        await client.start()
        try:
            with pytest.raises(EngineStartError) as e:
                await client.wait_ready(timeout=TIMEOUT)
            proc = client._proc
            await asyncio.wait_for(proc.wait(), TIMEOUT)  # the worker exits after its fatal frame
            # Until the client has seen the exit (socket closed) and its restart decision
            # ran to its end (no task left), or it restarted the worker after all.
            while (client._sock is not None or client._tasks) and client.restarts == 0:
                await asyncio.sleep(0.01)
            with pytest.raises(EngineStartError):
                await client.wait_ready(timeout=TIMEOUT)  # still the same answer, at once
            return str(e.value), client.state, client.restarts, client.error, client._proc is proc
        finally:
            await client.stop()

    message, state, restarts, error, same_worker = asyncio.run(main())
    assert "broken.gguf" in message and message == error
    assert state == "loading" and restarts == 0 and same_worker


def test_handle_state_table_moves_only_along_its_edges():
    from mashbox.engine.handle import HANDLE_TRANSITIONS, HandleState, IllegalTransition, RequestHandle

    assert set(HANDLE_TRANSITIONS) == set(HandleState)
    for path in ([HandleState.RUNNING, HandleState.FINISHED, HandleState.CLOSED],
                 [HandleState.CANCELLING, HandleState.FINISHED, HandleState.CLOSED],
                 [HandleState.RUNNING, HandleState.CANCELLING, HandleState.FINISHED],
                 [HandleState.FINISHED]):
        h = RequestHandle(None, greq("r", [5], 1))
        for state in path:
            h._goto(state)
        assert h.state is path[-1]
    for start in HandleState:
        for target in HandleState:
            if target in HANDLE_TRANSITIONS[start]:
                continue
            h = RequestHandle(None, greq("r", [5], 1))
            h.state = start
            with pytest.raises(IllegalTransition):
                h._goto(target)
            assert h.state is start  # an illegal move changes nothing
    # e.g. no event after the final one, no return from CANCELLING, nothing after CLOSED
    assert HANDLE_TRANSITIONS[HandleState.CLOSED] == frozenset()
    assert HandleState.RUNNING not in HANDLE_TRANSITIONS[HandleState.CANCELLING]



def test_a_kv_cache_past_the_free_memory_is_refused_with_the_flags_to_lower(tiny):
    """Slots x ctx whose KV cache cannot fit the memory left after the weights: a start
    error naming --ctx and --slots, before the zeroed cache would be an OOM kill mid-load
    (and a restart loop)."""
    import torch

    from mashbox.engine.runner import _available_bytes
    from mashbox.model import loader
    from mashbox.model.kv_cache import KVCache

    free = _available_bytes()  # what the runner checks the cache against
    config = loader.load(tiny, torch.float32, torch.device("cpu")).config  # tiny_config's dtype
    per_ctx_token = KVCache.bytes_for(config, 64, 1024, torch.float32) // 1024  # 64 slots
    ctx = 1 << (2 * free // per_ctx_token).bit_length()  # a cache of over twice the free memory

    async def main():
        client = EngineClient(tiny_config(tiny, slots=64, ctx=ctx), ServerConfig())
        await client.start()
        try:
            with pytest.raises(EngineStartError) as e:
                await client.wait_ready(timeout=TIMEOUT)
            return str(e.value)
        finally:
            await client.stop()

    message = asyncio.run(main())
    assert "KV cache" in message and "--ctx" in message and "--slots" in message, message
