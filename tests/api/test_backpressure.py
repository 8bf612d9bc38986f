"""Backpressure and disconnects with the real engine, over real sockets.

One slot, held by a long generation; tenant alice fills her 32 waiting places, her 33rd
request gets 429 (both route families) while tenant bob still gets in; then every client
goes away and the running and waiting gauges return to zero (the engine requests were
cancelled whether they were queued or decoding).
"""
from __future__ import annotations

import asyncio
import json
import re
import time

import pytest

pytestmark = pytest.mark.slow

KEYS = {"alice": "sk-alice-0123456789", "bob": "sk-bob-9876543210"}


def _request(path: str, body: dict, key: str) -> bytes:
    raw = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {key}\r\nContent-Length: {len(raw)}\r\n\r\n").encode() + raw


async def _open(port: int, path: str, body: dict, key: str):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_request(path, body, key))
    await writer.drain()
    return reader, writer


async def _head(reader) -> tuple[int, dict, bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, v in (l.split(":", 1) for l in lines[1:] if ":" in l)}
    return status, headers, head


async def _gauges(port: int, key: str) -> dict:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
                 "Connection: close\r\n\r\n".encode())
    text = (await reader.read()).decode()
    writer.close()
    return {name: float(v) for name, v in
            re.findall(r"^mashbox:(num_requests_running|num_requests_waiting) ([0-9.e+]+)$", text, re.M)}


async def _until(port: int, key: str, want: dict, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        g = await _gauges(port, key)
        if all(g.get(k) == v for k, v in want.items()) or time.monotonic() > deadline:
            return g
        await asyncio.sleep(0.2)


def test_tenant_flood_gets_429_other_tenant_gets_in_and_disconnects_free_everything(start_mashbox, tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# two tenants\n" + "".join(f"{name}: {key}\n" for name, key in KEYS.items()))
    server = start_mashbox("--slots", "1", "--api-key-file", str(key_file),
                           headers={"Authorization": f"Bearer {KEYS['alice']}"})
    port = int(server.base_url.rsplit(":", 1)[1])
    alice, bob = KEYS["alice"], KEYS["bob"]
    # Counting goes on for thousands of tokens: the one slot stays busy through the test.
    long_job = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 3000, "stream": True}
    waiting_job = {"prompt": "Hello", "max_tokens": 8, "stream": True}

    async def main():
        conns = []
        try:
            r, w = await _open(port, "/v1/completions", long_job, alice)
            conns.append(w)
            status, _, _ = await _head(r)
            assert status == 200
            g = await _until(port, alice, {"num_requests_running": 1})
            assert g["num_requests_running"] == 1, g
            for _ in range(32):
                conns.append((await _open(port, "/v1/completions", waiting_job, alice))[1])
            g = await _until(port, alice, {"num_requests_waiting": 32})
            assert g == {"num_requests_running": 1, "num_requests_waiting": 32}, g

            # alice's 33rd waiting request: 429 with Retry-After, in each route family's shape.
            r, w = await _open(port, "/v1/chat/completions",
                               {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, alice)
            status, headers, _ = await _head(r)
            body = json.loads(await r.readexactly(int(headers["content-length"])))
            w.close()
            assert status == 429 and int(headers["retry-after"]) >= 1
            assert body["error"]["type"] == "rate_limit_error" and "waiting" in body["error"]["message"]
            r, w = await _open(port, "/v1/messages", {"model": "x", "max_tokens": 4, "stream": True,
                                                      "messages": [{"role": "user", "content": "hi"}]}, alice)
            status, headers, _ = await _head(r)
            body = json.loads(await r.readexactly(int(headers["content-length"])))
            w.close()
            assert status == 429 and body["type"] == "error" and headers.get("retry-after")

            # bob is another tenant: he gets in (message_start comes as soon as his prompt is counted).
            r, w = await _open(port, "/v1/messages", {"model": "x", "max_tokens": 4, "stream": True,
                                                      "messages": [{"role": "user", "content": "hi"}]}, bob)
            conns.append(w)
            status, headers, _ = await _head(r)
            assert status == 200 and headers["content-type"].startswith("text/event-stream")
            first = await asyncio.wait_for(r.readuntil(b"\n\n"), 30)
            assert b"message_start" in first
            g = await _until(port, alice, {"num_requests_waiting": 33})
            assert g == {"num_requests_running": 1, "num_requests_waiting": 33}, g
        finally:
            for w in conns:
                w.close()
        # Every client is gone: queued and decoding requests are cancelled, gauges back to 0.
        g = await _until(port, alice, {"num_requests_running": 0, "num_requests_waiting": 0}, timeout=30)
        assert g == {"num_requests_running": 0, "num_requests_waiting": 0}, g

    asyncio.run(main())
