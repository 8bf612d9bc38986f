"""GET /openapi.json: the repository's openapi.json (OpenAPI 3.1), with the running model.

The document is read once at start-up; the served copy names the running model in
`info.x-mashbox-model` and as the example of every request's `model` field, and its
`servers` URL is where this server listens: the configured host (the address the
connection arrived on when the host is a wildcard such as 0.0.0.0) and the port the
socket is really bound to (`--port 0` included).
"""
from __future__ import annotations

import copy
import os
from typing import Optional

import orjson

from mashbox.api.common import OPENAI, ApiContext
from mashbox.http.response import HTTPError, Response

# Shipped inside the package (package data) so an installed server serves it too; the
# repository's top-level openapi.json is a link to this file.
OPENAPI_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "openapi.json")


def load(path: str = OPENAPI_PATH) -> dict:
    with open(path, "rb") as f:
        return orjson.loads(f.read())


_WILDCARDS = ("", "0.0.0.0", "::")


def server_url(host: str, port: int, local_addr: Optional[tuple] = None) -> str:
    """http://host:port of this server; local_addr (the connection's socket name) gives the
    real port, and the real address when host is a wildcard."""
    if local_addr:
        if host in _WILDCARDS:
            host = str(local_addr[0])
        port = int(local_addr[1])
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def with_model(doc: dict, model_id: str, url: Optional[str] = None) -> dict:
    """A copy naming the running model (the document's own is a placeholder) and, when
    url is given, the server's own address as its one `servers` entry."""
    doc = copy.deepcopy(doc)
    if url is not None:
        doc["servers"] = [{"url": url}]
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
        sc = api.server_config
        url = server_url(sc.host, sc.port, req.local_addr)
        body = cache.get((model_id, url))
        if body is None:
            body = cache[(model_id, url)] = orjson.dumps(with_model(doc, model_id, url))
        return Response(200, body, content_type="application/json")

    return [("GET", "/openapi.json", openapi, OPENAI)]
