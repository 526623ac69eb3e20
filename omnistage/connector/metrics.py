"""Prometheus metrics of the data plane, per edge ("producer->consumer") and per stage.

The registry is passed in, so a stage's connector reports next to its other metrics.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_SECONDS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30)


class TransferMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.bytes = Counter("omnistage_transfer_bytes",
                             "Tensor bytes put (out) or fetched (in), per edge and transport",
                             ["edge", "transport", "direction"], registry=r)
        # path: one of paths.PATHS (6 values), so edges x 6 series at most
        self.paths = Counter("omnistage_transfer_path_tensors",
                             "Tensors fetched per edge and memory path (host, device-to-host, host-to-device, "
                             "host-staged, cuda, cuda-ipc)", ["edge", "path"], registry=r)
        self.chunks = Counter("omnistage_transfer_chunks", "Chunks put (out) or fetched (in), per edge",
                              ["edge", "direction"], registry=r)
        self.seconds = Histogram("omnistage_transfer_seconds", "Time to put (out) or fetch (in) one chunk's tensors",
                                 ["edge", "direction"], buckets=_SECONDS, registry=r)
        self.buffered = Gauge("omnistage_transfer_buffered_bytes", "Bytes a stage's connector holds for consumers",
                              ["stage"], registry=r)
        self.released = Counter("omnistage_transfer_released_bytes",
                                "Held bytes given back: consumed, ack, cancel, ttl or close", ["stage", "reason"],
                                registry=r)
        self.budget_wait = Histogram("omnistage_transfer_budget_wait_seconds",
                                     "Time a producer waited for room under its stage's buffer budget", ["stage"],
                                     buckets=_SECONDS, registry=r)
