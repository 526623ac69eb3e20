"""A stage that refuses to start shows why in its OmniPipeline: its model is not in the model store, so
the stage process writes one line to its termination log and exits 2; the node agent reports that line
as the container's termination message, as a kubelet does; the operator puts it in the stage's
`lastFailure` and in Degraded=True/StageFailing, posts one Warning Event for it however often the
container restarts, and takes it all back once no replica is missing.

With two replicas of every stage and a steady load, a stage replica that goes away (its pod deleted, its
process SIGKILLed, a one-stage rollout) costs no request, and the orchestrator restarted costs only
prompt UNAVAILABLE refusals (with a retry-after hint where it answered itself), never a hang."""

from __future__ import annotations

import json
import os
import signal
import time

import grpc
import pytest
import yaml

from omnistage.contract.launch import TERMINATION_LOG
from orchestrator_service.outliers import nothing_sent

from .conftest import NS
from .harness import REPO, wait_for
from .load import SteadyLoad

NAME = "broken-model"
STAGE = "llm"
MISSING = "no-such-model"
# What the stage process says (stage_service: the checkpoint check before any weights are read).
LINE = (f"/etc/omnistage/pipeline.yaml: spec.topology.stages[0].model ({STAGE}): "
        f"/models/{MISSING}: no such model directory")
FAIL_TIMEOUT = 120       # one Python start on a busy machine, then the exit
RESTART_TIMEOUT = 120    # the kubelet's first crash-loop back-off is 10 s


@pytest.fixture
def broken(operator):
    doc = yaml.safe_load((REPO / "examples" / "llm-tiny.yaml").read_text())
    doc["metadata"]["name"] = NAME
    doc["spec"]["topology"]["stages"][0]["model"] = MISSING   # valid as a spec: the store is on the nodes
    doc["spec"]["deployment"]["orchestrator"] = {"replicas": 0}
    operator.kubectl("apply", "-n", NS, "-f", "-", input=yaml.safe_dump(doc))
    yield operator
    operator.delete_pipeline(NS, NAME, "the broken pipeline's pods to go")


def last_failure(c) -> dict:
    return ((c.pipeline(NS, NAME).get("status") or {}).get("stages") or {}).get(STAGE, {}).get("lastFailure") or {}


def failing_events(c) -> list:
    return [e for e in c.core.list_namespaced_event(NS, field_selector=f"involvedObject.name={NAME}").items
            if e.reason == "StageFailing"]


def test_a_stage_that_refuses_to_start_says_why_in_the_pipeline_status(broken):
    c = broken
    failure = wait_for(lambda: last_failure(c).get("exitCode") and last_failure(c), FAIL_TIMEOUT,
                       f"{NAME}: status.stages.{STAGE}.lastFailure")
    # The line from the termination log itself, not a log tail (that would end with a newline).
    assert failure["message"] == LINE, failure
    assert failure["exitCode"] == 2 and failure["reason"] in ("CrashLoopBackOff", "Error")
    selector = f"omnistage.io/pipeline={NAME},omnistage.io/stage={STAGE}"
    (pod,) = c.core.list_namespaced_pod(NS, label_selector=selector).items
    assert failure["pod"] == pod.metadata.name and failure["container"] == "stage"
    (cs,) = pod.status.container_statuses
    terminated = cs.last_state.terminated or cs.state.terminated
    assert (terminated.exit_code, terminated.message) == (2, LINE)        # what the kubelet stand-in reports
    assert pod.spec.containers[0].termination_message_path == TERMINATION_LOG

    degraded = c.wait_condition(NS, NAME, "Degraded", "True", 30, reason="StageFailing")
    assert degraded["message"].startswith(f"{STAGE}: exit code 2, ") and degraded["message"].endswith(f": {LINE}")
    assert c.condition(NS, NAME, "Ready")["status"] == "False"
    described = c.kubectl("describe", "omnip", "-n", NS, NAME).stdout
    assert "StageFailing" in described and f"/models/{MISSING}: no such model directory" in described
    (event,) = wait_for(lambda: failing_events(c), 30, "a StageFailing Event")
    assert event.type == "Warning" and event.message.endswith(LINE)

    # It crashes again with the same line: the status follows (a new finishedAt), the Event is not repeated.
    first = failure["finishedAt"]
    wait_for(lambda: last_failure(c).get("finishedAt", first) != first, RESTART_TIMEOUT,
             "the operator to see the container fail a second time")
    assert last_failure(c)["message"] == LINE
    assert len(failing_events(c)) == 1, [e.message for e in failing_events(c)]

    # No replica missing (scaled to zero here): the failure leaves the status and Degraded clears.
    c.kubectl("patch", "omnip", "-n", NS, NAME, "--type=merge",
              "-p", json.dumps({"spec": {"deployment": {"stages": {STAGE: {"replicas": 0}}}}}))
    c.wait_condition(NS, NAME, "Degraded", "False", 60)
    assert "lastFailure" not in c.pipeline(NS, NAME)["status"]["stages"][STAGE]


UNPLACED = "unplaceable"
PENDING_REASON_S = 10   # a Pending pod's reason reaches the status within seconds (the pod event enqueues)


def test_a_stage_the_scheduler_cannot_place_says_why_in_seconds(operator):
    """A stage asking for more CPU than any node has: the scheduler's reason and message reach the stage's
    lastFailure, Degraded=True/StageFailing and one Warning Event, within seconds of the pod's refusal."""
    c = operator
    doc = yaml.safe_load((REPO / "examples" / "llm-tiny.yaml").read_text())
    doc["metadata"]["name"] = UNPLACED
    doc["spec"]["deployment"]["stages"][STAGE] = {"resources": {"requests": {"cpu": "5000"}}}   # the node: 1000
    doc["spec"]["deployment"]["orchestrator"] = {"replicas": 0}
    c.kubectl("apply", "-n", NS, "-f", "-", input=yaml.safe_dump(doc))
    try:
        selector = f"omnistage.io/pipeline={UNPLACED},omnistage.io/stage={STAGE}"
        refused = wait_for(lambda: [p for p in c.core.list_namespaced_pod(NS, label_selector=selector).items
                                    if any(x.type == "PodScheduled" and x.status == "False"
                                           for x in p.status.conditions or ())], 60, "the scheduler's refusal")
        t0 = time.monotonic()

        def failure() -> dict:
            st = c.pipeline(NS, UNPLACED).get("status") or {}
            return ((st.get("stages") or {}).get(STAGE) or {}).get("lastFailure") or {}

        got = wait_for(lambda: failure().get("reason") == "Unschedulable" and failure(), PENDING_REASON_S,
                       "the Unschedulable reason in the status")
        assert time.monotonic() - t0 <= PENDING_REASON_S
        assert got["pod"] == refused[0].metadata.name and "Insufficient cpu" in got["message"], got
        degraded = c.wait_condition(NS, UNPLACED, "Degraded", "True", 30, reason="StageFailing")
        assert degraded["message"].startswith(f"{STAGE}: Unschedulable: ") and "Insufficient cpu" in degraded["message"]
        events = wait_for(lambda: [e for e in c.core.list_namespaced_event(
            NS, field_selector=f"involvedObject.name={UNPLACED}").items if e.reason == "StageFailing"], 30,
            "a StageFailing Event")
        assert len(events) == 1 and events[0].type == "Warning" and "Unschedulable" in events[0].message
    finally:
        c.delete_pipeline(NS, UNPLACED, "the unplaceable pipeline's pods to go")


# ------------------------------------------------------------- replicas going away under load
# examples/qwen3-omni-tiny.yaml with 2 replicas of every stage, under a steady load: a stage replica
# deleted, SIGKILLed or rolled costs no request (its calls go to the other replica: docs/faults.md), and
# the orchestrator restarted costs only prompt UNAVAILABLE refusals, never a hang.

TWO = "faults-omni"
STAGES = ("thinker", "talker", "code2wav")
REPLICAS = 2
TWO_READY_TIMEOUT = 300   # Python processes importing torch and loading models on 2 cores
TWO_ROLL_TIMEOUT = 300
TWO_REQUEST = {"prompt": "Hi", "max_tokens": 8, "max_codec_frames": 25}


@pytest.fixture(scope="module")
def two_of_each(operator):
    doc = yaml.safe_load((REPO / "examples" / "qwen3-omni-tiny.yaml").read_text())
    doc["metadata"]["name"] = TWO
    operator.kubectl("apply", "-n", NS, "-f", "-", input=yaml.safe_dump(doc))
    operator.wait_condition(NS, TWO, "Ready", "True", TWO_READY_TIMEOUT)
    # One more replica of each stage at a time: six processes importing torch at once on 2 cores outlast
    # the liveness probe's patience (the kubelet would restart them forever), one at a time does not.
    for stage in STAGES:
        operator.kubectl("patch", "omnip", "-n", NS, TWO, "--type=merge", "-p", json.dumps(
            {"spec": {"deployment": {"stages": {stage: {"replicas": REPLICAS}}}}}))
        wait_for(lambda: len([p for p in stage_pods(operator, stage) if pod_ready(p)]) == REPLICAS,
                 TWO_READY_TIMEOUT, f"{REPLICAS} ready {stage} replicas")
    wait_all_ready(operator)
    yield operator
    operator.delete_pipeline(NS, TWO, f"the {TWO} pods to go")


def stage_pods(c, stage: str) -> list:
    sel = f"omnistage.io/pipeline={TWO},omnistage.io/component=stage,omnistage.io/stage={stage}"
    return [p for p in c.core.list_namespaced_pod(NS, label_selector=sel).items if not p.metadata.deletion_timestamp]


def pod_ready(p) -> bool:
    return any(cond.type == "Ready" and cond.status == "True" for cond in p.status.conditions or ())


def every_replica_ready(c) -> bool:
    """Ready, and exactly REPLICAS ready pods of every stage, each rolled out."""
    if c.condition(NS, TWO, "Ready").get("status") != "True":
        return False
    for stage in STAGES:
        d = c.apps.read_namespaced_deployment(f"{TWO}-{stage}", NS)
        s = d.status
        if (s.observed_generation or 0) < d.metadata.generation or (s.updated_replicas or 0) != REPLICAS:
            return False
        pods = stage_pods(c, stage)
        if len(pods) != REPLICAS or not all(pod_ready(p) for p in pods):
            return False
    return True


def wait_all_ready(c) -> None:
    wait_for(lambda: every_replica_ready(c), TWO_ROLL_TIMEOUT, f"{TWO}: {REPLICAS} ready replicas of every stage")


def steady_load(c, **kw) -> SteadyLoad:
    return SteadyLoad(c.orchestrator_endpoint(NS, TWO), concurrency=2, request=dict(TWO_REQUEST), **kw)


def served_after(c, load: SteadyLoad, t: float) -> None:
    wait_for(lambda: load.completed_after(t) >= 2, 120, "requests served after the fault")


def no_failures(load: SteadyLoad) -> None:
    assert load.failures() == [], [(f.code, f.message) for f in load.failures()]
    assert load.count() >= 4


def test_deleting_one_stage_pod_under_load_fails_no_request(two_of_each):
    c = two_of_each
    wait_all_ready(c)
    victim = stage_pods(c, "talker")[0]
    with steady_load(c) as load:
        wait_for(lambda: load.count() >= 2, 120, "the load to get going")
        c.core.delete_namespaced_pod(victim.metadata.name, NS)  # its preStop hook drains it, as a scale-down would
        wait_for(lambda: victim.metadata.uid not in {p.metadata.uid for p in stage_pods(c, "talker")}
                 and every_replica_ready(c), TWO_ROLL_TIMEOUT, "a replacement talker ready")
        served_after(c, load, time.monotonic())
    no_failures(load)


def test_sigkill_of_a_stage_process_under_load_fails_no_request(two_of_each):
    c = two_of_each
    wait_all_ready(c)
    victim = stage_pods(c, "talker")[0]
    (cs,) = victim.status.container_statuses
    pid = int(cs.container_id.removeprefix("e2e-agent://"))  # the node agent's process for the container
    restarts = cs.restart_count
    with steady_load(c) as load:
        wait_for(lambda: load.count() >= 2, 120, "the load to get going")
        os.killpg(pid, signal.SIGKILL)  # the whole container: no drain, no goodbye
        wait_for(lambda: c.core.read_namespaced_pod(victim.metadata.name, NS).status.container_statuses[0]
                 .restart_count > restarts and every_replica_ready(c), TWO_ROLL_TIMEOUT,
                 "the agent to restart the killed container and it to be ready")
        served_after(c, load, time.monotonic())
    no_failures(load)


def test_a_one_stage_rollout_under_load_fails_no_request(two_of_each):
    c = two_of_each
    wait_all_ready(c)
    before = {p.metadata.uid for p in stage_pods(c, "talker")}
    with steady_load(c) as load:
        wait_for(lambda: load.count() >= 2, 120, "the load to get going")
        c.kubectl("patch", "omnip", "-n", NS, TWO, "--type=merge", "-p", json.dumps(
            {"spec": {"deployment": {"stages": {"talker": {"env": {"E2E_ROLLOUT": "1"}}}}}}))
        wait_for(lambda: not before & {p.metadata.uid for p in stage_pods(c, "talker")} and every_replica_ready(c),
                 TWO_ROLL_TIMEOUT, "every talker replica replaced and ready")
        served_after(c, load, time.monotonic())
    no_failures(load)


def test_the_orchestrator_restarted_under_load_refuses_with_a_retry_hint_and_never_hangs(two_of_each):
    c = two_of_each
    wait_all_ready(c)
    sel = f"omnistage.io/pipeline={TWO},omnistage.io/component=orchestrator"
    (old,) = [p for p in c.core.list_namespaced_pod(NS, label_selector=sel).items if not p.metadata.deletion_timestamp]
    with steady_load(c, resolve=lambda: c.orchestrator_endpoint(NS, TWO)) as load:
        wait_for(lambda: load.count() >= 2, 120, "the load to get going")
        c.core.delete_namespaced_pod(old.metadata.name, NS)  # drains: refuses new work, finishes what it admitted
        wait_for(lambda: [p for p in c.core.list_namespaced_pod(NS, label_selector=sel).items
                          if p.metadata.uid != old.metadata.uid and pod_ready(p) and not p.metadata.deletion_timestamp],
                 TWO_ROLL_TIMEOUT, "a new orchestrator pod ready")
        served_after(c, load, time.monotonic())
    failures = load.failures()
    assert all(f.code == grpc.StatusCode.UNAVAILABLE for f in failures), [(f.code, f.message) for f in failures]
    assert all(f.finished - f.started < 30 for f in failures), "a request hung instead of being refused"
    # Refusals the draining orchestrator answered itself carry the hint; the rest found no process to answer.
    answered = [f for f in failures if not nothing_sent(f.code, f.message)]
    assert all(float(f.retry_after) > 0 for f in answered), [(f.message, f.retry_after) for f in answered]
