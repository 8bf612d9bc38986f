"""--alias: the model served under the names the clients' configurations use.

The real app on a real socket (scripted engine, the default model's tokenizer) with
`ServerConfig.aliases`: /v1/models lists the id and each alias, a request naming an
alias is served and its answer repeats that name, any other name keeps the spec's 404,
and Messages keeps accepting any name.
"""
from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from api_scripted_engine import InProcessServer, ScriptedEngine, text_events
from mashbox.config import ServerConfig

ALIASES = ("mashbox-model", "gpt-5-codex")
MSGS = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def app(default_model_path):
    engine = ScriptedEngine(lambda req: text_events(req, ["o", "k"]), ctx=512)
    with InProcessServer(engine, default_model_path, ServerConfig(host="127.0.0.1", port=0, aliases=ALIASES)) as s:
        yield s


@pytest.fixture(scope="module")
def client(app):
    return openai.OpenAI(base_url=app.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_id_and_every_alias(app):
    listed = httpx.get(app.base_url + "/v1/models").json()["data"]
    assert [m["id"] for m in listed] == ["scripted", *ALIASES]
    # one model under several names: the same figures under each
    assert len({tuple(sorted((k, v) for k, v in m.items() if k != "id")) for m in listed}) == 1
    for name in ("scripted", *ALIASES):
        r = httpx.get(f"{app.base_url}/v1/models/{name}")
        assert r.status_code == 200 and r.json()["id"] == name
    assert httpx.get(app.base_url + "/v1/models/other").status_code == 404


@pytest.mark.parametrize("name", ALIASES)
def test_an_alias_is_served_on_every_openai_route_and_repeated(client, name):
    chat = client.chat.completions.create(model=name, messages=MSGS)
    assert chat.model == name and chat.choices[0].message.content == "ok"
    with client.chat.completions.stream(model=name, messages=MSGS) as stream:
        assert {e.chunk.model for e in stream if e.type == "chunk"} == {name}
    assert client.completions.create(model=name, prompt="Say").model == name
    assert client.responses.create(model=name, input="Hi").model == name


def test_no_model_answers_with_the_id_and_other_names_are_404(app, client):
    r = httpx.post(app.base_url + "/v1/chat/completions", json={"messages": MSGS})
    assert r.status_code == 200 and r.json()["model"] == "scripted"
    for call in (lambda: client.chat.completions.create(model="mashbox", messages=MSGS),
                 lambda: client.completions.create(model="mashbox", prompt="Say"),
                 lambda: client.responses.create(model="mashbox", input="Hi")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] == "model_not_found"


def test_messages_accepts_any_name(app):
    c = anthropic.Anthropic(base_url=app.base_url, api_key="unused", max_retries=0, timeout=60)
    for name in ("mashbox-model", "claude-sonnet-4-5"):
        m = c.messages.create(model=name, max_tokens=8, messages=MSGS)
        assert m.model == name and m.content[0].text == "ok"
