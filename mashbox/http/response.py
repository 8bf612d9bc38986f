"""Responses a handler returns, and errors as values that know their HTTP status.

Rules:
- A `Response` has a whole body and is sent with Content-Length. Streams are
  `sse.StreamResponse`.
- `HTTPError` is raised anywhere under a handler (or by the protocol itself for parse
  errors); the router turns it into a body in the route family's error shape:
  OpenAI `{"error": {"message", "type", "param", "code"}}`, Anthropic
  `{"type": "error", "error": {"type", "message"}}`.
- Header names are written lower-case; values must be latin-1 and free of CR/LF (a
  value with a line break would let a caller inject headers, so it raises).
"""
from __future__ import annotations

import time
from email.utils import formatdate
from typing import Iterable, Mapping, Optional, Union

import orjson

Headers = Union[Mapping[str, str], Iterable[tuple[str, str]], None]

FAMILIES = ("openai", "anthropic")

REASONS = {
    100: "Continue",
    200: "OK",
    201: "Created",
    204: "No Content",
    304: "Not Modified",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    409: "Conflict",
    413: "Content Too Large",
    414: "URI Too Long",
    415: "Unsupported Media Type",
    422: "Unprocessable Content",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
    529: "Overloaded",
}

# status -> (OpenAI error type, Anthropic error type) when the raiser gave none.
ERROR_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    403: ("permission_error", "permission_error"),
    404: ("not_found_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    408: ("timeout_error", "timeout_error"),
    413: ("invalid_request_error", "request_too_large"),
    414: ("invalid_request_error", "invalid_request_error"),
    415: ("invalid_request_error", "invalid_request_error"),
    429: ("rate_limit_error", "rate_limit_error"),
    431: ("invalid_request_error", "invalid_request_error"),
    500: ("server_error", "api_error"),
    503: ("server_error", "overloaded_error"),
    529: ("overloaded_error", "overloaded_error"),
}


def _status_line(status: int) -> bytes:
    return f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}\r\n".encode("latin-1")


_STATUS_LINES = {s: _status_line(s) for s in REASONS}


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else _status_line(status)


def header_pairs(headers: Headers) -> list[tuple[str, str]]:
    if not headers:
        return []
    items = headers.items() if isinstance(headers, Mapping) else headers
    return [(str(k), str(v)) for k, v in items]


def encode_headers(pairs: Iterable[tuple[str, str]]) -> bytes:
    out = []
    for name, value in pairs:
        if "\r" in name or "\n" in name or ":" in name or "\r" in value or "\n" in value:
            raise ValueError(f"header {name!r} has a line break or a colon in its name")
        out.append(f"{name.lower()}: {value}\r\n")
    return "".join(out).encode("latin-1")


class _DateCache:
    """The Date header changes once a second; formatting it per response is waste."""

    __slots__ = ("_second", "_line")

    def __init__(self):
        self._second = -1
        self._line = b""

    def line(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._line = f"date: {formatdate(now, usegmt=True)}\r\n".encode("latin-1")
        return self._line


date_cache = _DateCache()


class Response:
    """A whole response. `body` is bytes; Content-Length is added when it is written."""

    __slots__ = ("status", "body", "content_type", "headers", "_encoded_headers")

    def __init__(
        self,
        status: int = 200,
        body: bytes = b"",
        headers: Headers = None,
        content_type: Optional[str] = "application/json",
    ):
        if not isinstance(body, (bytes, bytearray, memoryview)):
            raise TypeError(f"Response body must be bytes, not {type(body).__name__}")
        self.status = status
        self.body = bytes(body)
        self.content_type = content_type
        self.headers = header_pairs(headers)
        self._encoded_headers: Optional[bytes] = None

    def encoded_headers(self) -> bytes:
        """content-type and the extra headers, encoded once (checked for injection)."""
        if self._encoded_headers is None:
            pairs = list(self.headers)
            if self.content_type is not None:
                pairs.insert(0, ("content-type", self.content_type))
            self._encoded_headers = encode_headers(pairs)
        return self._encoded_headers

    def __repr__(self) -> str:
        return f"Response({self.status}, {len(self.body)} bytes)"


def json_response(obj, status: int = 200, headers: Headers = None) -> Response:
    return Response(status, orjson.dumps(obj), headers, "application/json")


def text_response(text: str, status: int = 200, headers: Headers = None,
                  content_type: str = "text/plain; charset=utf-8") -> Response:
    return Response(status, text.encode("utf-8"), headers, content_type)


class HTTPError(Exception):
    """An error answer. Raise it from a handler; the router formats it per route family.

    `type` None takes the family's usual type for the status (ERROR_TYPES). `headers`
    carries e.g. Retry-After / x-should-retry (see `retry_after`).
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: Optional[str] = None,
        code: Optional[str] = None,
        param: Optional[str] = None,
        headers: Headers = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = header_pairs(headers)

    def error_type(self, family: str) -> str:
        if self.type is not None:
            return self.type
        pair = ERROR_TYPES.get(self.status)
        if pair is None:
            pair = ERROR_TYPES[500] if self.status >= 500 else ERROR_TYPES[400]
        return pair[1] if family == "anthropic" else pair[0]

    def body(self, family: str) -> dict:
        if family == "anthropic":
            return {"type": "error", "error": {"type": self.error_type(family), "message": self.message}}
        return {
            "error": {
                "message": self.message,
                "type": self.error_type(family),
                "param": self.param,
                "code": self.code,
            }
        }

    def to_response(self, family: str = "openai") -> Response:
        return json_response(self.body(family), self.status, self.headers)

    def __repr__(self) -> str:
        return f"HTTPError({self.status}, {self.message!r})"


def retry_after(seconds: float, should_retry: Optional[bool] = None) -> list[tuple[str, str]]:
    """Headers for a 429 / 503 / 529: Retry-After in whole seconds (at least 1), and
    Anthropic's x-should-retry when given."""
    pairs = [("retry-after", str(max(1, int(round(seconds)))))]
    if should_retry is not None:
        pairs.append(("x-should-retry", "true" if should_retry else "false"))
    return pairs
