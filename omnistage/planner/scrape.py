"""A stage replica's counters, and an orchestrator's time to first packet, real-time factor, audio chunks
(late ones apart) and per-class counters, read from their Prometheus metrics (the text their status ports serve).

The metric names the planner reads are declared here and the stage's and orchestrator's metrics
(stage_service/metrics.py, orchestrator_service/metrics.py) are registered under them: one home for the
contract between them.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from omnistage.planner.classes import ClassCounts
from omnistage.planner.jobs import JobsReading
from omnistage.planner.load import ReplicaCounters

REQUESTS = "omnistage_stage_requests"       # counter, labels stage, outcome
QUEUE_DEPTH = "omnistage_stage_queue_depth"  # gauge
RUNNING = "omnistage_stage_running"          # gauge
STEP_SECONDS = "omnistage_stage_step_seconds"  # histogram: its sum is the engine's busy time, its count its steps
UNITS = "omnistage_stage_units"              # counter, labels stage, unit
FIRST_OUTPUT_SECONDS = "omnistage_request_first_output_seconds"  # orchestrator histogram: time to the first output
RTF = "omnistage_request_rtf"           # orchestrator histogram: a finished request's audio real-time factor
ORCHESTRATOR_HISTOGRAMS = (FIRST_OUTPUT_SECONDS, RTF)
# Orchestrator counters (no labels: one orchestrator serves one pipeline): the audio chunks it delivered to
# clients, and of them those that came after the audio before them had finished playing (targets.underruns)
AUDIO_CHUNKS = "omnistage_audio_chunks"
AUDIO_UNDERRUNS = "omnistage_audio_underruns"
ORCHESTRATOR_COUNTERS = (AUDIO_CHUNKS, AUDIO_UNDERRUNS)
# Per request class (orchestrator_service/request_class.py: the request's input and output modalities), what the
# orchestrator counts from each request's trace: the demand a request of each class puts on each stage.
CLASS_REQUESTS = "omnistage_class_requests"              # counter, label class: requests admitted
CLASS_FINISHED = "omnistage_class_finished"              # counter, label class: requests finished
CLASS_ENDED = "omnistage_class_ended"                    # counter, label class: admitted requests ended, any outcome
CLASS_STAGE_REQUESTS = "omnistage_class_stage_requests"  # counter, labels class, stage: finished ones the stage served
CLASS_STAGE_UNITS = "omnistage_class_stage_units"        # counter, labels class, stage, unit: the stage's work for them
# Orchestrator gauges of the durable job store (/v1/videos): jobs waiting in the store to be run, as a replica last
# counted them (every replica counts the same store, so replicas are not summed), jobs a replica runs now, and
# the most it runs at once (its --jobs-concurrency; 0 without a store or while it drains): its job slots.
JOBS_QUEUED = "omnistage_jobs_queued"
JOBS_RUNNING = "omnistage_jobs_running"
JOBS_SLOTS = "omnistage_jobs_slots"
# Outcomes of requests that reached the engine (rejected and invalid ones never did): their work counts.
RAN = frozenset({"finished", "cancelled", "failed", "timeout"})


def replica_counters(text: str, at: float) -> tuple[ReplicaCounters, str]:
    """The counters in one replica's metrics text at time `at`, and the unit its work is counted in
    ("" before its first step)."""
    units = busy = finished = steps = 0.0
    queued = running = 0
    unit = ""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == f"{UNITS}_total":
                units += s.value
                unit = s.labels.get("unit", unit)
            elif s.name == f"{STEP_SECONDS}_sum":
                busy += s.value
            elif s.name == f"{STEP_SECONDS}_count":
                steps += s.value
            elif s.name == f"{REQUESTS}_total" and s.labels.get("outcome") in RAN:
                finished += s.value
            elif s.name == QUEUE_DEPTH:
                queued += int(s.value)
            elif s.name == RUNNING:
                running += int(s.value)
    return ReplicaCounters(at, units, busy, finished, queued, running, steps), unit


def orchestrator_buckets(text: str) -> dict[str, dict[float, float]]:
    """An orchestrator's cumulative histograms the planner's targets read (ORCHESTRATOR_HISTOGRAMS):
    histogram name -> upper bound -> count. One the orchestrator does not export is empty."""
    out: dict[str, dict[float, float]] = {name: {} for name in ORCHESTRATOR_HISTOGRAMS}
    for family in text_string_to_metric_families(text):
        if family.name not in out:
            continue
        into = out[family.name]
        for s in family.samples:
            if s.name == f"{family.name}_bucket":
                le = float(s.labels["le"])
                into[le] = into.get(le, 0.0) + s.value
    return out


def orchestrator_counters(text: str) -> dict[str, float]:
    """An orchestrator's counters the planner's targets read (ORCHESTRATOR_COUNTERS): name -> value (summed
    over any labels). One the orchestrator does not export is 0."""
    out = dict.fromkeys(ORCHESTRATOR_COUNTERS, 0.0)
    names = {f"{name}_total": name for name in ORCHESTRATOR_COUNTERS}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in names:
                out[names[s.name]] += s.value
    return out


def orchestrator_jobs(text: str) -> JobsReading | None:
    """An orchestrator's job gauges (JOBS_QUEUED, JOBS_SLOTS, JOBS_RUNNING); None for one that does not export
    the queued jobs (an older image). One without slots runs no jobs (0)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in (JOBS_QUEUED, JOBS_SLOTS, JOBS_RUNNING):
                values[s.name] = s.value
    if JOBS_QUEUED not in values:
        return None
    return JobsReading(values[JOBS_QUEUED], values.get(JOBS_SLOTS, 0.0), values.get(JOBS_RUNNING, 0.0))


def orchestrator_jobs_queued(text: str) -> float | None:
    """The jobs an orchestrator counted queued in its job store (JOBS_QUEUED); None for one that does not export
    it (no job store, or an older image)."""
    reading = orchestrator_jobs(text)
    return None if reading is None else reading.queued


def orchestrator_classes(text: str) -> ClassCounts:
    """An orchestrator's per-class counters (CLASS_*): empty for one that does not export them."""
    admitted: dict[str, float] = {}
    finished: dict[str, float] = {}
    served: dict[tuple[str, str], float] = {}
    units: dict[tuple[str, str], float] = {}
    ended: dict[str, float] = {}
    counts = ClassCounts(admitted, finished, served, units, ended)
    # the table each counter sums into (keyed by class, or by (class, stage) where per_stage)
    into: dict[str, tuple[dict[Any, float], bool]] = {
        f"{CLASS_REQUESTS}_total": (admitted, False), f"{CLASS_FINISHED}_total": (finished, False),
        f"{CLASS_ENDED}_total": (ended, False),
        f"{CLASS_STAGE_REQUESTS}_total": (served, True), f"{CLASS_STAGE_UNITS}_total": (units, True)}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name not in into or "class" not in s.labels:
                continue
            table, per_stage = into[s.name]
            if per_stage and "stage" not in s.labels:
                continue
            key = (s.labels["class"], s.labels["stage"]) if per_stage else s.labels["class"]
            table[key] = table.get(key, 0.0) + s.value   # summed over the other labels (a stage's unit)
    return counts
