"""GET /openapi.json: the repository's openapi.json (OpenAPI 3.1), with the running model.

The document is read once at start-up; the served copy names the running model in
`info.x-mashbox-model` and as the example of every request's `model` field.
"""
from __future__ import annotations

import copy
import os

import orjson

from mashbox.api.common import OPENAI, ApiContext
from mashbox.http.response import HTTPError, Response

# Shipped inside the package (package data) so an installed server serves it too; the
# repository's top-level openapi.json is a link to this file.
OPENAPI_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "openapi.json")


def load(path: str = OPENAPI_PATH) -> dict:
    with open(path, "rb") as f:
        return orjson.loads(f.read())


def with_model(doc: dict, model_id: str) -> dict:
    """A copy naming the running model (the document's own is a placeholder)."""
    doc = copy.deepcopy(doc)
    doc.setdefault("info", {})["x-mashbox-model"] = model_id
    for schema in doc.get("components", {}).get("schemas", {}).values():
        model = schema.get("properties", {}).get("model")
        if isinstance(model, dict):
            model["example"] = model_id
    return doc


def routes(api: ApiContext) -> list:
    try:
        doc = load()
    except OSError:
        doc = None
    cache: dict = {}

    async def openapi(req):
        if doc is None:
            raise HTTPError(404, f"openapi.json is not installed with this server ({OPENAPI_PATH}).")
        model_id = api.model_id
        body = cache.get(model_id)
        if body is None:
            body = cache[model_id] = orjson.dumps(with_model(doc, model_id))
        return Response(200, body, content_type="application/json")

    return [("GET", "/openapi.json", openapi, OPENAI)]
