"""api/prompt_pool.py: a big body is prepared in a parse process, with the same answer
(value, session tag, or the very 400) it gets inline; a dead parse process is replaced;
the processes end with the pool."""
from __future__ import annotations

import asyncio
import functools
import os

import orjson
import pytest

from api_scripted_engine import ScriptedEngine
from mashbox.api import app, chat, messages, pipeline
from mashbox.api.common import ApiContext
from mashbox.api.prompt_pool import BIG_BODY_BYTES, PromptPool
from mashbox.config import EngineConfig, ServerConfig
from mashbox.http.request import Request
from mashbox.http.response import HTTPError

PAD = b" " * BIG_BODY_BYTES  # JSON whitespace: a big body around a small prompt


@pytest.fixture(scope="module")
def contexts(default_model_path):
    """(inline ApiContext, ApiContext with a one-process pool), one engine and text."""
    sc = ServerConfig()
    ec = EngineConfig(model_path=default_model_path, model_id="m", ctx=4096)
    engine = ScriptedEngine(lambda req: [], ctx=4096)
    tokenizer, template = app.load_text(ec)
    pool = PromptPool(sc, ec, template.source, workers=1)
    yield (ApiContext(sc, ec, engine, tokenizer, template),
           ApiContext(sc, ec, engine, tokenizer, template, prompt_pool=pool))
    pool.shutdown()


def request(path: str, body: bytes) -> Request:
    return Request("POST", path, headers={"content-type": "application/json"}, body=body)


def both(contexts, path: str, body: bytes, job):
    """(inline outcome, pooled outcome): each a value or the HTTPError raised, and the session tag."""
    out = []
    for api in contexts:
        req = request(path, body)
        try:
            value = asyncio.run(pipeline.off_loop(api, req, job))
        except HTTPError as exc:
            value = (exc.status, exc.message, exc.type, exc.code, exc.param, exc.headers)
        out.append((value, req.session_tag))
    return out


def test_a_big_body_gets_what_it_gets_inline(contexts):
    job = functools.partial(pipeline.prepare, chat.SURFACE)
    small = orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "prompt_cache_key": "sess-1", "seed": 7})
    inline, pooled = both(contexts, "/v1/chat/completions", small + PAD, job)
    assert pooled == inline and pooled[1] == "sess-1"
    request_value, prompt = pooled[0]
    assert prompt.ids and request_value.conversation.messages[0]["content"] == "hi"

    count_body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello there"}]}) + PAD
    inline, pooled = both(contexts, "/v1/messages/count_tokens", count_body, messages.count_body)
    assert pooled == inline and isinstance(pooled[0], int) and pooled[0] > 2


@pytest.mark.parametrize("body", [
    orjson.dumps({"messages": [{"role": "user", "content": "hello world " * 200_000}]}),  # far too long
    orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}) + PAD,
    b'{"messages": [' + PAD,  # not JSON
])
def test_a_big_bodys_400_crosses_unchanged(contexts, body):
    job = functools.partial(pipeline.prepare, chat.SURFACE)
    inline, pooled = both(contexts, "/v1/chat/completions", body, job)
    assert isinstance(pooled[0], tuple) and pooled[0][0] == 400
    assert pooled == inline


def pid_of(api, req) -> int:
    return os.getpid()


def dies_once(marker: str, api, req) -> int:
    """Kills its process the first time (a parse process killed, out of memory)."""
    if not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(1)
    return os.getpid()


def test_jobs_run_in_another_process_that_a_death_replaces_and_shutdown_ends(contexts, tmp_path):
    inline, pooled = contexts
    big = request("/v1/chat/completions", PAD)
    assert asyncio.run(pipeline.off_loop(inline, big, pid_of)) == os.getpid()
    first = asyncio.run(pipeline.off_loop(pooled, big, pid_of))
    assert first != os.getpid()
    assert asyncio.run(pipeline.off_loop(pooled, request("/v1/chat/completions", b"{}"), pid_of)) == os.getpid()

    pool = PromptPool(pooled.server_config, pooled.engine_config, pooled.template.source, workers=1)
    api = ApiContext(pooled.server_config, pooled.engine_config, pooled.engine, pooled.tokenizer,
                     pooled.template, prompt_pool=pool)
    marker = str(tmp_path / "died")
    survivor = asyncio.run(pipeline.off_loop(api, big, functools.partial(dies_once, marker)))
    assert os.path.exists(marker) and survivor not in (os.getpid(), first)
    pool.shutdown()
    with pytest.raises(RuntimeError):
        asyncio.run(pipeline.off_loop(api, big, pid_of))
