"""The targets the orchestrators measure (targets.ttfpP95Ms, targets.rtf): p95 from two readings of the
orchestrators' cumulative histograms, the pressure a miss puts on the bottleneck (the larger of the two
when both are missed), and the planner giving the busiest growable stage the next replica while a target
is missed, and nothing more once it is met."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from omnistage.api.model import Autoscaling, AutoscalingTargets, StageAutoscaling
from omnistage.planner.controller import Planner
from omnistage.planner.latency import MAX_PRESSURE, MIN_REQUESTS, merged, missed, p95, pressure
from omnistage.planner.load import ReplicaCounters
from omnistage.planner.scrape import FIRST_OUTPUT_SECONDS, RTF, orchestrator_buckets
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
    assert p95(cumulative(before), cumulative(after)) == want


@given(st.lists(st.integers(0, 50), min_size=5, max_size=5))
def test_p95_is_a_bucket_bound_with_at_least_95_percent_below(counts):
    got = p95(cumulative([0] * 5), cumulative(counts))
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
    for seconds in (0.05, 0.05, 0.7):
        m.first_output_seconds.observe(seconds)
    b = orchestrator_buckets(generate_latest(m.registry).decode())[FIRST_OUTPUT_SECONDS]
    assert b[math.inf] == 3 and max(n for le, n in b.items() if le < 0.1) == 2
    assert merged({"a": b, "b": b})[math.inf] == 6


@pytest.mark.parametrize("ttfp_ms, rtf, p95s, factor, told", [
    (0, 0, {FIRST_OUTPUT_SECONDS: 5.0, RTF: 3.0}, 1.0, []),                  # no targets: nothing looked at
    (1000, 1.0, {FIRST_OUTPUT_SECONDS: 1.0, RTF: 1.0}, 1.0, []),             # met at the target
    (1000, 1.0, {FIRST_OUTPUT_SECONDS: None, RTF: None}, 1.0, []),              # too few requests to say
    (1000, 1.0, {}, 1.0, []),                                              # no orchestrator read yet
    (1000, 1.0, {FIRST_OUTPUT_SECONDS: 0.5, RTF: 1.5}, 1.5, ["rtf p95 1.50 over the 1.00 target"]),
    (1000, 1.0, {FIRST_OUTPUT_SECONDS: 1.2, RTF: 0.5}, 1.2, ["first packet p95 1200 ms over the 1000 ms target"]),
    (1000, 1.0, {FIRST_OUTPUT_SECONDS: 1.2, RTF: 1.5}, 1.5,                  # both missed: the larger
     ["first packet p95 1200 ms over the 1000 ms target", "rtf p95 1.50 over the 1.00 target"]),
    (1000, 0.5, {FIRST_OUTPUT_SECONDS: 1.8, RTF: 0.6}, 1.8,
     ["first packet p95 1800 ms over the 1000 ms target", "rtf p95 0.60 over the 0.50 target"]),
    (0, 0.8, {FIRST_OUTPUT_SECONDS: 9.0, RTF: math.inf}, MAX_PRESSURE, ["rtf p95 inf over the 0.80 target"]),
    (1000, 0, {FIRST_OUTPUT_SECONDS: 5.0, RTF: 4.0}, MAX_PRESSURE,
     ["first packet p95 5000 ms over the 1000 ms target"]),
])
def test_missed_targets_table(ttfp_ms, rtf, p95s, factor, told):
    got = missed(AutoscalingTargets(ttfp_p95_ms=ttfp_ms, rtf=rtf), p95s)
    assert got == (pytest.approx(factor), told)


TARGET = st.one_of(st.just(0.0), st.floats(0.01, 1e4))         # 0: no target
MEASURED = st.one_of(st.none(), st.floats(0, 1e5), st.just(math.inf))


@given(TARGET, TARGET, MEASURED, MEASURED, st.floats(0, 1e5), st.floats(0, 1e5))
def test_pressure_is_monotone_in_the_miss_at_most_the_cap_and_none_when_met(t_ttfp, t_rtf, ttfp, rtf, more_ttfp,
                                                                            more_rtf):
    targets = AutoscalingTargets(ttfp_p95_ms=t_ttfp, rtf=t_rtf)
    # the histogram is in seconds, the target in ms
    factor, told = missed(targets, {FIRST_OUTPUT_SECONDS: None if ttfp is None else ttfp / 1e3, RTF: rtf})
    assert 1.0 <= factor <= MAX_PRESSURE
    ttfp_ms = None if ttfp is None else ttfp / 1e3 * 1e3
    met = [t <= 0 or m is None or m <= t for t, m in ((t_ttfp, ttfp_ms), (t_rtf, rtf))]
    assert (factor == 1.0) == all(met) and len(told) == met.count(False)
    assert factor == max(pressure(t_ttfp, ttfp_ms), pressure(t_rtf, rtf))
    worse = {FIRST_OUTPUT_SECONDS: None if ttfp is None else (ttfp + more_ttfp) / 1e3,
             RTF: None if rtf is None else rtf + more_rtf}
    assert missed(targets, worse)[0] >= factor


def test_rtf_is_observed_only_for_requests_with_audio_and_read_back_from_the_metrics():
    m = OrchestratorMetrics(CollectorRegistry())
    m.observe_audio(3.0, 0.0)              # no audio: says nothing of the real-time factor
    m.observe_audio(1.0, 2.0)              # 0.5
    m.observe_audio(3.0, 2.0)              # 1.5
    b = orchestrator_buckets(generate_latest(m.registry).decode())
    assert b[RTF][math.inf] == 2 and b[RTF][0.5] == 1 and b[RTF][1.25] == 1 and b[RTF][1.5] == 2
    assert b[FIRST_OUTPUT_SECONDS][math.inf] == 0
    assert orchestrator_buckets("") == {FIRST_OUTPUT_SECONDS: {}, RTF: {}}   # an orchestrator without them


def planner(ttfp_ms: float = 0.0, rtf: float = 0.0) -> Planner:
    auto = Autoscaling(enabled=True, targets=AutoscalingTargets(ttfp_p95_ms=ttfp_ms, rtf=rtf, utilization=0.8),
                       stages={"talker": StageAutoscaling(1, 4, 0.0), "thinker": StageAutoscaling(1, 4, 0.0)})
    return Planner(auto, {"thinker": 1, "talker": 1})


def drive(p: Planner, first_packet_ms: float, rtf: float | None = None, seconds: int = 12):
    """The Thinker at 0.3 utilisation, the Talker at 0.5 (both well under the 0.8 target), requests answering
    in `first_packet_ms` and, with `rtf`, producing 2 s of audio each at that real-time factor; the
    orchestrator's histograms read back from its real metrics text."""
    units = {"thinker": 0.0, "talker": 0.0}
    orch = OrchestratorMetrics(CollectorRegistry())
    for t in range(seconds + 1):
        for stage, rate, busy in (("thinker", 50.0, 0.3), ("talker", 60.0, 0.5)):
            p.observe(stage, {f"{stage}-0": ReplicaCounters(float(t), units[stage], t * busy, t * 2.0, 0, 1,
                                                            steps=t * 10.0)}, "frames")
            units[stage] += rate * 1.0
        p.observe_orchestrators({"orch-0": orchestrator_buckets(generate_latest(orch.registry).decode())}, float(t))
        for _ in range(4):
            orch.first_output_seconds.observe(first_packet_ms / 1e3)
            if rtf is not None:
                orch.observe_audio(rtf * 2.0, 2.0)
    return p.decide(float(seconds))


def test_a_missed_first_packet_target_gives_the_busiest_growable_stage_a_replica():
    met, late = drive(planner(1000), 400.0), drive(planner(1000), 4000.0)
    assert met.changes == []                                  # utilisation alone asks for nothing
    assert [(c.stage, c.after) for c in late.changes] == [("talker", 2)]
    assert "first packet p95 5000 ms over the 1000 ms target" in late.plan.reason
    assert drive(planner(0), 4000.0).changes == []            # no target: latency is not looked at


def test_a_missed_rtf_target_gives_the_busiest_growable_stage_a_replica():
    met, slow = drive(planner(rtf=1.0), 400.0, rtf=0.6), drive(planner(rtf=1.0), 400.0, rtf=1.8)
    assert met.changes == []
    assert [(c.stage, c.after) for c in slow.changes] == [("talker", 2)]
    assert slow.plan.reason.endswith("; rtf p95 2.00 over the 1.00 target: talker planned at 2.00x its load")
    assert drive(planner(rtf=1.0), 400.0).changes == []       # text only: no audio, no rtf to miss
    assert drive(planner(), 400.0, rtf=3.0).changes == []     # no target: the rtf is not looked at


def test_latency_read_before_the_orchestrators_stopped_answering_presses_no_more_once_a_window_old():
    p = planner(1000)
    assert "over the 1000 ms target" in drive(p, 4000.0).plan.reason
    later = p.decide(12.0 + p.window_s + 1)   # no orchestrator reading since t = 12
    assert "target" not in later.plan.reason


def test_both_targets_missed_plan_the_bottleneck_once_at_the_larger_pressure():
    # The Talker at 0.5 utilisation: 1.33x (first packet 2000 over 1500) alone leaves it under the 0.8 target,
    # 2x (rtf 2.0 over 1.0) takes it over; together, the larger.
    alone = drive(planner(1500), 1800.0)
    assert alone.changes == [] and "talker planned at 1.33x its load" in alone.plan.reason
    both = drive(planner(1500, rtf=1.0), 1800.0, rtf=1.8)
    assert both.plan.reason.endswith("; first packet p95 2000 ms over the 1500 ms target, rtf p95 2.00 over the "
                                     "1.00 target: talker planned at 2.00x its load")
    assert [(c.stage, c.after) for c in both.changes] == [("talker", 2)]
