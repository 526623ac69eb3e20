"""Prometheus metrics of one orchestrator replica."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# the stage planner reads them (targets.ttfpP95Ms, targets.rtf; per request class, the demand on each stage)
from omnistage.planner.scrape import (
    CLASS_ENDED,
    CLASS_FINISHED,
    CLASS_REQUESTS,
    CLASS_STAGE_REQUESTS,
    CLASS_STAGE_UNITS,
    FIRST_OUTPUT_MS,
    RTF,
)

_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000, 60000)
# Real-time factors: fine around 1 (where a target sits: its p95 is read as the upper bound of a bucket)
_RTF = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0)


class OrchestratorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.requests = Counter("omnistage_requests", "Client requests by outcome "
                                "(admitted, rejected, finished, cancelled, failed, invalid)", ["outcome"], registry=r)
        self.inflight = Gauge("omnistage_requests_inflight", "Requests being served", registry=r)
        self.waiting = Gauge("omnistage_admission_queue", "Requests waiting for admission", registry=r)
        self.admission_wait_ms = Histogram("omnistage_admission_wait_ms", "Time waited for admission (ms)",
                                           buckets=_MS, registry=r)
        self.media_decode_ms = Histogram("omnistage_media_decode_ms", "Time to decode a request's media parts "
                                         "at admission (ms)", buckets=_MS, registry=r)
        self.latency_ms = Histogram("omnistage_request_latency_ms", "End-to-end request latency (ms)",
                                    buckets=_MS, registry=r)
        self.first_output_ms = Histogram(FIRST_OUTPUT_MS, "Time to the first output event (ms)",
                                         buckets=_MS, registry=r)
        self.rtf = Histogram(RTF, "Real-time factor of a finished request's audio: seconds from its arrival to its "
                             "last audio chunk over the seconds of audio it produced (below 1: faster than real "
                             "time)", buckets=_RTF, registry=r)
        self.stage_ms = Histogram("omnistage_stage_time_ms", "Per-stage time of a request (ms) by part "
                                  "(queue, compute, transfer, first_chunk, total)", ["stage", "part"],
                                  buckets=_MS, registry=r)
        self.retries = Counter("omnistage_stage_retries", "Stage calls retried on another replica", ["stage"],
                               registry=r)
        self.waiting_peak = Gauge("omnistage_admission_queue_peak", "Most requests ever waiting for admission",
                                  registry=r)
        self.backlog = Gauge("omnistage_stage_backlog", "Requests at a stage or waiting for a slot on it",
                             ["stage"], registry=r)
        self.backlog_peak = Gauge("omnistage_stage_backlog_peak", "Most requests ever at a stage",
                                  ["stage"], registry=r)
        self.capacity = Gauge("omnistage_stage_capacity", "Requests a stage's ready replicas can hold",
                              ["stage"], registry=r)
        self.stage_errors = Counter("omnistage_stage_errors", "Stage calls that failed", ["stage", "code"],
                                    registry=r)
        # Per request class (request_class.py): "class" is a fixed vocabulary, so their series are bounded.
        self.class_requests = Counter(CLASS_REQUESTS, "Requests admitted, by request class", ["class"], registry=r)
        self.class_finished = Counter(CLASS_FINISHED, "Requests finished, by request class", ["class"], registry=r)
        self.class_ended = Counter(CLASS_ENDED, "Admitted requests ended (finished, cancelled, failed or timed out), "
                                   "by request class", ["class"], registry=r)
        self.class_stage_requests = Counter(CLASS_STAGE_REQUESTS, "Finished requests a stage served, by request "
                                            "class", ["class", "stage"], registry=r)
        self.class_stage_units = Counter(CLASS_STAGE_UNITS, "Work units a stage did for finished requests, by "
                                         "request class (from their traces)", ["class", "stage", "unit"], registry=r)

    def observe_audio(self, to_last_audio_s: float, audio_s: float) -> None:
        """A finished request's real-time factor; one that produced no audio says nothing of it."""
        if audio_s > 0:
            self.rtf.observe(to_last_audio_s / audio_s)

    def observe_ended(self, request_class: str, trace=None) -> None:
        """An admitted request of `request_class` ended; `trace` (its RequestTrace) when it finished: each
        stage's work for it (a stage whose engine counts no units is counted as served only). The stages'
        counters move first and the ended count last, so a scrape between them reads work of requests not yet
        counted as ended, never requests without their work (the planner divides the work by them)."""
        if trace is not None:
            for st in trace.stages:
                self.class_stage_requests.labels(request_class, st.stage).inc()
                if st.unit:
                    self.class_stage_units.labels(request_class, st.stage, st.unit).inc(st.units)
            self.class_finished.labels(request_class).inc()
        self.class_ended.labels(request_class).inc()

    def observe_admission(self, admission, router) -> None:
        self.waiting_peak.set(admission.peak_queued)
        for stage, pool in router.pools.items():
            self.backlog.labels(stage).set(pool.backlog())
            self.backlog_peak.labels(stage).set(pool.peak_backlog)
            self.capacity.labels(stage).set(pool.capacity())
