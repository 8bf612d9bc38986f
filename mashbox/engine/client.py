"""The server side of the engine (no torch): spawns the worker, admits requests, routes events.

Rules:
- One socket to the worker, framed by frames.py, read with `loop.add_reader` (no thread)
  and written without blocking (what the socket does not take waits for `add_writer`).
- The client implements engine/interface.py's `Engine`; its handles, `GenerationHandle`.
- A request is *waiting* from submit until the worker says it has a slot (an event with
  `started`, or its final event), or until it is cancelled: a request whose client is
  gone stops counting at once, not when the worker acknowledges the cancel. Admission
  caps count waiting requests only: per tenant (`max_waiting_per_tenant`) and in all
  (`max_waiting_total`) -> QueueFull(scope). A request is *running* from its `started`
  event to its final event (cancelled or not: its slot is taken until then).
- A handle's life is handle.py's table (HANDLE_TRANSITIONS); the client moves it.
- States: "loading" until the worker's ready frame, "ok" after it. When the worker dies,
  the state goes back to "loading", `restarts` counts it, and a new worker is started.
  Every request it had ends at once: a cancelled one with "cancelled", the others with
  StepEvent(finish_reason="error"). The client never sends a request twice: the one
  retry of a request whose client has received nothing lives in api/generation.py,
  the only layer that knows what its client received (a request can have tokens that
  no client saw yet, held back by the output parser).
- A worker that reports a fatal load error is not restarted; `wait_ready` raises
  EngineStartError with its message.
- Watchdog: while the client has open requests and the worker is ready, some frame must
  arrive at least every `watchdog_s` (default WATCHDOG_S): a busy worker sends its
  events every step and an "alive" frame every frames.ALIVE_EVERY_S otherwise (a
  prompt prefilled in many chunks). A worker that sends nothing for that long (frozen:
  SIGSTOP, a hung kernel, a dead lock) is killed and handled as a worker that died: its
  requests end with "error" (Generation retries those whose clients received nothing)
  and a new one starts; health says "loading" meanwhile. `stalls` counts them. One
  step longer than watchdog_s would be taken for a freeze: WATCHDOG_S is far above the
  longest step seen (a 512-token prefill chunk of a 1.7B model on 2 cores, seconds).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import socket
import sys
import time
from typing import Optional

from mashbox.config import EngineConfig, GenerationRequest, ServerConfig, StepEvent
from mashbox.engine import frames
from mashbox.engine.handle import HandleState, IllegalTransition, RequestHandle
from mashbox.engine.histogram import E2E_BUCKETS, QUEUE_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS, Histogram
from mashbox.engine.interface import EngineInfo, EngineStartError, EngineStats, NotReady, QueueFull

log = logging.getLogger("mashbox.engine.client")

WATCHDOG_S = 60.0  # no frame for this long while requests are open: the worker is frozen

_PKG_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


__all__ = ["EngineClient", "RequestHandle", "HandleState", "IllegalTransition",
           "NotReady", "QueueFull", "EngineStartError", "WATCHDOG_S"]


# -- the client -----------------------------------------------------------------------------


class EngineClient:
    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig,
                 *, restart: bool = True, watchdog_s: float = WATCHDOG_S) -> None:
        if watchdog_s <= 2 * frames.ALIVE_EVERY_S:
            raise ValueError(f"watchdog_s must be above {2 * frames.ALIVE_EVERY_S} s (twice the worker's "
                             f"alive interval), not {watchdog_s}")
        self.engine_config = engine_config
        self.server_config = server_config
        self.restart_on_exit = restart
        self.watchdog_s = watchdog_s
        self.stalls = 0  # workers killed by the watchdog
        self.state = "loading"
        self.info: Optional[EngineInfo] = None  # from the first ready frame on
        self.restarts = 0
        self.error: Optional[str] = None  # a fatal load error
        self._handles: dict[str, RequestHandle] = {}  # the open ones
        # Admission: the ids that count toward the caps, with their tenants.
        self._waiting: dict[str, str] = {}
        self._in_slot: set[str] = set()  # the ids the worker has given a slot
        self._waiting_by_tenant: collections.Counter[str] = collections.Counter()
        self._proc: Optional[asyncio.subprocess.Process] = None
        self._sock: Optional[socket.socket] = None
        self._reader: Optional[frames.FrameReader] = None
        self._out = bytearray()
        self._gen = 0  # which worker generation the socket belongs to
        self._ready = asyncio.Event()
        self._stopping = False
        self._fails_before_ready = 0
        self._tasks: set[asyncio.Task] = set()
        self._last_frame = 0.0  # time.monotonic() of the worker's last bytes (or of new work)
        self._watch: Optional[asyncio.TimerHandle] = None
        # metrics
        self.finished_by_reason: collections.Counter[str] = collections.Counter()
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self._worker_counters: dict = {}
        self._worker_gauges: dict = {}  # the running worker's levels (host cache bytes)
        self._counter_base: collections.Counter[str] = collections.Counter()
        self.h_ttft = Histogram(TTFT_BUCKETS)
        self.h_queue = Histogram(QUEUE_BUCKETS)
        self.h_e2e = Histogram(E2E_BUCKETS)
        self.h_tpot = Histogram(TPOT_BUCKETS)

    # -- life cycle ---------------------------------------------------------------------

    @property
    def worker_pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    async def start(self) -> None:
        """Spawn the worker; returns at once (state "loading"); see wait_ready."""
        self._stopping = False
        await self._spawn()

    async def wait_ready(self, timeout: Optional[float] = None) -> None:
        """Until the state is "ok"; raises EngineStartError if the model cannot load."""
        async def _wait():
            while self.state != "ok":
                if self.error is not None:
                    raise EngineStartError(self.error)
                self._ready.clear()
                await self._ready.wait()
        await asyncio.wait_for(_wait(), timeout)

    async def stop(self) -> None:
        self._stopping = True
        for h in list(self._handles.values()):
            self._end_locally(h, "cancelled", None)
        proc = self._proc
        if self._sock is not None:
            self._send({"op": "shutdown"})
            self._flush()
        if proc is not None and proc.returncode is None:
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except asyncio.TimeoutError:
                log.warning("worker %d did not stop; killing it", proc.pid)
                proc.kill()
                await proc.wait()
        self._close_socket()
        for t in list(self._tasks):
            t.cancel()
        self.state = "loading"

    async def _spawn(self) -> None:
        parent, child = socket.socketpair()
        parent.setblocking(False)
        env = dict(os.environ)
        env["PYTHONPATH"] = _PKG_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        # The worker runs the same mashbox as this process, whatever the cwd: `python -m`
        # would put the cwd first on sys.path, so started inside a checkout it would import
        # the source tree (no built extension) instead of the installed package. The -c
        # bootstrap puts _PKG_ROOT where the cwd would be (sys.path[0]), on every Python.
        boot = ("import runpy, sys; sys.path[0] = sys.argv.pop(1); "
                "runpy.run_module('mashbox.engine.worker', run_name='__main__', alter_sys=True)")
        # OMP_WAIT_POLICY is left to the user: on free cores OpenMP's spinning threads
        # decode ~1.7x faster than yielding ones (benchmarks/decode.py, 2 cores: b1 81 vs
        # 48 tok/s), while on a busy shared machine PASSIVE (or --threads 1) is faster.
        try:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", boot, _PKG_ROOT, "--fd", str(child.fileno()),
                pass_fds=(child.fileno(),), stdin=asyncio.subprocess.DEVNULL, env=env,
            )
        finally:
            child.close()
        self._gen += 1
        gen = self._gen
        self._sock = parent
        self._reader = frames.FrameReader()
        self._out = bytearray()
        asyncio.get_running_loop().add_reader(parent.fileno(), self._on_readable, gen)
        log.info("engine worker started (pid %d)", self._proc.pid)
        self._send({"op": "start", "config": dataclasses.asdict(self.engine_config)})

    def _close_socket(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self._sock is None:
            return
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._sock.fileno())
        loop.remove_writer(self._sock.fileno())
        self._sock.close()
        self._sock = None

    # -- requests -----------------------------------------------------------------------

    def submit(self, req: GenerationRequest) -> RequestHandle:
        if self.state != "ok":
            raise NotReady()
        if req.id in self._handles:
            raise ValueError(f"request id {req.id!r} is already running")
        sc = self.server_config
        if self._waiting_by_tenant[req.tenant] >= sc.max_waiting_per_tenant:
            raise QueueFull("tenant")
        if len(self._waiting) >= sc.max_waiting_total:
            raise QueueFull("total")
        if not self._handles:
            self._last_frame = time.monotonic()  # the worker was idle: its silence ends now
        h = RequestHandle(self, req)
        self._handles[req.id] = h
        self._waiting[req.id] = req.tenant
        self._waiting_by_tenant[req.tenant] += 1
        self._send({"op": "submit", "req": req.to_wire()})  # a failed write ends it (_worker_gone)
        return h

    def _cancel(self, h: RequestHandle) -> None:
        if h.state not in (HandleState.WAITING, HandleState.RUNNING):
            return  # cancelling already, or over
        h._goto(HandleState.CANCELLING)
        self._not_waiting(h)  # its client is gone: it no longer holds a place in the queue
        if self._sock is not None:
            self._send({"op": "cancel", "id": h.id})
        else:  # no worker has it (one just died): end it here
            self._end_locally(h, "cancelled", None)

    def _not_waiting(self, h: RequestHandle) -> None:
        tenant = self._waiting.pop(h.id, None)
        if tenant is not None:
            self._waiting_by_tenant[tenant] -= 1
            if not self._waiting_by_tenant[tenant]:
                del self._waiting_by_tenant[tenant]

    def _end_locally(self, h: RequestHandle, reason: str, error: Optional[str]) -> None:
        self._deliver(StepEvent(id=h.id, finish_reason=reason, error=error,
                                prompt_tokens=len(h.req.prompt_ids)))

    def _deliver(self, ev: StepEvent) -> None:
        h = self._handles.get(ev.id)
        if h is None:
            return  # ended here already (a late event of a dead worker's request)
        now = time.perf_counter()
        if ev.started or ev.finish_reason is not None:
            self._not_waiting(h)
        if ev.started:
            self._in_slot.add(h.id)
            if h.state is HandleState.WAITING:
                h._goto(HandleState.RUNNING)
        if ev.token_ids:
            self.generated_tokens += len(ev.token_ids)
            if h.t_first_token is None:
                h.t_first_token = now
                self.h_ttft.observe(now - h.t_submit)
        if ev.finish_reason is not None:
            h._goto(HandleState.FINISHED)
            del self._handles[ev.id]
            self._in_slot.discard(ev.id)
            self.finished_by_reason[ev.finish_reason] += 1
            self.prompt_tokens += ev.prompt_tokens
            self.h_e2e.observe(now - h.t_submit)
            t = ev.timings
            if t is not None:
                self.h_queue.observe(t.queue_ms / 1e3)
                if t.predicted_n > 1:
                    self.h_tpot.observe(t.predicted_ms / 1e3 / (t.predicted_n - 1))
        h._push(ev)

    # -- the pipe -----------------------------------------------------------------------

    def _send(self, obj) -> None:
        if self._sock is None:
            return
        self._out += frames.encode(obj)
        self._flush()

    def _flush(self) -> None:
        sock = self._sock
        if sock is None or not self._out:
            return
        try:
            n = sock.send(self._out)
        except BlockingIOError:
            n = 0
        except OSError as e:
            log.warning("engine pipe write failed: %s", e)
            self._worker_gone(self._gen)
            return
        del self._out[:n]
        loop = asyncio.get_running_loop()
        if self._out:
            loop.add_writer(sock.fileno(), self._flush)
        else:
            loop.remove_writer(sock.fileno())

    def _on_readable(self, gen: int) -> None:
        if gen != self._gen or self._sock is None:
            return
        while True:
            try:
                data = self._sock.recv(1 << 20)
            except BlockingIOError:
                return
            except OSError as e:
                log.warning("engine pipe read failed: %s", e)
                data = b""
            if not data:
                self._worker_gone(gen)
                return
            self._last_frame = time.monotonic()
            try:
                got = self._reader.feed(data)
            except (frames.FrameError, ValueError) as e:
                log.error("bad frame from the worker: %s", e)
                self._kill_worker()
                self._worker_gone(gen)
                return
            for f in got:
                self._on_frame(f)

    def _on_frame(self, f: dict) -> None:
        op = f.get("op")
        if op == "events":
            for d in f["events"]:
                self._deliver(StepEvent.from_wire(d))
            self._worker_counters = f.get("counters", self._worker_counters)
            self._worker_gauges = f.get("gauges", self._worker_gauges)
        elif op == "ready":
            self.info = EngineInfo.from_wire(f["info"])
            self.state = "ok"
            self._fails_before_ready = 0
            log.info("engine ready: %s", self.info)
            self._arm_watchdog(self._gen)
            self._ready.set()
        elif op == "alive":
            pass  # a busy worker's step without events: progress all the same
        elif op == "fatal":
            self.error = f.get("message", "the worker failed to load the model")
            log.error("engine worker failed: %s", self.error)
            self._ready.set()
        else:
            log.error("unknown frame op from the worker: %r", op)

    def _arm_watchdog(self, gen: int) -> None:
        self._watch = asyncio.get_running_loop().call_later(self.watchdog_s / 4, self._check_progress, gen)

    def _check_progress(self, gen: int) -> None:
        if self._watch is not None:  # called early (a test): one timer chain all the same
            self._watch.cancel()
        self._watch = None
        if gen != self._gen or self._sock is None or self.state != "ok":
            return
        silent = time.monotonic() - self._last_frame
        if self._handles and silent > self.watchdog_s:
            # Bytes may be waiting that this loop had no time to read (it was blocked).
            self._on_readable(gen)
            if gen != self._gen or self._sock is None:
                return  # it died meanwhile: handled as a death
            silent = time.monotonic() - self._last_frame
        if self._handles and silent > self.watchdog_s:
            log.error("engine worker %s sent nothing for %.1f s with %d requests open; killing it",
                      self.worker_pid, silent, len(self._handles))
            self.stalls += 1
            self._kill_worker()
            self._worker_gone(gen, f"the engine worker made no progress for {self.watchdog_s:g} s")
            return
        self._arm_watchdog(gen)

    def _kill_worker(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()

    def _worker_gone(self, gen: int, why: str = "the engine worker stopped") -> None:
        if gen != self._gen or self._sock is None:
            return
        self._close_socket()
        was_ready = self.state == "ok"
        self.state = "loading"
        for k, v in self._worker_counters.items():
            self._counter_base[k] += v
        self._worker_counters = {}
        self._worker_gauges = {}  # a new worker starts with an empty host cache
        if self._stopping:
            return
        if not was_ready:
            self._fails_before_ready += 1
        for h in list(self._handles.values()):
            if h.state is HandleState.CANCELLING:
                self._end_locally(h, "cancelled", None)
            else:
                self._end_locally(h, "error", why)
        log.error("engine worker exited%s", "" if self.error is None else f": {self.error}")
        task = asyncio.get_running_loop().create_task(self._reap_and_restart())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reap_and_restart(self) -> None:
        proc = self._proc
        if proc is not None:
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
            log.warning("engine worker %d exited with %s", proc.pid, proc.returncode)
        if self._stopping or not self.restart_on_exit or self.error is not None:
            self._ready.set()
            return
        delay = min(0.5 * (2 ** max(self._fails_before_ready - 1, 0)), 10.0) if self._fails_before_ready else 0.0
        if delay:
            await asyncio.sleep(delay)
        self.restarts += 1
        await self._spawn()

    # -- stats --------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        counters = collections.Counter(self._counter_base)
        for k, v in self._worker_counters.items():
            counters[k] += v
        running = len(self._in_slot)
        info = self.info
        slots = info.slots if info is not None else self.engine_config.slots
        return EngineStats(
            state=self.state,
            running=running,
            waiting=len(self._waiting),
            slots=slots,
            slots_used=running,
            kv_cache_usage=running / slots if slots else 0.0,
            ctx=info.ctx if info is not None else int(self.engine_config.ctx or 0),
            worker_pid=self.worker_pid,
            worker_restarts=self.restarts,
            worker_stalls=self.stalls,
            requests_finished=self.finished_by_reason,
            prompt_tokens=self.prompt_tokens,
            generated_tokens=self.generated_tokens,
            prefix_cache_lookups=counters.get("prefix_lookups", 0),
            prefix_cache_hits=counters.get("prefix_hits", 0),
            prefix_cache_hit_tokens=counters.get("prefix_hit_tokens", 0),
            prefix_cache_copies=counters.get("prefix_copies", 0),
            host_cache_hits=counters.get("host_cache_hits", 0),
            host_cache_hit_tokens=counters.get("host_cache_hit_tokens", 0),
            host_cache_evictions=counters.get("host_cache_evictions", 0),
            host_cache_saved_blocks=counters.get("host_cache_saved_blocks", 0),
            host_cache_bytes=self._worker_gauges.get("host_cache_bytes", 0),
            snapshot_bytes=self._worker_gauges.get("snapshot_bytes", 0),
            host_cache_cap_bytes=info.host_cache_cap_bytes if info is not None else 0,
            host_cache_block_bytes=self._worker_gauges.get("host_cache_block_bytes", 0),
            prefill_dedupes=counters.get("prefill_dedupes", 0),
            cache_namespace=info.cache_namespace if info is not None else None,
            preemptions=0,
            compiles_after_ready=0 if self.state == "ok" else None,  # eager torch: none
            histograms={
                "time_to_first_token_seconds": self.h_ttft.snapshot(),
                "queue_time_seconds": self.h_queue.snapshot(),
                "e2e_request_latency_seconds": self.h_e2e.snapshot(),
                "time_per_output_token_seconds": self.h_tpot.snapshot(),
            },
        )
