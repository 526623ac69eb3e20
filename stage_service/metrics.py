"""Prometheus metrics of one stage replica (a registry per server, so several can share a process)."""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from omnistage.planner.scrape import QUEUE_DEPTH, REQUESTS, RUNNING, STEP_MS, UNITS  # what the planner reads

_MS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000)
RATE_WINDOW_S = 10.0


class StageMetrics:
    def __init__(self, stage: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r, labels = self.registry, ["stage"]
        self.requests = Counter(REQUESTS, "Requests ended, by outcome "
                                "(finished, cancelled, failed, rejected, invalid, timeout)",
                                ["stage", "outcome"], registry=r)
        self.queue_depth = Gauge(QUEUE_DEPTH, "Requests admitted, waiting for the engine",
                                 labels, registry=r)
        self.running = Gauge(RUNNING, "Requests the engine is working on", labels, registry=r)
        self.parked = Gauge("omnistage_stage_parked", "Requests out of the batch until their readers catch up "
                            "(they count against maxQueued, as queued ones do)", labels, registry=r)
        self.batch_size = Histogram("omnistage_stage_batch_size", "Requests per engine step", labels,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.step_ms = Histogram(STEP_MS, "Engine step time (ms)", labels,
                                 buckets=_MS_BUCKETS, registry=r)
        self.queue_ms = Histogram("omnistage_stage_queue_ms", "Time a request waited before its first step (ms)",
                                  labels, buckets=_MS_BUCKETS, registry=r)
        self.units = Counter(UNITS, "Work units produced (tokens, frames, steps, images, chunks)",
                             ["stage", "unit"], registry=r)
        self.units_per_second = Gauge("omnistage_stage_units_per_second",
                                      f"Work units produced per second over the last {RATE_WINDOW_S:.0f} s",
                                      ["stage", "unit"], registry=r)
        self.failed_steps = Counter("omnistage_stage_failed_steps", "Engine steps that raised", labels, registry=r)
        self.preemptions = Counter("omnistage_stage_kv_preemptions", "Running requests whose KV cache was dropped "
                                   "to fit the stage's KV budget (recomputed when readmitted)", labels, registry=r)
        self.chunks = Counter("omnistage_stage_output_chunks", "Output chunks sent", labels, registry=r)
        self.output_bytes = Counter("omnistage_stage_output_bytes", "Tensor bytes sent in output chunks",
                                    labels, registry=r)
        self.stage = stage
        self._recent: deque[tuple[float, int]] = deque()

    def outcome(self, outcome: str) -> None:
        self.requests.labels(self.stage, outcome).inc()

    def load(self, running: int, queued: int, parked: int = 0) -> None:
        self.running.labels(self.stage).set(running)
        self.queue_depth.labels(self.stage).set(queued)
        self.parked.labels(self.stage).set(parked)

    def step(self, batch: int, ms: float | None, unit: str, units: int | None = None) -> None:
        """One engine step over `batch` requests that produced `units` (default: one per request)."""
        units = batch if units is None else units
        self.batch_size.labels(self.stage).observe(batch)
        if ms is not None:
            self.step_ms.labels(self.stage).observe(ms)
        self.units.labels(self.stage, unit).inc(units)
        now = time.monotonic()
        self._recent.append((now, units))
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()
        span = max(now - self._recent[0][0], 1e-3) if len(self._recent) > 1 else RATE_WINDOW_S
        self.units_per_second.labels(self.stage, unit).set(sum(u for _, u in self._recent) / span)
