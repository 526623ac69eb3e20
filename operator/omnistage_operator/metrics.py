"""The operator's own health as Prometheus metrics, served on its metrics port next to the planner's
(handlers.py): reconciles by result and how long they took, and its work queue (workqueue.py: the operator's
own, so its depth is known exactly)."""

from __future__ import annotations

from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from omnistage.contract.metrics import LATENCY_SECONDS

# How a reconcile pass ended: ok; waiting on something (kopf.TemporaryError, tried again after its delay);
# invalid (kopf.PermanentError: the spec is refused, nothing to retry until it changes); error (anything else:
# retried with backoff). One value per pass, so sum() counts passes.
RESULTS = ("ok", "waiting", "invalid", "error")


class QueueState(Protocol):
    """What is read of the work queue (workqueue.WorkQueue, which imports this module for the worker)."""

    def queued(self) -> int: ...
    def active(self) -> int: ...
    def delayed(self) -> int: ...


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, queue: QueueState | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.reconciles = Counter("omnistage_operator_reconciles", "Reconcile passes of a pipeline, by result "
                                  f"({', '.join(RESULTS)})", ["result"], registry=r)
        self.reconcile_seconds = Histogram("omnistage_operator_reconcile_seconds", "Time one reconcile pass took "
                                           "(reads, writes and status, whatever its result)",
                                           buckets=LATENCY_SECONDS, registry=r)
        self.queue_depth = Gauge("omnistage_operator_queue_depth", "Pipelines queued for a reconcile, waiting "
                                 "for a worker", registry=r)
        self.inflight = Gauge("omnistage_operator_reconciles_inflight", "Reconcile passes running now",
                              registry=r)
        self.delayed = Gauge("omnistage_operator_queue_delayed", "Pipelines due for a reconcile later (a retry "
                             "after a failure, a requeue, a burst of child events)", registry=r)
        if queue is not None:   # read when scraped, so they are never stale
            self.queue_depth.set_function(lambda: queue.queued())
            self.inflight.set_function(lambda: queue.active())
            self.delayed.set_function(lambda: queue.delayed())

    def reconciled(self, result: str, seconds: float) -> None:
        self.reconciles.labels(result).inc()
        self.reconcile_seconds.observe(seconds)
