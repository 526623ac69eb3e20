"""A stage replica's counters, read from its Prometheus metrics (the text its status port serves).

The metric names the planner reads are declared here and the stage's metrics (stage_service/metrics.py)
are registered under them: one home for the contract between the two.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from .load import ReplicaCounters

REQUESTS = "omnistage_stage_requests"       # counter, labels stage, outcome
QUEUE_DEPTH = "omnistage_stage_queue_depth"  # gauge
RUNNING = "omnistage_stage_running"          # gauge
STEP_MS = "omnistage_stage_step_ms"          # histogram: its sum is the engine's busy time, its count its steps
UNITS = "omnistage_stage_units"              # counter, labels stage, unit
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
            elif s.name == f"{STEP_MS}_sum":
                busy += s.value / 1e3
            elif s.name == f"{STEP_MS}_count":
                steps += s.value
            elif s.name == f"{REQUESTS}_total" and s.labels.get("outcome") in RAN:
                finished += s.value
            elif s.name == QUEUE_DEPTH:
                queued += int(s.value)
            elif s.name == RUNNING:
                running += int(s.value)
    return ReplicaCounters(at, units, busy, finished, queued, running, steps), unit
