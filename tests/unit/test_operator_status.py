"""Conditions and status: transitions are recorded only on flips, and an unchanged world gives an
unchanged status (so the operator writes nothing)."""

from __future__ import annotations

import pytest

from omnistage_operator.conditions import condition, get_condition, set_condition
from omnistage_operator.rollout import RolloutPlan
from omnistage_operator.status import build_status, invalid_status, status_patch, unit_counts
from omnistage_operator.vocabulary import (R_ALL_READY, R_AS_EXPECTED, R_INVALID_SPEC, R_NOT_READY,
                                           R_PROGRESS_DEADLINE, R_REPLICA_FAILURE, R_ROLLING_OUT,
                                           R_ROLLOUT_COMPLETE, R_SCALED_TO_ZERO, R_STAGE_UNAVAILABLE)

T0, T1 = "2024-01-01T00:00:00Z", "2024-01-01T00:05:00Z"
IDLE = RolloutPlan((), (), ())


# ------------------------------------------------------------------------------- conditions

def test_set_condition_adds_with_time():
    conds = []
    assert set_condition(conds, condition("Ready", True, "AllStagesReady", "ok"), T0)
    assert conds == [{"type": "Ready", "status": "True", "reason": "AllStagesReady", "message": "ok",
                      "lastTransitionTime": T0}]


@pytest.mark.parametrize("new, changed, time", [
    (condition("Ready", True, "AllStagesReady", "ok"), False, T0),          # same: nothing
    (condition("Ready", True, "AllStagesReady", "other words"), True, T0),  # message only: no flip
    (condition("Ready", True, "Other", "ok"), True, T0),                    # reason only: no flip
    (condition("Ready", False, "StagesNotReady", "x"), True, T1),           # flip: new time
    (condition("Ready", "Unknown", "Lost", "x"), True, T1),
])
def test_set_condition_moves_time_only_on_flips(new, changed, time):
    conds = [{**condition("Ready", True, "AllStagesReady", "ok"), "lastTransitionTime": T0}]
    assert set_condition(conds, new, T1) is changed
    assert conds[0]["lastTransitionTime"] == time
    assert conds[0]["reason"] == new["reason"]


def test_set_condition_keeps_other_types():
    conds = [{**condition("Ready", True, "A", ""), "lastTransitionTime": T0}]
    set_condition(conds, condition("Degraded", False, "AsExpected", ""), T1)
    assert [c["type"] for c in conds] == ["Ready", "Degraded"]
    assert get_condition(conds, "Ready")["lastTransitionTime"] == T0


# ----------------------------------------------------------------------------------- status

def live(ready, updated=None):
    return {"status": {"readyReplicas": ready, "updatedReplicas": ready if updated is None else updated}}


def status(old=None, counts=None, orch=(1, 1), plan=IDLE, deployments=None, now=T0):
    counts = counts or {"thinker": (1, 1), "talker": (1, 1), "code2wav": (1, 1)}
    stages = {s: unit_counts(want, live(have)) for s, (want, have) in counts.items()}
    return build_status(old, generation=3, stages=stages, orchestrator=unit_counts(orch[0], live(orch[1])),
                        deployments=deployments or {}, plan=plan, endpoint="p-orchestrator.ns.svc:50051", now=now)


def cond(st, type_):
    return get_condition(st["conditions"], type_)


def test_all_ready():
    st = status()
    assert (cond(st, "Ready")["status"], cond(st, "Ready")["reason"]) == ("True", R_ALL_READY)
    assert (cond(st, "Progressing")["status"], cond(st, "Progressing")["reason"]) == ("False", R_ROLLOUT_COMPLETE)
    assert (cond(st, "Degraded")["status"], cond(st, "Degraded")["reason"]) == ("False", R_AS_EXPECTED)
    assert st["observedGeneration"] == 3 and st["stagesReady"] == "3/3"
    assert st["stages"]["talker"] == {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}
    assert st["orchestratorEndpoint"] == "p-orchestrator.ns.svc:50051"
    assert all(c["observedGeneration"] == 3 for c in st["conditions"])


def test_starting_up_is_not_degraded():
    st = status(counts={"thinker": (1, 0), "talker": (1, 1), "code2wav": (1, 0)},
                plan=RolloutPlan((), (), ("thinker", "code2wav")))
    assert cond(st, "Ready")["reason"] == R_NOT_READY
    assert "thinker 0/1 ready" in cond(st, "Ready")["message"]
    assert cond(st, "Degraded")["status"] == "False"
    assert cond(st, "Progressing")["status"] == "True"
    assert st["stagesReady"] == "1/3"


def test_losing_a_replica_after_ready_is_degraded_until_back():
    ready = status()
    lost = status(old=ready, counts={"thinker": (1, 1), "talker": (1, 0), "code2wav": (1, 1)}, now=T1)
    assert cond(lost, "Ready")["status"] == "False" and cond(lost, "Ready")["lastTransitionTime"] == T1
    assert (cond(lost, "Degraded")["status"], cond(lost, "Degraded")["reason"]) == ("True", R_STAGE_UNAVAILABLE)
    still = status(old=lost, counts={"thinker": (1, 1), "talker": (1, 0), "code2wav": (1, 1)}, now=T1)
    assert cond(still, "Degraded")["status"] == "True"   # stays degraded while short
    back = status(old=lost, now=T1)
    assert cond(back, "Ready")["status"] == "True" and cond(back, "Degraded")["status"] == "False"


def test_orchestrator_counts_for_ready():
    st = status(orch=(1, 0))
    assert cond(st, "Ready")["status"] == "False"
    assert "orchestrator 0/1 ready" in cond(st, "Ready")["message"]


def test_scaled_to_zero():
    st = status(counts={"thinker": (0, 0), "talker": (1, 1), "code2wav": (1, 1)})
    assert (cond(st, "Ready")["status"], cond(st, "Ready")["reason"]) == ("False", R_SCALED_TO_ZERO)


def test_rolling_out_message_names_units():
    st = status(plan=RolloutPlan(("talker",), ("code2wav",), ("talker",)))
    p = cond(st, "Progressing")
    assert (p["status"], p["reason"]) == ("True", R_ROLLING_OUT)
    assert p["message"] == "rolling out: talker; waiting their turn: code2wav"
    assert cond(st, "Ready")["status"] == "True"   # a surge rollout keeps serving


def test_deployment_failures_are_degraded():
    stuck = {"status": {"conditions": [{"type": "Progressing", "status": "False",
                                        "reason": "ProgressDeadlineExceeded"}]}}
    failing = {"status": {"conditions": [{"type": "ReplicaFailure", "status": "True"}]}}
    assert cond(status(deployments={"talker": stuck}), "Degraded")["reason"] == R_PROGRESS_DEADLINE
    assert cond(status(deployments={"talker": failing}), "Degraded")["reason"] == R_REPLICA_FAILURE


def test_same_world_same_status_no_patch():
    first = status()
    again = status(old=first, now=T1)
    assert again == first
    assert status_patch(first, again) is None


def test_status_patch_removes_stages_that_went_away():
    old = status()
    new = status(old=old, counts={"thinker": (1, 1), "talker": (1, 1)})
    patch = status_patch(old, new)
    assert patch["stages"]["code2wav"] is None
    assert patch["stages"]["talker"] == new["stages"]["talker"]


def test_invalid_spec_keeps_counts_and_says_why():
    old = status()
    bad = invalid_status(old, generation=4, errors=['spec.topology.stages[1].inputs[0]: unknown stage "x"'], now=T1)
    r = cond(bad, "Ready")
    assert (r["status"], r["reason"]) == ("False", R_INVALID_SPEC)
    assert 'unknown stage "x"' in r["message"] and r["lastTransitionTime"] == T1
    assert cond(bad, "Progressing")["reason"] == R_INVALID_SPEC
    assert bad["observedGeneration"] == 4 and bad["stages"] == old["stages"]
    again = invalid_status(bad, generation=4, errors=['spec.topology.stages[1].inputs[0]: unknown stage "x"'],
                           now="2030-01-01T00:00:00Z")
    assert status_patch(bad, again) is None


def test_invalid_status_on_a_new_object():
    st = invalid_status(None, generation=1, errors=["metadata.name: bad"], now=T0)
    assert [c["type"] for c in st["conditions"]] == ["Ready", "Progressing"]
    assert st["observedGeneration"] == 1


def test_long_messages_are_cut():
    st = invalid_status(None, generation=1, errors=["x" * 5000], now=T0)
    assert len(cond(st, "Ready")["message"]) == 1000
