"""The worker process: `python -m mashbox.engine.worker --fd N`.

`Engine` is the step: schedule -> run -> sample -> detokenize -> match stops -> finish,
one list of StepEvents per step. Detokenization and stop matching happen here, next to
sampling, so a request's slot is freed the step it ends. `main` is the pipe loop around
it: block on the socket while idle, poll it between steps while busy, one "events" frame
per step (frames.py says what crosses the pipe).
"""
from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import socket
import sys
import time
from typing import Optional

from mashbox.config import EngineConfig, GenerationRequest, StepEvent, Timings
from mashbox.engine import frames, heap
from mashbox.engine.constraints import BROKEN, DONE, ConstraintTable, checks_after
from mashbox.engine.request import Request, State
from mashbox.engine.scheduler import Scheduler

log = logging.getLogger("mashbox.engine.worker")

COMPILE_POLL_S = 0.05  # an idle step waits this long for a grammar compile (frames wait behind it)


class _Output:
    """Per-request text state: incremental detokenizer and stop matcher."""

    __slots__ = ("detok", "stops")

    def __init__(self, detok, stops) -> None:
        self.detok = detok
        self.stops = stops


class Engine:
    """Scheduler + runner + text output for one model. Single-threaded; not thread-safe."""

    def __init__(self, cfg: EngineConfig, runner=None, tokenizer=None) -> None:
        from mashbox.engine.runner import Runner  # torch is imported here, not at module load
        from mashbox.text.tokenizer import load_tokenizer

        self.cfg = cfg
        self.runner = runner if runner is not None else Runner(cfg)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.model_path)
        self.eos_ids = frozenset(self.tokenizer.eos_ids)
        self.ctx = self.runner.ctx
        pool, cache = self.runner.host_pool, self.runner.cache
        self.scheduler = Scheduler(cfg.slots, self.ctx, cfg.prefill_chunk, cfg.prefix_block,
                                   host_blocks=pool.num_blocks, host_block_bytes=pool.block_bytes(cache, pool.block),
                                   kv_capacity=cache.capacity)
        self.constraints = ConstraintTable(self.tokenizer, self.runner.vocab_size, cfg.slots)
        self._outputs: dict[str, _Output] = {}
        self._pending: list[StepEvent] = []  # events made between steps (cancel, errors)
        self._compiling: dict[str, Request] = {}  # submitted, waiting for their grammar (constraints.py)
        self.steps = 0
        heap.trim()  # the load's parsing garbage: ~50 MB resident on a 1.7B GGUF otherwise

    # -- info ---------------------------------------------------------------------------

    def info(self) -> dict:
        r = self.runner
        return {
            "model_id": self.cfg.model_id,
            "ctx": self.ctx,
            "slots": self.cfg.slots,
            "vocab_size": r.vocab_size,
            "dtype": str(r.dtype).removeprefix("torch."),
            "device": str(r.device),
            "arch": r.model_config.arch,
            "weights_file": r.weights_file,
            "bpw": r.bpw,
            "gb": r.weight_bytes / 1e9,
            "prefix_block": self.cfg.prefix_block,
            "prefill_chunk": self.cfg.prefill_chunk,
            "pid": os.getpid(),
            "cache_namespace": self.cache_namespace(),
            "host_cache_cap_bytes": self.scheduler.host.cap_bytes if self.scheduler.host is not None else 0,
        }

    def cache_namespace(self) -> str:
        """What cached K/V is valid for: the model (id, architecture, weights file by name,
        size and mtime), the tokenizer and chat template files, the compute dtype and
        device type, and the cache policy (block size, layout version)."""
        import hashlib

        r = self.runner
        parts = [self.cfg.model_id, r.model_config.arch, str(r.dtype), r.device.type,
                 f"block={self.cfg.prefix_block}", "kv-layout=1", self.cfg.weights,
                 str(self.cfg.rope_scaling), str(self.cfg.rope_scale)]
        path = self.cfg.model_path
        files = [path] if os.path.isfile(path) else [
            os.path.join(path, f) for f in sorted(os.listdir(path)) if os.path.isfile(os.path.join(path, f))]
        h = hashlib.sha256("\0".join(parts).encode())
        for f in files:
            st = os.stat(f)
            name = os.path.basename(f)
            h.update(f"\0{name}:{st.st_size}:{st.st_mtime_ns}".encode())
            if name.startswith("tokenizer") or name.endswith(".jinja"):  # small: the template lives here
                with open(f, "rb") as fh:
                    h.update(hashlib.sha256(fh.read()).digest())
        return "mashbox-kv1-" + h.hexdigest()[:16]

    def counters(self) -> dict:
        p = self.scheduler.prefix
        out = {"prefix_lookups": p.lookups, "prefix_hits": p.hits, "prefix_hit_tokens": p.hit_tokens,
               "prefix_copies": p.copies, "prefill_dedupes": self.scheduler.dedupes}
        h = self.scheduler.host
        if h is not None:
            out.update(host_cache_hits=h.hits, host_cache_hit_tokens=h.hit_tokens,
                       host_cache_evictions=h.evictions, host_cache_saved_blocks=h.saved_blocks)
        return out

    def gauges(self) -> dict:
        """Levels now (not summed over worker restarts, unlike counters)."""
        h = self.scheduler.host
        if h is None:
            return {}
        return {"host_cache_bytes": h.host_bytes, "snapshot_bytes": h.snapshot_bytes,
                "host_cache_cap_bytes": h.cap_bytes, "host_cache_block_bytes": h.block_bytes}

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._pending) or bool(self._compiling)

    # -- requests -----------------------------------------------------------------------

    def submit(self, req: GenerationRequest) -> None:
        if self.scheduler.get(req.id) is not None or req.id in self._compiling:
            self._pending.append(StepEvent(id=req.id, finish_reason="error",
                                           error=f"request id {req.id!r} is already running"))
            return
        r = Request(req)
        try:
            vocab = self.runner.vocab_size
            if req.prompt_ids and not (0 <= min(req.prompt_ids) and max(req.prompt_ids) < vocab):
                # one bad id would fail the forward of every request in its step
                raise ValueError(f"prompt_ids holds an id outside the vocabulary [0, {vocab})")
            if req.constraint is not None and not self.constraints.add(
                    req.id, req.constraint, checks_after(req.sampling, req.logprobs)):
                self._compiling[req.id] = r  # its grammar compiles off the step; the others go on
                return
            self.scheduler.add(r)
        except ValueError as e:
            self.constraints.drop(req.id)
            self._pending.append(StepEvent(id=req.id, finish_reason="error", error=str(e),
                                           prompt_tokens=r.num_prompt, timings=Timings()))
            return

    def _admit_compiled(self) -> None:
        """Requests whose grammar finished compiling go to the scheduler (or fail alone)."""
        for rid, error in self.constraints.compiled():
            r = self._compiling.pop(rid)
            if error is None:
                try:
                    self.scheduler.add(r)
                    continue
                except ValueError as e:
                    error = str(e)
                    self.constraints.drop(rid)
            self._pending.append(StepEvent(id=rid, finish_reason="error", error=error,
                                           prompt_tokens=r.num_prompt, timings=Timings()))

    def cancel(self, request_id: str) -> None:
        if request_id in self._compiling:
            r = self._compiling.pop(request_id)
            self.constraints.drop(request_id)
            r.move(State.FINISHED)
            r.finish_reason = "cancelled"
            self._pending.append(self._final_event(r, "", time.perf_counter()))
            return
        r = self.scheduler.cancel(request_id)
        if r is not None:
            self._pending.append(self._final_event(r, "", time.perf_counter()))
            self._outputs.pop(r.id, None)
            self.constraints.drop(r.id)

    # -- the step -----------------------------------------------------------------------

    def step(self) -> list[StepEvent]:
        if self._compiling:
            if not self.scheduler.has_work and not self._pending:
                self.constraints.wait_compiles(COMPILE_POLL_S)  # nothing else to do meanwhile
            self._admit_compiled()
        events, self._pending = self._pending, []
        sched = self.scheduler
        plan = sched.schedule()
        if plan.empty:
            return events
        now = time.perf_counter()
        for r in plan.admitted:
            r.t_admit = now
            self.runner.admit(r.slot, r.req.sampling, r.num_prompt, r.req.logprobs)
            self._outputs[r.id] = self._make_output(r)
        try:
            sampled = self.runner.run(plan, sched.slots.tokens, self.constraints)
        except Exception as e:  # a failed forward ends the step's requests, not the worker
            log.exception("step failed")
            sched.step_failed(plan)
            for row in plan.rows:
                r = row.request
                if not r.finished:
                    sched.finish(r, "error", error=f"engine step failed: {e}")
                    events.append(self._final_event(r, "", time.perf_counter()))
                    self._outputs.pop(r.id, None)
                    self.constraints.drop(r.id)
            return events
        sched.advance(plan)
        now = time.perf_counter()
        self.steps += 1
        sampled_ids = set()
        it = iter(sampled)
        lps = self.runner.step_logprobs  # None, or one per sampled row
        lp_it = iter(lps) if lps is not None else None
        for row in plan.rows:
            if not row.sample:
                continue
            r = row.request
            sampled_ids.add(r.id)
            lp = next(lp_it) if lp_it is not None else None
            events.append(self._on_token(r, next(it), now, () if lp is None else (lp,)))
        for r in plan.admitted:
            if r.id not in sampled_ids:  # still prefilling: tell the server it has a slot
                r.started_sent = True
                events.append(StepEvent(id=r.id, started=True, prompt_tokens=r.num_prompt,
                                        cached_tokens=r.num_cached))
        return events

    def _make_output(self, r: Request) -> _Output:
        from mashbox import native
        from mashbox.text.detok import IncrementalDetokenizer

        detok = IncrementalDetokenizer(self.tokenizer, list(r.req.prompt_ids))
        stops = native.StopMatcher(list(r.req.stops)) if r.req.stops else None
        return _Output(detok, stops)

    def _on_token(self, r: Request, tok: int, now: float, logprobs: tuple = ()) -> StepEvent:
        sched = self.scheduler
        sched.append_token(r, tok)
        if r.t_first_token is None:
            r.t_first_token = now
        r.t_last_token = now
        out = self._outputs[r.id]
        text = out.detok.push([tok])
        reason: Optional[str] = None
        stop_seq: Optional[str] = None
        error: Optional[str] = None
        grammar_done = False
        if self.constraints.active:
            state = self.constraints.consume(r.id, tok)
            grammar_done = state == DONE  # the value is complete: nothing may follow but EOS
            if state == BROKEN:
                reason, error = "error", f"sampled token {tok} is not allowed by the request's grammar"
        if out.stops is not None and reason is None:
            text, idx = out.stops.feed(text)
            if idx >= 0:
                reason, stop_seq = "stop_sequence", r.req.stops[idx]
        if reason is None:
            if (tok in self.eos_ids and not r.req.ignore_eos) or grammar_done:
                reason = "stop"
            elif r.num_generated >= r.req.max_tokens or len(r.token_ids) >= self.ctx:
                reason = "length"
            if reason is not None:
                # bytes still held for an unfinished UTF-8 sequence, then the stop hold-back
                tail = out.detok.flush()
                if out.stops is None:
                    text += tail
                else:
                    more, idx = out.stops.feed(tail)
                    text += more
                    if idx >= 0:
                        reason, stop_seq = "stop_sequence", r.req.stops[idx]
                    else:
                        text += out.stops.flush()
        if reason is None:
            started = not r.started_sent
            r.started_sent = True
            return StepEvent(id=r.id, token_ids=(tok,), text=text, started=started,
                             prompt_tokens=r.num_prompt if started else 0,
                             cached_tokens=r.num_cached if started else 0, logprobs=logprobs)
        sched.finish(r, reason, stop_sequence=stop_seq, error=error)
        self._outputs.pop(r.id, None)
        self.constraints.drop(r.id)
        return self._final_event(r, text, now, (tok,), logprobs)

    def _final_event(self, r: Request, text: str, now: float, token_ids: tuple = (),
                     logprobs: tuple = ()) -> StepEvent:
        started = r.t_admit is not None and not r.started_sent
        r.started_sent = r.started_sent or started
        t_admit = r.t_admit if r.t_admit is not None else now
        t_first = r.t_first_token if r.t_first_token is not None else now
        t_last = r.t_last_token if r.t_last_token is not None else t_first
        prefilled = min(r.num_computed, r.num_prompt) - r.num_cached
        timings = Timings(
            queue_ms=(t_admit - r.t_arrival) * 1e3,
            prompt_ms=(t_first - t_admit) * 1e3 if r.t_admit is not None else 0.0,
            predicted_ms=(t_last - t_first) * 1e3,
            prompt_n=max(prefilled, 0),
            cache_n=r.num_cached,
            predicted_n=r.num_generated,
        )
        return StepEvent(
            id=r.id,
            token_ids=token_ids,
            text=text,
            finish_reason=r.finish_reason,
            stop_sequence=r.stop_sequence,
            error=r.error,
            prompt_tokens=r.num_prompt,
            cached_tokens=r.num_cached,
            started=started,
            timings=timings,
            logprobs=logprobs,
        )


# -- the process --------------------------------------------------------------------------


class _Pipe:
    """The worker's end of the socket: blocking sends, reads that may or may not wait."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = frames.FrameReader()
        self.closed = False

    def send(self, obj) -> None:
        self.sock.sendall(frames.encode(obj))

    def receive(self, wait: bool) -> list:
        """Frames that arrived; blocks until at least one when `wait`."""
        out: list = []
        while True:
            if not wait or out:
                r, _, _ = select.select([self.sock], [], [], 0)
                if not r:
                    return out
            data = self.sock.recv(1 << 20)
            if not data:
                self.closed = True
                return out
            out.extend(self.reader.feed(data))
            wait = False


def serve(pipe: _Pipe, engine: Engine) -> None:
    last_sent = time.monotonic()
    while True:
        for f in pipe.receive(wait=not engine.has_work):
            op = f.get("op")
            if op == "submit":
                engine.submit(GenerationRequest.from_wire(f["req"]))
            elif op == "cancel":
                engine.cancel(f["id"])
            elif op == "shutdown":
                log.info("shutdown requested")
                return
            else:
                log.error("unknown frame op %r", op)
        if pipe.closed:
            log.info("server closed the pipe; exiting")
            return
        events = engine.step()
        now = time.monotonic()
        if events:
            pipe.send({"op": "events", "events": [e.to_wire() for e in events],
                       "counters": engine.counters(), "gauges": engine.gauges()})
            last_sent = now
        elif now - last_sent >= frames.ALIVE_EVERY_S:  # the client's watchdog hears progress
            pipe.send({"op": "alive"})
            last_sent = now


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="mashbox.engine.worker")
    ap.add_argument("--fd", type=int, required=True, help="the socket shared with the server")
    args = ap.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s worker[%(process)d] %(levelname)s %(name)s: %(message)s")
    # Ctrl-C reaches the whole process group, and a service manager's stop (systemd's
    # control-group kill, `timeout`, `kill -- -PGID`) sends SIGTERM to every process in it:
    # the server decides when the worker stops (a "shutdown" frame after its grace period,
    # or the pipe closing if it dies), so neither ends running requests early
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    sock = socket.socket(fileno=args.fd)
    sock.setblocking(True)
    pipe = _Pipe(sock)
    start = None
    while start is None:
        got = pipe.receive(wait=True)
        if pipe.closed and not got:
            return 1
        for f in got:
            if f.get("op") == "start":
                start = f
    cfg = EngineConfig(**start["config"])
    from mashbox import native

    if not native.NATIVE:
        if os.environ.get(native.REFERENCE_ENV) != "reference":
            message = (f"{native.MISSING}: reinstall mashbox with a C compiler and the Python headers, "
                       f"or set {native.REFERENCE_ENV}=reference to serve on the slow pure Python "
                       "reference")
            log.error("%s", message)
            pipe.send({"op": "fatal", "message": message})
            return 2
        log.warning("%s=reference: serving on the pure Python reference, not the C extension "
                    "(sampling and the CPU kernels are many times slower)", native.REFERENCE_ENV)
    log.info("loading %s from %s", cfg.model_id, cfg.model_path)
    try:
        engine = Engine(cfg)
    except Exception as e:  # noqa: BLE001 - every load failure is reported to the server
        log.exception("model load failed")
        pipe.send({"op": "fatal", "message": f"{type(e).__name__}: {e}"})
        return 2
    # the llguidance tokenizer holds the GIL while it is built (~0.3 s): before ready, not
    # in the first steps
    engine.constraints.wait_tokenizer()
    pipe.send({"op": "ready", "info": engine.info()})
    log.info("ready")
    serve(pipe, engine)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
