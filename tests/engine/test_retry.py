"""The one retry (api/generation.py), with a real EngineClient and a worker killed mid-request.

The engine never resends a request; Generation runs it again once, from the start, while
its client has received nothing (README: "requests whose clients have received nothing
are sent again once"). The worker is killed with SIGKILL at a point the test chooses by
events (the first token has reached Generation), never after a sleep.
"""
from __future__ import annotations

import os
import signal
import sys

import pytest

from mashbox.api.common import ApiContext, SamplingFields
from mashbox.api.generation import Generation, GenerationError
from mashbox.api.prompt import Prompt
from mashbox.config import SamplingParams, ServerConfig

sys.path.insert(0, os.path.dirname(__file__))
from engine_harness import run_client, tiny_config  # noqa: E402
from tiny_model import hf_greedy  # noqa: E402

TIMEOUT = 120
TOKENS = 100  # long enough that the worker is still decoding when it is killed


def generation(client, ids) -> Generation:
    api = ApiContext(ServerConfig(), client.engine_config, client, tokenizer=None, template=None)
    fields = SamplingFields(sampling=SamplingParams(), stops=(), max_tokens=TOKENS, seed_given=False)
    return Generation(api, Prompt(ids=tuple(ids), max_tokens=TOKENS), fields, "openai", ignore_eos=True)


async def run_killing_after_first_token(client, gen: Generation, output_sent: bool, sig=signal.SIGKILL):
    """Drive `gen`; at its first step with tokens send the worker `sig` (and mark the output
    as sent when asked). Returns (the worker's pid, the steps seen, the error if any)."""
    pid, steps, error = None, [], None
    try:
        async for step in gen.steps():
            steps.append(step)
            if pid is None and step.event is not None and step.event.token_ids:
                pid = client.worker_pid
                gen.output_sent = output_sent
                os.kill(pid, sig)
    except GenerationError as e:
        error = e
    return pid, steps, error


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_request_whose_client_got_nothing_runs_again_from_the_start(tiny, tiny_tok, sig):
    """A dead worker (SIGKILL) or a frozen one (SIGSTOP: the watchdog kills it)."""
    ids = tiny_tok.encode("hello world")
    want = hf_greedy(tiny, ids, TOKENS)

    async def main(client):
        gen = generation(client, ids)
        pid, steps, error = await run_killing_after_first_token(client, gen, output_sent=False, sig=sig)
        return pid, error, gen.result, client.worker_pid, client.stats()

    pid, error, result, new_pid, stats = run_client(main, tiny_config(tiny, slots=1), timeout=TIMEOUT,
                                                    watchdog_s=2.0)
    assert error is None
    assert new_pid != pid and stats.worker_restarts == 1
    assert stats.worker_stalls == (1 if sig == signal.SIGSTOP else 0)
    # The retry started over: the result is one whole run's, equal to the reference.
    assert result.finish_reason == "length" and result.completion_tokens == TOKENS
    assert result.text == tiny_tok.decode(ids + want)[len(tiny_tok.decode(ids)):]
    assert stats.requests_finished == {"error": 1, "length": 1}


def test_a_request_whose_client_got_output_is_not_run_again(tiny, tiny_tok):
    ids = tiny_tok.encode("hello world")

    async def main(client):
        gen = generation(client, ids)
        pid, steps, error = await run_killing_after_first_token(client, gen, output_sent=True)
        await client.wait_ready(timeout=TIMEOUT)  # the worker is restarted all the same
        return error, gen.result, client.stats()

    error, result, stats = run_client(main, tiny_config(tiny, slots=1), timeout=TIMEOUT)
    assert isinstance(error, GenerationError) and "worker" in str(error)
    assert result.finish_reason == "error"
    assert stats.requests_finished == {"error": 1} and stats.worker_restarts == 1


def test_a_failed_retry_is_a_generation_error(tiny, tiny_tok):
    """The one retry is one: when the second run's worker dies too, the error stands."""
    ids = tiny_tok.encode("hello world")

    async def main(client):
        gen = generation(client, ids)
        killed = []
        error = None
        try:
            async for step in gen.steps():
                if step.event is not None and step.event.token_ids and client.worker_pid not in killed:
                    killed.append(client.worker_pid)
                    os.kill(client.worker_pid, signal.SIGKILL)
        except GenerationError as e:
            error = e
        return killed, error, client.stats()

    killed, error, stats = run_client(main, tiny_config(tiny, slots=1), timeout=TIMEOUT)
    assert len(killed) == 2 and killed[0] != killed[1]
    assert isinstance(error, GenerationError)
    assert stats.requests_finished == {"error": 2}
