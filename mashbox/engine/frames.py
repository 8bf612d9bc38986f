"""Frames on the server <-> worker pipe: a 4-byte big-endian length, then orjson bytes.

Sans-IO: `encode` makes bytes, `FrameReader.feed` takes whatever bytes arrived (any
split) and returns the complete frames; the caller owns the socket.

Frames (every one a JSON object with an "op"):
  server -> worker: {"op": "start", "config": EngineConfig fields}   (first frame)
                    {"op": "submit", "req": GenerationRequest.to_wire()}
                    {"op": "cancel", "id": str}
                    {"op": "shutdown"}
  worker -> server: {"op": "ready", "info": {...}}                    (first frame)
                    {"op": "events", "events": [StepEvent.to_wire(), ...]}  (one a step)
                    {"op": "alive"}   (a step without events, at most every ALIVE_EVERY_S)
                    {"op": "fatal", "message": str}   (load failed; the worker exits 2)
"""
from __future__ import annotations

import struct

import orjson

_HEADER = struct.Struct(">I")
ALIVE_EVERY_S = 0.5  # a busy worker's silence is never longer (but for one long step)
MAX_FRAME = 1 << 30  # a frame this big means the stream is corrupt, not a real message


class FrameError(Exception):
    pass


def encode(obj) -> bytes:
    body = orjson.dumps(obj)
    return _HEADER.pack(len(body)) + body


class FrameReader:
    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list:
        self._buf += data
        frames = []
        pos = 0
        buf = self._buf
        while len(buf) - pos >= _HEADER.size:
            (n,) = _HEADER.unpack_from(buf, pos)
            if n > MAX_FRAME:
                raise FrameError(f"frame length {n} exceeds {MAX_FRAME}")
            if len(buf) - pos - _HEADER.size < n:
                break
            start = pos + _HEADER.size
            frames.append(orjson.loads(bytes(buf[start : start + n])))
            pos = start + n
        if pos:
            del buf[:pos]
        return frames

    @property
    def pending_bytes(self) -> int:
        return len(self._buf)
