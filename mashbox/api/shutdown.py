"""The shutdown state of one served ApiContext (api/pipeline.py's rules say what each
state means to a request; app.py drives it: `drain()` at SIGTERM / SIGINT, `end()` when
the grace period is over)."""
from __future__ import annotations

import asyncio
from typing import Optional


class Shutdown:
    def __init__(self) -> None:
        self.draining = False
        self._ended: Optional[asyncio.Future] = None

    def ended(self) -> asyncio.Future:
        """A future of the running loop, done once `end()` was called."""
        if self._ended is None:
            self._ended = asyncio.get_running_loop().create_future()
        return self._ended

    def drain(self) -> None:
        self.draining = True

    def end(self) -> None:
        self.draining = True
        fut = self.ended()
        if not fut.done():
            fut.set_result(None)
