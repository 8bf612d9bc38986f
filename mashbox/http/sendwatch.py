"""Whether a TCP client is taking the bytes we send it, read from the kernel.

Why: the slow-reader cut-off cannot rely on the transport pausing. The kernel autotunes
a socket's send buffer up to tcp_wmem's max (4 MiB on a stock kernel), so a stream to a
client that reads nothing can run for many minutes before the buffer is full and
`pause_writing` is ever called. What says "the client reads nothing" whatever the
buffer sizes is the kernel's own count of the bytes the client acknowledged
(TCP_INFO's tcpi_bytes_acked, Linux 4.1+) not moving while bytes wait for it
(SIOCOUTQ: sent but unacknowledged plus not yet sent, and what the transport still
holds). A client whose kernel window is open acknowledges; one whose receive buffer is
full does not, however large our buffers are.

`SendProbe.for_transport` returns None where the socket cannot say (not TCP, not
Linux, a test transport without a socket); the protocol then falls back to timing how
long the transport stays paused.
"""
from __future__ import annotations

import fcntl
import socket
import struct
from typing import Optional

SIOCOUTQ = 0x5411  # linux/sockios.h: bytes in the send queue (unsent + unacknowledged)
_TCP_INFO = getattr(socket, "TCP_INFO", None)
_BYTES_ACKED = struct.Struct("=Q")
_BYTES_ACKED_AT = 120  # offset of tcpi_bytes_acked in struct tcp_info (linux/tcp.h)
_TCP_INFO_LEN = _BYTES_ACKED_AT + _BYTES_ACKED.size
_INT = struct.Struct("=i")
_NO_LINGER = struct.pack("ii", 1, 0)


class SendProbe:
    """Reads (bytes waiting for the client, bytes it acknowledged so far) of one socket."""

    __slots__ = ("sock", "fd")

    def __init__(self, sock):
        self.sock = sock
        self.fd = sock.fileno()

    @classmethod
    def for_transport(cls, transport) -> Optional["SendProbe"]:
        sock = transport.get_extra_info("socket")
        if (sock is None or _TCP_INFO is None or sock.type != socket.SOCK_STREAM
                or sock.family not in (socket.AF_INET, socket.AF_INET6)):
            return None
        probe = cls(sock)
        try:
            probe.read()
        except (OSError, ValueError, struct.error):
            return None  # no SIOCOUTQ, or a tcp_info without bytes_acked (kernel < 4.1)
        return probe

    def read(self) -> tuple[int, int]:
        """(bytes in the kernel's send queue, bytes the client acknowledged). Raises
        OSError when the socket is gone."""
        queued = _INT.unpack(fcntl.ioctl(self.fd, SIOCOUTQ, b"\0" * _INT.size))[0]
        info = self.sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _TCP_INFO_LEN)
        if len(info) < _TCP_INFO_LEN:
            raise ValueError("tcp_info has no tcpi_bytes_acked")
        return queued, _BYTES_ACKED.unpack_from(info, _BYTES_ACKED_AT)[0]

    def reset_on_close(self) -> None:
        """Make the coming close drop what is still queued and send a reset: a client that
        reads nothing would otherwise keep those bytes in the kernel (an orphaned socket)
        for minutes, and never learn that the stream ended."""
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _NO_LINGER)
        except OSError:
            pass


class SendWatch:
    """The slow-reader check of one connection: while `watching`, CHECKS_PER_TIMEOUT
    times per timeout (at most 1 s apart) it reads the probe; bytes waiting for the
    client and none acknowledged for `timeout_s` -> `on_cut()` (after arranging the
    reset). Bytes taken, or nothing waiting, count as progress."""

    __slots__ = ("loop", "transport", "probe", "timeout_s", "on_cut", "_timer", "_acked", "_moved_at")

    CHECKS_PER_TIMEOUT = 5

    def __init__(self, loop, transport, probe: SendProbe, timeout_s: float, on_cut):
        self.loop = loop
        self.transport = transport  # its own buffer counts as waiting bytes too
        self.probe = probe
        self.timeout_s = timeout_s
        self.on_cut = on_cut
        self._timer = None
        self._acked = 0  # the client's acknowledged bytes at the last check
        self._moved_at = 0.0  # loop time the client last took bytes (or had none waiting)

    @property
    def check_s(self) -> float:
        return min(1.0, self.timeout_s / self.CHECKS_PER_TIMEOUT)

    def start(self) -> None:
        """An answer is being written (again: no effect while already watching)."""
        if self._timer is not None:
            return
        try:
            self._acked = self.probe.read()[1]
        except OSError:
            return  # the socket is gone; connection_lost follows
        self._moved_at = self.loop.time()
        self._timer = self.loop.call_later(self.check_s, self._check)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        self._timer = None
        try:
            queued, acked = self.probe.read()
        except OSError:
            return
        now = self.loop.time()
        if acked != self._acked or queued + self.transport.get_write_buffer_size() == 0:
            self._acked = acked
            self._moved_at = now
        elif now - self._moved_at >= self.timeout_s:
            self.probe.reset_on_close()
            self.on_cut()
            return
        self._timer = self.loop.call_later(self.check_s, self._check)
