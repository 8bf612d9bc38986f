"""Routing by (method, path) to async handlers, with the request guard in front.

Rules:
- Paths are literal segments or `{name}` parameters (one whole segment each). Routes
  match the request's canonical segments only (request.py's path rule: the same form
  security checks), never the raw target. Literal routes are looked up in a dict by
  their segments; parameter routes are tried in the order added.
- A path that matches no route is 404; a path that matches with another method is 405
  with `Allow`. HEAD is answered by the GET handler when no HEAD route exists (the
  protocol drops the body).
- Each route belongs to an error family ("openai" or "anthropic"); errors for paths that
  match no route take the family of the route whose literal prefix they extend
  (so /v1/messages/nope answers in the Anthropic shape).
- `handle(req)` runs: guard (Host, Origin, key) -> route -> guard (Content-Type) ->
  handler. Any HTTPError on the way becomes the family's error body; any other
  exception is logged and answered 500. Cancellation passes through.
"""
from __future__ import annotations

import logging
from typing import Awaitable, Callable, Optional, Union

from .request import Request
from .response import FAMILIES, HTTPError, Response
from .sse import StreamResponse

log = logging.getLogger("mashbox.http")

Handler = Callable[[Request], Awaitable[Union[Response, StreamResponse]]]

__all__ = ["Router", "Route", "Request", "Handler"]


class Route:
    __slots__ = ("method", "path", "handler", "family", "segments", "prefix")

    def __init__(self, method: str, path: str, handler: Handler, family: str):
        self.method = method
        self.path = path
        self.handler = handler
        self.family = family
        self.segments = tuple(path.strip("/").split("/")) if path != "/" else ()
        # Literal part before the first parameter: decides the family of unknown paths.
        lit = []
        for s in self.segments:
            if s.startswith("{"):
                break
            lit.append(s)
        self.prefix = "/" + "/".join(lit)

    @property
    def has_params(self) -> bool:
        return any(s.startswith("{") for s in self.segments)

    def match(self, segments: list[str]) -> Optional[dict]:
        if len(segments) != len(self.segments):
            return None
        params = {}
        for want, got in zip(self.segments, segments):
            if want.startswith("{"):
                if not got:
                    return None
                params[want[1:-1]] = got
            elif got != want:
                return None
        return params


class Router:
    def __init__(self, guard=None):
        """guard: a security.Guard (None: no Host / Origin / key / Content-Type checks)."""
        self.guard = guard
        self._static: dict[tuple[str, ...], dict[str, Route]] = {}  # segments -> method -> route
        self._dynamic: list[Route] = []
        self._family_prefixes: list[tuple[str, str]] = []  # (prefix, family), longest first

    def add(self, method: str, path: str, handler: Handler, family: str = "openai") -> Route:
        method = method.upper()
        if family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, not {family!r}")
        if not path.startswith("/"):
            raise ValueError(f"route path must start with '/': {path!r}")
        route = Route(method, path, handler, family)
        if route.has_params:
            for r in self._dynamic:
                if r.path == path and r.method == method:
                    raise ValueError(f"route {method} {path} added twice")
            self._dynamic.append(route)
        else:
            by_method = self._static.setdefault(route.segments, {})
            if method in by_method:
                raise ValueError(f"route {method} {path} added twice")
            by_method[method] = route
        if route.prefix != "/":
            self._family_prefixes.append((route.prefix, family))
            self._family_prefixes.sort(key=lambda p: -len(p[0]))
        return route

    def get(self, path: str, handler: Handler, family: str = "openai") -> Route:
        return self.add("GET", path, handler, family)

    def post(self, path: str, handler: Handler, family: str = "openai") -> Route:
        return self.add("POST", path, handler, family)

    def family_for(self, path: str) -> str:
        """The error family for a path no route answered (or before routing)."""
        for prefix, family in self._family_prefixes:
            if path == prefix or path.startswith(prefix + "/"):
                return family
        return "openai"

    def _methods_at(self, segments: tuple[str, ...]) -> dict[str, tuple[Route, dict]]:
        found: dict[str, tuple[Route, dict]] = {}
        static = self._static.get(segments)
        if static:
            for m, r in static.items():
                found[m] = (r, {})
        if self._dynamic:
            for r in self._dynamic:
                if r.method in found:
                    continue
                params = r.match(segments)
                if params is not None:
                    found[r.method] = (r, params)
        return found

    def resolve(self, method: str, segments: tuple[str, ...], path: str) -> tuple[Route, dict]:
        """The route and path params for (method, canonical segments); HTTPError 404 /
        405 otherwise (`path`, the canonical path, only names it in the message)."""
        static = self._static.get(segments)
        if static is not None:
            route = static.get(method)
            if route is None and method == "HEAD":
                route = static.get("GET")
            if route is not None:
                return route, {}
        found = self._methods_at(segments)
        hit = found.get(method) or (found.get("GET") if method == "HEAD" else None)
        if hit is not None:
            return hit
        if not found:
            raise HTTPError(404, f"No route for {method} {path}.", code="not_found")
        allow = set(found)
        if "GET" in allow:
            allow.add("HEAD")
        allow_header = ", ".join(sorted(allow))
        raise HTTPError(
            405,
            f"Method {method} is not allowed on {path}; allowed: {allow_header}.",
            code="method_not_allowed",
            headers=[("allow", allow_header)],
        )

    def check_head(self, req: Request) -> None:
        """What the head alone decides, for a request whose body has not been read
        (protocol.py calls it): the guard's Host / Origin / key checks and, when the
        request routes to a POST route, its Content-Type. Raises the HTTPError that
        `handle` would answer; a path without a route is left to `handle` (404 / 405)."""
        guard = self.guard
        if guard is None:
            return
        guard.check(req)
        if req.method == "POST":
            try:
                self.resolve(req.method, req.segments, req.path)
            except HTTPError:
                return
            guard.check_content_type(req)

    async def handle(self, req: Request) -> Union[Response, StreamResponse]:
        family = None
        try:
            guard = self.guard
            if guard is not None:
                guard.check(req)
            route, params = self.resolve(req.method, req.segments, req.path)
            family = req.family = route.family
            req.params = params
            if guard is not None and req.method == "POST":
                guard.check_content_type(req)
            return await route.handler(req)
        except HTTPError as e:
            return e.to_response(family or self.family_for(req.path))
        except Exception:  # a handler bug: log it (no headers, no body), answer 500
            log.exception("handler failed: %s %s", req.method, req.raw_path)
            err = HTTPError(500, "The server failed while handling this request.")
            return err.to_response(family or self.family_for(req.path))
