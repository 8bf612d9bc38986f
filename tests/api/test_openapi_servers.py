"""GET /openapi.json names where this server really listens in `servers` (not always :8000).

Over a real socket: the route module's own handler behind http.server on a port the
kernel picks, then on a wildcard host; and server_url's rules for IPv6 and wildcards.
"""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from mashbox.api import openapi
from mashbox.config import ServerConfig
from mashbox.http.router import Router
from mashbox.http.server import serve


def _served_doc(sc: ServerConfig) -> tuple[dict, int]:
    api = SimpleNamespace(model_id="tiny-model", server_config=sc)  # the two fields the route reads

    async def run():
        router = Router(None)
        for method, path, handler, family in openapi.routes(api):
            router.add(method, path, handler, family)
        server = await serve(router, sc)
        port = server.port
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /openapi.json HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            raw = await reader.read()
            writer.close()
        finally:
            await server.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        return json.loads(body), port

    return asyncio.run(run())


def test_servers_url_is_the_real_port():
    doc, port = _served_doc(ServerConfig(host="127.0.0.1", port=0))
    assert port != 8000
    assert doc["servers"] == [{"url": f"http://127.0.0.1:{port}"}]
    assert doc["info"]["x-mashbox-model"] == "tiny-model"


def test_wildcard_host_names_the_address_the_client_reached():
    doc, port = _served_doc(ServerConfig(host="0.0.0.0", port=0, api_keys=(("k", "t"),)))
    assert doc["servers"] == [{"url": f"http://127.0.0.1:{port}"}]


def test_server_url_rules():
    assert openapi.server_url("127.0.0.1", 8123) == "http://127.0.0.1:8123"
    assert openapi.server_url("localhost", 0, ("127.0.0.1", 4242)) == "http://localhost:4242"
    assert openapi.server_url("::1", 9000, ("::1", 9000, 0, 0)) == "http://[::1]:9000"
    assert openapi.server_url("::", 9000, ("::1", 9001, 0, 0)) == "http://[::1]:9001"
    assert openapi.server_url("0.0.0.0", 80, ("10.1.2.3", 80)) == "http://10.1.2.3:80"
