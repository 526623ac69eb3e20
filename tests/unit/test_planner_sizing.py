"""The planner's sizing: replicas per stage from load and capacity, within bounds and a budget."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnistage.planner.sizing import Budget, StageNeed, goodput, offered_load, plan


def N(stage, load, capacity, lo=1, hi=8, gpus=0):
    return StageNeed(stage, load, capacity, lo, hi, gpus)


# (id, needs, budget, utilization, replicas, bottleneck, budget_limited)
TABLE = [
    ("no load: every stage at its minimum", [N("thinker", 0, 100), N("talker", 0, 50, lo=2)], Budget(), 0.8,
     {"thinker": 1, "talker": 2}, None, False),
    ("each stage its own need at 0.8", [N("thinker", 160, 100), N("talker", 100, 50), N("code2wav", 30, 100)],
     Budget(), 0.8, {"thinker": 2, "talker": 3, "code2wav": 1}, "thinker", False),
    ("exactly at the target needs no extra replica", [N("a", 80, 100)], Budget(), 0.8, {"a": 1}, "a", False),
    ("full utilisation allowed", [N("a", 200, 100)], Budget(), 1.0, {"a": 2}, "a", False),
    ("max replicas bounds a stage", [N("a", 1000, 100, hi=3)], Budget(), 0.8, {"a": 3}, "a", False),
    ("budget short: the bottleneck gets the replicas",
     [N("thinker", 100, 100), N("talker", 300, 50), N("code2wav", 50, 100)], Budget(max_replicas=6), 0.8,
     {"thinker": 1, "talker": 4, "code2wav": 1}, "talker", True),
    ("budget short: replicas go where utilisation is highest, one at a time (ties: pipeline order)",
     [N("a", 300, 100), N("b", 300, 100)], Budget(max_replicas=5), 0.8, {"a": 3, "b": 2}, "b", True),
    ("GPU budget: a 2-GPU stage and a 1-GPU stage",
     [N("thinker", 400, 100, gpus=2), N("talker", 200, 100, gpus=1)], Budget(max_gpus=8), 0.8,
     {"thinker": 3, "talker": 2}, "thinker", True),
    ("a budget that fits every need changes nothing",
     [N("a", 160, 100), N("b", 40, 100)], Budget(max_replicas=10, max_gpus=0), 0.8, {"a": 2, "b": 1}, "a", False),
]


@pytest.mark.parametrize("name,needs,budget,util,replicas,bottleneck,limited", TABLE, ids=[t[0] for t in TABLE])
def test_plan_table(name, needs, budget, util, replicas, bottleneck, limited):
    p = plan(needs, budget, util)
    assert p.replicas() == replicas
    assert p.bottleneck == bottleneck
    assert p.budget_limited is limited


# (id, need, replicas, keep_down_to): a stage of 100 units/s a replica at the 0.8 target
MEASURED = [
    ("as before without a backlog or a range", StageNeed("a", 230, 100), 3, 4),
    ("a backlog is planned at full utilisation: 150 arriving and 40 of backlog fit 2 (not 3, at 0.8)",
     StageNeed("a", 190, 100, backlog=40), 2, 3),
    ("... and all of it must fit at full: 60 arriving and 150 of backlog", StageNeed("a", 210, 100, backlog=150),
     3, 3),
    ("grows only for what it surely has: 230 read, 150 sure", StageNeed("a", 230, 100, grow_load=150), 2, 4),
    ("shrinks only when fewer serve the load over the delay: 230 now, 300 over it",
     StageNeed("a", 230, 100, keep_load=300), 3, 5),
    ("what it surely has and what it held may differ most", StageNeed("a", 230, 100, grow_load=150, keep_load=300),
     2, 5),
]


@pytest.mark.parametrize("name,need,replicas,keep", MEASURED, ids=[t[0] for t in MEASURED])
def test_measured_loads_table(name, need, replicas, keep):
    p = plan([need], utilization=0.8)
    assert (p.stages["a"].replicas, p.stages["a"].keep_down_to) == (replicas, keep)
    assert p.stages["a"].utilization == pytest.approx(need.load / (replicas * need.capacity))  # the best estimate's


def test_a_missed_latency_target_scales_the_best_estimate_not_the_sure_load():
    n = StageNeed("a", 60, 100, backlog=10, grow_load=40, keep_load=70).scaled(2.0)
    assert (n.load, n.backlog, n.grow_load, n.keep_load) == (120, 20, None, 140)
    assert plan([n]).stages["a"].replicas == 2   # 100 arriving at 0.8, 120 at full


def test_reason_names_the_bottleneck_and_what_the_budget_cannot_meet():
    p = plan([N("thinker", 100, 100), N("talker", 300, 50)], Budget(max_replicas=4), 0.8)
    assert p.reason.startswith("talker is the bottleneck: 2.00 utilisation at 3 replicas (50 units/s each)")
    assert p.reason.endswith("the budget (maxReplicas 4) cannot meet the target: thinker 1/2, talker 3/8 replicas of "
                            "what they need")
    assert plan([N("a", 0, 1)]).reason == "no load: every stage at its minimum"


def test_scale_down_band_keeps_more_than_the_need():
    # 0.8 target: 3 replicas of 100 are needed for 230/s; 230 over 0.68 per replica would need 4 to go below.
    p = plan([N("a", 230, 100)], utilization=0.8)
    assert (p.stages["a"].replicas, p.stages["a"].keep_down_to) == (3, 4)


@pytest.mark.parametrize("needs,util,message", [
    ([N("a", 1, 0)], 0.8, "stage a: capacity must be > 0"),
    ([N("a", -1, 1)], 0.8, "load >= 0"),
    ([N("a", 1, 1, lo=3, hi=2)], 0.8, "1 <= min <= max replicas"),
    ([N("a", 1, 1)], 0.0, "utilization must be in (0, 1]"),
])
def test_bad_input_is_named(needs, util, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan(needs, utilization=util)


def test_offered_load_and_goodput():
    demand = {"speech": {"thinker": 64, "talker": 400, "code2wav": 400}, "text": {"thinker": 128}}
    load = offered_load({"speech": 2.0, "text": 1.0}, demand)
    assert load == {"thinker": 256.0, "talker": 800.0, "code2wav": 800.0}
    caps = {"thinker": 200.0, "talker": 300.0, "code2wav": 900.0}
    assert goodput({"thinker": 1, "talker": 2, "code2wav": 1}, caps, demand["speech"]) == pytest.approx(1.5)
    assert goodput({}, caps, {}) == math.inf


# ------------------------------------------------------------------ properties

stage_needs = st.lists(
    st.builds(lambda i, load, cap, lo, span, gpus: N(f"s{i}", load, cap, lo, lo + span, gpus),
              st.integers(0, 10**6), st.floats(0, 1e4), st.floats(0.1, 1e3), st.integers(1, 3), st.integers(0, 6),
              st.integers(0, 2)),
    min_size=1, max_size=5, unique_by=lambda n: n.stage)
utilizations = st.floats(0.05, 1.0)


@settings(max_examples=300, deadline=None)
@given(stage_needs, st.integers(0, 30), st.integers(0, 30), utilizations)
def test_never_outside_bounds_or_budget(needs, max_replicas, max_gpus, util):
    budget = Budget(max_replicas, max_gpus)
    p = plan(needs, budget, util)
    for n in needs:
        assert n.min_replicas <= p.stages[n.stage].replicas <= n.max_replicas
        assert p.stages[n.stage].replicas <= p.stages[n.stage].need
        assert p.stages[n.stage].keep_down_to >= p.stages[n.stage].replicas
    mins = Budget(max_replicas, max_gpus).fits(sum(n.min_replicas for n in needs),
                                               sum(n.min_replicas * n.gpus for n in needs))
    if mins:  # validation refuses budgets below the minimums; within them the plan never exceeds one
        assert budget.fits(sum(p.replicas().values()), sum(p.stages[n.stage].replicas * n.gpus for n in needs))


@settings(max_examples=300, deadline=None)
@given(stage_needs, st.integers(0, 30), utilizations, st.floats(0, 1), st.floats(0, 1), st.floats(1, 3))
def test_a_measured_range_grows_no_more_and_keeps_no_less_than_the_estimate(needs, max_replicas, util, backlog,
                                                                              sure, held):
    """Planned for the load it surely has (at most the estimate) a stage gets no more replicas than for the
    estimate, and keeping for the load over its delay (at least the estimate) keeps no fewer; neither leaves the
    bounds or the budget, and a scale-down still stops at or above the plan."""
    plain = [replace(n, backlog=n.load * backlog) for n in needs]
    ranged = [replace(n, grow_load=n.load * sure, keep_load=n.load * held) for n in plain]
    a, b = plan(plain, Budget(max_replicas), util), plan(ranged, Budget(max_replicas), util)
    unlimited = plan(ranged, Budget(), util)
    for n in needs:
        assert unlimited.stages[n.stage].replicas <= plan(plain, Budget(), util).stages[n.stage].replicas
        assert unlimited.stages[n.stage].keep_down_to >= unlimited.stages[n.stage].replicas
        assert n.min_replicas <= b.stages[n.stage].replicas <= n.max_replicas
    if sum(n.min_replicas for n in needs) <= max_replicas or not max_replicas:
        assert not max_replicas or sum(b.replicas().values()) <= max_replicas
    assert all(a.stages[s].utilization == b.stages[s].utilization for s in a.stages if
               b.stages[s].replicas == a.stages[s].replicas)


@settings(max_examples=300, deadline=None)
@given(stage_needs, st.integers(0, 30), utilizations, st.floats(1.0, 10.0))
def test_monotone_in_load(needs, max_replicas, util, factor):
    """More of the same load never takes a replica from any stage (replica budget: the allocation order
    depends only on the ratios, which scaling keeps)."""
    scaled = [N(n.stage, n.load * factor, n.capacity, n.min_replicas, n.max_replicas) for n in needs]
    base = [N(n.stage, n.load, n.capacity, n.min_replicas, n.max_replicas) for n in needs]
    a, b = plan(base, Budget(max_replicas), util), plan(scaled, Budget(max_replicas), util)
    assert all(b.stages[s].replicas >= a.stages[s].replicas for s in a.stages)


@settings(max_examples=300, deadline=None)
@given(stage_needs, st.integers(0, 4), st.floats(1.0, 10.0), utilizations)
def test_unbounded_budget_each_stage_follows_its_own_load(needs, i, factor, util):
    i = min(i, len(needs) - 1)
    more = list(needs)
    more[i] = N(needs[i].stage, needs[i].load * factor, needs[i].capacity, needs[i].min_replicas,
                needs[i].max_replicas, needs[i].gpus)
    a, b = plan(needs, utilization=util), plan(more, utilization=util)
    assert b.stages[needs[i].stage].replicas >= a.stages[needs[i].stage].replicas
    assert all(b.stages[s].replicas == a.stages[s].replicas for s in a.stages if s != needs[i].stage)


@settings(max_examples=300, deadline=None)
@given(stage_needs, st.integers(1, 30), utilizations)
def test_the_bottleneck_gets_the_next_replica(needs, max_replicas, util):
    """One more replica in the budget goes to the most utilised stage still short of its need."""
    needs = [N(n.stage, n.load, n.capacity, n.min_replicas, n.max_replicas) for n in needs]
    if sum(n.min_replicas for n in needs) > max_replicas:
        return
    a, b = plan(needs, Budget(max_replicas), util), plan(needs, Budget(max_replicas + 1), util)
    short = [n for n in needs if a.stages[n.stage].replicas < a.stages[n.stage].need]
    grown = {s: b.stages[s].replicas - a.stages[s].replicas for s in a.stages}
    if not short:
        assert set(grown.values()) == {0}
        return
    top = max(short, key=lambda n: n.utilization(a.stages[n.stage].replicas)).stage
    assert grown == {s: int(s == top) for s in grown}
