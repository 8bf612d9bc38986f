"""Real sockets: a mashbox http server on 127.0.0.1:<free port>, driven by raw sockets,
http.client, httpx and the official OpenAI / Anthropic SDKs. The handlers are test
routes over a scripted token source (the api layer's tests run the real engine)."""
from __future__ import annotations

import asyncio
import dataclasses
import http.client
import socket
import threading
import time

import anthropic
import httpx
import openai
import orjson
import pytest

from mashbox.config import ServerConfig
from mashbox.http.limits import Limits
from mashbox.http.response import HTTPError, json_response, retry_after, text_response
from mashbox.http.router import Router
from mashbox.http.security import Guard
from mashbox.http.server import serve
from mashbox.http.sse import DONE, HEARTBEAT, StreamResponse, data, event

BASE = ServerConfig(host="127.0.0.1", port=0, max_body_bytes=4096, max_url_bytes=1024,
                    max_header_bytes=2048, keepalive_timeout_s=5.0)


class Probes:
    """Thread-safe flags the server-side handlers set, read by the test thread."""

    def __init__(self):
        self.events: dict[str, threading.Event] = {}
        self.lock = threading.Lock()
        self.values: dict[str, object] = {}

    def ev(self, name: str) -> threading.Event:
        with self.lock:
            return self.events.setdefault(name, threading.Event())


def chat_chunk(cid: str, delta: dict, finish=None) -> dict:
    return {"id": cid, "object": "chat.completion.chunk", "created": 1, "model": "m1",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def app_factory(probes: Probes):
    def make(cfg: ServerConfig) -> Router:
        r = Router(Guard(cfg))

        async def health(req):
            return json_response({"status": "ok"})

        async def models(req):
            return json_response({"object": "list", "data": [{"id": "m1", "object": "model"}]})

        async def one_model(req):
            return json_response({"id": req.params["model"], "object": "model"})

        async def metrics(req):
            return text_response("mashbox:requests_running 0\n")

        async def openapi(req):
            return json_response({"openapi": "3.1.0"})

        async def chat(req):
            body = req.json()
            probes.values["tenant"] = req.tenant
            words = ["Mercury", ", Venus", " and Earth."]
            if not body.get("stream"):
                return json_response({
                    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m1",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(words)},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}})

            async def events():
                yield data(chat_chunk("chatcmpl-1", {"role": "assistant", "content": ""}))
                for w in words:
                    await asyncio.sleep(0.001)
                    yield data(chat_chunk("chatcmpl-1", {"content": w}))
                yield data(chat_chunk("chatcmpl-1", {}, "stop"))
                yield DONE
            return StreamResponse(events())

        async def messages(req):
            body = req.json()
            if body.get("max_tokens") == 0:
                raise HTTPError(400, "max_tokens: must be >= 1", param="max_tokens")
            return json_response({
                "id": "msg_1", "type": "message", "role": "assistant", "model": "m1",
                "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn",
                "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}})

        async def busy(req):
            raise HTTPError(429, "Too many requests are waiting.", headers=retry_after(3))

        async def endless(req):
            """Big frames as fast as the client takes them, until closed."""
            async def events():
                frame = b"data: " + b"x" * 65536 + b"\n\n"
                try:
                    while True:
                        probes.values["sent"] = probes.values.get("sent", 0) + 1
                        yield frame
                finally:
                    probes.values["closed_at"] = time.monotonic()
                    probes.ev("endless closed").set()
            return StreamResponse(events())

        async def megabytes(req):
            """`mb` MiB of 16 KiB frames, one each `ms` milliseconds (a fast token
            stream), then DONE; probes.values["mb sent"] counts the bytes produced."""
            frame = b"data: " + b"y" * 16376 + b"\n\n"
            n = int(float(req.query.get("mb", "2")) * 64)
            pause = float(req.query.get("ms", "0")) / 1000

            async def events():
                done = False
                probes.values["mb sent"] = 0
                try:
                    for _ in range(n):
                        yield frame
                        probes.values["mb sent"] += len(frame)
                        if pause:
                            await asyncio.sleep(pause)
                    done = True
                    yield DONE
                finally:
                    (probes.ev("mb finished") if done else probes.ev("mb cut")).set()
            return StreamResponse(events())

        async def big(req):
            return text_response("z" * (8 << 20))

        async def one_then_wait(req):
            """One frame, then waits on a generation that never comes (a long prefill)."""
            async def events():
                try:
                    yield data({"n": 0})
                    await asyncio.sleep(3600)
                    yield DONE
                finally:
                    probes.ev("wait closed").set()
            return StreamResponse(events())

        async def quiet(req):
            async def events():
                yield data({"n": 0})
                await asyncio.sleep(float(req.query.get("s", "0.5")))
                yield DONE
            return StreamResponse(events())

        async def hang(req):
            probes.ev("hang started").set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                probes.ev("hang cancelled").set()
                raise
            return text_response("never")

        r.get("/health", health)
        r.get("/", health)
        r.get("/v1/health", health)
        r.get("/v1/models", models)
        r.get("/v1/models/{model}", one_model)
        r.get("/metrics", metrics)
        r.get("/openapi.json", openapi)
        r.post("/v1/chat/completions", chat)
        r.post("/v1/messages", messages, family="anthropic")
        r.get("/v1/busy", busy)
        r.get("/v1/endless", endless)
        r.get("/v1/one-then-wait", one_then_wait)
        r.get("/v1/megabytes", megabytes)
        r.get("/v1/big", big)
        r.get("/v1/quiet", quiet)
        r.post("/v1/hang", hang)
        return r
    return make


@pytest.fixture
def probes():
    return Probes()


@pytest.fixture
def srv(start_server, probes):
    return start_server(app_factory(probes), BASE)


KEYS = (("sk-alice-1", "alice"), ("sk-alice-2", "alice"), ("sk-lone", "key-0123456789abcdef"))


@pytest.fixture
def keyed(start_server, probes):
    return start_server(app_factory(probes), dataclasses.replace(BASE, api_keys=KEYS))


def request(srv, method, path, body=None, headers=None, host=True):
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
    try:
        c.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        hdrs = {"Host": srv.host()} if host is True else ({"Host": host} if host else {})
        hdrs.update(headers or {})
        if body is not None:
            hdrs.setdefault("Content-Length", str(len(body)))
        for k, v in hdrs.items():
            c.putheader(k, v)
        c.endheaders(body)
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        c.close()


def raw_exchange(srv, payload: bytes, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", srv.port), timeout=timeout) as s:
        s.sendall(payload)
        out = b""
        while True:
            try:
                b = s.recv(65536)
            except ConnectionResetError:
                break
            if not b:
                break
            out += b
        return out


JSON = {"Content-Type": "application/json"}


# ---- every status code this layer produces -------------------------------------------

def test_200_and_head(srv):
    status, h, body = request(srv, "GET", "/health")
    assert (status, orjson.loads(body)) == (200, {"status": "ok"})
    status, h2, body = request(srv, "HEAD", "/v1/health")
    assert status == 200 and body == b"" and h2["content-length"] == h["content-length"]


def test_400_malformed_request_closes(srv):
    out = raw_exchange(srv, b"GET /health HTTP/1.1\r\nHost: x\r\nNo colon here\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 400 ") and b"connection: close" in out


def test_400_body_not_json(srv):
    status, _, body = request(srv, "POST", "/v1/chat/completions", b"{nope", JSON)
    assert status == 400
    assert orjson.loads(body)["error"]["message"].startswith("The request body is not valid JSON")


def test_400_anthropic_shape(srv):
    status, _, body = request(srv, "POST", "/v1/messages", b'{"max_tokens": 0}', JSON)
    assert status == 400
    assert orjson.loads(body) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: must be >= 1"}}


def test_400_without_host(srv):
    status, _, _ = request(srv, "GET", "/health", host=None)
    assert status == 400


@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.2:{port}", "localhost.evil:{port}"])
def test_403_host_the_server_does_not_answer_to(srv, host):
    status, _, body = request(srv, "GET", "/health", host=host.format(port=srv.port))
    assert status == 403
    assert orjson.loads(body)["error"]["type"] == "permission_error"


@pytest.mark.parametrize("host", ["localhost:{port}", "127.0.0.1:{port}", "LOCALHOST:9999", "localhost"])
def test_host_names_it_answers_to(srv, host):
    # Only the name is compared: an SSH tunnel from another local port still works.
    assert request(srv, "GET", "/health", host=host.format(port=srv.port))[0] == 200


def test_server_names_are_answered(start_server, probes):
    s = start_server(app_factory(probes), dataclasses.replace(BASE, server_names=("box.lan",)))
    assert request(s, "GET", "/health", host=f"box.lan:{s.port}")[0] == 200
    assert request(s, "GET", "/health", host=f"other.lan:{s.port}")[0] == 403


@pytest.mark.parametrize("origin", ["http://evil.example", "http://127.0.0.1:1", "null", "https://127.0.0.1:{port}x"])
def test_403_other_origin(srv, origin):
    status, _, body = request(srv, "POST", "/v1/chat/completions", b'{"messages": []}',
                              {**JSON, "Origin": origin.format(port=srv.port)})
    assert status == 403
    assert "origin" in orjson.loads(body)["error"]["message"]


def test_same_origin_is_allowed(srv):
    status, _, _ = request(srv, "POST", "/v1/chat/completions", b'{"messages": []}',
                           {**JSON, "Origin": f"http://127.0.0.1:{srv.port}"})
    assert status == 200


def test_404_and_405(srv):
    status, _, body = request(srv, "GET", "/v1/nothing")
    assert status == 404 and orjson.loads(body)["error"]["type"] == "not_found_error"
    status, _, body = request(srv, "GET", "/v1/messages/batches")
    assert status == 404 and orjson.loads(body)["type"] == "error"
    status, h, _ = request(srv, "DELETE", "/v1/models")
    assert status == 405 and h["allow"] == "GET, HEAD"


def test_413_body_too_large(srv):
    out = raw_exchange(srv, b"POST /v1/chat/completions HTTP/1.1\r\nHost: " + srv.host().encode()
                       + b"\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n" + b"{" * 8192)
    assert out.startswith(b"HTTP/1.1 413 ")


def test_414_url_too_long(srv):
    status, _, _ = request(srv, "GET", "/health?q=" + "a" * 2000)
    assert status == 414


def test_415_post_not_json(srv):
    status, _, body = request(srv, "POST", "/v1/chat/completions", b"messages=hi",
                              {"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 415 and orjson.loads(body)["error"]["param"] == "content-type"
    status, _, _ = request(srv, "POST", "/v1/chat/completions", b'{"messages": []}')
    assert status == 415  # no Content-Type at all
    status, _, _ = request(srv, "POST", "/v1/chat/completions", b'{"messages": []}',
                           {"Content-Type": "Application/JSON; charset=utf-8"})
    assert status == 200


def test_431_headers_too_large(srv):
    status, _, _ = request(srv, "GET", "/health", headers={"X-Big": "b" * 3000})
    assert status == 431


def head_then_wait(srv, head: bytes, timeout: float = 10.0) -> bytes:
    """Send only a request's head (its body never comes) and read what the server answers
    until it closes; the recv timeout fails the test when the server waits for the body."""
    try:
        return raw_exchange(srv, head, timeout)
    except socket.timeout:
        raise AssertionError("no answer before the body: the server waited for it") from None


def post_head(srv, path: str, extra: str, host: str | None = None, length: int = 4000) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {host or srv.host()}\r\nContent-Length: {length}\r\n"
            f"{extra}\r\n").encode()


def test_key_host_origin_and_content_type_are_refused_before_the_body(srv, keyed):
    """Issue 10 item 4: the head decides, the body is never waited for (nor buffered)."""
    cases = [
        (keyed, post_head(keyed, "/v1/chat/completions", "Content-Type: application/json\r\n"), 401),
        (keyed, post_head(keyed, "/v1/chat/completions", "Content-Type: application/json\r\n"
                          "Expect: 100-continue\r\nAuthorization: Bearer sk-wrong\r\n"), 401),
        (srv, post_head(srv, "/v1/chat/completions", "Content-Type: application/json\r\n",
                        host="evil.example"), 403),
        (srv, post_head(srv, "/v1/chat/completions", "Content-Type: application/json\r\n"
                        "Origin: http://evil.example\r\n"), 403),
        (srv, post_head(srv, "/v1/chat/completions", "Content-Type: text/plain\r\n"), 415),
        (srv, post_head(srv, "/v1/messages", ""), 415),
        (srv, (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {srv.host()}\r\n"
               "Transfer-Encoding: chunked\r\n\r\n").encode(), 415),
    ]
    for server, head, status in cases:
        out = head_then_wait(server, head)
        assert out.startswith(b"HTTP/1.1 %d " % status), (head, out[:200])
        assert b"100 Continue" not in out and b"connection: close\r\n" in out
    # The key checked at the head is the same check: a good key waits for its body.
    with socket.create_connection(("127.0.0.1", keyed.port), timeout=5) as s:
        body = b'{"messages": [{"role": "user", "content": "hi"}]}'
        s.sendall(post_head(keyed, "/v1/chat/completions", "Content-Type: application/json\r\n"
                            "Authorization: Bearer sk-lone\r\n", length=len(body)))
        s.sendall(body)
        assert s.recv(65536).startswith(b"HTTP/1.1 200 ")


def test_a_body_that_trickles_is_408_and_closed(start_server, probes):
    """A body must deliver body_progress_bytes per body_progress_s: a byte every 0.1 s
    is cut with 408 after the deadline; the same request sent at once is answered."""
    limits = Limits(body_progress_s=0.5, body_progress_bytes=1024)
    s = start_server(app_factory(probes), BASE, limits)
    sock = socket.create_connection(("127.0.0.1", s.port), timeout=10)
    try:
        sock.sendall(post_head(s, "/v1/chat/completions", "Content-Type: application/json\r\n", length=1000))
        sock.settimeout(0.1)
        out = b""
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10:
            try:
                sock.sendall(b" ")
            except (BrokenPipeError, ConnectionResetError):
                break
            try:
                b = sock.recv(65536)
            except socket.timeout:
                continue
            except ConnectionResetError:
                break
            if not b:
                break
            out += b
        assert out.startswith(b"HTTP/1.1 408 "), out[:200]
        assert orjson.loads(out.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
        assert b"connection: close\r\n" in out
    finally:
        sock.close()


def test_buffered_bodies_are_bounded_across_connections(start_server, probes):
    """20 connections each holding 30 MB of an unfinished body took 600 MB; here 6 hold
    3 MiB of a 4 MiB body each against an 8 MiB bound: what the server holds stays within
    the bound, and the bodies that do not fit are refused with 503 and Retry-After."""
    mib = 1 << 20
    cfg = dataclasses.replace(BASE, max_body_bytes=4 * mib)
    limits = Limits(max_buffered_body_bytes=8 * mib)
    s = start_server(app_factory(probes), cfg, limits)
    answers: dict[int, bytes] = {}
    socks = []

    def client(i: int) -> None:
        sock = socket.create_connection(("127.0.0.1", s.port), timeout=20)
        socks.append(sock)
        try:
            sock.sendall(post_head(s, "/v1/chat/completions", "Content-Type: application/json\r\n",
                                   length=4 * mib))
            sock.sendall(b" " * (3 * mib))  # and never the last MiB
            sock.settimeout(20)
            answers[i] = sock.recv(65536)
        except OSError as e:
            answers[i] = repr(e).encode()

    def held() -> tuple[int, int]:
        """(bytes of unfinished bodies the server holds, connections holding all 3 MiB)."""
        conns = list(s.server.connections)
        return (sum(sum(len(b) for b in list(c._m_body)) for c in conns),
                sum(1 for c in conns if c._m_body_bytes == 3 * mib))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until every client is answered or fully read
        if len([a for a in answers.values() if a]) + held()[1] >= 6:
            break
        time.sleep(0.05)
    total, full = held()
    try:
        assert total <= 8 * mib, f"the server holds {total / mib:.1f} MiB of unfinished bodies"
        refused = [a for a in answers.values() if a.startswith(b"HTTP/1.1 503 ")]
        assert len(refused) + full == 6 and refused, (full, [a[:60] for a in answers.values()])
        assert all(b"retry-after: 1\r\n" in a for a in refused)
        assert s.server.budget.used == total
    finally:
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a client still waiting in recv
            except OSError:
                pass
            sock.close()
        for t in threads:
            t.join(5)


def test_429_carries_retry_after_to_the_sdk(srv):
    client = httpx.get(srv.url("/v1/busy"), headers={"Host": srv.host()})
    assert client.status_code == 429 and client.headers["retry-after"] == "3"
    assert client.json()["error"]["type"] == "rate_limit_error"


# ---- API keys ---------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/models", "/metrics", "/openapi.json", "/v1/health", "/v1/unknown"])
def test_401_without_key_on_protected_paths(keyed, path):
    status, h, body = request(keyed, "GET", path)
    assert status == 401 and h["www-authenticate"] == "Bearer"
    assert orjson.loads(body)["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("path", [
    "//v1/models/m1", "/./v1/models/m1", "/v1/../v1/models/m1", "/v1/%6dodels/m1", "/%76%31/models/m1",
    "/v1//models/m1", "/v1/./models/m1", "/v1/models/./m1", "/x/../v1/models/m1", "/../v1/models/m1",
    "//v1/models", "/v1/%6dodels", "//metrics", "/%6detrics", "/./openapi.json", "/v1/models/",
])
def test_paths_the_router_answers_need_the_key_in_every_spelling(keyed, path):
    """The key check and the router read one canonical path: every spelling that routes
    to a protected route is refused without a key, and answered the same with one."""
    status, _, body = request(keyed, "GET", path)
    assert status == 401, (path, status, body)
    status, _, body = request(keyed, "GET", path, headers={"Authorization": "Bearer sk-lone"})
    assert status == 200, (path, status, body)
    if "models/" in path and not path.endswith("/"):
        assert orjson.loads(body)["id"] == "m1"


def test_an_encoded_slash_stays_inside_its_segment(keyed):
    auth = {"Authorization": "Bearer sk-lone"}
    status, _, body = request(keyed, "GET", "/v1/models/org%2Fname", headers=auth)
    assert status == 200 and orjson.loads(body)["id"] == "org/name"
    # "/v1%2Fmodels" is one segment: no route has it, and it is refused without a key
    # (the check is never looser than the router).
    assert request(keyed, "GET", "/v1%2Fmodels", headers=auth)[0] == 404
    assert request(keyed, "GET", "/v1%2Fmodels")[0] == 401


@pytest.mark.parametrize("path", ["/health", "/"])
def test_health_stays_open_with_keys(keyed, path):
    assert request(keyed, "GET", path)[0] == 200


def test_keys_by_bearer_and_x_api_key_give_tenants(keyed, probes):
    body = b'{"messages": []}'
    assert request(keyed, "POST", "/v1/chat/completions", body, {**JSON, "Authorization": "Bearer sk-wrong"})[0] == 401
    assert request(keyed, "POST", "/v1/chat/completions", body, {**JSON, "Authorization": "Bearer sk-alice-2"})[0] == 200
    assert probes.values["tenant"] == "alice"
    assert request(keyed, "POST", "/v1/chat/completions", body, {**JSON, "x-api-key": "sk-lone"})[0] == 200
    assert probes.values["tenant"] == "key-0123456789abcdef"
    assert request(keyed, "POST", "/v1/chat/completions", body, {**JSON, "Authorization": "Basic sk-lone"})[0] == 401


def test_official_sdks_see_401_in_their_shapes(keyed):
    oa = openai.OpenAI(base_url=keyed.url("/v1"), api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        oa.models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    an = anthropic.Anthropic(base_url=keyed.url(), api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        an.messages.create(model="claude-x", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": "The API key is not valid."}}
    ok = anthropic.Anthropic(base_url=keyed.url(), api_key="sk-alice-1", max_retries=0)
    msg = ok.messages.create(model="claude-x", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert msg.content[0].text == "hi"


def test_refuses_non_loopback_host_without_keys():
    async def main():
        with pytest.raises(ValueError, match="without an API key"):
            await serve(Router(), dataclasses.replace(BASE, host="0.0.0.0"))
    asyncio.run(main())


# ---- streaming ----------------------------------------------------------------------------

def test_openai_sdk_reads_the_stream(srv):
    oa = openai.OpenAI(base_url=srv.url("/v1"), api_key="unused", max_retries=0)
    stream = oa.chat.completions.create(model="m1", messages=[{"role": "user", "content": "planets"}], stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert text == "Mercury, Venus and Earth."
    # keep-alive: the SDK's pooled connection serves the next (non-streamed) request
    r = oa.chat.completions.create(model="m1", messages=[{"role": "user", "content": "planets"}])
    assert r.choices[0].message.content == "Mercury, Venus and Earth."


def test_stream_headers(srv):
    with httpx.stream("POST", srv.url("/v1/chat/completions"), json={"stream": True, "messages": []}) as r:
        assert r.headers["content-type"] == "text/event-stream"
        assert r.headers["cache-control"] == "no-cache"
        assert r.headers["connection"] == "keep-alive"
        assert r.headers["transfer-encoding"] == "chunked"
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and len(lines) == 6


def test_heartbeat_after_quiet_period(start_server, probes):
    s = start_server(app_factory(probes), dataclasses.replace(BASE, heartbeat_s=0.15))
    with httpx.stream("GET", s.url("/v1/quiet?s=0.5")) as r:
        body = b"".join(r.iter_raw())
    assert body.startswith(b'data: {"n":0}\n\n' + HEARTBEAT)
    assert 2 <= body.count(HEARTBEAT) <= 4 and body.endswith(DONE)


def test_slow_reader_is_cut_and_its_iterator_closed(start_server, probes):
    cfg = dataclasses.replace(BASE, slow_reader_timeout_s=0.6, heartbeat_s=0.1)
    s = start_server(app_factory(probes), cfg)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", s.port))
    sock.sendall(b"GET /v1/endless HTTP/1.1\r\nHost: " + s.host().encode() + b"\r\n\r\n")
    # Taken before the one recv below: the server cannot stall on this client before it
    # has the request, so the cut comes at least the timeout after this (taken after the
    # recv, a loaded machine could let the server stall first and the cut look early).
    stopped = time.monotonic()
    assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")  # from here on the client reads nothing
    assert probes.ev("endless closed").wait(15), "slow reader was never cut"
    waited = probes.values["closed_at"] - stopped
    assert waited >= cfg.slow_reader_timeout_s - 0.05, f"cut after {waited:.2f}s, before the timeout"
    # The server closed (reset) the connection: draining the socket ends.
    sock.settimeout(5)
    try:
        while sock.recv(1 << 20):
            pass
    except ConnectionResetError:
        pass
    sock.close()
    # The generator stopped being pulled once the kernel buffers filled.
    assert probes.values["sent"] < 2000


def test_a_client_that_reads_nothing_is_cut_whatever_the_send_buffer_autotuning_does(start_server, probes):
    """Issue 10 item 1, on the machine's own sysctls: a client with a 1 KiB receive buffer
    that never reads a 4 MiB stream paced at 0.8 MB/s. The kernel autotunes the server's
    send buffer towards tcp_wmem's max (4 MiB on a stock kernel) and takes megabytes of
    it, so writing does not pause for seconds (at a token stream's pace, for many
    minutes); the cut must come slow_reader_timeout_s after the client stopped taking
    bytes, long before those buffers are full."""
    cfg = dataclasses.replace(BASE, slow_reader_timeout_s=0.5)
    s = start_server(app_factory(probes), cfg)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect(("127.0.0.1", s.port))
    sock.sendall(b"GET /v1/megabytes?mb=4&ms=20 HTTP/1.1\r\nHost: " + s.host().encode() + b"\r\n\r\n")
    try:
        # The client reads nothing at all; the event is set by the generator's finally.
        assert probes.ev("mb cut").wait(30) or probes.ev("mb finished").wait(30)
        sent = probes.values["mb sent"]
        assert probes.ev("mb cut").is_set(), f"never cut: the whole stream ({sent} bytes) went out"
        # Cut after about 0.5 s of the stream (0.4 MB at this pace, fewer on a busy
        # machine), whereas waiting for writing to pause takes the kernel's buffers.
        assert sent < 1_000_000, f"cut only after {sent} bytes"
        sock.settimeout(10)
        with pytest.raises(ConnectionResetError):  # reset: the queued bytes are dropped
            while sock.recv(1 << 20):
                pass
    finally:
        sock.close()


def test_a_large_answer_to_a_client_that_reads_nothing_is_cut(start_server, probes):
    """Not only streams: an 8 MiB JSON answer waits in the transport for a client that
    never reads; the connection is reset after the timeout, not held forever."""
    cfg = dataclasses.replace(BASE, slow_reader_timeout_s=0.5)
    s = start_server(app_factory(probes), cfg)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect(("127.0.0.1", s.port))
    try:
        sock.sendall(b"GET /v1/big HTTP/1.1\r\nHost: " + s.host().encode() + b"\r\n\r\n")
        deadline = time.monotonic() + 30
        while not s.server.connections:  # accepted (the cut is 0.5 s away at least)
            assert time.monotonic() < deadline, "the connection was never accepted"
            time.sleep(0.01)
        while s.server.connections:
            assert time.monotonic() < deadline, "the connection was never cut"
            time.sleep(0.05)
        sock.settimeout(10)
        with pytest.raises(ConnectionResetError):
            while sock.recv(1 << 20):
                pass
    finally:
        sock.close()


def test_a_stream_with_nothing_to_read_yet_is_not_cut(start_server, probes):
    """Only a client that does not read is cut: a stream whose next frame takes three
    times the cut-off (a long prefill) ends normally."""
    cfg = dataclasses.replace(BASE, slow_reader_timeout_s=0.3)
    s = start_server(app_factory(probes), cfg)
    with httpx.stream("GET", s.url("/v1/quiet?s=1.0"), timeout=10) as r:
        body = b"".join(r.iter_raw())
    assert body == b'data: {"n":0}\n\n' + DONE


def test_reader_that_pauses_briefly_is_not_cut(start_server, probes):
    cfg = dataclasses.replace(BASE, slow_reader_timeout_s=1.5)
    s = start_server(app_factory(probes), cfg)
    with httpx.stream("GET", s.url("/v1/endless")) as r:
        got = 0
        for i, chunk in enumerate(r.iter_raw()):
            got += len(chunk)
            if i == 5:
                time.sleep(0.5)  # stops reading, less than the timeout
            if got > 4_000_000:
                break
    assert got > 4_000_000
    assert probes.ev("endless closed").wait(5)  # closing our side ends the stream too


def test_disconnect_closes_the_stream_iterator_at_once(srv, probes):
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.sendall(b"GET /v1/one-then-wait HTTP/1.1\r\nHost: " + srv.host().encode() + b"\r\n\r\n")
    got = b""
    while b'data: {"n":0}' not in got:
        got += sock.recv(4096)
    t0 = time.monotonic()
    sock.close()
    assert probes.ev("wait closed").wait(2)
    assert time.monotonic() - t0 < 0.5


def test_disconnect_cancels_a_non_streamed_handler(srv, probes):
    sock = socket.create_connection(("127.0.0.1", srv.port))
    body = b'{"a": 1}'
    sock.sendall(b"POST /v1/hang HTTP/1.1\r\nHost: " + srv.host().encode()
                 + b"\r\nContent-Type: application/json\r\nContent-Length: 8\r\n\r\n" + body)
    assert probes.ev("hang started").wait(2)
    t0 = time.monotonic()
    sock.close()
    assert probes.ev("hang cancelled").wait(2)
    assert time.monotonic() - t0 < 0.5


def test_pipelined_over_a_real_socket(srv):
    h = b"Host: " + srv.host().encode() + b"\r\n"
    out = raw_exchange(srv, b"GET /health HTTP/1.1\r\n" + h + b"\r\n"
                       + b"GET /v1/models HTTP/1.1\r\n" + h + b"\r\n"
                       + b"GET /health HTTP/1.1\r\n" + h + b"Connection: close\r\n\r\n")
    assert out.count(b"HTTP/1.1 200 OK") == 3
    assert out.index(b'"status":"ok"') < out.index(b'"object":"list"') < out.rindex(b'"status":"ok"')


def test_sse_event_frame_format():
    frame = event("message_start", {"type": "message_start"})
    assert frame == b'event: message_start\ndata: {"type":"message_start"}\n\n'
    with pytest.raises(ValueError):
        event("bad\nname", {})


def test_server_close_ends_idle_connections_and_aborts_streams_after_the_grace():
    async def main():
        closed = asyncio.Event()

        async def endless(req):
            async def events():
                try:
                    while True:
                        yield data({"t": 1})
                        await asyncio.sleep(0.01)
                finally:
                    closed.set()
            return StreamResponse(events())

        async def health(req):
            return json_response({"status": "ok"})

        r = Router(Guard(BASE))
        r.get("/v1/endless", endless)
        r.get("/health", health)
        server = await serve(r, BASE)
        host = f"Host: 127.0.0.1:{server.port}\r\n".encode()
        idle_r, idle_w = await asyncio.open_connection("127.0.0.1", server.port)
        idle_w.write(b"GET /health HTTP/1.1\r\n" + host + b"\r\n")
        await idle_r.readuntil(b'{"status":"ok"}')
        sr, sw = await asyncio.open_connection("127.0.0.1", server.port)
        sw.write(b"GET /v1/endless HTTP/1.1\r\n" + host + b"\r\n")
        await sr.readuntil(b'data: {"t":1}')
        t0 = time.monotonic()
        await asyncio.wait_for(server.close(grace_s=0.3), 5)
        took = time.monotonic() - t0
        assert closed.is_set()
        assert 0.25 <= took < 2.0
        assert await asyncio.wait_for(idle_r.read(), 1) == b""  # closed cleanly
        for w in (idle_w, sw):
            w.close()

    asyncio.run(main())
