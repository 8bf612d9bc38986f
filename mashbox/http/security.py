"""Who may talk to the server: Host, Origin, API key, and the POST body's media type.

Rules (server-api.md, first paragraph):
- Without keys (only allowed on a loopback host) no key is checked and any key a client
  sends is ignored; every request's tenant is "default".
- With keys (ServerConfig.api_keys), /v1 routes, /metrics and /openapi.json need one,
  sent as `Authorization: Bearer <key>` or `x-api-key: <key>`, compared in constant
  time; 401 without. /health and / stay open (load balancers and the chat page). A
  request's tenant is its key's name; a key without a name is its own tenant (a hash of
  the key, so the key itself never reaches logs or metrics).
- Host must name the server (DNS rebinding): its listening address, the address the
  connection arrived on, localhost / 127.0.0.1 / [::1], or a ServerConfig.server_names
  entry; only the name is compared, not the port, so an SSH tunnel from another local
  port still works (a rebinding attack changes the name, never only the port). 403
  otherwise; an HTTP/1.1 request without Host is 400 (RFC 9112).
- An `Origin` header must be the server's own origin as the browser sees it, that is
  the scheme plus the request's Host (same name and port); a page of any other origin,
  and `Origin: null`, get 403.
- POST bodies must be `application/json` (parameters such as charset allowed): 415.
- Every decision reads the request's canonical path (request.py's path rule), the same
  form the router matches, so no spelling of a path routes where the key check did not
  look. The check runs as soon as the head is complete (protocol.py), before any body.
- Nothing here logs a key, a header or a body.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from typing import Mapping, Optional

from mashbox.config import ServerConfig

from .request import Request
from .response import HTTPError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_HOSTS = ("", "0.0.0.0", "::")

ENV_KEY = "MASHBOX_API_KEY"


def is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def unnamed_tenant(key: str) -> str:
    """The tenant of a key without a name: a short hash, never the key itself."""
    return "key-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]


def load_api_keys(path: Optional[str], env: Mapping[str, str] = os.environ) -> tuple[tuple[str, str], ...]:
    """(key, tenant) pairs from an --api-key-file and / or MASHBOX_API_KEY.

    File format: one key a line; `name: key` gives the key a tenant name (keys with one
    name share a tenant); blank lines and lines starting with `#` are skipped. Raises
    ValueError naming the file and line for a malformed line, a key given twice with two
    tenants, or a file without keys; OSError when the file cannot be read.
    """
    pairs: dict[str, str] = {}

    def put(key: str, tenant: str, where: str) -> None:
        if not key:
            raise ValueError(f"{where}: empty API key")
        if any(c.isspace() for c in key):
            raise ValueError(f"{where}: an API key cannot contain whitespace")
        old = pairs.get(key)
        if old is not None and old != tenant:
            raise ValueError(f"{where}: the same key is given for two tenants")
        pairs[key] = tenant

    if path is not None:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        found = 0
        for n, raw in enumerate(lines, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            where = f"{path}:{n}"
            if ":" in line:
                name, _, key = line.partition(":")
                name, key = name.strip(), key.strip()
                if not name:
                    raise ValueError(f"{where}: `name: key` line without a name")
                put(key, name, where)
            else:
                put(line, unnamed_tenant(line), where)
            found += 1
        if not found:
            raise ValueError(f"{path}: no API keys in the file")
    env_key = (env.get(ENV_KEY) or "").strip()
    if env_key:
        put(env_key, pairs.get(env_key) or unnamed_tenant(env_key), ENV_KEY)
    return tuple(pairs.items())


def check_bind(host: str, api_keys) -> None:
    """Refuse a non-loopback host without keys (ValueError with what to do)."""
    if not api_keys and not is_loopback(host):
        raise ValueError(
            f"refusing to listen on {host} without an API key: give --api-key-file or set "
            f"{ENV_KEY} (without a key mashbox only listens on 127.0.0.1)"
        )


def _split_host(value: str) -> tuple[str, Optional[str]]:
    """'Name:port' / '[v6]:port' / 'name' -> (lower-case name without brackets, port)."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return value, None
        name, rest = value[1:end], value[end + 1:]
        return name, (rest[1:] if rest.startswith(":") else None)
    if value.count(":") == 1:
        name, _, port = value.partition(":")
        return name.rstrip("."), port
    return value.rstrip("."), None


def _media_type(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


# Canonical paths that need a key when keys are configured. /v1/health is a /v1 route,
# so the spec's rule covers it; /health and / are the open health checks. Every path the
# router sends to a /v1, /metrics or /openapi.json route passes here (its first segment
# is "v1", or it is exactly that one segment).
def is_protected(path: str) -> bool:
    return path.startswith("/v1/") or path == "/v1" or path == "/metrics" or path == "/openapi.json"


class Guard:
    """Checks a request before (check) and after (check_content_type) routing."""

    def __init__(self, config: ServerConfig):
        self.config = config
        names = set(LOOPBACK_NAMES)
        if config.host not in WILDCARD_HOSTS:
            names.add(_split_host(config.host)[0])
        for n in config.server_names:
            names.add(_split_host(n)[0])
        self._names = frozenset(names)
        self._keys = tuple(
            (k.encode("utf-8"), t or unnamed_tenant(k)) for k, t in config.api_keys
        )

    def host_allowed(self, host_name: str, local_addr) -> bool:
        if host_name in self._names:
            return True
        # An IP literal equal to the address the connection arrived on: a client that
        # dialled us by address (0.0.0.0 binds); rebinding always uses a DNS name.
        return bool(local_addr) and host_name == str(local_addr[0]).lower()

    def check(self, req: Request) -> None:
        headers = req.headers
        host = headers.get("host")
        if host is None:
            if req.http_version != "1.0":
                raise HTTPError(400, "The Host header is missing.", param="host")
        else:
            name, _ = _split_host(host)
            if not self.host_allowed(name, req.local_addr):
                raise HTTPError(403, "This server does not answer to the host name in the Host header.",
                                type="permission_error", param="host")
        origin = headers.get("origin")
        if origin is not None:
            self._check_origin(origin, host)
        if self._keys and is_protected(req.path):
            req.tenant = self.tenant_of(req)

    def _check_origin(self, origin: str, host: Optional[str]) -> None:
        scheme, sep, rest = origin.strip().lower().partition("://")
        ok = bool(sep) and scheme in ("http", "https") and host is not None and "/" not in rest
        if ok:
            o_name, o_port = _split_host(rest)
            h_name, h_port = _split_host(host)
            default = "443" if scheme == "https" else "80"
            ok = o_name == h_name and (o_port or default) == (h_port or default)
        if not ok:
            raise HTTPError(403, "Requests from a web page of another origin are refused.",
                            type="permission_error", param="origin")

    def tenant_of(self, req: Request) -> str:
        """The tenant of the request's key; 401 when it has none or a wrong one."""
        candidates = []
        x_key = req.headers.get("x-api-key")
        if x_key:
            candidates.append(x_key.strip().encode("latin-1"))
        auth = req.headers.get("authorization")
        if auth:
            scheme, _, token = auth.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                candidates.append(token.strip().encode("latin-1"))
        if not candidates:
            raise HTTPError(401, "An API key is required: send Authorization: Bearer <key> or x-api-key.",
                            code="invalid_api_key", headers=[("www-authenticate", "Bearer")])
        tenant = None
        # Compare every candidate with every key, without stopping early, so the time
        # taken does not depend on which key (if any) matched.
        for cand in candidates:
            for key, name in self._keys:
                if hmac.compare_digest(cand, key) and tenant is None:
                    tenant = name
        if tenant is None:
            raise HTTPError(401, "The API key is not valid.", code="invalid_api_key",
                            headers=[("www-authenticate", "Bearer")])
        return tenant

    def check_content_type(self, req: Request) -> None:
        ctype = req.headers.get("content-type")
        if ctype is None or _media_type(ctype) != "application/json":
            raise HTTPError(415, "POST bodies must be sent with Content-Type: application/json.",
                            param="content-type")
