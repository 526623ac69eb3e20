"""Prometheus metrics of one orchestrator replica."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from omnistage.contract.metrics import LATENCY_SECONDS

# the stage planner reads them (targets.ttfpP95Ms, targets.rtf, targets.underruns; per request class, the demand
# on each stage)
from omnistage.planner.scrape import (
    AUDIO_CHUNKS,
    AUDIO_UNDERRUNS,
    CLASS_ENDED,
    CLASS_FINISHED,
    CLASS_REQUESTS,
    CLASS_STAGE_REQUESTS,
    CLASS_STAGE_UNITS,
    FIRST_OUTPUT_SECONDS,
    JOBS_QUEUED,
    JOBS_RUNNING,
    JOBS_SLOTS,
    RTF,
)

# How a client request ended: each request that reaches the request path is counted once, under one of these
# (the HTTP door's own refusals before it, of a body or a key, are in its access lines). An admitted one ends
# finished, cancelled, failed or timeout; one never admitted rejected (full), unauthenticated (its API key, on
# the gRPC door), invalid, failed (a stage down) or timeout (its deadline passed in the admission queue).
ENDED_OUTCOMES = ("finished", "cancelled", "failed", "timeout", "rejected", "unauthenticated", "invalid")
# How a job run by this replica ended (each run once): completed, failed, or taken_over (its lease was lost to
# another replica, which runs it again from the start).
JOB_OUTCOMES = ("completed", "failed", "taken_over")
# Real-time factors: fine around 1 (where a target sits: its p95 is read as the upper bound of a bucket)
_RTF = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0)


class OrchestratorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        # An event (admitted) and the end states apart, so that sum() over the outcomes counts each request once.
        self.admitted = Counter("omnistage_requests_admitted", "Client requests admitted (given a slot)",
                                registry=r)
        self.requests = Counter("omnistage_requests_ended", "Client requests ended, by outcome "
                                f"({', '.join(ENDED_OUTCOMES)}): each request once", ["outcome"], registry=r)
        for outcome in ENDED_OUTCOMES:  # every outcome's series from the start: rate() of an outcome never seen
            self.requests.labels(outcome)  # yet is 0, not absent, and its first one is counted as an increase
        self.inflight = Gauge("omnistage_requests_inflight", "Requests being served", registry=r)
        self.waiting = Gauge("omnistage_admission_queue", "Requests waiting for admission", registry=r)
        self.admission_wait_seconds = Histogram("omnistage_admission_wait_seconds", "Time waited for admission",
                                                buckets=LATENCY_SECONDS, registry=r)
        self.media_decode_seconds = Histogram("omnistage_request_media_decode_seconds", "Time to decode a "
                                              "request's media parts at admission", buckets=LATENCY_SECONDS,
                                              registry=r)
        self.latency_seconds = Histogram("omnistage_request_latency_seconds", "End-to-end request latency",
                                         buckets=LATENCY_SECONDS, registry=r)
        self.first_output_seconds = Histogram(FIRST_OUTPUT_SECONDS, "Time to the first output event",
                                              buckets=LATENCY_SECONDS, registry=r)
        self.rtf = Histogram(RTF, "Real-time factor of a finished request's audio: seconds from its arrival to its "
                             "last audio chunk over the seconds of audio it produced (below 1: faster than real "
                             "time)", buckets=_RTF, registry=r)
        # late chunks and all chunks side by side: the planner reads their share, which load alone does not move
        self.audio_chunks = Counter(AUDIO_CHUNKS, "Audio chunks delivered to clients (of requests with audio out)",
                                    registry=r)
        self.audio_underruns = Counter(AUDIO_UNDERRUNS, "Audio chunks that reached the client after the audio "
                                       "before them had finished playing (a listener playing the answer as it "
                                       "arrives heard a gap)", registry=r)
        self.stage_seconds = Histogram("omnistage_stage_time_seconds", "Per-stage time of a finished request, by "
                                       "part (queue, compute, transfer, encode, first_chunk, total)",
                                       ["stage", "part"], buckets=LATENCY_SECONDS, registry=r)
        self.retries = Counter("omnistage_stage_retries", "Stage calls retried on another replica", ["stage"],
                               registry=r)
        self.backlog = Gauge("omnistage_stage_backlog", "Requests at a stage or waiting for a slot on it",
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
        # The job API (/v1/videos, gRPC Jobs): the planner reads the queued jobs as demand on the pipeline.
        self.jobs_queued = Gauge(JOBS_QUEUED, "Jobs queued in the job store, as this replica last counted them",
                                 registry=r)
        self.jobs_running = Gauge(JOBS_RUNNING, "Jobs this replica runs now", registry=r)
        # the planner counts queued jobs only as far as free slots take them into the pipeline
        self.jobs_slots = Gauge(JOBS_SLOTS, "Jobs this replica runs at once at most (--jobs-concurrency; 0 without a "
                                "job store or while it drains)", registry=r)
        self.jobs = Counter("omnistage_jobs_ended", "Job runs of this replica ended, by outcome "
                            f"({', '.join(JOB_OUTCOMES)})", ["outcome"], registry=r)
        for outcome in JOB_OUTCOMES:
            self.jobs.labels(outcome)

    def observe_audio(self, to_last_audio_s: float, audio_s: float) -> None:
        """A finished request's real-time factor; one that produced no audio says nothing of it."""
        if audio_s > 0:
            self.rtf.observe(to_last_audio_s / audio_s)

    def observe_audio_chunk(self, late: bool) -> None:
        """An audio chunk delivered to a client; `late`: after the audio before it had finished playing
        (playback.Playback)."""
        self.audio_chunks.inc()
        if late:
            self.audio_underruns.inc()

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

    def observe_admission(self, router) -> None:
        for stage, pool in router.pools.items():
            self.backlog.labels(stage).set(pool.backlog())
            self.capacity.labels(stage).set(pool.capacity())
