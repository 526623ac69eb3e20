"""Prometheus metrics of one stage replica (a registry per server, so several can share a process)."""

from __future__ import annotations

from typing import Iterator

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from omnistage.contract.metrics import LATENCY_SECONDS
from omnistage.planner.scrape import QUEUE_DEPTH, REQUESTS, RUNNING, STEP_SECONDS, UNITS  # what the planner reads


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
        self.step_seconds = Histogram(STEP_SECONDS, "Engine step time", labels,
                                      buckets=LATENCY_SECONDS, registry=r)
        self.queue_seconds = Histogram("omnistage_stage_queue_seconds", "Time a request waited before its first "
                                       "step", labels, buckets=LATENCY_SECONDS, registry=r)
        # its rate() is the stage's throughput (the planner reads it so)
        self.units = Counter(UNITS, "Work units produced (tokens, frames, steps, images, chunks)",
                             ["stage", "unit"], registry=r)
        self.failed_steps = Counter("omnistage_stage_failed_steps", "Engine steps that raised", labels, registry=r)
        self.preemptions = Counter("omnistage_stage_kv_preemptions", "Running requests whose KV cache was dropped "
                                   "to fit the stage's KV budget (recomputed when readmitted)", labels, registry=r)
        self.cached_steps = Counter("omnistage_stage_cached_steps", "Denoise steps of a request that reused its "
                                    "cached residual, its DiT's blocks after the first skipped "
                                    "(engineArgs.step_cache_threshold)", labels, registry=r)
        self.chunks = Counter("omnistage_stage_output_chunks", "Output chunks sent", labels, registry=r)
        self.output_bytes = Counter("omnistage_stage_output_bytes", "Tensor bytes sent in output chunks",
                                    labels, registry=r)
        self.stage = stage

    def reexport(self, prefix: str, source: CollectorRegistry = REGISTRY) -> None:
        """Serve, with the stage's own, the metrics an engine library registers in `source` (prometheus_client's
        global registry by default) under names starting with `prefix`: read from there at each scrape, never
        copied."""
        self.registry.register(_Reexported(source, prefix))

    def outcome(self, outcome: str) -> None:
        self.requests.labels(self.stage, outcome).inc()

    def load(self, running: int, queued: int, parked: int = 0) -> None:
        self.running.labels(self.stage).set(running)
        self.queue_depth.labels(self.stage).set(queued)
        self.parked.labels(self.stage).set(parked)

    def step(self, batch: int, seconds: float | None, unit: str, units: int | None = None) -> None:
        """One engine step over `batch` requests that took `seconds` and produced `units` (default: one per
        request)."""
        units = batch if units is None else units
        self.batch_size.labels(self.stage).observe(batch)
        if seconds is not None:
            self.step_seconds.labels(self.stage).observe(seconds)
        self.units.labels(self.stage, unit).inc(units)


class _Reexported:
    """The families of another registry whose names start with a prefix (a collector with no describe(), so
    the registry does not check their names against its own at registration)."""

    def __init__(self, source: CollectorRegistry, prefix: str):
        self.source, self.prefix = source, prefix

    def collect(self) -> Iterator[Metric]:
        return (family for family in self.source.collect() if family.name.startswith(self.prefix))
