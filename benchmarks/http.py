"""HTTP layer throughput: mashbox's hand-written server against uvicorn + starlette.

Two scenarios, the same routes on both servers, side by side in one run:

- health: `GET /health` answering a small JSON object;
- sse: `GET /v1/stream`, a 200-chunk server-sent event stream of chat.completion.chunk
  frames from a scripted generator (one event-loop turn per chunk, as tokens arrive),
  ending with `data: [DONE]`. Each chunk is one send() on both servers, and on loopback
  the kernel's share of a send dominates, which bounds the ratio here;
- sse-burst: the same stream with all 200 chunks ready at once (a server that fell
  behind its engine); mashbox sends frames the generator yields without waiting in
  one send, uvicorn + starlette one send per chunk.

Each server runs as a subprocess on 127.0.0.1 (uvloop in both; uvicorn with
http="httptools", no access log; mashbox with its Guard and access logging at WARNING).
The load comes from `--procs` client processes, each a small asyncio raw-socket client
with keep-alive connections (`--conns` in all) sending one request at a time per
connection, for `--seconds` (after a warm-up) or until `--max-requests`. Latency is per
request, send to the last byte of the response (the whole stream for sse).

Besides requests/s (which on a small shared machine also depends on the client's share
of the CPUs), the server process's own CPU time per request is measured from /proc, a
figure the client's load does not distort.

Output: one line per scenario,

    health: mashbox <r>/s p50 <ms> p99 <ms> cpu <us>/req | uvicorn+starlette ... | <x>x req/s, <y>x less server cpu per request

Usage: python benchmarks/http.py [--seconds 5] [--conns 32] [--sse-conns 16] [--procs 1]
"""
from __future__ import annotations

import os
import sys

# This file is named http.py: keep its folder off sys.path so `import http` (used by
# uvicorn, http.client, ...) finds the standard library, and put the repo root on it.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import multiprocessing  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import orjson  # noqa: E402

N_CHUNKS = 200
HEALTH = {"status": "ok", "model": "bench", "slots": 4}


def chunk_frames() -> list[bytes]:
    frames = []
    for i in range(N_CHUNKS):
        obj = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1700000000,
               "model": "bench", "choices": [{"index": 0, "delta": {"content": f" tok{i}"},
                                              "finish_reason": None}]}
        frames.append(b"data: " + orjson.dumps(obj) + b"\n\n")
    frames.append(b"data: [DONE]\n\n")
    return frames


# ---- servers ---------------------------------------------------------------------------

def serve_mashbox(port: int) -> None:
    import uvloop

    from mashbox.config import ServerConfig
    from mashbox.http.response import json_response
    from mashbox.http.router import Router
    from mashbox.http.security import Guard
    from mashbox.http.server import serve
    from mashbox.http.sse import StreamResponse

    frames = chunk_frames()

    async def health(req):
        return json_response(HEALTH)

    async def stream(req):
        async def events():
            for f in frames:
                await asyncio.sleep(0)
                yield f
        return StreamResponse(events())

    async def burst(req):
        async def events():
            for f in frames:
                yield f
        return StreamResponse(events())

    async def main():
        cfg = ServerConfig(host="127.0.0.1", port=port)
        r = Router(Guard(cfg))
        r.get("/health", health)
        r.get("/v1/stream", stream)
        r.get("/v1/burst", burst)
        await serve(r, cfg)
        print("READY", flush=True)
        await asyncio.Event().wait()

    uvloop.run(main())


def serve_uvicorn(port: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    frames = chunk_frames()

    async def health(request):
        return JSONResponse(HEALTH)

    async def stream(request):
        async def events():
            for f in frames:
                await asyncio.sleep(0)
                yield f
        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    async def burst(request):
        async def events():
            for f in frames:
                yield f
        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    app = Starlette(routes=[Route("/health", health), Route("/v1/stream", stream),
                            Route("/v1/burst", burst)])
    print("READY", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools",
                log_level="warning", access_log=False, lifespan="off")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(kind: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", kind, "--port", str(port)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "READY", f"{kind} server did not start"
    deadline = time.monotonic() + 10
    while True:  # uvicorn prints READY before it binds
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return p, port
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# ---- load client -----------------------------------------------------------------------

class _Conn(asyncio.Protocol):
    """One keep-alive connection; `request()` sends and waits for the whole response.
    Understands Content-Length and chunked bodies (enough for these two routes)."""

    def __init__(self):
        self.buf = bytearray()
        self.waiter = None
        self.transport = None

    def connection_made(self, t):
        self.transport = t

    def data_received(self, data):
        self.buf += data
        if self.waiter is not None and self._complete():
            w, self.waiter = self.waiter, None
            w.set_result(None)

    def connection_lost(self, exc):
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("server closed the connection"))

    def _complete(self) -> bool:
        buf = self.buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            return False
        head = bytes(buf[:end]).lower()
        i = head.find(b"content-length:")
        if i >= 0:
            n = int(head[i + 15:head.find(b"\r\n", i) if head.find(b"\r\n", i) > 0 else None])
            if len(buf) >= end + 4 + n:
                del buf[:end + 4 + n]
                return True
            return False
        if buf.endswith(b"\r\n0\r\n\r\n"):
            buf.clear()
            return True
        return False

    async def request(self, raw: bytes) -> None:
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        await self.waiter


def client_proc(port: int, path: str, conns: int, seconds: float, warmup: float, max_requests: int, out):
    import uvloop

    raw = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUser-Agent: bench\r\n\r\n".encode()

    async def main():
        loop = asyncio.get_running_loop()
        clock = time.perf_counter  # uvloop's loop.time() has millisecond resolution
        lat: list[float] = []
        count = [0]
        total = [0]
        t_start = clock()
        t_measure = t_start + warmup
        t_end = t_measure + seconds

        async def one():
            _, c = await loop.create_connection(_Conn, "127.0.0.1", port)
            while True:
                t0 = clock()
                if t0 >= t_end or count[0] >= max_requests:
                    break
                await c.request(raw)
                t1 = clock()
                total[0] += 1
                if t0 >= t_measure:
                    lat.append(t1 - t0)
                    count[0] += 1
            c.transport.close()

        await asyncio.gather(*(one() for _ in range(conns)))
        elapsed = min(clock(), t_end) - t_measure
        return lat, elapsed, total[0]

    out.put(uvloop.run(main()))


def drive(port: int, path: str, conns: int, procs: int, seconds: float, warmup: float,
          max_requests: int) -> dict:
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    per = [conns // procs + (1 if i < conns % procs else 0) for i in range(procs)]
    ps = [ctx.Process(target=client_proc, args=(port, path, n, seconds, warmup, max_requests // procs, q))
          for n in per if n]
    for p in ps:
        p.start()
    results = [q.get(timeout=seconds + warmup + 120) for _ in ps]
    for p in ps:
        p.join()
    lat = sorted(x for r in results for x in r[0])
    elapsed = max(r[1] for r in results)
    if not lat:
        return {"rps": 0.0, "p50": float("nan"), "p99": float("nan"), "n": 0, "total": 0}
    return {
        "total": sum(r[2] for r in results),
        "rps": len(lat) / elapsed,
        "p50": lat[len(lat) // 2] * 1000,
        "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000,
        "n": len(lat),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--serve", choices=["mashbox", "uvicorn"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds per scenario and server")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--conns", type=int, default=32, help="connections for health")
    ap.add_argument("--sse-conns", type=int, default=16, help="connections for sse")
    ap.add_argument("--procs", type=int, default=1, help="client processes")
    ap.add_argument("--max-requests", type=int, default=2_000_000)
    ap.add_argument("--only", choices=["health", "sse", "sse-burst"], default=None)
    args = ap.parse_args()
    if args.serve == "mashbox":
        return serve_mashbox(args.port)
    if args.serve == "uvicorn":
        return serve_uvicorn(args.port)

    scenarios = [("health", "/health", args.conns), ("sse", "/v1/stream", args.sse_conns),
                 ("sse-burst", "/v1/burst", args.sse_conns)]
    if args.only:
        scenarios = [s for s in scenarios if s[0] == args.only]
    print(f"# {os.cpu_count()} cpus, {args.procs} client process(es), {args.seconds:g}s per run", flush=True)
    for name, path, conns in scenarios:
        res = {}
        for kind in ("mashbox", "uvicorn"):
            proc, port = start_server(kind)
            try:
                cpu0 = cpu_seconds(proc.pid)
                res[kind] = drive(port, path, conns, args.procs, args.seconds, args.warmup, args.max_requests)
                res[kind]["cpu_us"] = (cpu_seconds(proc.pid) - cpu0) / max(1, res[kind]["total"]) * 1e6
            finally:
                proc.terminate()
                proc.wait(10)
        m, u = res["mashbox"], res["uvicorn"]
        ratio = m["rps"] / u["rps"] if u["rps"] else float("inf")
        cpu_ratio = u["cpu_us"] / m["cpu_us"] if m["cpu_us"] else float("nan")
        print(f"{name}: mashbox {m['rps']:.0f}/s p50 {m['p50']:.2f}ms p99 {m['p99']:.2f}ms "
              f"cpu {m['cpu_us']:.0f}us/req | uvicorn+starlette {u['rps']:.0f}/s p50 {u['p50']:.2f}ms "
              f"p99 {u['p99']:.2f}ms cpu {u['cpu_us']:.0f}us/req | {ratio:.2f}x req/s, "
              f"{cpu_ratio:.2f}x less server cpu per request ({conns} conns)", flush=True)


if __name__ == "__main__":
    main()
