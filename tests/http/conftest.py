"""Fixtures for the http layer: a fake transport for byte-level protocol tests (run them
on vclock.py's controlled clock), an exact response splitter, and a real server on
127.0.0.1:<free port> in a thread."""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest
import uvloop

from mashbox.config import ServerConfig
from mashbox.http.limits import Limits
from mashbox.http.server import Server, serve


class FakeTransport(asyncio.Transport):
    """Records what the protocol writes and the flow-control calls it makes."""

    def __init__(self, protocol=None):
        super().__init__()
        self.protocol = protocol
        self.data = bytearray()
        self.closed = False
        self.aborted = False
        self.eof_written = False
        self.reading_paused = False
        self.pause_calls = 0
        self.closed_at: Optional[float] = None  # loop time of close / abort
        self.written_at: Optional[float] = None  # loop time of the last write

    def write(self, data):
        assert not self.closed, "write after close"
        self.data += data
        self.written_at = asyncio.get_event_loop().time()

    def writelines(self, lines):
        for d in lines:
            self.write(d)

    def close(self):
        if not self.closed:
            self.closed = True
            loop = asyncio.get_event_loop()
            self.closed_at = loop.time()
            loop.call_soon(self.protocol.connection_lost, None)

    def abort(self):
        self.aborted = True
        self.close()

    def is_closing(self):
        return self.closed

    def can_write_eof(self):
        return True

    def write_eof(self):
        self.eof_written = True

    def pause_reading(self):
        self.reading_paused = True
        self.pause_calls += 1

    def resume_reading(self):
        self.reading_paused = False

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def take(self) -> bytes:
        out = bytes(self.data)
        self.data.clear()
        return out


@dataclass
class ParsedResponse:
    status: int
    headers: dict  # lower-case name -> value (last wins)
    header_list: list
    body: bytes
    chunked: bool = False


def parse_responses(data: bytes, head_methods: tuple[bool, ...] = ()) -> list[ParsedResponse]:
    """Every response in `data`, split exactly (Content-Length, chunked, or to the end).
    head_methods[i] True: the i-th answered a HEAD (no body after its head). Raises on
    bytes that are not a well-formed response, so framing bugs fail the test."""
    out: list[ParsedResponse] = []
    pos = 0
    i = 0
    while pos < len(data):
        end = data.index(b"\r\n\r\n", pos)
        lines = data[pos:end].decode("latin-1").split("\r\n")
        version, status, _reason = lines[0].split(" ", 2)
        assert version == "HTTP/1.1", lines[0]
        headers, header_list = {}, []
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            assert sep and name == name.strip(), f"bad header line {line!r}"
            headers[name.lower()] = value.strip()
            header_list.append((name.lower(), value.strip()))
        pos = end + 4
        r = ParsedResponse(int(status), headers, header_list, b"")
        is_head = i < len(head_methods) and head_methods[i]
        if is_head or r.status in (100, 204, 304):
            pass
        elif headers.get("transfer-encoding") == "chunked":
            assert "content-length" not in headers
            r.chunked = True
            body = bytearray()
            while True:
                eol = data.index(b"\r\n", pos)
                size = int(data[pos:eol], 16)
                pos = eol + 2
                if size == 0:
                    assert data[pos:pos + 2] == b"\r\n", "no CRLF after the last chunk"
                    pos += 2
                    break
                body += data[pos:pos + size]
                assert data[pos + size:pos + size + 2] == b"\r\n", "chunk not followed by CRLF"
                pos += size + 2
            r.body = bytes(body)
        elif "content-length" in headers:
            n = int(headers["content-length"])
            r.body = data[pos:pos + n]
            assert len(r.body) == n, "body shorter than Content-Length"
            pos += n
        else:
            r.body = data[pos:]
            pos = len(data)
        out.append(r)
        i += 1
    return out


@pytest.fixture
def fake_transport():
    return FakeTransport


@dataclass
class ServerHandle:
    port: int
    config: ServerConfig
    loop: asyncio.AbstractEventLoop
    server: Optional[Server] = None  # read it from the test thread only for counts
    probes: dict = field(default_factory=dict)

    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{path}"


class ServerThread:
    """A mashbox http server in its own thread and uvloop loop, stopped by the test."""

    def __init__(self, make_router: Callable[[ServerConfig], object], config: ServerConfig,
                 limits: Optional[Limits] = None):
        self.make_router = make_router
        self.config = config
        self.limits = limits
        self.ready = threading.Event()
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        loop = uvloop.new_event_loop()
        asyncio.set_event_loop(loop)
        self.loop = loop
        try:
            router = self.make_router(self.config)
            self.server = loop.run_until_complete(serve(router, self.config, limits=self.limits))
        except BaseException as e:  # surfaced to the test by start()
            self.error = e
            self.ready.set()
            return
        self.ready.set()
        loop.run_forever()
        loop.run_until_complete(self.server.close(grace_s=1.0))
        loop.close()

    def start(self) -> ServerHandle:
        self.thread.start()
        self.ready.wait(10)
        if self.error is not None:
            raise self.error
        return ServerHandle(self.server.port, self.config, self.loop, self.server)

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        assert not self.thread.is_alive(), "server thread did not stop"


@pytest.fixture
def start_server():
    """start_server(make_router, config, limits=None) -> ServerHandle; every server stops
    after the test."""
    started: list[ServerThread] = []

    def start(make_router, config: ServerConfig, limits: Optional[Limits] = None) -> ServerHandle:
        st = ServerThread(make_router, config, limits)
        started.append(st)
        return st.start()

    yield start
    for st in started:
        st.stop()


@pytest.fixture
def parse():
    return parse_responses
