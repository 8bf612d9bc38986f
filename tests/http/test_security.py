"""API key files, the bind rule, and the Guard's Host / Origin / key decisions."""
from __future__ import annotations

import pytest

from mashbox.config import ServerConfig
from mashbox.http.request import Request, canonical_path
from mashbox.http.response import HTTPError
from mashbox.http.security import Guard, check_bind, is_loopback, is_protected, load_api_keys, unnamed_tenant


def test_load_api_keys_file_and_env(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# team keys\n\nalice: sk-a1\nalice: sk-a2\n  bob :  sk-b  \nsk-lone\n")
    keys = load_api_keys(str(f), {"MASHBOX_API_KEY": "sk-env"})
    assert dict(keys) == {
        "sk-a1": "alice", "sk-a2": "alice", "sk-b": "bob",
        "sk-lone": unnamed_tenant("sk-lone"), "sk-env": unnamed_tenant("sk-env"),
    }
    assert unnamed_tenant("sk-lone").startswith("key-") and "sk-lone" not in unnamed_tenant("sk-lone")
    assert load_api_keys(None, {}) == ()
    assert load_api_keys(None, {"MASHBOX_API_KEY": " k "}) == (("k", unnamed_tenant("k")),)


@pytest.mark.parametrize("text, match", [
    ("# only a comment\n", "no API keys"),
    (": sk-x\n", ":1: `name: key` line without a name"),
    ("alice: sk-1\nbob: sk-1\n", ":2: the same key is given for two tenants"),
    ("alice: sk 1\n", "whitespace"),
    ("alice:\n", "empty API key"),
])
def test_load_api_keys_errors_name_the_line(tmp_path, text, match):
    f = tmp_path / "keys"
    f.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_api_keys(str(f), {})


def test_missing_key_file_raises():
    with pytest.raises(OSError):
        load_api_keys("/nonexistent/keys", {})


def test_bind_rule():
    check_bind("127.0.0.1", ())
    check_bind("localhost", ())
    check_bind("::1", ())
    check_bind("0.0.0.0", (("k", "t"),))
    for host in ("0.0.0.0", "192.168.1.5", "::", "box.lan"):
        with pytest.raises(ValueError, match="--api-key-file"):
            check_bind(host, ())
    assert is_loopback("127.0.0.5") and is_loopback("[::1]") and not is_loopback("10.0.0.1")


def test_protected_paths():
    assert all(is_protected(p) for p in ("/v1/models", "/v1/health", "/metrics", "/openapi.json", "/v1"))
    assert not any(is_protected(p) for p in ("/health", "/", "/v1x", "/metricsx", "/ui/app.js"))


@pytest.mark.parametrize("target, path, segments", [
    ("/", "/", ()),
    ("//v1/models/m", "/v1/models/m", ("v1", "models", "m")),
    ("/./v1/./models", "/v1/models", ("v1", "models")),
    ("/v1/../v1/models/", "/v1/models", ("v1", "models")),
    ("/../../v1", "/v1", ("v1",)),
    ("/v1/%6dodels/%2e%2e/models", "/v1/models", ("v1", "models")),
    ("/v1/models/org%2Fname", "/v1/models/org/name", ("v1", "models", "org/name")),
    ("*", "*", ()),
])
def test_canonical_path(target, path, segments):
    assert canonical_path(target) == (path, segments)
    r = Request("GET", target)
    assert (r.path, r.segments, r.raw_path) == (path, segments, target)


def req(headers, path="/v1/models", local=("10.1.2.3", 8000)):
    return Request("GET", path, headers=headers, local_addr=local)


def test_host_rules():
    g = Guard(ServerConfig(host="0.0.0.0", port=8000, api_keys=(("k", "t"),), server_names=("Box.LAN:8000",)))
    for host in ("localhost:8000", "127.0.0.1", "[::1]:8000", "box.lan", "BOX.lan.:443", "10.1.2.3:8000"):
        g.check(req({"host": host, "x-api-key": "k"}))
    for host in ("0.0.0.0:8000", "evil.example", "box.lan.evil", "[::2]:8000", "10.1.2.4:8000"):
        with pytest.raises(HTTPError) as e:
            g.check(req({"host": host, "x-api-key": "k"}))
        assert e.value.status == 403


def test_origin_must_match_the_host_header():
    g = Guard(ServerConfig())
    g.check(req({"host": "localhost:9000", "origin": "http://localhost:9000"}))
    g.check(req({"host": "localhost", "origin": "http://localhost:80"}))
    for origin in ("http://localhost:9001", "http://127.0.0.1:9000", "null", "file://", "localhost:9000",
                   "http://localhost:9000/path"):
        with pytest.raises(HTTPError) as e:
            g.check(req({"host": "localhost:9000", "origin": origin}))
        assert e.value.status == 403


def test_keys_are_ignored_without_configured_keys():
    g = Guard(ServerConfig())
    r = req({"host": "localhost", "authorization": "Bearer anything"})
    g.check(r)
    assert r.tenant == "default"
