"""HTTP/1.1 over one connection: an asyncio.Protocol that is httptools' callback object.

(Over ~450 lines: httptools calls one object back for the whole connection, so parsing,
the pipeline of waiting requests and the write side share its state; the limits, the
body deadline and the slow-reader watch are their own modules, limits.py and sendwatch.py.)

Rules:
- Bytes in go to httptools.HttpRequestParser; its callbacks build one `Request` per
  message. Finished requests wait in `pipeline` and are answered strictly in order by
  one task at a time (`_serve`); reading pauses while more than PIPELINE_HIGH requests
  wait and resumes at PIPELINE_LOW.
- Limits are checked as bytes arrive: URL > max_url_bytes -> 414, headers >
  max_header_bytes -> 431, body (Content-Length or chunked total) > max_body_bytes ->
  413, anything httptools refuses -> 400. A refused request is answered in its turn,
  then the connection closes ("lingering close": half-close, read and drop what the
  client still sends for a moment, so the answer is not lost to a reset).
- A request with a body is checked as soon as its head is complete, before any of the
  body is read or buffered: Host / Origin / key (403 / 401) and, on a POST route,
  Content-Type (415), by the app's `check_head` (the router's guard); refused like a
  413. Its body then has a progress deadline (408) and counts toward the server-wide
  bound on buffered body bytes (503); see limits.py. A request without a body is
  checked by the router as before and keeps its connection.
- Responses carry Content-Length; streams use chunked transfer encoding on HTTP/1.1 and
  are close-delimited on HTTP/1.0. HEAD gets the same head as GET, without a body.
- Writing: `pause_writing` / `resume_writing` from the transport set `writing_paused`;
  writers await `drain()`.
- Slow-reader cut-off: while an answer is being written, a client that for
  slow_reader_timeout_s has bytes waiting for it and acknowledges none of them is cut
  (the connection is reset, which cancels its stream). The kernel's counts decide
  (sendwatch.py), not the transport pausing: the send buffer autotunes to megabytes, so
  a client that reads nothing may never fill it. A stream with nothing to send (a long
  prefill) is never cut. Transports without a TCP socket to ask fall back to: writing
  that stays paused for slow_reader_timeout_s is cut.
- Connection loss cancels the task answering the current request (a handler awaiting
  the engine, or the SSE pump, which then closes its iterator) and drops the pipeline.
- Idle keep-alive: a connection with nothing in flight whose next request's head is not
  complete within keepalive_timeout_s is closed (this also bounds slow headers).
- One access log line per request (logger mashbox.access): method, path without the
  query, status, milliseconds, session tag. Never headers, keys or bodies.

State is grouped: global (app, config, loop), per connection (transport, parser,
pipeline, flow control, timers), per message being parsed (the `_m*` fields).

Size: this file is over 450 lines because it is one object, the connection, whose parser
callbacks, refusals, timers and writers all read the same state; what stands on its own
is split out: channel.py (stream framing), sendwatch.py (the slow-reader check),
limits.py (body deadline and budget), request.py (the canonical path).
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Optional

import httptools

from mashbox.config import ServerConfig

from . import sse
from .channel import StreamChannel
from .limits import BodyBudget, Limits
from .request import Request
from .response import HTTPError, Response, date_cache, encode_headers, retry_after, status_line
from .sendwatch import SendProbe, SendWatch

log = logging.getLogger("mashbox.http")
access_log = logging.getLogger("mashbox.access")

PIPELINE_HIGH = 16  # requests parsed but not answered before reading pauses
PIPELINE_LOW = 4
LINGER_S = 2.0  # how long a refused connection drops incoming bytes before closing

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_CRLF = b"\r\n"


class _Refuse(Exception):
    """Raised inside parser callbacks to stop parsing with an HTTP error."""

    def __init__(self, error: HTTPError):
        super().__init__(error.message)
        self.error = error


def _session_tag(req: Request) -> str:
    tag = req.session_tag or req.headers.get("x-session-id")
    if not tag:
        return ""
    # Printable and short: the tag comes from the client and must not forge log lines.
    return " session=" + "".join(c if c.isprintable() and c != " " else "?" for c in tag[:64])


class HttpProtocol(asyncio.Protocol):
    def __init__(self, app, config: ServerConfig, loop: Optional[asyncio.AbstractEventLoop] = None,
                 connections: Optional[set] = None, limits: Optional[Limits] = None,
                 budget: Optional[BodyBudget] = None):
        """app: has `async handle(Request) -> Response | StreamResponse`,
        `check_head(Request)` (raises HTTPError) and `family_for(path) -> str` (a
        router.Router). connections: a set this connection adds itself to while open
        (the server closes them on shutdown). budget: the buffered-body bound shared
        with the server's other connections (None: one of this connection's own)."""
        # global
        self.app = app
        self.config = config
        self.loop = loop or asyncio.get_event_loop()
        self.connections = connections
        self.limits = limits if limits is not None else Limits()
        self.budget = budget if budget is not None else BodyBudget(
            max(self.limits.max_buffered_body_bytes, config.max_body_bytes))
        # per connection
        self.transport: Optional[asyncio.Transport] = None
        self.parser = httptools.HttpRequestParser(self)
        self.client_addr = None
        self.local_addr = None
        self.pipeline: deque[Request] = deque()
        self.task: Optional[asyncio.Task] = None  # answers pipeline[...] in order
        self.reading_paused = False
        self.writing_paused = False
        self.closed = False
        self.refused = False  # a refusal is queued: drop further input
        self.head_written = False  # the current answer's head went out
        self._drain_waiter: Optional[asyncio.Future] = None
        self._slow_timer: Optional[asyncio.TimerHandle] = None  # fallback: paused too long
        self._send_watch: Optional[SendWatch] = None  # None: no TCP counts, the fallback rule
        self._idle_timer: Optional[asyncio.TimerHandle] = None
        self._idle_since: Optional[float] = None  # loop time the connection went idle
        self._linger_timer: Optional[asyncio.TimerHandle] = None
        self._held = 0  # body bytes this connection counts in the budget
        self._body_timer: Optional[asyncio.TimerHandle] = None  # body progress deadline
        self._body_mark_at: Optional[float] = None  # loop time of the body's last progress
        self._body_mark_bytes = 0  # body bytes received at that time
        # per message being parsed
        self._m_url = b""
        self._m_headers: list[tuple[bytes, bytes]] = []
        self._m_header_bytes = 0
        self._m_in_head = False
        self._m_began = False  # a message began during the current data_received
        self._m_head_seen = 0
        self._m_req: Optional[Request] = None
        self._m_body: list[bytes] = []
        self._m_body_bytes = 0

    # ---- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.client_addr = transport.get_extra_info("peername")
        self.local_addr = transport.get_extra_info("sockname")
        probe = SendProbe.for_transport(transport)
        if probe is not None:
            self._send_watch = SendWatch(self.loop, transport, probe, self.config.slow_reader_timeout_s,
                                         self._cut_slow_reader)
        if self.connections is not None:
            self.connections.add(self)
        self._arm_idle()

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        if self.closed:
            return
        self.closed = True
        if self.connections is not None:
            self.connections.discard(self)
        for t in (self._slow_timer, self._idle_timer, self._linger_timer, self._body_timer):
            if t is not None:
                t.cancel()
        if self._send_watch is not None:
            self._send_watch.stop()
        self._release(self._held)
        self._m_body = []
        self.pipeline.clear()
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_exception(ConnectionResetError("client disconnected"))
        task = self.task
        if task is not None and not task.done() and task is not asyncio.current_task(self.loop):
            # Cancels a handler awaiting the engine, or the SSE pump (the stream is then
            # closed, so the api cancels the engine request). When the task itself
            # aborted the connection it is ending on its own.
            task.cancel()

    def eof_received(self) -> Optional[bool]:
        # A half-closed client gets no more answers (returning None closes the transport).
        return None

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return  # lingering close: drop what the client still sends
        self._m_began = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # Upgrade (websocket, h2c) is not offered: the request is answered as a plain
            # HTTP/1.1 request and the connection closes after it.
            if self.pipeline:
                self.pipeline[-1].keep_alive = False
            self.refused = True
            return
        except httptools.HttpParserCallbackError as e:
            cause = e.__context__
            if isinstance(cause, _Refuse):
                self._refuse(cause.error)
            else:
                log.error("request parsing failed", exc_info=cause or e)
                self._refuse(HTTPError(400, "Malformed HTTP request."))
            return
        except httptools.HttpParserError as e:
            self._refuse(HTTPError(400, f"Malformed HTTP request: {e.args[0] if e.args else e}"))
            return
        if self._m_in_head and not self._m_began:
            # httptools keeps a header line it has not finished; bound what it may hold.
            # (A chunk in which the message began is not counted: it may hold earlier
            # pipelined requests, and one chunk is bounded by the transport's read size.)
            self._m_head_seen += len(data)
            if self._m_head_seen > self.config.max_url_bytes + self.config.max_header_bytes:
                self._refuse(HTTPError(431, "The request's headers are too large.", code="headers_too_large"))

    def pause_writing(self) -> None:
        self.writing_paused = True
        if self._send_watch is None and self._slow_timer is None:
            self._slow_timer = self.loop.call_later(self.config.slow_reader_timeout_s, self._cut_slow_reader)

    def resume_writing(self) -> None:
        self.writing_paused = False
        if self._slow_timer is not None:
            self._slow_timer.cancel()
            self._slow_timer = None
        w = self._drain_waiter
        if w is not None:
            self._drain_waiter = None
            if not w.done():
                w.set_result(None)

    # ---- httptools callbacks ----------------------------------------------------------

    def on_message_begin(self) -> None:
        self._m_began = True
        self._m_url = b""
        self._m_headers = []
        self._m_header_bytes = 0
        self._m_in_head = True
        self._m_head_seen = 0
        self._m_req = None
        self._m_body = []
        self._m_body_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._m_url += url
        if len(self._m_url) > self.config.max_url_bytes:
            raise _Refuse(HTTPError(414, f"The request URL is longer than {self.config.max_url_bytes} bytes.",
                                    code="uri_too_long"))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._m_header_bytes += len(name) + len(value) + 4
        if self._m_header_bytes > self.config.max_header_bytes:
            raise _Refuse(HTTPError(431, f"The request's headers are larger than {self.config.max_header_bytes} bytes.",
                                    code="headers_too_large"))
        self._m_headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._m_in_head = False
        self._idle_since = None
        parser = self.parser
        headers: dict[str, str] = {}
        for name, value in self._m_headers:
            k = name.decode("latin-1").lower()
            v = value.decode("latin-1")
            old = headers.get(k)
            headers[k] = v if old is None else old + ", " + v
        raw_path, query = self._split_url(self._m_url)
        req = Request(  # makes the path canonical (request.py's path rule)
            parser.get_method().decode("ascii"),
            raw_path,
            query,
            headers,
            b"",
            self.client_addr,
            self.local_addr,
            parser.get_http_version(),
            parser.should_keep_alive(),
        )
        self._m_req = req
        cl = headers.get("content-length")
        length = int(cl) if cl is not None and cl.isdigit() else 0
        if length > self.config.max_body_bytes:
            raise _Refuse(HTTPError(413, f"The request body is larger than {self.config.max_body_bytes} bytes.",
                                    code="request_too_large"))
        if length or "chunked" in headers.get("transfer-encoding", "").lower():
            # A body follows: refuse now what its head already decides.
            try:
                self.app.check_head(req)
            except HTTPError as e:
                raise _Refuse(e) from None
            if length > self.budget.free:
                raise _Refuse(self._busy())
            self._body_mark_at = self.loop.time()
            self._body_mark_bytes = 0
            if self._body_timer is None:
                self._body_timer = self.loop.call_later(self.limits.body_progress_s, self._check_body)
        if (
            headers.get("expect", "").lower() == "100-continue"
            and self.task is None
            and not self.pipeline
        ):
            self.transport.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        n = len(body)
        if self._m_body_bytes + n > self.config.max_body_bytes:
            raise _Refuse(HTTPError(413, f"The request body is larger than {self.config.max_body_bytes} bytes.",
                                    code="request_too_large"))
        if not self.budget.take(n):
            raise _Refuse(self._busy())
        self._held += n
        self._m_body_bytes += n
        self._m_body.append(body)
        if self._m_body_bytes - self._body_mark_bytes >= self.limits.body_progress_bytes:
            self._body_mark_at = self.loop.time()
            self._body_mark_bytes = self._m_body_bytes

    def on_message_complete(self) -> None:
        req = self._m_req
        self._m_req = None
        self._body_mark_at = None
        if self._m_body:
            req.body = self._m_body[0] if len(self._m_body) == 1 else b"".join(self._m_body)
            self._m_body = []
        self._m_body_bytes = 0  # now counted by len(req.body) until it is answered
        self._enqueue(req)

    # ---- requests in, answers out -----------------------------------------------------

    @staticmethod
    def _split_url(url: bytes) -> tuple[str, str]:
        text = url.decode("latin-1")
        if not text.startswith("/"):
            if text == "*":
                return "*", ""
            # absolute-form (a proxy-style request): keep the path and query only
            try:
                parsed = httptools.parse_url(url)
            except httptools.HttpParserInvalidURLError:
                raise _Refuse(HTTPError(400, "The request URL is not valid.")) from None
            return (parsed.path or b"/").decode("latin-1"), (parsed.query or b"").decode("latin-1")
        path, _, query = text.partition("?")
        if "#" in query:
            query = query.partition("#")[0]
        elif "#" in path:
            path = path.partition("#")[0]
        return path, query

    def _enqueue(self, req: Request) -> None:
        self.pipeline.append(req)
        if len(self.pipeline) > PIPELINE_HIGH and not self.reading_paused and not self.refused:
            self.reading_paused = True
            self.transport.pause_reading()
        if self.task is None:
            self.task = self.loop.create_task(self._serve())

    def _refuse(self, error: HTTPError) -> None:
        """Answer `error` after the requests before it, then close."""
        self.refused = True
        req = self._m_req
        if req is None:
            raw_path, _ = ("-", "") if not self._m_url else self._split_url_safe(self._m_url)
            req = Request("-", raw_path, client_addr=self.client_addr, local_addr=self.local_addr)
        req.keep_alive = False
        req.error = error
        self._m_req = None
        self._m_in_head = False
        self._body_mark_at = None
        self._release(self._m_body_bytes)  # the refused body's bytes go at once
        self._m_body = []
        self._m_body_bytes = 0
        self._enqueue(req)

    def _busy(self) -> HTTPError:
        return HTTPError(503, "The server holds too many request bodies at the moment; retry shortly.",
                         code="server_busy", headers=retry_after(1))

    def _release(self, n: int) -> None:
        n = min(n, self._held)
        if n > 0:
            self._held -= n
            self.budget.give(n)

    def _split_url_safe(self, url: bytes) -> tuple[str, str]:
        try:
            return self._split_url(url)
        except _Refuse:
            return "-", ""

    async def _serve(self) -> None:
        try:
            while self.pipeline and not self.closed:
                req = self.pipeline.popleft()
                if self.reading_paused and len(self.pipeline) <= PIPELINE_LOW and not self.refused:
                    self.reading_paused = False
                    self.transport.resume_reading()
                    if self._body_mark_at is not None:  # paused time does not count
                        self._body_mark_at = self.loop.time()
                await self._answer(req)
                if not req.keep_alive:
                    self._close(lingering=req.error is not None)
                    return
        finally:
            self.task = None
        if not self.closed:
            self._arm_idle()

    async def _answer(self, req: Request) -> None:
        start = self.loop.time()
        status = 0
        self.head_written = False
        try:
            if req.error is not None:
                resp = req.error.to_response(self.app.family_for(req.path))
            else:
                resp = await self.app.handle(req)
            status = resp.status
            if isinstance(resp, Response):
                self._write_response(req, resp)
                if self.writing_paused:  # a large answer the client is slow to take
                    if self._send_watch is not None:
                        self._send_watch.start()
                    await self.drain()
            elif isinstance(resp, sse.StreamResponse):
                await self._write_stream(req, resp)
            else:
                raise TypeError(f"handler returned {type(resp).__name__}, not Response or StreamResponse")
        except asyncio.CancelledError:
            status = status or 499  # the client went away before its answer was written
            raise
        except ConnectionError:
            status = status or 499
        except Exception:
            log.exception("failed answering %s %s", req.method, req.raw_path)
            if not self.head_written and not self.closed:
                # Nothing written yet: a 500 keeps the client from hanging.
                status = 500
                req.keep_alive = False
                err = HTTPError(500, "The server failed while handling this request.")
                self._write_response(req, err.to_response(self.app.family_for(req.path)))
            else:
                req.keep_alive = False
        finally:
            if self._send_watch is not None:
                self._send_watch.stop()
            self._release(len(req.body))
            if access_log.isEnabledFor(logging.INFO):
                access_log.info("%s %s %d %.1fms%s", req.method, req.raw_path, status,
                                (self.loop.time() - start) * 1000.0, _session_tag(req))

    def _head(self, req: Request, status: int, headers: bytes) -> bytes:
        return b"".join((
            status_line(status),
            date_cache.line(),
            headers,
            b"" if req.keep_alive else b"connection: close\r\n",
        ))

    def _write_response(self, req: Request, resp: Response) -> None:
        if self.closed:
            return
        body = resp.body
        no_body = resp.status in (204, 304) or resp.status < 200
        length = b"" if no_body else b"content-length: %d\r\n" % len(body)
        head = self._head(req, resp.status, resp.encoded_headers() + length) + _CRLF
        self.head_written = True
        if req.method == "HEAD" or no_body or not body:
            self.transport.write(head)
        elif len(body) < 16384:
            self.transport.write(head + body)
        else:
            self.transport.writelines((head, body))

    async def _write_stream(self, req: Request, resp: sse.StreamResponse) -> None:
        try:
            if self.closed:
                return
            chunked = req.http_version != "1.0"
            if not chunked:
                req.keep_alive = False  # close-delimited
            pairs = [("content-type", sse.CONTENT_TYPE), ("cache-control", "no-cache"),
                     ("x-accel-buffering", "no")]
            if req.keep_alive:
                pairs.append(("connection", "keep-alive"))
            if chunked:
                pairs.append(("transfer-encoding", "chunked"))
            pairs.extend(resp.headers)
            head = self._head(req, resp.status, encode_headers(pairs)) + _CRLF
            self.head_written = True
            if self._send_watch is not None:
                self._send_watch.start()
            self.transport.write(head)
            if req.method == "HEAD":
                return
            channel = StreamChannel(self, chunked)
            st = await sse.pump(resp.events, channel, self.loop, self.config.heartbeat_s)
            if st.state == "failed":
                # End without the last chunk: the client sees a broken stream, not a clean end.
                channel.flush()
                req.keep_alive = False
                self._abort()
            elif not self.closed:
                channel.finish()
                if self.writing_paused:
                    await self.drain()
        finally:
            # Also on cancellation (disconnect, slow-reader cut): closes the iterator and
            # runs on_close, so the engine request is cancelled.
            await resp.close()

    @property
    def output_blocked(self) -> bool:
        """The transport takes no writes now: paused, or closing (the client reset it
        during a send; the loop has not yet run connection_lost, which fails a drain
        waiter). A closing transport never pauses, so a writer of frames that are all
        ready at once would otherwise spin the loop instead of waiting for the loss."""
        return self.writing_paused or self.closed or self.transport.is_closing()

    async def drain(self) -> None:
        """Wait until the transport takes writes again (raises if the client is gone)."""
        if self.closed:
            raise ConnectionResetError("client disconnected")
        if not self.output_blocked:
            return
        w = self._drain_waiter
        if w is None:
            w = self._drain_waiter = self.loop.create_future()
        await w

    # ---- timers and closing -----------------------------------------------------------

    def _arm_idle(self) -> None:
        # One lazy timer per connection rather than a new one per request: it checks
        # how long the connection has been idle when it fires and re-arms for the rest.
        self._idle_since = self.loop.time()
        if self._idle_timer is None:
            self._idle_timer = self.loop.call_later(self.config.keepalive_timeout_s, self._idle_check)

    def _idle_check(self) -> None:
        self._idle_timer = None
        since = self._idle_since
        if since is None or self.closed or self.task is not None or self.pipeline:
            return  # busy: the end of the current answer arms it again
        left = since + self.config.keepalive_timeout_s - self.loop.time()
        if left > 0.001:
            self._idle_timer = self.loop.call_later(left, self._idle_check)
        else:
            self._close()

    def _check_body(self) -> None:
        """The body progress deadline (limits.py), one lazy timer per connection."""
        self._body_timer = None
        mark = self._body_mark_at
        if mark is None or self.closed or self.refused or self._m_req is None:
            return
        now = self.loop.time()
        if self.reading_paused:  # the server holds the body back, not the client
            mark = self._body_mark_at = now
        left = mark + self.limits.body_progress_s - now
        if left > 0.001:
            self._body_timer = self.loop.call_later(left, self._check_body)
            return
        self._refuse(HTTPError(
            408, f"The request body did not arrive in time (at least {self.limits.body_progress_bytes} bytes "
                 f"every {self.limits.body_progress_s:g} s).", code="request_timeout"))

    def _cut_slow_reader(self) -> None:
        """The send watch's verdict, or the fallback's: writing paused for the timeout."""
        self._slow_timer = None
        if self.closed or (self._send_watch is None and not self.writing_paused):
            return
        log.warning("client %s read nothing for %.1f s; closing its connection",
                    self.client_addr, self.config.slow_reader_timeout_s)
        self._abort()

    def _close(self, lingering: bool = False) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        if lingering and t.can_write_eof():
            # Send our answer and FIN, keep dropping input for a moment so the client
            # reads the answer instead of a reset; eof_received or the timer closes.
            t.write_eof()
            self._linger_timer = self.loop.call_later(LINGER_S, t.close)
            if self.reading_paused:
                self.reading_paused = False
                t.resume_reading()
        else:
            t.close()

    def _abort(self) -> None:
        t = self.transport
        if t is not None and not self.closed:
            t.abort()
            # uvloop and asyncio call connection_lost soon; do its work now so waiters
            # and the current task see the loss at once.
            self.connection_lost(None)
