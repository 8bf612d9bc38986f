"""Latency histograms of the engine client, in seconds, reported the way Prometheus wants them
(cumulative bucket counts; the last bucket is +Inf and equals `count`)."""
from __future__ import annotations

from mashbox.engine.interface import HistogramSnapshot

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)


class Histogram:
    """Seconds; reported as cumulative bucket counts the way Prometheus wants them."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # last: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        i = 0
        while i < len(self.buckets) and v > self.buckets[i]:
            i += 1
        self.counts[i] += 1
        self.sum += v
        self.count += 1

    def snapshot(self) -> HistogramSnapshot:
        cum, out = 0, []
        for le, c in zip(self.buckets, self.counts):
            cum += c
            out.append((le, cum))
        return HistogramSnapshot(tuple(out), self.sum, self.count)
