"""The stage graph in the planner: an upstream's catch-up read as backlog in transit, not as a rise in load;
the share of requests reaching each stage and the demand a pipeline request puts on it."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omnistage.api.model import Autoscaling, AutoscalingBudget, AutoscalingTargets, StageAutoscaling
from omnistage.planner.controller import Planner
from omnistage.planner.graph import (
    RATIO_MEMORY,
    demand_per_request,
    edge_ratio,
    order,
    reach,
    slack,
    steady_arrivals,
    upstream_of,
)
from omnistage.planner.load import MIN_DRAIN_S, ReplicaCounters, StageWindow, arrived, offered, offered_parts
from omnistage.planner.sizing import StageNeed

CHAIN = {"thinker": (), "talker": ("thinker",), "code2wav": ("talker",)}


def test_the_graph_of_a_pipeline_is_each_stages_inputs():
    from pathlib import Path

    from omnistage.api.loading import load_pipeline

    p = load_pipeline(Path(__file__).resolve().parents[2] / "examples" / "qwen3-omni-tiny.yaml")
    assert upstream_of(p) == CHAIN
    assert order({"code2wav": ("talker",), "talker": ("thinker",), "thinker": ()}) == ["thinker", "talker", "code2wav"]


@pytest.mark.parametrize("name, prev, upstream_ended, stage_ended, expected", [
    ("first measurement", 0.0, 4.0, 2.8, 0.7),
    ("smoothed", 0.7, 4.0, 4.0, RATIO_MEMORY * 0.7 + (1 - RATIO_MEMORY) * 1.0),
    ("upstream ended nothing: kept", 0.7, 0.0, 3.0, 0.7),
    ("stage ended nothing: kept", 0.7, 3.0, 0.0, 0.7),
    ("nothing known, nothing ended", 0.0, 0.0, 0.0, 0.0),
])
def test_edge_ratio_table(name, prev, upstream_ended, stage_ended, expected):
    assert edge_ratio(prev, upstream_ended, stage_ended) == pytest.approx(expected), name


@pytest.mark.parametrize("name, upstream, arrived_, ratios, expected", [
    ("a chain: each bounded by its upstream's steady rate",
     CHAIN, {"thinker": 4.8, "talker": 6.0, "code2wav": 6.0},
     {("thinker", "talker"): 0.5, ("talker", "code2wav"): 1.0},
     {"thinker": None, "talker": 2.4, "code2wav": 2.4}),
    ("a stage below its bound bounds its consumer by what it received",
     CHAIN, {"thinker": 4.8, "talker": 1.0, "code2wav": 3.0},
     {("thinker", "talker"): 0.5, ("talker", "code2wav"): 1.0},
     {"thinker": None, "talker": 2.4, "code2wav": 1.0}),
    ("an edge not measured yet: no bound, and its consumer is bounded by what it received",
     CHAIN, {"thinker": 4.8, "talker": 6.0, "code2wav": 6.0}, {("talker", "code2wav"): 1.0},
     {"thinker": None, "talker": None, "code2wav": 6.0}),
    ("an input not measured in this window: no bound",
     CHAIN, {"talker": 6.0, "code2wav": 6.0}, {("thinker", "talker"): 1.0, ("talker", "code2wav"): 1.0},
     {"talker": None, "code2wav": 6.0}),
    ("two inputs: the larger bound",
     {"a": (), "b": (), "c": ("a", "b")}, {"a": 1.0, "b": 3.0, "c": 9.0}, {("a", "c"): 2.0, ("b", "c"): 1.0},
     {"a": None, "b": None, "c": 3.0}),
])
def test_steady_arrivals_table(name, upstream, arrived_, ratios, expected):
    got = steady_arrivals(upstream, arrived_, ratios)
    assert {s: v for s, v in got.items() if s in expected} == pytest.approx(expected), name


def test_slack_is_the_binomial_spread_of_the_share_that_goes_on():
    # 48 requests in 10 s, 0.7 go on: sd sqrt(48 x 0.21) = 3.17 requests, at 1.5 sd 0.476 requests/s
    assert slack(4.8, 0.7, 10.0, 1.5) == pytest.approx(1.5 * math.sqrt(48 * 0.21) / 10)
    assert slack(4.8, 1.0, 10.0, 1.5) == 0.0   # every request goes on: no choice, no spread
    assert slack(4.8, 0.7, 0.0, 1.5) == 0.0
    bound = steady_arrivals(CHAIN, {"thinker": 4.8, "talker": 9.0}, {("thinker", "talker"): 0.7},
                            {"thinker": 10.0, "talker": 10.0}, 1.5)["talker"]
    assert bound == pytest.approx(0.7 * 4.8 + slack(4.8, 0.7, 10.0, 1.5))


def test_reach_and_demand_per_request_follow_the_edges():
    ratios = {("thinker", "talker"): 0.7, ("talker", "code2wav"): 1.0}
    assert reach(CHAIN, ratios) == pytest.approx({"thinker": 1.0, "talker": 0.7, "code2wav": 0.7})
    # 93.6 tokens per Thinker request, 120 frames per Talker and Code2Wav request: a pipeline request takes
    # 0.7 x 120 frames at each of those
    assert demand_per_request(CHAIN, ratios, {"thinker": 93.6, "talker": 120.0, "code2wav": 120.0}) == \
        pytest.approx({"thinker": 93.6, "talker": 84.0, "code2wav": 84.0})
    # an edge not measured yet counts every request as going on
    assert reach(CHAIN, {}) == {"thinker": 1.0, "talker": 1.0, "code2wav": 1.0}


def W(requests_per_s, seconds=10.0, queued=0, queued_before=0, running=0, running_before=0):
    return StageWindow("talker", 3, seconds, requests_per_s * 120, 1.0, requests_per_s, queued, running,
                       queued_before, 0.0, running_before)


def test_arrivals_above_the_steady_bound_are_backlog_in_transit():
    """The modeled Talker after a load step: 5.5 requests/s of 120 frames arrive while the Thinker is offered
    what sends it 3.4. The 2.1 above count as backlog: their 10 s of work over the 30 s drain time."""
    w = W(5.5)
    load, backlog, transit = offered_parts(120, w, 1.0, steady=3.4)
    assert transit == pytest.approx(2.1 * 120 * 10 / MIN_DRAIN_S)
    assert (load, backlog) == (pytest.approx(3.4 * 120 + transit), pytest.approx(transit))
    # below the bound, or with no bound, nothing changes
    assert offered(120, w, 1.0, steady=6.0) == offered(120, w, 1.0) == (pytest.approx(5.5 * 120), 0.0)
    # a window longer than the drain time counts the excess at its rate, never more
    long = W(5.5, seconds=60.0)
    assert offered_parts(120, long, 1.0, steady=3.4)[2] == pytest.approx(2.1 * 120)
    # before a request has ended there is no work per request: the throughput, no bound
    assert offered(0, w, 1.0, steady=1.0) == (pytest.approx(5.5 * 120), 0.0)


@given(st.floats(0, 50), st.floats(0, 50), st.floats(0, 50), st.floats(0.5, 120), st.floats(0.1, 1e3),
       st.integers(0, 40), st.floats(0, 60))
def test_the_bound_never_raises_a_load_and_the_load_rises_with_arrivals_and_with_the_bound(
        rate, more, steady, seconds, per_request, queued, queue_seconds):
    w, w_more = W(rate, seconds, queued), W(rate + more, seconds, queued)
    free, _ = offered(per_request, w, queue_seconds)
    bounded, backlog = offered(per_request, w, queue_seconds, steady)
    assert bounded <= free * (1 + 1e-9) + 1e-9
    assert backlog <= bounded * (1 + 1e-9) + 1e-9
    # never below what the bound allows to arrive steadily
    assert bounded >= min(arrived(w), steady) * per_request * (1 - 1e-9)
    assert offered(per_request, w_more, queue_seconds, steady)[0] >= bounded * (1 - 1e-9)
    assert offered(per_request, w, queue_seconds, steady + more)[0] >= bounded * (1 - 1e-9)


@given(st.dictionaries(st.sampled_from(list(CHAIN)), st.floats(0, 100), min_size=3),
       st.floats(0.01, 1.0), st.floats(0.01, 1.0), st.floats(0, 50), st.floats(1, 30), st.floats(0, 3))
def test_steady_bounds_rise_with_what_the_upstream_receives(arr, r1, r2, more, seconds, errors):
    ratios = {("thinker", "talker"): r1, ("talker", "code2wav"): r2}
    secs = {s: seconds for s in CHAIN}
    before = steady_arrivals(CHAIN, arr, ratios, secs, errors)
    after = steady_arrivals(CHAIN, {**arr, "thinker": arr["thinker"] + more}, ratios, secs, errors)
    for s in ("talker", "code2wav"):
        assert after[s] >= before[s] * (1 - 1e-9)
    assert before["thinker"] is None


# ------------------------------------------------------------------ the planner with the graph


def config(**stages):
    return Autoscaling(enabled=True, targets=AutoscalingTargets(queue_seconds=1.0, utilization=0.8),
                       budget=AutoscalingBudget(max_replicas=12),
                       stages={s: StageAutoscaling(lo, hi, delay) for s, (lo, hi, delay) in stages.items()})


class Flow:
    """A stage's counters, advanced by hand: `arrive` requests arrive and `end` end per second (of
    `per_request` units, one busy second per `capacity` units), the difference waiting in its queue."""

    def __init__(self, name: str, per_request: float, capacity: float, queued: int = 0):
        self.name, self.per_request, self.capacity = name, per_request, capacity
        self.c = ReplicaCounters(0.0, queued=queued)

    def advance(self, at: float, arrive: float, end: float) -> dict[str, ReplicaCounters]:
        c, dt = self.c, at - self.c.at
        units = end * dt * self.per_request
        queued = max(c.queued + round((arrive - end) * dt), 0)
        self.c = ReplicaCounters(at, c.units + units, c.busy_seconds + units / self.capacity, c.finished + end * dt,
                                 queued, 0)
        return {f"{self.name}-0": self.c}


def drive(planner: Planner, seconds: float, thinker: tuple[float, float], talker: tuple[float, float],
          start: float, flows: dict[str, Flow]) -> float:
    """`seconds` of readings and decisions, one a second: per stage (arriving, ending) requests per second."""
    t = start
    while t < start + seconds:
        t += 1.0
        for name, (arrive, end) in (("thinker", thinker), ("talker", talker)):
            planner.observe(name, flows[name].advance(t, arrive, end), "frames")
        planner.decide(t)
    return t


def scenario(upstream) -> Planner:
    """Thinker -> Talker, 0.7 of the Thinker's requests going on; the Talker serves 200 frames/s per replica,
    120 frames a request. 60 s steady (Thinker offered 4.8 requests/s, the Talker 3.36: 403 frames/s, 2.5
    replicas at the target, 3 planned), then the Thinker works off the 60 requests it holds queued for 15 s:
    offered still 4.8, it ends 8.5 a second, and the Talker receives 6 (720 frames/s, 4.5 replicas at the
    target)."""
    planner = Planner(config(thinker=(1, 8, 30.0), talker=(1, 8, 30.0)), {"thinker": 2, "talker": 3},
                      upstream=upstream)
    flows = {"thinker": Flow("thinker", 93.6, 400.0, queued=60), "talker": Flow("talker", 120.0, 200.0)}
    t = drive(planner, 60, (4.8, 4.8), (3.36, 3.36), 0.0, flows)
    assert planner.desired()["talker"] == 3
    drive(planner, 15, (4.8, 8.5), (6.0, 6.0), t, flows)   # its queue falls by 3.7 a second
    return planner


def test_an_upstream_catch_up_is_backlog_in_transit_and_grows_no_replica():
    with_graph = scenario(CHAIN)
    assert with_graph.desired()["talker"] == 3, with_graph.estimates["talker"]
    est = with_graph.estimates["talker"]
    assert est.in_transit > 0 and est.load < 6.0 * 120 * 0.8
    # without the graph the same counters read as a rise: a fourth replica
    alone = scenario(None)
    assert alone.desired()["talker"] >= 4
    assert alone.estimates["talker"].in_transit == 0


def test_a_real_rise_still_grows_the_downstream_stage_with_the_graph():
    """The same counters at the Talker as in the catch-up, but the Thinker is offered more (8.57 requests/s,
    its arrivals rising with what it ends): no catch-up, the Talker grows."""
    planner = Planner(config(thinker=(1, 8, 30.0), talker=(1, 8, 30.0)), {"thinker": 2, "talker": 3},
                      upstream=CHAIN)
    flows = {"thinker": Flow("thinker", 93.6, 400.0), "talker": Flow("talker", 120.0, 200.0)}
    t = drive(planner, 60, (4.8, 4.8), (3.36, 3.36), 0.0, flows)
    drive(planner, 15, (8.57, 8.57), (6.0, 6.0), t, flows)
    assert planner.desired()["talker"] >= 4
    assert planner.estimates["talker"].in_transit == 0


def test_the_demand_per_request_is_decided_and_exported():
    from prometheus_client import generate_latest

    from omnistage.planner.metrics import PlannerMetrics

    planner = Planner(config(thinker=(1, 8, 30.0), talker=(1, 8, 30.0)), {"thinker": 2, "talker": 3},
                      upstream=CHAIN)
    flows = {"thinker": Flow("thinker", 93.6, 400.0), "talker": Flow("talker", 120.0, 200.0)}
    t = drive(planner, 30, (4.8, 4.8), (3.36, 3.36), 0.0, flows)
    d = planner.decide(t)
    assert d.demand == pytest.approx({"thinker": 93.6, "talker": 0.7 * 120}, rel=1e-3)
    m = PlannerMetrics("p")
    m.record(planner, d)
    text = generate_latest(m.registry).decode()
    assert 'omnistage_planner_demand_per_request{pipeline="p",stage="talker"} 84.0' in text
    assert 'omnistage_planner_in_transit{pipeline="p",stage="talker"} 0.0' in text


def test_a_stage_need_planned_on_a_bounded_load_never_gets_more_replicas():
    """What the graph takes off a load is planned at full utilisation as backlog: never more replicas than the
    load read as arrivals."""
    w = W(5.5)
    for steady in (0.0, 1.0, 3.4, 5.0, 9.0):
        load, backlog = offered(120, w, 1.0, steady)
        free, _ = offered(120, w, 1.0)
        bounded = StageNeed("talker", load, 200.0, 1, 8, backlog=backlog).replicas_for(0.8)
        assert bounded <= StageNeed("talker", free, 200.0, 1, 8).replicas_for(0.8)


def test_an_input_measured_over_another_span_bounds_nothing():
    # stages with different scale-down delays have delay windows of different lengths: 30 s of the upstream
    # say nothing of a 60 s window of the stage
    spans = steady_arrivals(CHAIN, {"thinker": 4.8, "talker": 9.0}, {("thinker", "talker"): 0.7},
                            {"thinker": 30.0, "talker": 60.0}, 1.5)
    assert spans["talker"] is None
    same = steady_arrivals(CHAIN, {"thinker": 4.8, "talker": 9.0}, {("thinker", "talker"): 0.7},
                           {"thinker": 60.0, "talker": 60.0}, 1.5)
    assert same["talker"] == pytest.approx(0.7 * 4.8 + slack(4.8, 0.7, 60.0, 1.5))


@pytest.mark.parametrize("delays", [(10.0, 60.0), (60.0, 10.0), (30.0, 30.0)])
def test_the_edge_ratio_holds_through_a_real_rise_whatever_the_stages_delays(delays):
    """0.7 of the Thinker's requests go on; both stages' load rises 1.8x for 60 s, no catch-up. The ratio
    is measured over the same span at both ends, so different scale-down delays do not move it, and none
    of the Talker's rise is taken for backlog in transit."""
    planner = Planner(config(thinker=(1, 8, delays[0]), talker=(1, 8, delays[1])), {"thinker": 2, "talker": 3},
                      upstream=CHAIN)
    flows = {"thinker": Flow("thinker", 93.6, 400.0), "talker": Flow("talker", 120.0, 200.0)}
    t = drive(planner, 60, (4.8, 4.8), (3.36, 3.36), 0.0, flows)
    t = drive(planner, 60, (8.64, 8.64), (6.05, 6.05), t, flows)
    assert planner.ratios[("thinker", "talker")] == pytest.approx(0.7, abs=0.02)
    assert planner.estimates["talker"].in_transit == pytest.approx(0.0, abs=1.0)
