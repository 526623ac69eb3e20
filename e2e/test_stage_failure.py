"""A stage that refuses to start shows why in its OmniPipeline: its model is not in the model store, so
the stage process writes one line to its termination log and exits 2; the node agent reports that line
as the container's termination message, as a kubelet does; the operator puts it in the stage's
`lastFailure` and in Degraded=True/StageFailing, posts one Warning Event for it however often the
container restarts, and takes it all back once no replica is missing."""

from __future__ import annotations

import json

import pytest
import yaml

from omnistage.launch import TERMINATION_LOG

from .conftest import NS
from .harness import REPO, wait_for

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
    operator.kubectl("delete", "omnip", "-n", NS, NAME, "--ignore-not-found", "--wait=true")
    wait_for(lambda: not operator.core.list_namespaced_pod(NS, label_selector=f"omnistage.io/pipeline={NAME}").items,
             120, "the broken pipeline's pods to go")


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
