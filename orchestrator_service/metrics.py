"""Prometheus metrics of one orchestrator replica."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000, 60000)


class OrchestratorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.requests = Counter("omnistage_requests", "Client requests by outcome "
                                "(admitted, rejected, finished, cancelled, failed, invalid)", ["outcome"], registry=r)
        self.inflight = Gauge("omnistage_requests_inflight", "Requests being served", registry=r)
        self.waiting = Gauge("omnistage_admission_queue", "Requests waiting for admission", registry=r)
        self.admission_wait_ms = Histogram("omnistage_admission_wait_ms", "Time waited for admission (ms)",
                                           buckets=_MS, registry=r)
        self.latency_ms = Histogram("omnistage_request_latency_ms", "End-to-end request latency (ms)",
                                    buckets=_MS, registry=r)
        self.first_output_ms = Histogram("omnistage_first_output_ms", "Time to the first output event (ms)",
                                         buckets=_MS, registry=r)
        self.stage_ms = Histogram("omnistage_stage_time_ms", "Per-stage time of a request (ms) by part "
                                  "(queue, compute, transfer, first_chunk, total)", ["stage", "part"],
                                  buckets=_MS, registry=r)
        self.stage_errors = Counter("omnistage_stage_errors", "Stage calls that failed", ["stage", "code"],
                                    registry=r)
