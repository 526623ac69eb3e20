"""Rollout decisions, as a table: which Deployments are written in this pass, which wait their turn."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from omnistage_operator.pipeline_object import parse
from omnistage_operator.rollout import (
    ONE_STAGE_AT_A_TIME,
    PARALLEL,
    RolloutPlan,
    UnitState,
    deployment_rolled_out,
    plan_rollout,
    rollout_order,
)
from omnistage_operator.vocabulary import ORCHESTRATOR

from ..conftest import EXAMPLES

ORDER = ("thinker", "talker", "code2wav", "orchestrator")


def U(name, state):
    """missing | synced (in sync, rolled out) | rolling (in sync, not rolled out) | changed (out of sync,
    rolled out) | changed-rolling (out of sync, not rolled out)"""
    return {
        "missing": UnitState(name, exists=False),
        "synced": UnitState(name, exists=True, in_sync=True, rolled_out=True),
        "rolling": UnitState(name, exists=True, in_sync=True, rolled_out=False),
        "changed": UnitState(name, exists=True, in_sync=False, rolled_out=True),
        "changed-rolling": UnitState(name, exists=True, in_sync=False, rolled_out=False),
    }[state]


def units(**states):
    return [U(name, s) for name, s in states.items()]


S = dict(thinker="synced", talker="synced", code2wav="synced", orchestrator="synced")

# (id, strategy, states, order, apply, waiting, progressing)
TABLE = [
    ("first creation: everything at once", ONE_STAGE_AT_A_TIME,
     dict(thinker="missing", talker="missing", code2wav="missing", orchestrator="missing"), ORDER,
     ("thinker", "talker", "code2wav", "orchestrator"), (), True),
    ("first creation, parallel", PARALLEL,
     dict(thinker="missing", talker="missing", code2wav="missing", orchestrator="missing"), ORDER,
     ("thinker", "talker", "code2wav", "orchestrator"), (), True),
    ("all in sync and rolled out: nothing to do", ONE_STAGE_AT_A_TIME, S, ORDER, (), (), False),
    ("all in sync, parallel: nothing to do", PARALLEL, S, ORDER, (), (), False),
    ("one changed stage rolls alone", ONE_STAGE_AT_A_TIME, {**S, "talker": "changed"}, ORDER,
     ("talker",), (), True),
    ("two changed: first in data-flow order goes, second waits", ONE_STAGE_AT_A_TIME,
     {**S, "talker": "changed", "code2wav": "changed"}, ORDER, ("talker",), ("code2wav",), True),
    ("two changed, explicit order puts code2wav first", ONE_STAGE_AT_A_TIME,
     {**S, "talker": "changed", "code2wav": "changed"}, ("code2wav", "thinker", "talker", "orchestrator"),
     ("code2wav",), ("talker",), True),
    ("two changed, parallel: both go", PARALLEL, {**S, "talker": "changed", "code2wav": "changed"}, ORDER,
     ("talker", "code2wav"), (), True),
    ("second waits while the first is still rolling", ONE_STAGE_AT_A_TIME,
     {**S, "talker": "rolling", "code2wav": "changed"}, ORDER, (), ("code2wav",), True),
    ("rolling one is done: the waiting one goes", ONE_STAGE_AT_A_TIME,
     {**S, "talker": "synced", "code2wav": "changed"}, ORDER, ("code2wav",), (), True),
    ("a stage changed again while rolling is written again", ONE_STAGE_AT_A_TIME,
     {**S, "talker": "changed-rolling"}, ORDER, ("talker",), (), True),
    ("changed again while rolling, another waits", ONE_STAGE_AT_A_TIME,
     {**S, "talker": "changed-rolling", "thinker": "changed"}, ORDER, ("talker",), ("thinker",), True),
    ("a stage short of ready replicas blocks others' changes", ONE_STAGE_AT_A_TIME,
     {**S, "thinker": "rolling", "code2wav": "changed"}, ORDER, (), ("code2wav",), True),
    ("a stage short of ready replicas does not block parallel", PARALLEL,
     {**S, "thinker": "rolling", "code2wav": "changed"}, ORDER, ("code2wav",), (), True),
    ("a deleted Deployment is put back at once even while another rolls", ONE_STAGE_AT_A_TIME,
     {**S, "talker": "rolling", "code2wav": "missing"}, ORDER, ("code2wav",), (), True),
    ("a deleted Deployment blocks a changed one in this pass", ONE_STAGE_AT_A_TIME,
     {**S, "talker": "missing", "code2wav": "changed"}, ORDER, ("talker",), ("code2wav",), True),
    ("the orchestrator rolls after the stages", ONE_STAGE_AT_A_TIME,
     {**S, "orchestrator": "changed", "thinker": "changed"}, ORDER, ("thinker",), ("orchestrator",), True),
    ("the orchestrator alone changed", ONE_STAGE_AT_A_TIME, {**S, "orchestrator": "changed"}, ORDER,
     ("orchestrator",), (), True),
    ("all three changed: one at a time, in order", ONE_STAGE_AT_A_TIME,
     {**S, "thinker": "changed", "talker": "changed", "code2wav": "changed"}, ORDER,
     ("thinker",), ("talker", "code2wav"), True),
    ("stages not in the order list go after it, by name", ONE_STAGE_AT_A_TIME,
     {**S, "zeta": "changed", "alpha": "changed"}, ORDER, ("alpha",), ("zeta",), True),
    ("only rolling, nothing changed: progressing, nothing written", ONE_STAGE_AT_A_TIME,
     {**S, "code2wav": "rolling"}, ORDER, (), (), True),
    ("two rolling (first start-up), one changed meanwhile", ONE_STAGE_AT_A_TIME,
     {**S, "thinker": "rolling", "talker": "changed-rolling"}, ORDER, ("talker",), (), True),
    ("missing and changed, parallel: both", PARALLEL, {**S, "thinker": "missing", "talker": "changed"}, ORDER,
     ("thinker", "talker"), (), True),
]


@pytest.mark.parametrize("strategy, states, order, apply, waiting, progressing", [t[1:] for t in TABLE],
                         ids=[t[0] for t in TABLE])
def test_plan(strategy, states, order, apply, waiting, progressing):
    plan = plan_rollout(units(**states), strategy, order)
    assert plan.apply == apply
    assert plan.waiting == waiting
    assert plan.progressing is progressing


def test_in_progress_lists_busy_and_applied_units():
    plan = plan_rollout(units(**{**S, "talker": "rolling", "code2wav": "changed"}), ONE_STAGE_AT_A_TIME, ORDER)
    assert plan.in_progress == ("talker",)
    plan = plan_rollout(units(**{**S, "code2wav": "changed"}), ONE_STAGE_AT_A_TIME, ORDER)
    assert plan.in_progress == ("code2wav",)


STATES = st.sampled_from(["missing", "synced", "rolling", "changed", "changed-rolling"])


@given(st.fixed_dictionaries({n: STATES for n in ORDER}), st.sampled_from([ONE_STAGE_AT_A_TIME, PARALLEL]))
def test_invariants(states, strategy):
    plan = plan_rollout(units(**states), strategy, ORDER)
    needs_write = {n for n, s in states.items() if s in ("missing", "changed", "changed-rolling")}
    # Every unit that needs a write is written now or waits; nothing in sync is written.
    assert set(plan.apply) | set(plan.waiting) == needs_write
    assert not set(plan.apply) & set(plan.waiting)
    # A missing Deployment never waits.
    assert {n for n, s in states.items() if s == "missing"} <= set(plan.apply)
    if strategy == PARALLEL:
        assert plan.waiting == ()
    else:
        # One at a time: among units that exist, at most one out-of-sync unit starts moving while
        # everything else is settled.
        started = [n for n in plan.apply if states[n] == "changed"]
        assert len(started) <= 1
        if started:
            assert all(states[n] in ("synced", "changed") for n in ORDER)
    assert plan.progressing == bool(needs_write or any(s == "rolling" for s in states.values()))


def test_rollout_order_from_the_pipeline():
    doc = yaml.safe_load((EXAMPLES / "qwen3-omni-tiny.yaml").read_text())
    assert rollout_order(parse(doc)) == ("thinker", "talker", "code2wav", ORCHESTRATOR)
    doc["spec"]["deployment"]["rollout"]["order"] = ["code2wav"]
    assert rollout_order(parse(doc)) == ("code2wav", "thinker", "talker", ORCHESTRATOR)


def dep(generation=2, observed=2, replicas=2, updated=2, total=2, available=2, conditions=()):
    return {"metadata": {"generation": generation}, "spec": {"replicas": replicas},
            "status": {"observedGeneration": observed, "updatedReplicas": updated, "replicas": total,
                       "availableReplicas": available, "conditions": list(conditions)}}


@pytest.mark.parametrize("obj, done, why", [
    (None, False, "not created yet"),
    (dep(), True, "rolled out"),
    (dep(observed=1), False, "observe"),
    (dep(updated=1), False, "1 of 2 replicas updated"),
    (dep(total=3), False, "1 old replicas pending termination"),
    (dep(available=1), False, "1 of 2 updated replicas available"),
    (dep(replicas=0, updated=0, total=0, available=0), True, "rolled out"),
    (dep(conditions=[{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}]), False,
     "deadline"),
    ({"metadata": {"generation": 1}, "spec": {"replicas": 1}}, False, "observe"),
])
def test_deployment_rolled_out(obj, done, why):
    got, message = deployment_rolled_out(obj)
    assert got is done
    assert why in message


def test_plan_is_a_value():
    assert plan_rollout([], ONE_STAGE_AT_A_TIME, ORDER) == RolloutPlan((), (), ())
