"""How a stream's frames reach one connection: the sse.Channel that HttpProtocol gives
sse.pump, with chunked framing on HTTP/1.1 and raw bytes on HTTP/1.0 (close-delimited).

`conn` is the HttpProtocol: its `output_blocked`, `closed`, `transport` and `drain()`.
"""
from __future__ import annotations

_LAST_CHUNK = b"0\r\n\r\n"


class StreamChannel:
    """sse.Channel: queued frames leave in one send when the pump flushes (the iterator
    has to wait, or the stream ends) or when more than FLUSH_BYTES are queued, so flow
    control still sees the transport's buffer. Chunked framing on HTTP/1.1; raw
    (close-delimited) on HTTP/1.0.
    """

    __slots__ = ("conn", "chunked", "parts", "size")

    FLUSH_BYTES = 65536

    def __init__(self, conn, chunked: bool):
        self.conn = conn
        self.chunked = chunked
        self.parts: list[bytes] = []
        self.size = 0

    @property
    def writing_paused(self) -> bool:
        return self.conn.output_blocked

    def write_body(self, chunk: bytes) -> None:
        if self.chunked:
            self.parts.append(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        else:
            self.parts.append(chunk)
        self.size += len(chunk)
        if self.size >= self.FLUSH_BYTES:
            self.flush()

    def flush(self, tail: bytes = b"") -> None:
        parts = self.parts
        if tail:
            parts.append(tail)
        if not parts:
            return
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        self.parts = []
        self.size = 0
        if not self.conn.closed:
            self.conn.transport.write(data)

    def finish(self) -> None:
        """The stream ended: queued frames and the last chunk, in one send."""
        self.flush(_LAST_CHUNK if self.chunked else b"")

    async def drain(self) -> None:
        await self.conn.drain()
