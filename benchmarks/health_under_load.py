"""GET /health latency while big prompts arrive (issue 10 item 3: p99 under 50 ms).

The real server (`python -m mashbox run MODEL`, the real worker) runs as a subprocess on
127.0.0.1. A separate poller process asks GET /health about every 10 ms on one
keep-alive connection, while this process posts chat bodies of --mb megabytes of
"hello world " text, one after another (`seq`) or two at a time (`x2`), to
/v1/chat/completions and /v1/messages (refused: far longer than the context) and
/v1/messages/count_tokens (rendered and tokenized to the exact count). Each scenario
prints the poller's latencies:

    chat seq: 3 bodies of 20 MB, answers 400 400 400 in 1.9 s; /health n 190 p50 0.6 ms p99 4.1 ms max 7.9 ms

and the load average beside them: on a shared machine, read them as an upper bound.

Usage: python benchmarks/health_under_load.py [--model PATH] [--mb 20] [--bodies 3]
       [--only chat,messages,count] [--smoke]
"""
from __future__ import annotations

import os
import sys

# benchmarks/http.py would shadow the standard library's http: keep this folder off sys.path.
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != HERE]

import argparse  # noqa: E402
import http.client  # noqa: E402
import multiprocessing  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
ROUTES = {
    "chat": ("/v1/chat/completions", lambda text: {"messages": [{"role": "user", "content": text}]}),
    "messages": ("/v1/messages", lambda text: {"model": "m", "max_tokens": 16,
                                               "messages": [{"role": "user", "content": text}]}),
    "count": ("/v1/messages/count_tokens", lambda text: {"model": "m",
                                                         "messages": [{"role": "user", "content": text}]}),
}
HEADERS = {"content-type": "application/json", "anthropic-version": "2023-06-01"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port: int, path: str, timeout: float = 5.0) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        r.read()
        return r.status
    finally:
        conn.close()


def start_server(model: str, port: int, ctx: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "mashbox", "run", model, "--port", str(port), "--ctx", str(ctx),
           "--slots", "2", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if get(port, "/health", 1.0) == 200:
                return proc
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not become ready in 300 s")


def poller(port: int, stop, out) -> None:
    """In its own process: GET /health every ~10 ms until `stop` is set; latencies to `out`."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    latencies = []
    while not stop.is_set():
        t = time.perf_counter()
        conn.request("GET", "/health")
        r = conn.getresponse()
        r.read()
        dt = time.perf_counter() - t
        if r.status != 200:
            raise SystemExit(f"/health answered {r.status}")
        latencies.append(dt)
        time.sleep(max(0.0, 0.01 - dt))
    conn.close()
    out.send(latencies)


def post(port: int, path: str, body: bytes, statuses: list) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", path, body=body, headers=HEADERS)
        r = conn.getresponse()
        data = r.read()
        statuses.append(r.status)
        if r.status not in (200, 400) or (r.status == 400 and b"context" not in data):
            print(f"unexpected answer {r.status}: {data[:300]!r}", flush=True)
    finally:
        conn.close()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def scenario(port: int, name: str, body: bytes, bodies: int, concurrent: int) -> None:
    path = ROUTES[name][0]
    ctx = multiprocessing.get_context("spawn")
    stop, (recv, send) = ctx.Event(), ctx.Pipe(duplex=False)
    p = ctx.Process(target=poller, args=(port, stop, send))
    p.start()
    time.sleep(0.5)  # the poller's first answers: a baseline before the bodies
    statuses: list[int] = []
    t = time.monotonic()
    for _ in range(0, bodies, concurrent):
        threads = [threading.Thread(target=post, args=(port, path, body, statuses)) for _ in range(concurrent)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    elapsed = time.monotonic() - t
    stop.set()
    latencies = recv.recv()
    p.join()
    ms = [x * 1000 for x in latencies]
    kind = "seq" if concurrent == 1 else f"x{concurrent}"
    print(f"{name} {kind}: {len(statuses)} bodies of {len(body) / 1e6:.0f} MB, answers "
          f"{' '.join(map(str, statuses))} in {elapsed:.1f} s; /health n {len(ms)} p50 {pct(ms, 0.5):.1f} ms "
          f"p99 {pct(ms, 0.99):.1f} ms max {max(ms, default=0.0):.1f} ms  (load {os.getloadavg()[0]:.1f})",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model to serve (default: the default model, pulled)")
    ap.add_argument("--mb", type=float, default=20.0, help="megabytes of prompt text per body")
    ap.add_argument("--bodies", type=int, default=10, help="bodies per scenario (even: x2 sends pairs)")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--only", default="chat,messages,count", help="comma-separated routes: chat, messages, count")
    ap.add_argument("--smoke", action="store_true", help="a quick run: 2 MB bodies, 2 of each")
    args = ap.parse_args()
    if args.smoke:
        args.mb, args.bodies = 2.0, 2
    sys.path.insert(0, ROOT)
    model = args.model
    if model is None:
        from mashbox import registry

        model = str(registry.pull(registry.DEFAULT_MODEL_ID, quiet=True))
    import orjson

    text = "hello world " * int(args.mb * 1e6 / 12)
    port = free_port()
    server = start_server(model, port, args.ctx)
    print(f"load average {os.getloadavg()}, cpus {os.cpu_count()}", flush=True)
    try:
        for name in args.only.split(","):
            body = orjson.dumps(ROUTES[name][1](text))
            for concurrent in (1, 2):
                scenario(port, name, body, args.bodies, concurrent)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    main()
