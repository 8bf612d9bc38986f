"""What the api tests share to talk to a server: requests, raw bytes and SSE frames.

- `post(base_url, body, path)`: an httpx POST, the response as httpx gives it.
- `raw_exchange(base_url, method, path, body)`: one HTTP/1.1 request on a plain socket
  (`connection: close`), the response's head and its body exactly as written (a chunked
  body is de-chunked, and its framing checked on the way).
- `sse_frames(raw)`: (event name or "", data text) per SSE frame; comments skipped.
- `sse_events(raw)`: strict `event: NAME\\ndata: JSON` frames -> (name, payload), with
  the name repeated as the payload's type (Messages, Responses).
- `raw_stream(base_url, body, path)`: a streamed POST read with httpx -> sse_events.
"""
from __future__ import annotations

import socket
from typing import Optional
from urllib.parse import urlsplit

import httpx
import orjson


def post(base_url: str, body, path: str = "/v1/chat/completions", headers: Optional[dict] = None,
         timeout: float = 60.0) -> httpx.Response:
    return httpx.post(base_url + path, json=body, headers=headers, timeout=timeout)


def raw_exchange(base_url: str, method: str, path: str, body: Optional[bytes] = None,
                 headers: Optional[dict] = None, timeout: float = 60.0) -> tuple[bytes, bytes]:
    """(head, body) of one response read until the server closes the connection."""
    url = urlsplit(base_url)
    lines = [f"{method} {path} HTTP/1.1", f"host: {url.hostname}:{url.port}", "connection: close"]
    for k, v in (headers or {}).items():
        lines.append(f"{k}: {v}")
    if body is not None:
        lines += ["content-type: application/json", f"content-length: {len(body)}"]
    data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")
    with socket.create_connection((url.hostname, url.port), timeout=timeout) as s:
        s.sendall(data)
        parts = []
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            parts.append(chunk)
    raw = b"".join(parts)
    head, sep, rest = raw.partition(b"\r\n\r\n")
    assert sep, raw[:200]
    if b"\r\ntransfer-encoding: chunked" in head.lower():
        rest = dechunk(rest)
    return head, rest


def dechunk(raw: bytes) -> bytes:
    """A chunked body -> its payload; the framing must be exact and end with the last chunk."""
    out = []
    pos = 0
    while True:
        eol = raw.index(b"\r\n", pos)
        size = int(raw[pos:eol], 16)
        start = eol + 2
        if size == 0:
            assert raw[start:] == b"\r\n", raw[start:start + 100]
            return b"".join(out)
        out.append(raw[start:start + size])
        assert raw[start + size:start + size + 2] == b"\r\n"
        pos = start + size + 2


def sse_frames(raw: bytes) -> list[tuple[str, str]]:
    frames = []
    for block in raw.decode().split("\n\n"):
        if not block.strip() or block.startswith(":"):
            continue
        name, data = "", []
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data.append(line[len("data: "):])
        frames.append((name, "\n".join(data)))
    return frames


def sse_events(raw: bytes) -> list[tuple[str, dict]]:
    assert raw.endswith(b"\n\n"), raw[-100:]
    frames = []
    for block in raw[:-2].split(b"\n\n"):
        if block.startswith(b":"):
            continue
        lines = block.split(b"\n")
        assert len(lines) == 2 and lines[0].startswith(b"event: ") and lines[1].startswith(b"data: "), block
        name = lines[0][len(b"event: "):].decode()
        data = orjson.loads(lines[1][len(b"data: "):])
        assert data["type"] == name
        frames.append((name, data))
    return frames


def raw_stream(base_url: str, body: dict, path: str = "/v1/messages", headers: Optional[dict] = None,
               timeout: float = 300.0) -> list[tuple[str, dict]]:
    with httpx.stream("POST", base_url + path, json=body, headers=headers, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.read())
