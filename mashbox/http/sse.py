"""Server-sent event streams: what a handler returns to stream, and the pump that writes it.

Rules:
- A handler returns `StreamResponse(events)`; `events` is an async iterator of ready
  SSE frames (bytes, built with `data` / `event` / `DONE`). The protocol writes the
  head (text/event-stream, no-cache, keep-alive; chunked on HTTP/1.1, close-delimited on
  HTTP/1.0), then `pump` writes each frame as it comes.
- Flow control: after each write, while the transport has paused writing, the pump
  awaits the connection's drain; it never pulls the next frame meanwhile, so a slow
  client stalls its own generator only. The connection cuts a client whose writing
  stays paused for ServerConfig.slow_reader_timeout_s (see protocol.py).
- Heartbeat: `: heartbeat` goes out after heartbeat_s without a frame, and then every
  heartbeat_s; it is not a frame (it does not count as one) and it is skipped while
  writing is paused, so it never hides a client that reads nothing.
- Whatever ends the stream (the events ran out, the generator failed, a disconnect or
  the slow-reader cut cancelled the pump, a HEAD request that never pulls a frame), the
  protocol calls `StreamResponse.close()`: the iterator's `aclose()`, then `on_close`,
  so the api's `finally:` / callback cancels the engine request.

Stream states (an illegal transition raises):

    open ──events exhausted──▶ ended       (the protocol writes the last chunk)
    open ──generator raised──▶ failed      (the connection is closed unterminated)
    open ──cancelled──▶ cancelled          (disconnect / slow-reader cut)
"""
from __future__ import annotations

import asyncio
import logging
import types
from typing import AsyncIterator, Callable, Optional

import orjson

from .response import Headers, header_pairs

log = logging.getLogger("mashbox.http")

DONE = b"data: [DONE]\n\n"
HEARTBEAT = b": heartbeat\n\n"

CONTENT_TYPE = "text/event-stream"


def data(obj) -> bytes:
    """`data: {json}\\n\\n` (orjson output has no newlines, so one data line)."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def event(name: str, obj) -> bytes:
    """`event: name\\ndata: {json}\\n\\n`."""
    if "\n" in name or "\r" in name:
        raise ValueError(f"SSE event name has a line break: {name!r}")
    return b"event: " + name.encode("utf-8") + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


class StreamResponse:
    """A streamed answer: the protocol writes `events` with flow control and heartbeats.

    `on_close` (optional) is called once when the stream is over for any reason, after
    `events` was closed. Use it for cleanup that must happen even when the iterator
    never started: an async generator closed before its first item never runs its
    `finally` (HEAD requests, a client gone before the first frame).
    """

    __slots__ = ("events", "status", "headers", "on_close", "_closed")

    def __init__(self, events: AsyncIterator[bytes], headers: Headers = None, status: int = 200,
                 on_close: Optional[Callable[[], None]] = None):
        self.events = events
        self.status = status
        self.headers = header_pairs(headers)
        self.on_close = on_close
        self._closed = False

    async def close(self) -> None:
        """Close the iterator (`aclose()`), then call on_close; only the first call acts."""
        if self._closed:
            return
        self._closed = True
        try:
            close = getattr(self.events, "aclose", None)
            if close is not None:
                await close()
        finally:
            if self.on_close is not None:
                try:
                    self.on_close()
                except Exception:
                    log.exception("SSE on_close callback failed")

    def __repr__(self) -> str:
        return f"StreamResponse({self.status})"


# state -> allowed next states
TRANSITIONS = {
    "open": ("ended", "failed", "cancelled"),
    "ended": (),
    "failed": (),
    "cancelled": (),
}


class StreamState:
    __slots__ = ("state", "frames", "heartbeats")

    def __init__(self):
        self.state = "open"
        self.frames = 0
        self.heartbeats = 0

    def to(self, new: str) -> None:
        if new not in TRANSITIONS[self.state]:
            raise RuntimeError(f"SSE stream cannot go from {self.state} to {new}")
        self.state = new


class Channel:
    """What the pump needs from a connection (HttpProtocol implements it)."""

    writing_paused: bool

    def write_body(self, chunk: bytes) -> None:
        """Queue a frame (the channel flushes by itself past its size threshold)."""

    def flush(self) -> None:
        """Send the queued frames now."""

    async def drain(self) -> None: ...


class _ClientGone(Exception):
    """The connection was lost while the pump waited to write (not the iterator's error)."""


@types.coroutine
def _resume(it, first):
    """Finish awaiting `it`, an awaitable's iterator that has already yielded `first`:
    the rest of what `yield from it` would do. What the task sends or throws goes to
    `it`, what `it` yields goes to the task; its return value is ours."""
    yielded = first
    while True:
        try:
            sent = yield yielded
        except GeneratorExit:
            it.close()
            raise
        except BaseException as exc:  # cancellation, thrown into the iterator as usual
            try:
                yielded = it.throw(exc)
            except StopIteration as e:
                return e.value
        else:
            try:
                yielded = it.send(sent)
            except StopIteration as e:
                return e.value


async def pump(
    events: AsyncIterator[bytes],
    channel: Channel,
    loop: asyncio.AbstractEventLoop,
    heartbeat_s: float,
) -> StreamState:
    """Write every frame of `events` to `channel`; returns the final state ("ended" or
    "failed"); raises CancelledError when cancelled. The caller closes the stream
    (StreamResponse.close) whatever happens.

    Frames go out when the iterator has to wait: each step of `events.__anext__()` is
    started by hand; if it finishes at once the frame is queued, and if it suspends
    (waiting for the next token) the queue is flushed before the pump awaits the rest
    of the step. Paced frames (one per token) are thus written as they come, with no
    extra loop callback, and frames ready together (a server that fell behind its
    engine) share one send.
    """
    st = StreamState()
    last_activity = loop.time()
    timer: Optional[asyncio.TimerHandle] = None

    def beat() -> None:
        nonlocal timer, last_activity
        now = loop.time()
        due = last_activity + heartbeat_s
        if now >= due - 0.001:
            if not channel.writing_paused:
                channel.write_body(HEARTBEAT)
                channel.flush()
                st.heartbeats += 1
            last_activity = now
            due = now + heartbeat_s
        timer = loop.call_at(due, beat)

    if heartbeat_s > 0:
        timer = loop.call_at(last_activity + heartbeat_s, beat)
    anext = type(events).__anext__
    try:
        while True:
            it = anext(events).__await__()
            try:
                pending = it.send(None)
            except StopIteration as e:
                frame = e.value  # ready at once
            except StopAsyncIteration:
                break
            else:
                channel.flush()
                try:
                    frame = await _resume(it, pending)
                except StopAsyncIteration:
                    break
            if frame:
                channel.write_body(frame)
                st.frames += 1
                last_activity = loop.time()
                if channel.writing_paused:
                    try:
                        await channel.drain()
                    except ConnectionError as e:
                        raise _ClientGone from e
        st.to("ended")
    except asyncio.CancelledError:
        st.to("cancelled")
        raise
    except _ClientGone:
        st.to("cancelled")  # the client went away while the pump waited to write
    except Exception:
        # The api should end its own streams with its error event; reaching here is a
        # bug upstream. Log it (not the frames) and let the caller close the connection.
        log.exception("SSE event iterator failed")
        st.to("failed")
    finally:
        if timer is not None:
            timer.cancel()
    return st
