"""The orchestrator's per-request-class counters (orchestrator_service/metrics.py), as the stage planner
scrapes them (the names omnistage/planner/scrape.py declares): from a finished request's trace, each stage
it went through and that stage's work units, under the request's class."""

from __future__ import annotations

from prometheus_client import generate_latest

from omnistage.planner.scrape import (
    CLASS_ENDED,
    CLASS_FINISHED,
    CLASS_REQUESTS,
    CLASS_STAGE_REQUESTS,
    CLASS_STAGE_UNITS,
)
from omnistage.v1 import common_pb2
from orchestrator_service.metrics import OrchestratorMetrics

SPEECH = "text->text+audio"


def trace(*stages: tuple[str, int, str]) -> common_pb2.RequestTrace:
    return common_pb2.RequestTrace(stages=[common_pb2.StageTrace(stage=s, units=n, unit=u) for s, n, u in stages])


def sample(m: OrchestratorMetrics, name: str, **labels) -> float:
    return m.registry.get_sample_value(f"{name}_total", labels) or 0.0


def test_finished_requests_count_each_stage_and_its_units_under_their_class():
    m = OrchestratorMetrics()
    m.class_requests.labels(SPEECH).inc(3)  # admitted: the servicer counts them; one of them never finishes
    m.observe_ended(SPEECH, trace(("thinker", 8, "tokens"), ("talker", 30, "frames"), ("code2wav", 2, "chunks")))
    m.observe_ended(SPEECH, trace(("thinker", 4, "tokens"), ("talker", 12, "frames"), ("code2wav", 1, "chunks")))
    m.observe_ended(SPEECH)  # cancelled: ended, no work counted
    m.observe_ended("text->text", trace(("thinker", 5, "tokens")))
    assert sample(m, CLASS_REQUESTS, **{"class": SPEECH}) == 3
    assert sample(m, CLASS_FINISHED, **{"class": SPEECH}) == 2 and sample(m, CLASS_ENDED, **{"class": SPEECH}) == 3
    assert sample(m, CLASS_FINISHED, **{"class": "text->text"}) == 1
    for stage, units, unit in (("thinker", 12, "tokens"), ("talker", 42, "frames"), ("code2wav", 3, "chunks")):
        assert sample(m, CLASS_STAGE_REQUESTS, **{"class": SPEECH, "stage": stage}) == 2
        assert sample(m, CLASS_STAGE_UNITS, **{"class": SPEECH, "stage": stage, "unit": unit}) == units
    assert sample(m, CLASS_STAGE_UNITS, **{"class": "text->text", "stage": "thinker", "unit": "tokens"}) == 5
    assert sample(m, CLASS_STAGE_REQUESTS, **{"class": "text->text", "stage": "talker"}) == 0  # it skipped the Talker


def test_a_stage_that_counts_no_units_is_counted_as_served_only():
    m = OrchestratorMetrics()
    m.observe_ended("text->text", trace(("thinker", 0, "")))
    assert sample(m, CLASS_STAGE_REQUESTS, **{"class": "text->text", "stage": "thinker"}) == 1
    assert f"{CLASS_STAGE_UNITS}_total{{".encode() not in generate_latest(m.registry)  # no series with unit ""
