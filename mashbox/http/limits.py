"""How long a request body may take and how many body bytes the server holds at once.

Rules:
- Body progress deadline: from the end of its head, a request body must deliver
  `body_progress_bytes` (or the rest of the body, when less is left) within each
  `body_progress_s`; otherwise the request is answered 408 and the connection closes.
  A client trickling a byte a second is cut after body_progress_s; an honest upload
  needs only body_progress_bytes / body_progress_s (64 KiB in 30 s: about 2 KiB/s).
  Time while the server itself has paused reading does not count.
- Buffered-body bound: the bytes of request bodies a server holds, from their first
  byte until their request is answered (or its connection is gone), are counted across
  all its connections. A body whose Content-Length does not fit in what is left, or a
  chunk that would pass the bound, is refused with 503 and a Retry-After, and its
  connection closes (its bytes are freed at once). Nothing pauses waiting for room, so
  partial bodies can never hold each other up.
- The values are internal (tests shorten them); the README's Safety section states the
  shipped defaults.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    body_progress_s: float = 30.0
    body_progress_bytes: int = 64 * 1024
    max_buffered_body_bytes: int = 128 * 1024 * 1024  # across all connections

    def __post_init__(self):
        if self.body_progress_s <= 0 or self.body_progress_bytes <= 0 or self.max_buffered_body_bytes <= 0:
            raise ValueError(f"every limit must be positive: {self}")


class BodyBudget:
    """The buffered-body bound, shared by one server's connections (one event loop)."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0

    @property
    def free(self) -> int:
        return self.limit - self.used

    def take(self, n: int) -> bool:
        """Count n more bytes held; False (nothing counted) when that would pass the bound."""
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n
        if self.used < 0:
            raise RuntimeError(f"body budget went below zero ({self.used})")
