"""The listening socket: one HttpProtocol per connection, and a clean shutdown.

The caller owns the event loop (api/app.py installs uvloop and runs it). `serve()`
checks the bind rule (no non-loopback host without keys), listens, and returns a
`Server` whose `close(grace_s, end)` shuts down in this order:

  1. stop listening at once (a new connection is refused by the kernel) and close every
     idle connection; a connection is closed as soon as its running answer is written;
  2. wait up to grace_s for the running answers to finish;
  3. call `end()` (the api's Shutdown.end: open streams write their error event and
     terminator, non-streamed requests their 503 / 529) and wait up to END_S more for
     those answers to be written;
  4. abort whatever is left (a client that reads nothing), which cancels its handler.
"""
from __future__ import annotations

import asyncio
import socket
from typing import Callable, Optional

from mashbox.config import ServerConfig

from .limits import BodyBudget, Limits
from .protocol import HttpProtocol
from .security import check_bind

END_S = 2.0  # after end(): time for the final frames / 503s to be written before the abort
POLL_S = 0.02


class Server:
    def __init__(self, app, config: ServerConfig, limits: Optional[Limits] = None):
        self.app = app
        self.config = config
        self.limits = limits if limits is not None else Limits()
        # One bound on buffered request bodies for all connections (limits.py); it
        # always holds at least one largest body.
        self.budget = BodyBudget(max(self.limits.max_buffered_body_bytes, config.max_body_bytes))
        self.connections: set[HttpProtocol] = set()
        self._server: Optional[asyncio.AbstractServer] = None

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        return self._server.sockets[0].getsockname()[1]

    def _factory(self) -> HttpProtocol:
        return HttpProtocol(self.app, self.config, self._loop, self.connections, self.limits, self.budget)

    async def start(self, sock: Optional[socket.socket] = None) -> "Server":
        check_bind(self.config.host, self.config.api_keys)
        self._loop = asyncio.get_running_loop()
        if sock is not None:
            self._server = await self._loop.create_server(self._factory, sock=sock, backlog=1024)
        else:
            self._server = await self._loop.create_server(
                self._factory, self.config.host, self.config.port, reuse_address=True, backlog=1024
            )
        return self

    def _close_idle(self) -> None:
        for conn in list(self.connections):
            if conn.task is None and not conn.pipeline:
                conn._close()

    async def _wait_connections(self, seconds: float) -> None:
        deadline = self._loop.time() + seconds
        while True:
            self._close_idle()
            if not self.connections or self._loop.time() >= deadline:
                return
            await asyncio.sleep(POLL_S)

    async def close(self, grace_s: float = 5.0, end: Optional[Callable[[], None]] = None) -> None:
        """Shut down (the module's steps); `end` None skips step 3."""
        if self._server is None:
            return
        self._server.close()
        await self._wait_connections(grace_s)
        if self.connections and end is not None:
            end()
            await self._wait_connections(END_S)
        for conn in list(self.connections):
            conn._abort()
        await self._server.wait_closed()
        self._server = None


async def serve(app, config: ServerConfig, sock: Optional[socket.socket] = None,
                limits: Optional[Limits] = None) -> Server:
    """Listen on config.host:config.port (or `sock`) and answer with `app` (a Router)."""
    return await Server(app, config, limits).start(sock)
