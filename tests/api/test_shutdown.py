"""Graceful shutdown (issue 10 item 6), on a real socket: the real app (router, guard,
routes, http server) in a thread via app.serve_async, with a scripted engine whose
answers run as long as a test needs; and `python -m mashbox run` (the real worker, a
real SIGTERM) for the flag and one end-to-end case.

What is checked: once stop is set (what SIGTERM / SIGINT set), the listener is closed at
once; a request that finishes within the grace period is answered normally; when the
grace period is over, an open stream ends with its route's error event and terminator
and a non-streamed request still running gets 503 (OpenAI) / 529 (Anthropic) in its
family's error shape; serve_async returns 0. Every wait is on an event or a condition
with a bounded deadline, never a sleep window.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

import httpx
import pytest

from api_scripted_engine import ScriptedEngine, ScriptedHandle
from mashbox.config import EngineConfig, GenerationRequest, ServerConfig, StepEvent

DEADLINE_S = 30.0


class Gate:
    """A script item: the handle waits until the gate is opened (from the test thread)."""

    def __init__(self):
        self.event = threading.Event()

    def open(self) -> None:
        self.event.set()


class GatedHandle(ScriptedHandle):
    async def __anext__(self) -> StepEvent:
        while self.events and isinstance(self.events[0], Gate):
            gate = self.events.pop(0)
            while not gate.event.is_set():  # the test thread opens it; looked at, not a window
                await asyncio.sleep(0.005)
        return await super().__anext__()


class GatedEngine(ScriptedEngine):
    def submit(self, req: GenerationRequest) -> GatedHandle:
        handle = super().submit(req)
        return GatedHandle(self, req, handle.events)


def events(req: GenerationRequest, gate: Optional[Gate], finish: bool) -> list:
    """Started, one token "Hi", then (after `gate`, when given) " there" and the finish;
    without `finish` the answer never ends (it waits until it is cancelled)."""
    n = len(req.prompt_ids)
    out: list = [StepEvent(id=req.id, started=True, prompt_tokens=n),
                 StepEvent(id=req.id, token_ids=(100,), text="Hi", prompt_tokens=n)]
    if gate is not None:
        out.append(gate)
    if finish:
        out += [StepEvent(id=req.id, token_ids=(101,), text=" there", prompt_tokens=n),
                StepEvent(id=req.id, finish_reason="stop", prompt_tokens=n)]
    return out


class Served:
    """serve_async in a thread on a free port; `stop()` sets its stop event, `join()`
    returns its exit code."""

    def __init__(self, engine: ScriptedEngine, model_path: str, grace_s: float):
        self.engine = engine
        self.config = ServerConfig(host="127.0.0.1", port=0, shutdown_grace_s=grace_s)
        self.engine_config = EngineConfig(model_path=model_path, model_id="scripted", ctx=256)
        self.port = 0
        self.exit_code: Optional[int] = None
        self.error: Optional[BaseException] = None
        self._listening = threading.Event()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop: Optional[asyncio.Event] = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "Served":
        self._thread.start()
        assert self._listening.wait(60), "the server did not start"
        if self.error is not None:
            raise self.error
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        self._thread.join(DEADLINE_S)

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # the loop is over already
                pass

    def join(self) -> Optional[int]:
        self._thread.join(DEADLINE_S)
        assert not self._thread.is_alive(), "serve_async did not return"
        return self.exit_code

    def _run(self) -> None:
        import uvloop

        from mashbox.api.app import serve_async

        async def main():
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()

            def listening(server):
                self.port = server.port
                self._listening.set()

            from mashbox.text.chat import ChatTemplate
            from mashbox.text.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(self.engine_config.model_path)
            self.exit_code = await serve_async(self.config, self.engine_config, engine=self.engine,
                                               stop=self._stop, on_listening=listening,
                                               text=(tokenizer, ChatTemplate(tokenizer)))

        try:
            uvloop.run(main())
        except BaseException as e:
            self.error = e
            self._listening.set()


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    except ConnectionResetError:
        # a connect racing the listener's close is reset (it sat in the closing backlog):
        # not yet the refusal asked for; the next probe tells
        return False
    return False


ROUTES = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    "completions": ("/v1/completions", {"prompt": "hi"}),
    "messages": ("/v1/messages", {"model": "scripted", "max_tokens": 16,
                                  "messages": [{"role": "user", "content": "hi"}]}),
    "responses": ("/v1/responses", {"input": "hi"}),
}


def body(route: str, stream: bool, tag: str) -> dict:
    """A request of `route`; `tag` (in the prompt) tells the script what to answer."""
    b = json.loads(json.dumps(ROUTES[route][1]))
    if "messages" in b:
        b["messages"][0]["content"] = tag
    elif "prompt" in b:
        b["prompt"] = tag
    else:
        b["input"] = tag
    if "max_tokens" not in b and route != "responses":
        b["max_tokens"] = 16
    b["stream"] = stream
    return b


class Streamed:
    """A streamed request in a thread: `first` is set once its first frame arrived; `text`
    is all it received once `done` is set."""

    def __init__(self, url: str, request: dict):
        self.first = threading.Event()
        self.done = threading.Event()
        self.status = 0
        self.text = ""
        self.error: Optional[BaseException] = None
        self._args = (url, request)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        url, b = self._args
        try:
            with httpx.stream("POST", url, json=b, timeout=DEADLINE_S) as r:
                self.status = r.status_code
                for chunk in r.iter_text():
                    self.text += chunk
                    self.first.set()
        except BaseException as e:  # a broken stream: the test says so
            self.error = e
        finally:
            self.first.set()
            self.done.set()

    def wait(self) -> str:
        assert self.done.wait(DEADLINE_S), "the stream did not end"
        assert self.error is None, f"the stream broke: {self.error!r} after {self.text!r}"
        return self.text


class Whole:
    """A non-streamed request in a thread."""

    def __init__(self, url: str, request: dict):
        self.done = threading.Event()
        self.response: Optional[httpx.Response] = None
        self.error: Optional[BaseException] = None
        self._args = (url, request)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        url, b = self._args
        try:
            self.response = httpx.post(url, json=b, timeout=DEADLINE_S)
        except BaseException as e:
            self.error = e
        finally:
            self.done.set()

    def wait(self) -> httpx.Response:
        assert self.done.wait(DEADLINE_S), "no answer"
        assert self.error is None, f"no answer: {self.error!r}"
        return self.response


def streamed(base_url: str, route: str, tag: str) -> Streamed:
    return Streamed(base_url + ROUTES[route][0], body(route, True, tag))


def whole(base_url: str, route: str, tag: str) -> Whole:
    return Whole(base_url + ROUTES[route][0], body(route, False, tag))


def submitted(engine: ScriptedEngine, n: int) -> bool:
    return len(engine.submitted) >= n


def tag_script(gate: Optional[Gate] = None):
    def script(req: GenerationRequest) -> list:
        finish = gate is not None
        return events(req, gate, finish)
    return script


def frames_of(text: str) -> list[str]:
    return [f for f in text.split("\n\n") if f]


# The stream's last frames, per route, and the non-streamed family's status / error type.
TERMINAL = {
    "chat": lambda fr: fr[-2].startswith("event: error\ndata: ") and fr[-1] == "data: [DONE]",
    "completions": lambda fr: fr[-2].startswith("event: error\ndata: ") and fr[-1] == "data: [DONE]",
    "messages": lambda fr: fr[-1].startswith("event: error\ndata: "),
    "responses": lambda fr: fr[-2].startswith("event: error\ndata: ")
    and fr[-1].startswith("event: response.failed\ndata: "),
}
WHOLE = {"chat": (503, "server_error"), "completions": (503, "server_error"),
         "messages": (529, "overloaded_error"), "responses": (503, "server_error")}


@pytest.mark.parametrize("stream_route, whole_route", [
    ("chat", "messages"), ("messages", "chat"), ("responses", "completions"), ("completions", "responses"),
])
def test_after_the_grace_period_streams_end_with_their_error_event_and_requests_get_503(
        stream_route, whole_route, default_model_path):
    engine = GatedEngine(tag_script(None), ctx=256)  # answers that never end
    with Served(engine, default_model_path, grace_s=0.0) as server:
        s = streamed(server.base_url, stream_route, "stream")
        assert s.first.wait(DEADLINE_S)
        w = whole(server.base_url, whole_route, "whole")
        wait_until(lambda: submitted(engine, 2), "both requests to reach the engine")
        server.stop()
        text = s.wait()
        r = w.wait()
        assert server.join() == 0
    assert s.status == 200
    fr = frames_of(text)
    assert TERMINAL[stream_route](fr), fr[-3:]
    error = [f for f in fr if f.startswith("event: error")][0]
    assert "The server is shutting down" in error, error
    assert "Hi" in text  # the output sent before the end is kept
    status, kind = WHOLE[whole_route]
    assert r.status_code == status, r.text
    err = r.json()
    if whole_route == "messages":
        assert err["type"] == "error" and err["error"]["type"] == kind
    else:
        assert err["error"]["type"] == kind and err["error"]["code"] == "server_shutting_down"
    assert "shutting down" in err["error"]["message"]
    assert r.headers["x-should-retry"] == "true"
    assert sorted(engine.cancelled) == sorted(req.id for req in engine.submitted)  # slots freed


def test_requests_that_finish_within_the_grace_period_complete_normally(default_model_path):
    gate = Gate()
    engine = GatedEngine(tag_script(gate), ctx=256)
    with Served(engine, default_model_path, grace_s=DEADLINE_S) as server:
        s = streamed(server.base_url, "chat", "stream")
        assert s.first.wait(DEADLINE_S)
        w = whole(server.base_url, "messages", "whole")
        wait_until(lambda: submitted(engine, 2), "both requests to reach the engine")
        server.stop()
        wait_until(lambda: refused(server.port), "the listener to close")  # new connections: refused
        assert not s.done.is_set() and not w.done.is_set()
        gate.open()
        text = s.wait()
        r = w.wait()
        assert server.join() == 0
    fr = frames_of(text)
    assert fr[-1] == "data: [DONE]" and '"finish_reason":"stop"' in fr[-2], fr[-3:]
    assert "event: error" not in text
    assert r.status_code == 200 and r.json()["content"][0]["text"] == "Hi there"


def test_a_request_arriving_on_an_open_connection_during_the_grace_period_gets_503(default_model_path):
    """Pipelined behind a running request: it arrives on a connection the shutdown keeps
    open for the first answer, so the route refuses it (503 / connection: close)."""
    gate = Gate()
    engine = GatedEngine(tag_script(gate), ctx=256)
    with Served(engine, default_model_path, grace_s=DEADLINE_S) as server:
        first = json.dumps(body("chat", False, "first")).encode()
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE_S)
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n")
        sock.sendall(head % len(first) + first)
        wait_until(lambda: submitted(engine, 1), "the first request to reach the engine")
        server.stop()
        wait_until(lambda: refused(server.port), "the listener to close")
        second = json.dumps(body("chat", False, "second")).encode()
        sock.sendall(head % len(second) + second)
        gate.open()
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        sock.close()
        assert server.join() == 0
    answers = data.split(b"HTTP/1.1 ")[1:]
    assert len(answers) == 2, data
    assert answers[0].startswith(b"200 ") and b"Hi there" in answers[0]
    assert answers[1].startswith(b"503 ") and b"server_shutting_down" in answers[1], answers[1]
    assert len(engine.submitted) == 1


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "x"])
def test_bad_shutdown_grace_exits_2_with_one_line(value, default_model_path):
    r = subprocess.run([sys.executable, "-m", "mashbox", "run", default_model_path, f"--shutdown-grace={value}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 or value == "x", r.stderr
    assert "--shutdown-grace" in r.stderr


def test_help_names_the_shutdown_grace():
    r = subprocess.run([sys.executable, "-m", "mashbox", "run", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "--shutdown-grace" in r.stdout


class RealServer:
    """`python -m mashbox run <default model> --shutdown-grace G` with the real worker."""

    def __init__(self, model_path: str, tmp_path, grace: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log_path = tmp_path / "server.log"
        self.base_url = f"http://127.0.0.1:{self.port}"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mashbox", "run", model_path, "--port", str(self.port), "--slots", "2",
                 "--ctx", "2048", "--threads", "1", "--shutdown-grace", grace],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def __enter__(self) -> "RealServer":
        deadline = time.monotonic() + 300
        while True:  # the model loads: polled with a deadline
            assert self.proc.poll() is None, self.log()
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, self.log()
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


COUNT = {"messages": [{"role": "user", "content": "Count from 1 to 1000, one number a line."}],
         "max_tokens": 1500, "temperature": 0, "stream": True}


def test_sigterm_on_the_real_server_ends_a_stream_and_answers_a_running_request(default_model_path, tmp_path):
    """--shutdown-grace 0: SIGTERM while a stream and a non-streamed request are decoding."""
    with RealServer(default_model_path, tmp_path, "0") as server:
        base = server.base_url
        stream = Streamed(base + "/v1/chat/completions", COUNT)
        running = Whole(base + "/v1/completions",
                        {"prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 1500, "temperature": 0})
        wait_until(lambda: '"content"' in stream.text, "the stream's first content")

        def both_decoding() -> bool:
            h = httpx.get(base + "/health", timeout=5).json()
            return h["live_rows"] >= 2

        wait_until(both_decoding, "both requests to decode")
        assert not running.done.is_set()
        server.proc.send_signal(signal.SIGTERM)
        text = stream.wait()
        r = running.wait()
        assert server.proc.wait(DEADLINE_S) == 0, server.log()
    fr = frames_of(text)
    assert fr[-2].startswith("event: error\ndata: ") and "shutting down" in fr[-2] and fr[-1] == "data: [DONE]", fr[-3:]
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down", r.text


def test_a_stream_goes_on_during_the_grace_and_a_second_sigterm_ends_it(default_model_path, tmp_path):
    """--shutdown-grace 600: after SIGTERM new connections are refused and the stream keeps
    receiving tokens; a second SIGTERM ends it with its error event, and the server exits 0."""
    with RealServer(default_model_path, tmp_path, "600") as server:
        stream = Streamed(server.base_url + "/v1/chat/completions", COUNT)
        wait_until(lambda: '"content"' in stream.text, "the stream's first content")
        server.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: refused(server.port), "the listener to close")
        seen = len(stream.text)
        wait_until(lambda: len(stream.text) > seen, "more of the stream after SIGTERM")
        assert not stream.done.is_set()
        server.proc.send_signal(signal.SIGTERM)
        text = stream.wait()
        assert server.proc.wait(DEADLINE_S) == 0, server.log()
    fr = frames_of(text)
    assert fr[-2].startswith("event: error\ndata: ") and "shutting down" in fr[-2] and fr[-1] == "data: [DONE]", fr[-3:]


def test_sigterm_to_the_whole_process_group_leaves_the_worker_to_the_server(default_model_path, tmp_path):
    """A service manager's stop signals every process of the group (systemd's control-group
    kill, `timeout`, `kill -- -PGID`): the worker outlives it, so the grace period holds; a
    second group SIGTERM ends the stream with its error event, the server exits 0, and
    stopping the worker it asked to stop logs no pipe failure."""
    with RealServer(default_model_path, tmp_path, "600") as server:
        stream = Streamed(server.base_url + "/v1/chat/completions", COUNT)
        wait_until(lambda: '"content"' in stream.text, "the stream's first content")
        os.killpg(server.proc.pid, signal.SIGTERM)  # RealServer's session: the server and its worker
        wait_until(lambda: refused(server.port), "the listener to close")
        seen = len(stream.text)
        wait_until(lambda: len(stream.text) > seen, "more of the stream after the group's SIGTERM")
        assert not stream.done.is_set()
        os.killpg(server.proc.pid, signal.SIGTERM)
        text = stream.wait()
        assert server.proc.wait(DEADLINE_S) == 0, server.log()
        assert "engine pipe" not in server.log() and "worker exited" not in server.log(), server.log()
    fr = frames_of(text)
    assert fr[-2].startswith("event: error\ndata: ") and "shutting down" in fr[-2] and fr[-1] == "data: [DONE]", fr[-3:]


def test_a_worker_whose_server_is_killed_exits_on_its_own(default_model_path, tmp_path):
    """The worker ignores the signals a group stop sends, so what ends it when its server
    dies at once (SIGKILL, the OOM killer) is the pipe closing: it must not be left behind
    holding the model's memory."""
    with RealServer(default_model_path, tmp_path, "0") as server:
        worker = httpx.get(server.base_url + "/health", timeout=5).json()["worker_pid"]
        os.kill(server.proc.pid, signal.SIGKILL)  # the server alone: its worker stays in the group
        server.proc.wait(DEADLINE_S)

        def worker_gone() -> bool:
            try:
                os.kill(worker, 0)
            except ProcessLookupError:
                return True
            with open(f"/proc/{worker}/stat") as f:  # exited, not yet reaped by init
                return f.read().rsplit(")", 1)[1].split()[0] == "Z"

        wait_until(worker_gone, "the orphaned worker to exit")
