"""Prometheus metrics of one stage replica (a registry per server, so several can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_MS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000)


class StageMetrics:
    def __init__(self, stage: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r, labels = self.registry, ["stage"]
        self.requests = Counter("omnistage_stage_requests", "Requests finished by outcome",
                                ["stage", "outcome"], registry=r)
        self.queue_depth = Gauge("omnistage_stage_queue_depth", "Requests admitted, waiting for the engine",
                                 labels, registry=r)
        self.running = Gauge("omnistage_stage_running", "Requests the engine is working on", labels, registry=r)
        self.batch_size = Histogram("omnistage_stage_batch_size", "Requests per engine step", labels,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.step_ms = Histogram("omnistage_stage_step_ms", "Engine step time (ms)", labels,
                                 buckets=_MS_BUCKETS, registry=r)
        self.queue_ms = Histogram("omnistage_stage_queue_ms", "Time a request waited before its first step (ms)",
                                  labels, buckets=_MS_BUCKETS, registry=r)
        self.units = Counter("omnistage_stage_units", "Work units produced (tokens, frames, steps, images)",
                             ["stage", "unit"], registry=r)
        self.chunks = Counter("omnistage_stage_output_chunks", "Output chunks sent", labels, registry=r)
        self.output_bytes = Counter("omnistage_stage_output_bytes", "Tensor bytes sent in output chunks",
                                    labels, registry=r)
        self.stage = stage

    def outcome(self, outcome: str) -> None:
        self.requests.labels(self.stage, outcome).inc()
