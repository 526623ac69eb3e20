"""The first-packet target (targets.ttfpP95Ms): p95 from two readings of the orchestrators' cumulative
histogram, the pressure it puts on the bottleneck, and the planner giving the busiest growable stage the
next replica while the target is missed, and nothing more once it is met."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from omnistage.planner.controller import Planner
from omnistage.planner.latency import MAX_PRESSURE, MIN_REQUESTS, merged, p95_ms, pressure
from omnistage.planner.load import ReplicaCounters
from omnistage.planner.scrape import first_output_buckets
from omnistage.spec.model import Autoscaling, AutoscalingTargets, StageAutoscaling
from orchestrator_service.metrics import OrchestratorMetrics

BOUNDS = (100.0, 500.0, 1000.0, 5000.0, math.inf)


def cumulative(counts):
    """Per-bucket counts -> the cumulative histogram Prometheus keeps."""
    total, out = 0.0, {}
    for b, n in zip(BOUNDS, counts):
        total += n
        out[b] = total
    return out


@pytest.mark.parametrize("before, after, want", [
    ([0, 0, 0, 0, 0], [100, 0, 0, 0, 0], 100.0),
    ([0, 0, 0, 0, 0], [90, 5, 5, 0, 0], 500.0),         # the 95th of 100 is in the second bucket
    ([0, 0, 0, 0, 0], [50, 40, 4, 6, 0], 5000.0),
    ([10, 0, 0, 0, 0], [10, 0, 20, 0, 0], 1000.0),      # only what came between the readings counts
    ([0, 0, 0, 0, 0], [1, 1, 0, 0, 0], None),           # too few to say
    ([500, 0, 0, 0, 0], [0, 0, 10, 0, 0], 1000.0),      # a restarted orchestrator counts from zero
    ([0, 0, 0, 0, 0], [0, 0, 0, 0, 10], math.inf),
])
def test_p95_table(before, after, want):
    assert p95_ms(cumulative(before), cumulative(after)) == want


@given(st.lists(st.integers(0, 50), min_size=5, max_size=5))
def test_p95_is_a_bucket_bound_with_at_least_95_percent_below(counts):
    got = p95_ms(cumulative([0] * 5), cumulative(counts))
    if sum(counts) < MIN_REQUESTS:
        assert got is None
        return
    assert got in BOUNDS and cumulative(counts)[got] >= 0.95 * sum(counts)


@pytest.mark.parametrize("target, p95, want", [
    (0, 900.0, 1.0), (1000, None, 1.0), (1000, 800.0, 1.0), (1000, 1000.0, 1.0),
    (1000, 1500.0, 1.5), (1000, 5000.0, MAX_PRESSURE), (1000, math.inf, MAX_PRESSURE),
])
def test_pressure(target, p95, want):
    assert pressure(target, p95) == want


def test_buckets_read_from_the_orchestrators_metrics_and_merged():
    m = OrchestratorMetrics(CollectorRegistry())
    for ms in (50, 50, 700):
        m.first_output_ms.observe(ms)
    b = first_output_buckets(generate_latest(m.registry).decode())
    assert b[math.inf] == 3 and max(n for le, n in b.items() if le < 100) == 2
    assert merged({"a": b, "b": b})[math.inf] == 6


def planner(ttfp_ms: float) -> Planner:
    auto = Autoscaling(enabled=True, targets=AutoscalingTargets(ttfp_p95_ms=ttfp_ms, utilization=0.8),
                       stages={"talker": StageAutoscaling(1, 4, 0.0), "thinker": StageAutoscaling(1, 4, 0.0)})
    return Planner(auto, {"thinker": 1, "talker": 1})


def drive(p: Planner, first_packet_ms: float, seconds: int = 12):
    """The Thinker at 0.3 utilisation, the Talker at 0.5 (both well under the 0.8 target), requests answering
    in `first_packet_ms`."""
    units = {"thinker": 0.0, "talker": 0.0}
    seen = [0] * 5
    for t in range(seconds + 1):
        for stage, rate, busy in (("thinker", 50.0, 0.3), ("talker", 60.0, 0.5)):
            p.observe(stage, {f"{stage}-0": ReplicaCounters(float(t), units[stage], t * busy, t * 2.0, 0, 1,
                                                            steps=t * 10.0)}, "frames")
            units[stage] += rate * 1.0
        p.observe_first_output({"orch-0": cumulative(seen)}, float(t))
        seen[next(i for i, b in enumerate(BOUNDS) if first_packet_ms <= b)] += 4
    return p.decide(float(seconds))


def test_a_missed_first_packet_target_gives_the_busiest_growable_stage_a_replica():
    met, missed = drive(planner(1000), 400.0), drive(planner(1000), 4000.0)
    assert met.changes == []                                  # utilisation alone asks for nothing
    assert [(c.stage, c.after) for c in missed.changes] == [("talker", 2)]
    assert "first packet p95 5000 ms over the 1000 ms target" in missed.plan.reason
    assert drive(planner(0), 4000.0).changes == []            # no target: latency is not looked at
