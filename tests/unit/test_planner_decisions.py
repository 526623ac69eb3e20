"""The planner's decisions over time: up at once, down after the delay, no flapping, the budget held."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from omnistage.planner.decisions import REBALANCE_S, Change, StageScale, decide
from omnistage.planner.sizing import Budget, Plan, StageNeed, StagePlan, plan


def P(**stages):
    """A plan from stage=(replicas, keep_down_to, utilization)."""
    return Plan({s: StagePlan(s, r, k, r, u) for s, (r, k, u) in stages.items()}, None, False, "")


def run(state, plans, delays, budget=Budget(), gpus=None):
    """Feed (time, plan) pairs; returns the final state and every change made."""
    changes = []
    for now, p in plans:
        state, made = decide(state, p, now, delays, gpus, budget)
        changes += [(now, c) for c in made]
    return state, changes


def test_scale_up_is_immediate():
    state, changes = run({"talker": StageScale(1)}, [(0.0, P(talker=(3, 3, 0.9)))], {"talker": 60})
    assert state["talker"].replicas == 3
    assert changes == [(0.0, Change("talker", 1, 3))]


def test_scale_down_waits_for_its_delay_then_goes_to_the_most_asked_for():
    plans = [(0.0, P(a=(1, 1, 0.2))), (30.0, P(a=(2, 2, 0.5))), (59.0, P(a=(1, 1, 0.2))),
             (60.0, P(a=(1, 1, 0.2)))]
    state, changes = run({"a": StageScale(4)}, plans, {"a": 60})
    assert changes == [(60.0, Change("a", 4, 2))]  # at 30 s the plan wanted 2: the delay's most
    assert state["a"] == StageScale(2)


def test_a_plan_back_within_the_band_cancels_a_pending_scale_down():
    plans = [(0.0, P(a=(1, 1, 0.2))), (40.0, P(a=(3, 4, 0.7))), (70.0, P(a=(1, 1, 0.2))),
             (100.0, P(a=(1, 1, 0.2)))]
    state, changes = run({"a": StageScale(4)}, plans, {"a": 60})
    assert changes == []  # the count restarted at 70 s
    assert state["a"] == StageScale(4, 70.0, 1)


def test_within_the_band_nothing_changes():
    # needs 3, keeps 4: a stage at 3 or 4 stays
    for replicas in (3, 4):
        _, changes = run({"a": StageScale(replicas)}, [(t, P(a=(3, 4, 0.75))) for t in range(0, 600, 5)], {"a": 0})
        assert changes == []


def test_zero_delay_scales_down_at_once():
    _, changes = run({"a": StageScale(5)}, [(0.0, P(a=(2, 2, 0.3)))], {"a": 0})
    assert changes == [(0.0, Change("a", 5, 2))]


def test_a_moved_bottleneck_grows_as_the_old_one_gives_up_what_it_no_longer_needs():
    """Under a full budget the stage the bottleneck left gives a replica to the one it moved to once fewer
    have been enough for it for REBALANCE_S, before its own scale-down delay."""
    budget = Budget(max_replicas=5)
    start = {"talker": StageScale(3), "code2wav": StageScale(2)}
    moved = P(talker=(2, 2, 0.6), code2wav=(3, 3, 1.3))
    state, changes = run(start, [(0.0, moved), (REBALANCE_S - 1, moved), (REBALANCE_S, moved)],
                         {"talker": 30, "code2wav": 30}, budget)
    assert changes == [(REBALANCE_S, Change("talker", 3, 2)), (REBALANCE_S, Change("code2wav", 2, 3))]
    assert sum(s.replicas for s in state.values()) == 5


def test_no_stage_gives_up_a_replica_it_still_needs():
    budget = Budget(max_replicas=5)
    start = {"talker": StageScale(3), "code2wav": StageScale(2)}
    both = P(talker=(3, 3, 0.9), code2wav=(3, 3, 1.3))
    _, changes = run(start, [(t, both) for t in (0.0, 10.0, 60.0)], {"talker": 30, "code2wav": 30}, budget)
    assert changes == []


def test_scale_ups_share_a_budget_most_loaded_first():
    budget = Budget(max_gpus=4)
    state, changes = run({"a": StageScale(1), "b": StageScale(1)}, [(0.0, P(a=(3, 3, 1.2), b=(2, 2, 1.5)))],
                         {}, budget, gpus={"a": 1, "b": 1})
    assert [c for _, c in changes] == [Change("a", 1, 2), Change("b", 1, 2)]


def test_a_steady_load_changes_once():
    state, changes = run({"a": StageScale(1)}, [(float(t), plan([StageNeed("a", 130.0, 10.0, 1, 100)]))
                                                for t in range(300)], {"a": 30.0})
    assert changes == [(0.0, Change("a", 1, 17))]


@settings(max_examples=100, deadline=None)
@given(st.floats(1.0, 1e4), st.floats(1.0, 100.0), st.integers(0, 2**32 - 1))
def test_a_noisy_steady_load_never_scales_down(load, capacity, seed):
    """A stage whose load is measured with +-5% noise never loses a replica: the band between adding (at
    0.8) and removing (below 0.68) is wider than the noise; a sample at the top of the noise may add one
    (scale-ups are immediate: smoothing is the load estimate's), never past the need at the top."""
    rng = random.Random(seed)
    state = {"a": StageScale(1)}
    changes = []
    for tick in range(300):
        noisy = load * (1 + rng.uniform(-0.05, 0.05))
        p = plan([StageNeed("a", noisy, capacity, 1, 1000)], utilization=0.8)
        state, made = decide(state, p, float(tick), {"a": 30.0})
        changes += made
    assert all(c.after > c.before for c in changes), changes
    assert state["a"].replicas <= StageNeed("a", load * 1.05, capacity, 1, 1000).replicas_for(0.8)


def test_under_a_full_budget_a_stage_above_its_allocation_gives_up_replicas_it_still_could_use():
    """The budget's allocation is the plan: A (load 300) holds 4 of 6 while B (load 600) has 2; A goes to 2
    and B to 4, A's replicas moving once A has been over its allocation for REBALANCE_S."""
    needs = [StageNeed("a", 300, 100, 1, 8), StageNeed("b", 600, 100, 1, 8)]
    p = plan(needs, Budget(max_replicas=6))
    assert p.replicas() == {"a": 2, "b": 4} and p.stages["a"].keep_down_to == 2
    state, changes = run({"a": StageScale(4), "b": StageScale(2)},
                         [(t, p) for t in (0.0, REBALANCE_S, 2 * REBALANCE_S)], {"a": 60, "b": 60},
                         Budget(max_replicas=6))
    assert {s: sc.replicas for s, sc in state.items()} == {"a": 2, "b": 4}
    assert all(t >= REBALANCE_S for t, _ in changes)
