"""Byte-level tests of HttpProtocol: bytes in through the parser callbacks, bytes out
through a fake transport (no sockets), asserting on exactly what is written.

Every test runs on vclock.py's controlled clock: a timeout is asserted at its exact
(virtual) time, not inside a sleep window a loaded machine could stretch."""
from __future__ import annotations

import asyncio
import dataclasses

import orjson
import pytest

from mashbox.config import ServerConfig
from mashbox.http import protocol as protocol_mod
from mashbox.http.protocol import HttpProtocol
from mashbox.http.response import HTTPError, json_response, text_response
from mashbox.http.router import Router
from mashbox.http.security import Guard
from mashbox.http.sse import DONE, HEARTBEAT, StreamResponse, data
from vclock import run_virtual

CFG = ServerConfig(port=8000, max_body_bytes=1000, max_url_bytes=200, max_header_bytes=600,
                   keepalive_timeout_s=5.0)
HOST = b"Host: 127.0.0.1:8000\r\n"


def get(path: str, extra: bytes = b"") -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\n" + HOST + extra + b"\r\n"


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST " + path.encode() + b" HTTP/1.1\r\n" + HOST + b"Content-Type: application/json\r\n"
            + b"Content-Length: %d\r\n" % len(body) + extra + b"\r\n" + body)


def make_router(cfg: ServerConfig = CFG, log: list | None = None) -> Router:
    r = Router(Guard(cfg))
    gates: dict[str, asyncio.Event] = {}

    async def health(req):
        return json_response({"status": "ok"})

    async def slow(req):
        await asyncio.sleep(float(req.query.get("s", "0.05")))
        return text_response("slow " + req.query.get("n", ""))

    async def fast(req):
        return text_response("fast " + req.query.get("n", ""))

    async def echo(req):
        return json_response({"body": req.json(), "len": len(req.body)})

    async def gate(req):
        ev = gates.setdefault(req.params["name"], asyncio.Event())
        await ev.wait()
        return text_response("opened")

    async def hang(req):
        try:
            await asyncio.sleep(3600)
        finally:
            log.append("hang cancelled")
        return text_response("never")

    async def stream(req):
        async def events():
            try:
                for i in range(3):
                    yield data({"i": i})
                yield DONE
            finally:
                if log is not None:
                    log.append("stream closed")

        return StreamResponse(events(), headers={"x-stream": "1"})

    async def model(req):
        if req.params["model"] != "m1":
            raise HTTPError(404, f"Model {req.params['model']} not found.", code="model_not_found")
        return json_response({"id": "m1"})

    r.get("/health", health)
    r.get("/slow", slow)
    r.get("/fast", fast)
    r.post("/v1/echo", echo)
    r.get("/gate/{name}", gate)
    r.get("/hang", hang)
    r.get("/v1/stream", stream)
    r.get("/v1/models/{model}", model)
    r.post("/v1/messages", echo, family="anthropic")
    r.gates = gates
    return r


async def open_conn(router: Router, transport_cls, cfg: ServerConfig = CFG):
    loop = asyncio.get_running_loop()
    proto = HttpProtocol(router, cfg, loop)
    t = transport_cls(proto)
    proto.connection_made(t)
    return proto, t


async def settle(proto: HttpProtocol, timeout: float = 2.0) -> None:
    """Until the protocol has answered everything it parsed."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while proto.task is not None or proto.pipeline:
        assert loop.time() < end, "protocol did not settle"
        await asyncio.sleep(0.001)
    await asyncio.sleep(0)


def run(coro):
    return run_virtual(coro)


def test_pipelined_requests_answered_in_order(fake_transport, parse):
    async def main():
        proto, t = await open_conn(make_router(), fake_transport)
        # The first handler is slow, the others instant: answers must still come in order.
        proto.data_received(get("/slow?n=1&s=0.05") + get("/fast?n=2") + get("/slow?n=3&s=0.0") + get("/fast?n=4"))
        await settle(proto)
        rs = parse(t.take())
        assert [r.body for r in rs] == [b"slow 1", b"fast 2", b"slow 3", b"fast 4"]
        assert all(r.status == 200 and "connection" not in r.headers for r in rs)
        assert not t.closed

    run(main())


def test_pipelined_request_split_at_every_byte(fake_transport, parse):
    async def main():
        proto, t = await open_conn(make_router(), fake_transport)
        raw = get("/fast?n=a") + post("/v1/echo", b'{"x": [1, 2]}') + get("/health")
        for i in range(len(raw)):
            proto.data_received(raw[i:i + 1])
        await settle(proto)
        rs = parse(t.take())
        assert [r.status for r in rs] == [200, 200, 200]
        assert rs[0].body == b"fast a"
        assert orjson.loads(rs[1].body) == {"body": {"x": [1, 2]}, "len": 13}
        assert orjson.loads(rs[2].body) == {"status": "ok"}

    run(main())


def test_keep_alive_and_connection_close(fake_transport, parse):
    async def main():
        proto, t = await open_conn(make_router(), fake_transport)
        proto.data_received(get("/health"))
        await settle(proto)
        assert parse(t.take())[0].status == 200 and not t.closed
        proto.data_received(get("/health", b"Connection: close\r\n"))
        await settle(proto)
        r = parse(t.take())[0]
        assert r.status == 200 and r.headers["connection"] == "close"
        assert t.closed

    run(main())


def test_http10_closes_unless_keep_alive(fake_transport, parse):
    async def main():
        proto, t = await open_conn(make_router(), fake_transport)
        proto.data_received(b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        await settle(proto)
        assert parse(t.take())[0].status == 200 and not t.closed
        proto.data_received(b"GET /health HTTP/1.0\r\n\r\n")
        await settle(proto)
        assert parse(t.take())[0].headers["connection"] == "close"
        assert t.closed

    run(main())


def test_chunked_request_body(fake_transport, parse):
    async def main():
        proto, t = await open_conn(make_router(), fake_transport)
        body = b'{"text": "' + b"y" * 300 + b'"}'
        chunks = b"".join(b"%x\r\n%b\r\n" % (len(body[i:i + 70]), body[i:i + 70]) for i in range(0, len(body), 70))
        raw = (b"POST /v1/echo HTTP/1.1\r\n" + HOST + b"Content-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n")
        proto.data_received(raw[:50])
        proto.data_received(raw[50:])
        await settle(proto)
        r = parse(t.take())[0]
        assert r.status == 200
        assert orjson.loads(r.body) == {"body": {"text": "y" * 300}, "len": len(body)}

    run(main())


def test_body_over_limit_by_content_length_is_413_and_closes(fake_transport, parse):
    async def main():
        log = []
        proto, t = await open_conn(make_router(log=log), fake_transport)
        # The head alone refuses it: the 1001 bytes never need to arrive.
        proto.data_received(b"POST /v1/echo HTTP/1.1\r\n" + HOST + b"Content-Type: application/json\r\n"
                            b"Content-Length: 1001\r\n\r\n")
        await settle(proto)
        r = parse(t.take())[0]
        assert r.status == 413 and r.headers["connection"] == "close"
        assert orjson.loads(r.body)["error"]["code"] == "request_too_large"
        assert t.eof_written  # lingering close: FIN first, input dropped until the client ends
        proto.data_received(b"x" * 500)  # the body still arriving is ignored
        assert t.take() == b""

    run(main())


def test_chunked_body_over_limit_is_413_in_the_anthropic_shape(fake_transport, parse):
    async def main():
        proto, t = await open_conn(make_router(), fake_transport)
        proto.data_received(b"POST /v1/messages HTTP/1.1\r\n" + HOST + b"Content-Type: application/json\r\n"
                            b"Transfer-Encoding: chunked\r\n\r\n")
        for _ in range(3):
            proto.data_received(b"190\r\n" + b"z" * 400 + b"\r\n")
        await settle(proto)
        r = parse(t.take())[0]
        assert r.status == 413
        assert orjson.loads(r.body) == {"type": "error", "error": {
            "type": "request_too_large", "message": "The request body is larger than 1000 bytes."}}

    run(main())


def test_url_too_long_is_414(fake_transport, parse):
    async def main():
        proto, t = await open_conn(make_router(), fake_transport)
        proto.data_received(b"GET /health?" + b"q" * 150)
        proto.data_received(b"q" * 100 + b" HTTP/1.1\r\n" + HOST + b"\r\n")
        await settle(proto)
        r = parse(t.take())[0]
        assert r.status == 414 and r.headers["connection"] == "close"

    run(main())


def test_headers_too_large_is_431(fake_transport, parse):
    async def main():
        proto, t = await open_conn(make_router(), fake_transport)
        many = b"".join(b"X-Filler-%d: %s\r\n" % (i, b"v" * 40) for i in range(20))
        proto.data_received(get("/health", many))
        await settle(proto)
        r = parse(t.take())[0]
        assert r.status == 431 and t.eof_written

    run(main())


def test_one_endless_header_line_is_431_before_it_ends(fake_transport, parse):
    async def main():
        proto, t = await open_conn(make_router(), fake_transport)
        proto.data_received(b"GET /health HTTP/1.1\r\n" + HOST + b"X-Big: ")
        for _ in range(10):
            proto.data_received(b"b" * 100)  # never a line end
        await settle(proto)
        r = parse(t.take())[0]
        assert r.status == 431

    run(main())


@pytest.mark.parametrize("raw", [
    b"GARBAGE\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nBad Header Line\r\n\r\n",
    b"GET /health HTTP/9.9\r\n\r\n",
    # (a well-formed head, so the head's own checks pass and the bad chunk decides)
    b"POST /v1/echo HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"POST /v1/echo HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
    # request smuggling shapes: both framings, or a bare LF
    b"POST /v1/echo HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"GET /health HTTP/1.1\nHost: 127.0.0.1:8000\n\n",
])
def test_malformed_is_400_and_closes(fake_transport, parse, raw):
    async def main():
        proto, t = await open_conn(make_router(), fake_transport)
        proto.data_received(raw)
        await settle(proto)
        rs = parse(t.take())
        assert [r.status for r in rs] == [400]
        assert rs[0].headers["connection"] == "close"
        assert orjson.loads(rs[0].body)["error"]["type"] == "invalid_request_error"
        assert t.eof_written

    run(main())


def test_malformed_after_a_good_request_answers_both_in_order(fake_transport, parse):
    async def main():
        proto, t = await open_conn(make_router(), fake_transport)
        proto.data_received(get("/slow?n=1&s=0.03") + b"NOT HTTP AT ALL\r\n\r\n")
        await settle(proto)
        rs = parse(t.take())
        assert [(r.status, r.body[:6]) for r in rs][0] == (200, b"slow 1")
        assert rs[1].status == 400

    run(main())


def test_head_is_get_without_body(fake_transport, parse):
    async def main():
        proto, t = await open_conn(make_router(), fake_transport)
        proto.data_received(get("/health"))
        await settle(proto)
        g = parse(t.take())[0]
        proto.data_received(b"HEAD /health HTTP/1.1\r\n" + HOST + b"\r\n" + get("/fast?n=after"))
        await settle(proto)
        raw = t.take()
        h, after = parse(raw, head_methods=(True, False))
        assert h.status == 200 and h.body == b""
        assert h.headers["content-length"] == g.headers["content-length"] == "15"
        assert after.body == b"fast after"
        # HEAD on an unknown path and on a stream: heads only.
        proto.data_received(b"HEAD /nope HTTP/1.1\r\n" + HOST + b"\r\nHEAD /v1/stream HTTP/1.1\r\n" + HOST + b"\r\n")
        await settle(proto)
        n, s = parse(t.take(), head_methods=(True, True))
        assert n.status == 404 and int(n.headers["content-length"]) > 0 and n.body == b""
        assert s.status == 200 and s.headers["content-type"] == "text/event-stream"

    run(main())


def test_404_405_and_families(fake_transport, parse):
    async def main():
        proto, t = await open_conn(make_router(), fake_transport)
        proto.data_received(get("/nope") + b"DELETE /health HTTP/1.1\r\n" + HOST + b"\r\n"
                            + get("/v1/messages") + get("/v1/messages/count") + get("/v1/models/m2")
                            + get("/v1/models/m1"))
        await settle(proto)
        nope, delete, msg_get, msg_unknown, m2, m1 = parse(t.take())
        assert nope.status == 404 and orjson.loads(nope.body)["error"]["type"] == "not_found_error"
        assert delete.status == 405 and delete.headers["allow"] == "GET, HEAD"
        assert msg_get.status == 405 and msg_get.headers["allow"] == "POST"
        assert orjson.loads(msg_get.body)["type"] == "error"  # Anthropic shape
        assert msg_unknown.status == 404
        assert orjson.loads(msg_unknown.body)["error"]["type"] == "not_found_error"
        assert orjson.loads(msg_unknown.body)["type"] == "error"
        assert m2.status == 404 and orjson.loads(m2.body)["error"]["code"] == "model_not_found"
        assert m1.status == 200 and orjson.loads(m1.body) == {"id": "m1"}
        assert not t.closed  # routing errors keep the connection

    run(main())


def test_reading_pauses_above_the_pipeline_high_water_mark(fake_transport, parse):
    async def main():
        router = make_router()
        proto, t = await open_conn(router, fake_transport)
        proto.data_received(get("/gate/a") + get("/fast?n=0") * (protocol_mod.PIPELINE_HIGH + 4))
        await asyncio.sleep(0.01)
        assert t.reading_paused, "reading should pause while many answers wait"
        router.gates.setdefault("a", asyncio.Event()).set()
        await settle(proto)
        assert not t.reading_paused
        rs = parse(t.take())
        assert len(rs) == protocol_mod.PIPELINE_HIGH + 5 and rs[0].body == b"opened"

    run(main())


def test_idle_keep_alive_connection_closes_after_timeout(fake_transport, parse):
    async def main():
        cfg = dataclasses.replace(CFG, keepalive_timeout_s=75.0)
        proto, t = await open_conn(make_router(cfg), fake_transport, cfg)
        proto.data_received(get("/health"))
        await settle(proto)
        assert parse(t.take())[0].status == 200
        answered = t.written_at
        await asyncio.sleep(answered + 75.0 - 0.01 - asyncio.get_running_loop().time())
        assert not t.closed, "closed before the keep-alive timeout"
        await asyncio.sleep(0.02)
        assert t.closed and t.take() == b""
        assert t.closed_at == pytest.approx(answered + 75.0, abs=1e-6)

    run(main())


def test_slow_headers_close_at_the_idle_timeout(fake_transport):
    async def main():
        cfg = dataclasses.replace(CFG, keepalive_timeout_s=75.0)
        proto, t = await open_conn(make_router(cfg), fake_transport, cfg)
        opened = asyncio.get_running_loop().time()
        proto.data_received(b"GET /health HTTP/1.1\r\n")  # and never the rest
        await asyncio.sleep(75.0 - 0.01)
        assert not t.closed
        await asyncio.sleep(0.02)
        assert t.closed and t.closed_at == pytest.approx(opened + 75.0, abs=1e-6)

    run(main())


def test_expect_100_continue(fake_transport, parse):
    async def main():
        proto, t = await open_conn(make_router(), fake_transport)
        proto.data_received(b"POST /v1/echo HTTP/1.1\r\n" + HOST + b"Content-Type: application/json\r\n"
                            b"Content-Length: 2\r\nExpect: 100-continue\r\n\r\n")
        assert t.take() == b"HTTP/1.1 100 Continue\r\n\r\n"
        proto.data_received(b"{}")
        await settle(proto)
        assert parse(t.take())[0].status == 200

    run(main())


def test_disconnect_cancels_a_running_handler(fake_transport):
    async def main():
        log = []
        proto, t = await open_conn(make_router(log=log), fake_transport)
        proto.data_received(get("/hang") + get("/health"))
        await asyncio.sleep(0.01)
        proto.connection_lost(ConnectionResetError())
        await asyncio.sleep(0.01)
        assert log == ["hang cancelled"]
        assert t.take() == b"" and not proto.pipeline

    run(main())


def test_sse_is_chunked_and_keeps_the_connection(fake_transport, parse):
    async def main():
        log = []
        proto, t = await open_conn(make_router(log=log), fake_transport)
        proto.data_received(get("/v1/stream") + get("/health"))
        await settle(proto)
        raw = t.take()
        s, h = parse(raw)
        assert s.status == 200 and s.chunked
        assert s.headers["content-type"] == "text/event-stream"
        assert s.headers["cache-control"] == "no-cache"
        assert s.headers["connection"] == "keep-alive"
        assert s.headers["x-stream"] == "1"
        assert "content-length" not in s.headers
        assert s.body == b'data: {"i":0}\n\ndata: {"i":1}\n\ndata: {"i":2}\n\n' + DONE
        # each frame is its own chunk, written as it came
        assert raw.count(b"\r\nf\r\ndata: ") == 3
        assert h.status == 200 and not t.closed
        assert log == ["stream closed"]

    run(main())


def test_sse_on_http10_is_close_delimited(fake_transport, parse):
    async def main():
        proto, t = await open_conn(make_router(), fake_transport)
        proto.data_received(b"GET /v1/stream HTTP/1.0\r\n\r\n")
        await settle(proto)
        await asyncio.sleep(0.01)
        s = parse(t.take())[0]
        assert "transfer-encoding" not in s.headers and s.headers["connection"] == "close"
        assert s.body.endswith(DONE) and t.closed

    run(main())


def test_sse_waits_while_writing_is_paused_and_cuts_a_slow_reader(fake_transport, parse):
    """A transport without a TCP socket to ask (sendwatch.py): writing that stays paused
    for slow_reader_timeout_s is cut, at exactly that time; meanwhile the generator is
    not pulled and no heartbeat is written."""
    async def main():
        cfg = dataclasses.replace(CFG, slow_reader_timeout_s=30.0, heartbeat_s=15.0)
        loop = asyncio.get_running_loop()
        closed = []
        pulled = []

        async def endless(req):
            async def events():
                try:
                    i = 0
                    while True:
                        pulled.append(i)
                        yield data({"i": i})
                        i += 1
                        await asyncio.sleep(0.001)  # a fast token stream
                finally:
                    closed.append(True)
            return StreamResponse(events())

        r = Router(Guard(cfg))
        r.get("/v1/endless", endless)
        proto, t = await open_conn(r, fake_transport, cfg)
        proto.data_received(get("/v1/endless"))
        await asyncio.sleep(0.01)
        proto.pause_writing()  # the client stopped reading
        await asyncio.sleep(0.01)  # a frame already on its way is written, then the pump waits
        n_paused = len(pulled)
        before = len(t.data)
        await asyncio.sleep(20.0)  # past a heartbeat, short of the cut
        # Paused: nothing more pulled from the generator, no heartbeat written.
        assert len(pulled) == n_paused and len(t.data) == before
        assert not t.closed
        proto.resume_writing()  # it read a little
        await asyncio.sleep(0.01)
        assert len(pulled) > n_paused and not closed
        proto.pause_writing()  # and stops for good
        paused_at = loop.time()
        await asyncio.sleep(30.0 - 0.01)
        assert not t.closed, "cut before the slow-reader timeout"
        await asyncio.sleep(0.02)
        assert t.closed and t.aborted
        assert t.closed_at == pytest.approx(paused_at + 30.0, abs=1e-6)
        assert closed == [True]

    run(main())


def test_sse_heartbeat_after_quiet_period(fake_transport, parse):
    async def main():
        cfg = dataclasses.replace(CFG, heartbeat_s=15.0)

        async def quiet(req):
            async def events():
                yield data({"a": 1})
                await asyncio.sleep(40.0)  # a long prefill: heartbeats at 15 s and 30 s
                yield DONE
            return StreamResponse(events())

        r = Router(Guard(cfg))
        r.get("/v1/quiet", quiet)
        proto, t = await open_conn(r, fake_transport, cfg)
        proto.data_received(get("/v1/quiet"))
        await settle(proto, timeout=60.0)
        s = parse(t.take())[0]
        assert s.body == b'data: {"a":1}\n\n' + HEARTBEAT + HEARTBEAT + DONE

    run(main())


def test_failing_generator_closes_without_the_last_chunk(fake_transport):
    async def main():
        async def broken(req):
            async def events():
                yield data({"a": 1})
                raise RuntimeError("boom")
            return StreamResponse(events())

        r = Router(Guard(CFG))
        r.get("/v1/broken", broken)
        proto, t = await open_conn(r, fake_transport)
        proto.data_received(get("/v1/broken"))
        await asyncio.sleep(0.02)
        raw = t.take()
        assert raw.endswith(b'data: {"a":1}\n\n\r\n') and b"\r\n0\r\n\r\n" not in raw
        assert t.aborted

    run(main())


def test_access_log_has_no_headers_keys_or_bodies(fake_transport, caplog):
    async def main():
        proto, t = await open_conn(make_router(), fake_transport)
        proto.data_received(post("/v1/echo?secret=q", b'{"prompt": "private words"}',
                                 b"Authorization: Bearer sk-secret-key\r\nX-Session-Id: sess-42\r\n"))
        await settle(proto)

    with caplog.at_level("INFO", logger="mashbox.access"):
        run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == "mashbox.access"]
    assert len(lines) == 1
    line = lines[0]
    assert line.startswith("POST /v1/echo 200 ") and line.endswith(" session=sess-42")
    for secret in ("sk-secret-key", "private", "secret=q", "Bearer"):
        assert secret not in line


def test_stream_close_runs_on_close_even_when_the_generator_never_started(fake_transport, parse):
    """HEAD and a client gone before the first frame: an async generator that never
    started skips its `finally`, so on_close is the api's hook to cancel the engine."""
    async def main():
        log = []

        async def gated(req):
            async def events():
                try:
                    log.append("started")
                    yield data({"a": 1})
                finally:
                    log.append("finally")
            return StreamResponse(events(), on_close=lambda: log.append("on_close"))

        r = Router(Guard(CFG))
        r.get("/v1/s", gated)
        proto, t = await open_conn(r, fake_transport)
        proto.data_received(b"HEAD /v1/s HTTP/1.1\r\n" + HOST + b"\r\n")
        await settle(proto)
        assert parse(t.take(), head_methods=(True,))[0].status == 200
        assert log == ["on_close"]
        log.clear()
        proto.data_received(get("/v1/s"))
        await settle(proto)
        assert parse(t.take())[0].body == b'data: {"a":1}\n\n'
        assert log == ["started", "finally", "on_close"]

    run(main())



def test_large_pipelined_body_then_a_new_head_in_one_read_is_not_431(fake_transport, parse):
    async def main():
        cfg = dataclasses.replace(CFG, max_body_bytes=100_000)
        proto, t = await open_conn(make_router(cfg), fake_transport, cfg)
        body = b'{"pad": "' + b"p" * 50_000 + b'"}'
        # One read: a whole POST with a body larger than the header limits, then the
        # first bytes of the next request's head.
        proto.data_received(post("/v1/echo", body) + b"GET /fast?n=2 HTTP/1.1\r\n")
        proto.data_received(HOST + b"\r\n")
        await settle(proto)
        a, b = parse(t.take())
        assert a.status == 200 and orjson.loads(a.body)["len"] == len(body)
        assert b.status == 200 and b.body == b"fast 2"

    run(main())


def test_frames_ready_together_share_a_send_and_paced_frames_go_out_at_once(fake_transport, parse):
    async def main():
        gate = asyncio.Event()

        async def burst_then_wait(req):
            async def events():
                for i in range(50):
                    yield data({"i": i})  # all ready at once
                await gate.wait()  # then the "engine" is slow
                yield DONE
            return StreamResponse(events())

        class CountingTransport(fake_transport):
            writes = 0

            def write(self, d):
                CountingTransport.writes += 1
                super().write(d)

        r = Router(Guard(CFG))
        r.get("/v1/b", burst_then_wait)
        proto, t = await open_conn(r, CountingTransport)
        proto.data_received(get("/v1/b"))
        await asyncio.sleep(0.01)
        # The head, then the 50 frames in one send, written before the generator waits.
        assert CountingTransport.writes == 2
        assert t.data.count(b"data: {") == 50
        gate.set()
        await settle(proto)
        assert CountingTransport.writes == 3  # [DONE] and the last chunk together
        s = parse(t.take())[0]
        assert s.body.count(b"data: {") == 50 and s.body.endswith(DONE)

    run(main())


def test_class_based_event_iterator_with_aclose(fake_transport, parse):
    """The api wraps its generators in a class (EventStream-like): __anext__ is a
    coroutine that may wait, aclose cancels the engine request."""
    async def main():
        log = []

        class Frames:
            def __init__(self):
                self.n = 0

            def __aiter__(self):
                return self

            async def __anext__(self):
                if self.n == 3:
                    raise StopAsyncIteration
                self.n += 1
                if self.n == 2:
                    await asyncio.sleep(0.005)
                return data({"n": self.n})

            async def aclose(self):
                log.append("aclose")

        async def h(req):
            return StreamResponse(Frames())

        r = Router(Guard(CFG))
        r.get("/v1/c", h)
        proto, t = await open_conn(r, fake_transport)
        proto.data_received(get("/v1/c"))
        await settle(proto)
        assert parse(t.take())[0].body == b'data: {"n":1}\n\ndata: {"n":2}\n\ndata: {"n":3}\n\n'
        assert log == ["aclose"]

    run(main())


def test_a_response_that_cannot_be_written_becomes_500(fake_transport, parse):
    async def main():
        async def bad_header(req):
            return text_response("x", headers={"x-evil": "a\r\nset-cookie: b"})

        async def not_a_response(req):
            return {"status": "ok"}

        r = Router(Guard(CFG))
        r.get("/bad", bad_header)
        r.get("/dict", not_a_response)
        for path in ("/bad", "/dict"):
            proto, t = await open_conn(r, fake_transport)
            proto.data_received(get(path))
            await settle(proto)
            out = t.take()
            assert b"set-cookie" not in out
            resp = parse(out)[0]
            assert resp.status == 500 and resp.headers["connection"] == "close"
            assert orjson.loads(resp.body)["error"]["type"] == "server_error"

    run(main())


@pytest.mark.timeout(120)
def test_a_reset_during_a_burst_of_ready_frames_ends_the_stream(fake_transport):
    """uvloop drops writes to a transport whose send failed and calls connection_lost only
    on a later loop turn; a stream whose frames are all ready at once must then wait for
    that instead of pulling frames forever (the loop would spin at 100% CPU)."""
    async def main():
        log = []

        pulled = [0]

        async def endless(req):
            async def events():
                try:
                    while pulled[0] < 3_000_000:  # "endless": the bound only ends a spin
                        pulled[0] += 1
                        yield data({"x": 1})
                finally:
                    log.append("closed")
            return StreamResponse(events())

        class ResetTransport(fake_transport):
            def write(self, d):
                if self.closed:
                    return  # dropped, as uvloop does once the transport is closing
                if len(self.data) > 100_000:  # the send fails: closing, lost on a later turn
                    self.closed = True
                    asyncio.get_event_loop().call_soon(self.protocol.connection_lost, ConnectionResetError())
                    return
                super().write(d)

        r = Router(Guard(CFG))
        r.get("/v1/e", endless)
        proto, t = await open_conn(r, ResetTransport)
        proto.data_received(get("/v1/e"))
        for _ in range(200):
            await asyncio.sleep(0.01)
            if log:
                break
        assert log == ["closed"] and proto.closed
        assert pulled[0] < 20_000, f"{pulled[0]} frames pulled after the transport closed"

    run(main())


def test_body_bytes_are_counted_until_answered_and_freed_on_every_path(fake_transport, parse):
    """The buffered-body budget (limits.py) gets every byte back: after an answer, a
    refusal, a disconnect mid-body, and a disconnect while the handler runs."""
    from mashbox.http.limits import BodyBudget

    async def main():
        cfg = dataclasses.replace(CFG, max_body_bytes=100_000)
        budget = BodyBudget(150_000)
        router = make_router(cfg, log=[])
        body = b'{"pad": "' + b"p" * 50_000 + b'"}'
        # answered
        proto, t = await open_conn(router, fake_transport, cfg)
        proto.budget = budget
        proto.data_received(post("/v1/echo", body))
        await settle(proto)
        assert parse(t.take())[0].status == 200 and budget.used == 0
        # a disconnect mid-body
        proto.data_received(post("/v1/echo", body)[:30_000])
        assert budget.used > 0
        proto.connection_lost(ConnectionResetError())
        assert budget.used == 0
        # two connections: the second body does not fit beside the first and is 503
        a, ta = await open_conn(router, fake_transport, cfg)
        b, tb = await open_conn(router, fake_transport, cfg)
        a.budget = b.budget = budget
        a.data_received(post("/v1/echo", b"x" * 90_000)[:-1])  # held, unfinished
        b.data_received(post("/v1/echo", b"y" * 90_000)[:-1])
        await settle(b)
        r = parse(tb.take())[0]
        assert r.status == 503 and r.headers["retry-after"] == "1" and r.headers["connection"] == "close"
        assert budget.used == 90_000 - 1  # b's bytes were freed at once
        a.data_received(b"x")
        await settle(a)
        assert parse(ta.take())[0].status == 400 and budget.used == 0  # (not JSON: answered)
        # a Content-Length that does not fit is refused from the head alone
        c, tc = await open_conn(router, fake_transport, cfg)
        c.budget = BodyBudget(1000)
        c.data_received(post("/v1/echo", b"z" * 5000)[:200])
        await settle(c)
        assert parse(tc.take())[0].status == 503 and c.budget.used == 0

    run(main())


def test_body_progress_deadline(fake_transport, parse):
    """A body must bring body_progress_bytes every body_progress_s (at its exact
    deadline: 408 and close); a steady upload is not cut however long it takes, and
    time while the server pauses reading does not count."""
    from mashbox.http.limits import Limits

    async def main():
        loop = asyncio.get_running_loop()
        cfg = dataclasses.replace(CFG, max_body_bytes=1_000_000)
        limits = Limits(body_progress_s=30.0, body_progress_bytes=1000)
        router = make_router(cfg)
        # a trickle: one byte a second
        proto, t = await open_conn(router, fake_transport, cfg)
        proto.limits = limits
        proto.data_received(post("/v1/echo", b"a" * 500)[:-500])
        head_at = loop.time()
        for _ in range(29):
            proto.data_received(b"a")
            await asyncio.sleep(1.0)
        assert t.take() == b""
        await asyncio.sleep(head_at + 30.0 + 0.01 - loop.time())
        r = parse(t.take())[0]
        assert r.status == 408 and r.headers["connection"] == "close"
        assert orjson.loads(r.body)["error"]["code"] == "request_timeout"
        assert t.eof_written and proto.budget.used == 0
        # a steady upload, 1000 bytes every 20 s, for 200 s: answered
        proto, t = await open_conn(router, fake_transport, cfg)
        proto.limits = limits
        body = b'{"p": "' + b"q" * 9990 + b'"}'
        raw = post("/v1/echo", body)
        head = len(raw) - len(body)
        proto.data_received(raw[:head])
        for i in range(head, len(raw), 1000):
            await asyncio.sleep(20.0)
            proto.data_received(raw[i:i + 1000])
        await settle(proto)
        assert parse(t.take())[0].status == 200
        # paused reading (the pipeline is full) does not count against the body
        proto, t = await open_conn(router, fake_transport, cfg)
        proto.limits = limits
        proto.data_received(get("/gate/p") + get("/fast") * (protocol_mod.PIPELINE_HIGH + 4)
                            + raw[:head + 10])
        assert t.reading_paused
        await asyncio.sleep(100.0)
        assert b"408" not in t.data
        router.gates.setdefault("p", asyncio.Event()).set()
        await asyncio.sleep(0.01)
        assert not t.reading_paused
        proto.data_received(raw[head + 10:])
        await settle(proto)
        rs = parse(t.take())
        assert [r.status for r in rs][-1] == 200 and len(rs) == protocol_mod.PIPELINE_HIGH + 6

    run(main())
