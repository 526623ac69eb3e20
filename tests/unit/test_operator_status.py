"""Conditions and status: transitions are recorded only on flips, and an unchanged world gives an
unchanged status (so the operator writes nothing); a unit short of replicas carries its pods' last
failure (termination message, exit code, reason) and Degraded names it, bounded."""

from __future__ import annotations

import pytest

from omnistage_operator import vocabulary
from omnistage_operator.conditions import condition, get_condition, set_condition
from omnistage_operator.rollout import RolloutPlan
from omnistage_operator.status import (
    MAX_MESSAGE,
    MAX_TERMINATION_MESSAGE,
    build_status,
    failure_summary,
    invalid_status,
    last_failure,
    new_failures,
    pods_by_unit,
    status_patch,
    unit_counts,
)

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
    assert (cond(st, "Ready")["status"], cond(st, "Ready")["reason"]) == ("True", vocabulary.R_ALL_READY)
    assert (cond(st, "Progressing")["status"], cond(st, "Progressing")["reason"]) == (
        "False", vocabulary.R_ROLLOUT_COMPLETE)
    assert (cond(st, "Degraded")["status"], cond(st, "Degraded")["reason"]) == ("False", vocabulary.R_AS_EXPECTED)
    assert st["observedGeneration"] == 3 and st["stagesReady"] == "3/3"
    assert st["stages"]["talker"] == {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}
    assert st["orchestratorEndpoint"] == "p-orchestrator.ns.svc:50051"
    assert all(c["observedGeneration"] == 3 for c in st["conditions"])


def test_starting_up_is_not_degraded():
    st = status(counts={"thinker": (1, 0), "talker": (1, 1), "code2wav": (1, 0)},
                plan=RolloutPlan((), (), ("thinker", "code2wav")))
    assert cond(st, "Ready")["reason"] == vocabulary.R_NOT_READY
    assert "thinker 0/1 ready" in cond(st, "Ready")["message"]
    assert cond(st, "Degraded")["status"] == "False"
    assert cond(st, "Progressing")["status"] == "True"
    assert st["stagesReady"] == "1/3"


def test_losing_a_replica_after_ready_is_degraded_until_back():
    ready = status()
    lost = status(old=ready, counts={"thinker": (1, 1), "talker": (1, 0), "code2wav": (1, 1)}, now=T1)
    assert cond(lost, "Ready")["status"] == "False" and cond(lost, "Ready")["lastTransitionTime"] == T1
    assert (cond(lost, "Degraded")["status"], cond(lost, "Degraded")["reason"]) == (
        "True", vocabulary.R_STAGE_UNAVAILABLE)
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
    assert (cond(st, "Ready")["status"], cond(st, "Ready")["reason"]) == ("False", vocabulary.R_SCALED_TO_ZERO)


def test_rolling_out_message_names_units():
    st = status(plan=RolloutPlan(("talker",), ("code2wav",), ("talker",)))
    p = cond(st, "Progressing")
    assert (p["status"], p["reason"]) == ("True", vocabulary.R_ROLLING_OUT)
    assert p["message"] == "rolling out: talker; waiting their turn: code2wav"
    assert cond(st, "Ready")["status"] == "True"   # a surge rollout keeps serving


def test_deployment_failures_are_degraded():
    stuck = {"status": {"conditions": [{"type": "Progressing", "status": "False",
                                        "reason": "ProgressDeadlineExceeded"}]}}
    failing = {"status": {"conditions": [{"type": "ReplicaFailure", "status": "True"}]}}
    assert cond(status(deployments={"talker": stuck}), "Degraded")["reason"] == vocabulary.R_PROGRESS_DEADLINE
    assert cond(status(deployments={"talker": failing}), "Degraded")["reason"] == vocabulary.R_REPLICA_FAILURE


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
    assert (r["status"], r["reason"]) == ("False", vocabulary.R_INVALID_SPEC)
    assert 'unknown stage "x"' in r["message"] and r["lastTransitionTime"] == T1
    assert cond(bad, "Progressing")["reason"] == vocabulary.R_INVALID_SPEC
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


# ------------------------------------------------------------------ why replicas are missing

LINE = ("/etc/omnistage/pipeline.yaml: spec.topology.stages[0].model (llm): /models/qwen2-tiny: "
        "no config.json (not a checkpoint)")


def pod(name, *, stage="talker", ready=False, state=None, last=None, deleting=False, component="stage"):
    labels = {"omnistage.io/pipeline": "p", "omnistage.io/component": component}
    if component == "stage":
        labels["omnistage.io/stage"] = stage
    meta = {"name": name, "labels": labels, **({"deletionTimestamp": T1} if deleting else {})}
    cs = {"name": component, "ready": ready, "restartCount": 1 if last else 0,
          "state": state or {"running": {"startedAt": T0}}, "lastState": last or {}}
    return {"metadata": meta, "status": {"containerStatuses": [cs]}}


def ended(code=2, message=LINE, at=T0, reason="Error"):
    return {"terminated": {"exitCode": code, "reason": reason, "message": message, "startedAt": T0,
                           "finishedAt": at}}


CRASH_LOOP = {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s restarting failed container"}}


def failing_status(pods, counts=None, old=None):
    counts = counts or {"thinker": (1, 1), "talker": (1, 0), "code2wav": (1, 1)}
    by_unit = pods_by_unit(pods)
    stages = {s: unit_counts(want, live(have), by_unit.get(s, ())) for s, (want, have) in counts.items()}
    return build_status(old, generation=3, stages=stages,
                        orchestrator=unit_counts(1, live(1), by_unit.get("orchestrator", ())),
                        deployments={}, plan=IDLE, endpoint="e", now=T0)


def test_a_terminated_container_gives_the_stage_its_last_failure_and_degraded_names_it():
    st = failing_status([pod("p-talker-1", state=CRASH_LOOP, last=ended())])
    assert st["stages"]["talker"]["lastFailure"] == {
        "pod": "p-talker-1", "container": "stage", "exitCode": 2, "reason": "CrashLoopBackOff",
        "message": LINE, "finishedAt": T0}
    d = cond(st, "Degraded")
    assert (d["status"], d["reason"]) == ("True", vocabulary.R_STAGE_FAILING)
    assert d["message"] == f"talker: exit code 2, CrashLoopBackOff: {LINE}"
    assert "lastFailure" not in st["stages"]["thinker"]
    assert cond(st, "Ready")["reason"] == vocabulary.R_NOT_READY


@pytest.mark.parametrize("cs_state, last, want", [
    (ended(), {}, {"exitCode": 2, "reason": "Error"}),                                  # just exited
    ({"running": {"startedAt": T1}}, ended(), {"exitCode": 2, "reason": "Error"}),     # restarted, loading
    (ended(0, "", reason="Completed"), ended(137, "", reason="OOMKilled"),             # the last non-zero exit
     {"exitCode": 137, "reason": "OOMKilled"}),
    ({"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image \"x\""}}, {},
     {"reason": "ImagePullBackOff", "message": "Back-off pulling image \"x\""}),       # never ran
])
def test_what_counts_as_a_failure(cs_state, last, want):
    (failure,) = [f for f in [last_failure([pod("a", state=cs_state, last=last)])] if f]
    assert {k: failure[k] for k in want} == want
    if "exitCode" not in want:
        assert "exitCode" not in failure and "finishedAt" not in failure


@pytest.mark.parametrize("pods", [
    [pod("a")],                                                                  # running, not ready yet
    [pod("a", state={"waiting": {"reason": "ContainerCreating"}})],              # on its way up
    [pod("a", ready=True, last=ended())],                                        # crashed once, serves now
    [pod("a", state=CRASH_LOOP, last=ended(), deleting=True)],                   # on its way out
    [pod("a", state=ended(0, "", reason="Completed"))],                          # a clean exit
])
def test_no_failure(pods):
    assert last_failure(pods) is None


def test_the_newest_failure_wins_and_ties_are_stable():
    older = pod("a", state=CRASH_LOOP, last=ended(message="old news", at=T0))
    newer = pod("b", state=CRASH_LOOP, last=ended(message=LINE, at=T1))
    assert last_failure([older, newer])["message"] == LINE == last_failure([newer, older])["message"]
    same = [pod(n, state=CRASH_LOOP, last=ended(at=T0)) for n in ("b", "a", "c")]
    assert last_failure(same)["pod"] == last_failure(list(reversed(same)))["pod"] == "c"


def test_no_failure_is_looked_for_when_every_replica_is_ready():
    st = failing_status([pod("p-talker-1", state=CRASH_LOOP, last=ended())],
                        counts={"thinker": (1, 1), "talker": (1, 1), "code2wav": (1, 1)})
    assert st["stages"]["talker"] == {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}
    assert (cond(st, "Degraded")["status"], cond(st, "Ready")["status"]) == ("False", "True")


def test_pods_go_to_their_unit():
    pods = [pod("t", stage="talker"), pod("o", component="orchestrator"), pod("c", stage="code2wav")]
    assert {u: [p["metadata"]["name"] for p in ps] for u, ps in pods_by_unit(pods).items()} == {
        "talker": ["t"], "orchestrator": ["o"], "code2wav": ["c"]}


def test_the_orchestrator_failing_is_reported_too():
    st = build_status(None, generation=1, stages={}, deployments={}, plan=IDLE, endpoint="e", now=T0,
                      orchestrator=unit_counts(1, live(0), [pod("o", component="orchestrator", state=CRASH_LOOP,
                                                                 last=ended(1, "boom"))]))
    assert cond(st, "Degraded")["message"] == "orchestrator: exit code 1, CrashLoopBackOff: boom"


def test_long_and_many_line_messages_are_bounded_keeping_the_end():
    tail = "ValueError: the real reason"
    log_tail = "\n".join(["Traceback (most recent call last):"] + [f'  File "x.py", line {i}' for i in range(80)]
                         + [tail])
    pods = [pod(f"{s}-1", stage=s, state=CRASH_LOOP, last=ended(1, log_tail + "x" * 6000 + "\n" + tail))
            for s in ("thinker", "talker", "code2wav")]
    st = failing_status(pods, counts={"thinker": (1, 0), "talker": (1, 0), "code2wav": (1, 0)})
    failure = st["stages"]["talker"]["lastFailure"]
    assert len(failure["message"]) == MAX_TERMINATION_MESSAGE and failure["message"].endswith(tail)
    message = cond(st, "Degraded")["message"]
    assert len(message) <= MAX_MESSAGE and "\n" not in message
    parts = message.split("; ")
    assert [p.split(":")[0] for p in parts] == ["thinker", "talker", "code2wav"]   # every stage is named
    assert all(p.endswith(f"| {tail}") for p in parts)


def test_failure_summary_within_a_tiny_limit():
    s = failure_summary("talker", {"exitCode": 2, "reason": "Error", "message": "x" * 500}, limit=40)
    assert len(s) == 40 and s.startswith("talker: exit code 2, Error: …")


def test_a_failure_comes_and_goes_with_patches_that_remove_it():
    ok = status(counts={"thinker": (1, 1), "talker": (1, 0), "code2wav": (1, 1)})
    crashing = failing_status([pod("p-talker-1", state=CRASH_LOOP, last=ended())], old=ok)
    assert status_patch(ok, crashing)["stages"]["talker"]["lastFailure"]["message"] == LINE
    # Waiting for an image now: the old exit code and time must not linger in the merged object.
    pulling = failing_status([pod("p-talker-2", state={"waiting": {"reason": "ImagePullBackOff"}})], old=crashing)
    patch = status_patch(crashing, pulling)["stages"]["talker"]["lastFailure"]
    assert patch["exitCode"] is None and patch["finishedAt"] is None and patch["message"] is None
    assert patch["reason"] == "ImagePullBackOff"
    back = status(old=pulling, now=T1)
    assert status_patch(pulling, back)["stages"]["talker"]["lastFailure"] is None
    assert cond(back, "Degraded")["status"] == "False"


def test_one_event_per_new_failure_message_not_per_restart():
    first = failing_status([pod("p-talker-1", state=CRASH_LOOP, last=ended(at=T0))])
    assert new_failures(None, first) == [f"talker: exit code 2, CrashLoopBackOff: {LINE}"]
    restarted = failing_status([pod("p-talker-1", state={"running": {"startedAt": T1}}, last=ended(at=T1))],
                               old=first)
    assert status_patch(first, restarted) is not None and new_failures(first, restarted) == []
    other = failing_status([pod("p-talker-1", state=CRASH_LOOP, last=ended(message="something else"))],
                           old=restarted)
    assert new_failures(restarted, other) == ["talker: exit code 2, CrashLoopBackOff: something else"]
    waiting = failing_status([pod("p-talker-2", state={"waiting": {"reason": "ImagePullBackOff"}})])
    assert new_failures(None, waiting) == ["talker: ImagePullBackOff"]   # on the pipeline too, once
    again = failing_status([pod("p-talker-2", state={"waiting": {"reason": "ImagePullBackOff", "message": "x"}})],
                           old=waiting)
    assert new_failures(waiting, again) == []   # the same reason: no second Event


def unplaced(name, message="0/1 nodes are available: 1 Insufficient cpu.", stage="talker"):
    p = pod(name, stage=stage)
    p["status"] = {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}]}
    return p


def test_a_pod_the_scheduler_cannot_place_is_the_stages_failure_with_its_message_and_one_event():
    st = failing_status([unplaced("p-talker-1")])
    assert st["stages"]["talker"]["lastFailure"] == {
        "pod": "p-talker-1", "reason": "Unschedulable", "message": "0/1 nodes are available: 1 Insufficient cpu."}
    d = cond(st, "Degraded")
    assert (d["status"], d["reason"]) == ("True", vocabulary.R_STAGE_FAILING)
    assert d["message"] == "talker: Unschedulable: 0/1 nodes are available: 1 Insufficient cpu."
    assert new_failures(None, st) == [d["message"]]
    # the scheduler's counts change as nodes come and go: still the same failure, no second Event
    later = failing_status([unplaced("p-talker-1", "0/2 nodes are available: 2 Insufficient cpu.")], old=st)
    assert new_failures(st, later) == [] and "0/2 nodes" in later["stages"]["talker"]["lastFailure"]["message"]


def test_an_init_container_that_fails_is_the_stages_failure():
    p = pod("p-talker-1")
    p["status"]["initContainerStatuses"] = [{"name": "fetch-model", "ready": False, "restartCount": 2,
                                             "state": CRASH_LOOP, "lastState": ended(1, "401 Unauthorized")}]
    p["status"]["containerStatuses"][0]["state"] = {"waiting": {"reason": "PodInitializing"}}
    failure = last_failure([p])
    assert (failure["container"], failure["exitCode"], failure["message"]) == ("fetch-model", 1, "401 Unauthorized")
    done = pod("p-talker-2")   # an init container that finished is no failure
    done["status"]["initContainerStatuses"] = [{"name": "fetch-model", "ready": True,
                                                "state": ended(0, "", reason="Completed")}]
    assert last_failure([done]) is None


def test_a_status_with_a_failure_is_the_modelled_one():
    from .test_crd import SCHEMA, Validator, to_json_schema, undeclared
    st = failing_status([pod("p-talker-1", state=CRASH_LOOP, last=ended()), unplaced("c", stage="code2wav"),
                         pod("o", component="orchestrator", state={"waiting": {"reason": "ErrImagePull"}})],
                        counts={"thinker": (1, 1), "talker": (1, 0), "code2wav": (1, 0)})
    assert st["stages"]["code2wav"]["lastFailure"]["reason"] == "Unschedulable"
    node = SCHEMA["properties"]["status"]
    assert "lastFailure" in st["stages"]["talker"]
    assert list(Validator(to_json_schema(node)).iter_errors(st)) == [] and undeclared(node, st) == []


def test_a_pull_flapping_between_its_two_reasons_is_one_event_and_a_gated_pod_is_no_failure():
    pulling = failing_status([pod("p-talker-2", state={"waiting": {"reason": "ErrImagePull", "message": "m"}})])
    backoff = failing_status([pod("p-talker-2", state={"waiting": {"reason": "ImagePullBackOff", "message": "m"}})],
                             old=pulling)
    again = failing_status([pod("p-talker-2", state={"waiting": {"reason": "ErrImagePull", "message": "m"}})],
                           old=backoff)
    assert new_failures(None, pulling) != [] and new_failures(pulling, backoff) == [] == new_failures(backoff, again)
    gated = unplaced("p-talker-1")
    gated["status"]["conditions"][0].update(reason="SchedulingGated", message="waiting for its gates")
    assert last_failure([gated]) is None   # held on purpose (Kueue), not refused by the scheduler
