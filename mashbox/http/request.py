"""One parsed HTTP request, as handlers see it.

The protocol fills method, path, headers and body; security sets `tenant`; the router
sets `params` and `family`; the api may set `session_tag` (prompt_cache_key) for the
access log line. Header names are lower-case str, values str (latin-1 decoded; a
repeated header's values are joined with ", ").
"""
from __future__ import annotations

from typing import Optional
from urllib.parse import parse_qsl

import orjson

from .response import HTTPError


class Request:
    __slots__ = (
        "method",
        "path",
        "raw_path",
        "query_string",
        "headers",
        "body",
        "client_addr",
        "local_addr",
        "http_version",
        "keep_alive",
        "tenant",
        "session_tag",
        "params",
        "family",
        "error",
        "_query",
    )

    def __init__(
        self,
        method: str,
        path: str,
        query_string: str = "",
        headers: Optional[dict] = None,
        body: bytes = b"",
        client_addr: Optional[tuple] = None,
        local_addr: Optional[tuple] = None,
        http_version: str = "1.1",
        keep_alive: bool = True,
        raw_path: Optional[str] = None,
    ):
        self.method = method
        self.path = path  # percent-decoded
        self.raw_path = raw_path if raw_path is not None else path  # as sent, no query
        self.query_string = query_string
        self.headers = headers if headers is not None else {}
        self.body = body
        self.client_addr = client_addr
        self.local_addr = local_addr  # the listening address this connection arrived on
        self.http_version = http_version
        self.keep_alive = keep_alive
        self.tenant = "default"
        self.session_tag: Optional[str] = None
        self.params: dict = {}
        self.family = "openai"
        # Set by the protocol when the request was refused while parsing (413, 431, ...):
        # it is answered in order, then the connection closes.
        self.error: Optional[HTTPError] = None
        self._query: Optional[dict] = None

    @property
    def query(self) -> dict:
        """Query parameters; a repeated name keeps its last value."""
        if self._query is None:
            self._query = dict(parse_qsl(self.query_string, keep_blank_values=True))
        return self._query

    def json(self):
        """The body parsed as JSON; 400 naming the problem when it is not JSON."""
        if not self.body:
            raise HTTPError(400, "The request body is empty; expected a JSON object.")
        try:
            return orjson.loads(self.body)
        except orjson.JSONDecodeError as e:
            raise HTTPError(400, f"The request body is not valid JSON: {e}") from None

    def __repr__(self) -> str:
        return f"Request({self.method} {self.raw_path})"
