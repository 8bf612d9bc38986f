"""The server's own routes: health, the model list, one model.

Rules:
- GET /v1/health, /health and / answer the Health object: 200 with status "ok" once the
  worker sent its ready frame, 503 with status "loading" before (and while a worker
  restarts). HEAD is answered by the same handlers (the protocol drops the body).
  With `--ui`, GET / is the chat page instead.
- GET /v1/models lists the one model, once under its id and once under each --alias;
  GET /v1/models/{model} answers it when {model} is one of those names, else 404
  model_not_found. Figures the worker measures (context length,
  weights, GB, bits per weight) come from its ready frame; before it, the configured
  values (context 0 when the model's own length is not known yet).
- The host memory prompt cache fields (--cache-ram) come from engine.stats(): cache_bytes
  = host_cache_bytes + snapshot_bytes, each pool block counted once.
- Health fields about programs this build does not have are reported as what they are
  here: null ids, "uncertified".
"""
from __future__ import annotations

import logging
import os

from mashbox.api.common import OPENAI, ApiContext, model_not_found
from mashbox.http.response import Response, json_response

log = logging.getLogger("mashbox.api")

UI_INDEX = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ui", "index.html")


def health_json(api: ApiContext) -> dict:
    engine = api.engine
    stats = engine.stats()
    ready = api.ready
    body = {
        "status": "ok" if ready else "loading",
        "live_rows": stats.running if ready else None,
        "waiting": stats.waiting,
        "cache_bytes": stats.host_cache_bytes + stats.snapshot_bytes,
        "host_cache_bytes": stats.host_cache_bytes,
        "snapshot_bytes": stats.snapshot_bytes,
        "host_cache_cap_bytes": stats.host_cache_cap_bytes,
        "host_cache_evictions": stats.host_cache_evictions,
        "cache_namespace": stats.cache_namespace,
        "deployment_id": None,
        "component_set_sha": None,
        "certification": "uncertified",
        "compiles_after_ready": stats.compiles_after_ready if ready else None,
        "routed_experts": None,
        "worker_pid": stats.worker_pid,
        "worker_restarts": stats.worker_restarts,
    }
    error = engine.error
    if error:
        body["error"] = error  # the worker could not load the model: say why
    return body


def model_json(api: ApiContext, name: str = "") -> dict:
    """The Model object of the served model under `name` (one of api.served_names; the id
    when not given)."""
    info = api.info
    model = {
        "id": name or api.model_id,
        "object": "model",
        "owned_by": "mashbox-labs",
        "created": 0,
        "max_model_len": int((info.ctx if info else 0) or api.engine_config.ctx or 0),
        "prefix_cache": True,
        "slots": int((info.slots if info else 0) or api.engine_config.slots),
        "cache_ram_mib": int(api.engine_config.cache_ram_mib),
    }
    weights = os.path.basename((info.weights_file if info else "") or api.engine_config.model_path)
    if weights:
        model["weights"] = weights
    for key, value in (("gb", info.gb if info else None), ("bpw", info.bpw if info else None)):
        if value is not None:
            model[key] = float(value)
    return model


def routes(api: ApiContext) -> list:
    async def health(req):
        return json_response(health_json(api), 200 if api.ready else 503,
                             None if api.ready else {"retry-after": "5"})

    async def root(req):
        if api.server_config.ui and req.method == "GET":
            try:
                with open(UI_INDEX, "rb") as f:
                    return Response(200, f.read(), content_type="text/html; charset=utf-8")
            except OSError:
                log.warning("--ui: %s is missing; answering health at /", UI_INDEX)
        return await health(req)

    async def models(req):
        return json_response({"object": "list", "data": [model_json(api, name) for name in api.served_names]})

    async def one_model(req):
        name = req.params.get("model", "")
        if name not in api.served_names:
            raise model_not_found(name, api.model_id)
        return json_response(model_json(api, name))

    return [
        ("GET", "/v1/health", health, OPENAI),
        ("GET", "/health", health, OPENAI),
        ("GET", "/", root, OPENAI),
        ("GET", "/v1/models", models, OPENAI),
        ("GET", "/v1/models/{model}", one_model, OPENAI),
    ]
