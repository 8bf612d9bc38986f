"""The server's own routes: health, models, /metrics, /openapi.json; and the answers
while the model loads (scripted engine: the real worker is ready too soon to catch)."""
from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from api_scripted_engine import EngineInfo, InProcessServer, ScriptedEngine, text_events

SPEC_ROUTES = {
    ("get", "/v1/health"), ("get", "/health"), ("get", "/"), ("head", "/v1/health"), ("get", "/v1/models"),
    ("get", "/v1/models/{model}"), ("post", "/v1/chat/completions"), ("post", "/v1/completions"),
    ("post", "/v1/messages"), ("post", "/v1/messages/count_tokens"), ("post", "/v1/responses"),
    ("get", "/metrics"), ("get", "/openapi.json"),
}
SPEC_SCHEMAS = {"Health", "Model", "ModelList", "Error", "AnthropicError", "ChatMessage", "ChatCompletion",
                "ChatTimings", "ChatUsage", "ChatCompletionChunk", "Completion", "Message", "ContentBlock",
                "MessageUsage", "MessageStreamEvent", "TokenCount", "Response", "ResponseItem",
                "ResponseStreamEvent"}
METRICS = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "cache_config_info",
           "request_success_total", "prompt_tokens_total", "generation_tokens_total",
           "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
           "worker_restarts_total", "compiles_after_ready_total", "time_to_first_token_seconds",
           "request_queue_time_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds",
           "host_cache_bytes", "host_cache_capacity_bytes", "host_cache_hits_total", "host_cache_evictions_total",
           "prefill_dedupes_total")


@pytest.mark.slow
class TestRealServer:
    def test_health_routes(self, base_url):
        for path in ("/v1/health", "/health", "/"):
            r = httpx.get(base_url + path)
            assert r.status_code == 200
            h = r.json()
            assert h["status"] == "ok"
            assert type(h["waiting"]) is int and type(h["live_rows"]) is int
            assert isinstance(h["worker_pid"], int) and h["worker_restarts"] == 0
            # the default --cache-ram: a pool of whole blocks under 2048 MiB, what it holds counted once
            assert 0 < h["host_cache_cap_bytes"] <= 2048 << 20 and h["cache_namespace"].startswith("mashbox-kv1-")
            assert h["cache_bytes"] == h["host_cache_bytes"] + h["snapshot_bytes"] <= h["host_cache_cap_bytes"]
        r = httpx.head(base_url + "/v1/health")
        assert r.status_code == 200 and r.content == b""

    def test_health_counts_a_running_request_and_its_end(self, base_url, model_id):
        """live_rows counts the request being decoded; once its client goes away, the slot is
        free again (polled until it is, with a deadline)."""
        body = {"model": model_id, "messages": [{"role": "user", "content": "Count to fifty."}],
                "max_tokens": 200, "stream": True, "temperature": 0}
        with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            while '"content"' not in next(lines):  # the model is decoding: the request holds a slot
                pass
            h = httpx.get(base_url + "/health").json()
            assert h["live_rows"] + h["waiting"] >= 1, h
        deadline = time.monotonic() + 30
        while True:
            h = httpx.get(base_url + "/health").json()
            if h["live_rows"] == 0 and h["waiting"] == 0:
                break
            assert time.monotonic() < deadline, f"the cancelled request still holds its slot: {h}"
            time.sleep(0.05)

    def test_models(self, base_url, model_id):
        data = httpx.get(base_url + "/v1/models").json()
        assert data["object"] == "list" and len(data["data"]) == 1
        m = data["data"][0]
        assert m["id"] == model_id and m["object"] == "model" and m["owned_by"] == "mashbox-labs"
        assert m["created"] == 0 and m["max_model_len"] == 4096 and m["slots"] == 4
        assert m["cache_ram_mib"] == 2048  # the default --cache-ram
        assert m["weights"].endswith(".gguf") and m["bpw"] > 4 and m["gb"] > 0
        assert httpx.get(base_url + f"/v1/models/{model_id}").json() == m
        r = httpx.get(base_url + "/v1/models/gpt-4o")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"

    def test_models_through_the_sdk(self, openai_client, model_id):
        assert [m.id for m in openai_client.models.list()] == [model_id]
        assert openai_client.models.retrieve(model_id).id == model_id

    def test_metrics(self, base_url, openai_client, model_id):
        openai_client.completions.create(model=model_id, prompt="Hello", max_tokens=2)
        r = httpx.get(base_url + "/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        text = r.text
        names = set()
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            name = re.match(r"[^{ ]+", line).group(0)
            assert name.startswith("mashbox:"), line
            names.add(name)
        for m in METRICS:
            assert any(n == f"mashbox:{m}" or n.startswith(f"mashbox:{m}_") for n in names), m
        assert 'mashbox:cache_config_info{block_size="4096",num_blocks="4"} 1' in text
        finished = sum(int(v) for v in re.findall(r'mashbox:request_success_total\{[^}]*\} (\d+)', text))
        assert finished >= 1
        gen = int(re.search(r"^mashbox:generation_tokens_total (\d+)", text, re.M).group(1))
        assert gen >= 1
        for label in re.findall(r"\{([^}]*)\}", text):
            for pair in label.split(","):
                assert pair.split("=")[0] in ("finished_reason", "block_size", "num_blocks", "le")

    def test_openapi(self, base_url, model_id):
        r = httpx.get(base_url + "/openapi.json")
        assert r.status_code == 200
        doc = r.json()
        assert doc["openapi"].startswith("3.1")
        assert doc["info"]["x-mashbox-model"] == model_id
        routes = {(m, p) for p, ops in doc["paths"].items() for m in ops if m in ("get", "post", "head")}
        assert SPEC_ROUTES <= routes
        assert SPEC_SCHEMAS <= set(doc["components"]["schemas"])
        assert doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]["model"]["example"] == model_id


def test_openapi_file_refs_resolve():
    """Every $ref of the repository's openapi.json points at a schema it defines."""
    from mashbox.api.openapi import load

    doc = load()
    schemas = doc["components"]["schemas"]
    refs = re.findall(r'"\$ref":\s*"#/components/schemas/([^"]+)"', json.dumps(doc))
    assert refs and all(r in schemas for r in refs)


def test_loading_answers(default_model_path):
    engine = ScriptedEngine(lambda req: text_events(req, ["x"]), ready=False)
    with InProcessServer(engine, default_model_path) as app:
        r = httpx.get(app.base_url + "/v1/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        assert httpx.head(app.base_url + "/v1/health").status_code == 503
        r = httpx.post(app.base_url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503 and r.headers["retry-after"] and r.headers["x-should-retry"] == "true"
        assert r.json()["error"]["type"] == "server_error"
        r = httpx.post(app.base_url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503
        engine.state, engine.info = "ok", EngineInfo(model_id="scripted", ctx=64, slots=2)
        assert httpx.get(app.base_url + "/health").json()["status"] == "ok"
        r = httpx.post(app.base_url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "x"


def test_a_model_that_cannot_load_ends_serve_with_exit_code_1(default_model_path):
    import asyncio

    from mashbox.api.app import serve_async
    from mashbox.config import EngineConfig, ServerConfig

    class BrokenEngine(ScriptedEngine):
        async def wait_ready(self):
            raise RuntimeError("the weights file is corrupt")

    async def main():
        return await asyncio.wait_for(serve_async(
            ServerConfig(host="127.0.0.1", port=0), EngineConfig(model_path=default_model_path, model_id="x"),
            engine=BrokenEngine(lambda req: [], ready=False), stop=asyncio.Event()), 60)

    assert asyncio.run(main()) == 1


def test_ui_page_replaces_health_at_root_only_with_ui(default_model_path):
    """`mashbox run --ui`: GET / is the chat page; health stays at /health and /v1/health.
    The page drives this server's own streamed chat route, which the scripted engine answers."""
    from mashbox.config import ServerConfig

    engine = ScriptedEngine(lambda req: text_events(req, ["Hel", "lo"]))
    with InProcessServer(engine, default_model_path, ServerConfig(host="127.0.0.1", port=0, ui=True)) as app:
        r = httpx.get(app.base_url + "/")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "<title>MASHBOX Chat</title>" in r.text and "/v1/chat/completions" in r.text
        assert httpx.head(app.base_url + "/").status_code == 200
        assert httpx.get(app.base_url + "/health").json()["status"] == "ok"
        # The request the page sends, and the fields its script reads from the stream.
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", app.base_url + "/v1/chat/completions", json=body) as s:
            frames = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        chunks = [json.loads(f) for f in frames[:-1]]
        assert frames[-1] == "[DONE]"
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "Hello"
        assert any("timings" in c for c in chunks)
    with InProcessServer(engine, default_model_path) as app:  # without --ui, / is health
        assert httpx.get(app.base_url + "/").json()["status"] == "ok"
