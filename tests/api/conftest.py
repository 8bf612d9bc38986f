"""The real server, started once for the api tests: `python -m mashbox run <default model>`.

Fixtures:
- `server` (session): a running `mashbox run` subprocess on a free 127.0.0.1 port, with
  --slots 4 --ctx 4096; waits until GET /health is 200, stops the process with SIGTERM
  at the end and checks that it exited 0.
  Its `.base_url` is "http://127.0.0.1:PORT", `.model_id` what /v1/models reports.
- `base_url`, `model_id`: the same, as plain values.
- `openai_client`: an `openai.OpenAI` pointed at the server (no retries, so a status
  the server answers is the status the test sees).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

import pytest

STARTUP_TIMEOUT_S = 300.0  # loading + warm-up on a busy 2-core CPU
SERVER_CTX = 4096
SERVER_SLOTS = 4


@dataclass
class RunningServer:
    base_url: str
    model_id: str
    process: subprocess.Popen
    log_path: str

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0, headers: dict | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def start_server(model_path: str, tmp_dir: str, extra_args: tuple = (), headers: dict | None = None) -> RunningServer:
    port = free_port()
    log_path = os.path.join(tmp_dir, f"mashbox-{port}.log")
    log = open(log_path, "wb")
    cmd = [sys.executable, "-m", "mashbox", "run", model_path, "--port", str(port),
           "--slots", str(SERVER_SLOTS), "--ctx", str(SERVER_CTX),
           # one torch thread: the test client and the server share CI's 2 cores
           "--threads", "1", *extra_args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    server = RunningServer(base, "", proc, log_path)
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"mashbox run exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            status, _ = http_get(base + "/health", timeout=2.0)
        except OSError:
            status = 0
        if status == 200:
            break
        if time.monotonic() > deadline:
            stop_server(server)
            raise RuntimeError(f"mashbox run was not ready after {STARTUP_TIMEOUT_S:.0f} s:\n{server.log_tail()}")
        time.sleep(0.5)
    _, body = http_get(base + "/v1/models", headers=headers)
    server.model_id = json.loads(body)["data"][0]["id"]
    return server


def stop_server(server: RunningServer) -> None:
    proc = server.process
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.fixture(scope="session")
def server(default_model_path, tmp_path_factory):
    s = start_server(default_model_path, str(tmp_path_factory.mktemp("server")))
    try:
        yield s
    finally:
        stop_server(s)
    # SIGTERM is a clean shutdown: the server stops its worker and exits 0.
    assert s.process.returncode == 0, f"mashbox run exited with {s.process.returncode}:\n{s.log_tail()}"


@pytest.fixture(scope="session")
def base_url(server) -> str:
    return server.base_url


@pytest.fixture(scope="session")
def model_id(server) -> str:
    return server.model_id


@pytest.fixture(scope="session")
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture
def start_mashbox(default_model_path, tmp_path):
    """Start extra servers with their own flags (later flags win: `--slots 1` overrides);
    each is stopped when the test ends."""
    started: list[RunningServer] = []

    def start(*extra_args: str, headers: dict | None = None) -> RunningServer:
        s = start_server(default_model_path, str(tmp_path), tuple(extra_args), headers=headers)
        started.append(s)
        return s

    yield start
    for s in started:
        stop_server(s)


@pytest.fixture(scope="module")
def start_mashbox_module(default_model_path, tmp_path_factory):
    """`start_mashbox` for a module's tests to share one server of their own flags (a
    long-context server costs a start-up per test otherwise)."""
    started: list[RunningServer] = []
    tmp_dir = str(tmp_path_factory.mktemp("module-server"))

    def start(*extra_args: str, headers: dict | None = None) -> RunningServer:
        s = start_server(default_model_path, tmp_dir, tuple(extra_args), headers=headers)
        started.append(s)
        return s

    yield start
    for s in started:
        stop_server(s)
