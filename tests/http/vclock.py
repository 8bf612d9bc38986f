"""A controlled clock for protocol tests: an event loop whose time moves only when every
task waits on a timer, and then straight to the earliest one.

Why: protocol tests over a fake transport check timeouts (idle keep-alive, slow
reader, heartbeats, body deadlines). With the real clock they need sleep windows ("not
yet after 0.02 s, done after 0.1 s") that a loaded machine can stretch past either
edge. On this clock every timer fires in exactly its order and at exactly its virtual
time however busy the machine is, so a test can assert "not before the timeout, at the
timeout" exactly, and a test of a 30 s timeout takes no real time. Real sockets need
the real clock: use it with fake transports only.
"""
from __future__ import annotations

import asyncio
import selectors


class _JumpingSelector:
    """A selector whose waits take no time: when nothing is ready, the loop's virtual
    clock jumps to the next timer instead of sleeping until it."""

    def __init__(self, loop: "VirtualClockLoop"):
        self._real = selectors.DefaultSelector()
        self._loop = loop

    def select(self, timeout=None):
        events = self._real.select(0)
        if events or timeout == 0:
            return events
        if timeout is None:  # no timer and nothing ready: the test would hang
            events = self._real.select(5.0)
            if not events:
                raise RuntimeError("virtual clock: nothing scheduled and nothing ready (a deadlock)")
            return events
        self._loop.now += timeout
        return events

    def __getattr__(self, name):
        return getattr(self._real, name)


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop with a controlled clock: `time()` moves only when every task waits
    on a timer, and then straight to the earliest one. Timeouts, heartbeats and
    deadlines happen in exactly their order and at exactly their (virtual) times however
    busy the machine is, and a test of a 30 s timeout takes no real time. For protocol
    tests over a fake transport only (real sockets need the real clock)."""

    def __init__(self):
        self.now = 0.0
        super().__init__(_JumpingSelector(self))

    def time(self) -> float:
        return self.now


def run_virtual(coro):
    """asyncio.run on a VirtualClockLoop."""
    with asyncio.Runner(loop_factory=VirtualClockLoop) as runner:
        return runner.run(coro)
