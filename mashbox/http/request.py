"""One parsed HTTP request, as handlers see it, and the one canonical form of its path.

Path rule: the path is made canonical once, here, and security (which paths need a key)
and the router (which route answers) both read only the canonical form, so they can
never disagree about a path. Canonical: split the target on "/", percent-decode each
segment by itself, drop empty and "." segments, let ".." drop the segment before it
(never above the root). `//v1/models/x`, `/./v1/models/x`, `/v1/../v1/models/x` and
`/v1/%6dodels/x` are all `/v1/models/x`; a "/" sent as %2F stays inside its segment
(`segments` keeps it apart; the joined `path` shows it as "/", which only ever makes
the key check stricter, never looser). `raw_path` keeps the target as sent (logs).

The protocol fills method, path, headers and body; security sets `tenant`; the router
sets `params` and `family`; the api may set `session_tag` (prompt_cache_key) for the
access log line. Header names are lower-case str, values str (latin-1 decoded; a
repeated header's values are joined with ", ").
"""
from __future__ import annotations

from typing import Optional
from urllib.parse import parse_qsl, unquote

import orjson

from .response import HTTPError


def canonical_path(target: str) -> tuple[str, tuple[str, ...]]:
    """(canonical path, its percent-decoded segments) of a request target's path part
    (see the module's path rule). Targets not starting with "/" (`*`) are kept as they are."""
    if not target.startswith("/"):
        return target, ()
    out: list[str] = []
    for raw in target.split("/"):
        seg = unquote(raw) if "%" in raw else raw
        if seg == "" or seg == ".":
            continue
        if seg == "..":
            if out:
                out.pop()
            continue
        out.append(seg)
    return "/" + "/".join(out), tuple(out)


class Request:
    __slots__ = (
        "method",
        "path",
        "segments",
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
        # `path` is the target's path as sent (no query); raw_path, when given, wins.
        self.raw_path = raw_path if raw_path is not None else path  # as sent, no query
        self.path, self.segments = canonical_path(self.raw_path)  # the only form checked
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
