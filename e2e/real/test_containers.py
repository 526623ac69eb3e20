"""The scenarios that need the container runtime itself, on a real node (kubelet, containerd, runc) running
the project image built by `make image`: the example applied, Ready and answering through its Service
(gRPC and the OpenAI-compatible door, routed by kube-proxy); the restricted security context enforced by
the runtime; a one-stage rollout under load with no failed request; a stage whose model is missing reported
in the pipeline's status from the container's termination message.

The other e2e scenarios keep the node agent (e2e/node/agent.py): they test the operator and the control plane
(hand edits, idle reconciles, webhooks, the chart, autoscaling, GPU placement with fake devices, hundreds of
pods in the benchmark), where a container runtime would add only start-up time on a 2-core machine."""

from __future__ import annotations

import ipaddress
import json
import time
import urllib.request

import pytest
import yaml

from omnistage.contract import launch
from omnistage.contract.launch import TERMINATION_LOG

from ..harness import REPO, wait_for
from ..load import SteadyLoad
from ..test_stage_failure import LINE, MISSING, STAGE
from .conftest import NS
from .first_answer import PIPE, REQUEST, SMALL_REQUESTS, apply_to_first_answer

STAGES = ("thinker", "talker", "code2wav")
UNITS = (*STAGES, "orchestrator")
POD_CIDR = ipaddress.ip_network("10.88.0.0/16")   # node-up.sh's bridge
ROLL_TIMEOUT = 300


@pytest.fixture(scope="module")
def served(operator):
    result, times = apply_to_first_answer(operator, NS)
    print(f"[e2e-real] {PIPE}: {times}")
    yield operator, result
    operator.delete_pipeline(NS, PIPE, "the example's pods to go", timeout=180)


def unit_pods(c, unit: str) -> list:
    component = "orchestrator" if unit == "orchestrator" else "stage"
    sel = f"omnistage.io/pipeline={PIPE},omnistage.io/component={component}"
    if component == "stage":
        sel += f",omnistage.io/stage={unit}"
    return [p for p in c.core.list_namespaced_pod(NS, label_selector=sel).items if not p.metadata.deletion_timestamp]


def rolled_out(c, unit: str) -> bool:
    d = c.apps.read_namespaced_deployment(f"{PIPE}-{unit}", NS)
    s = d.status
    return (s.observed_generation or 0) >= d.metadata.generation and s.updated_replicas == d.spec.replicas == \
        s.replicas == s.available_replicas and len(unit_pods(c, unit)) == d.spec.replicas


# ---------------------------------------------------------------------------------- served

def test_the_example_answers_through_its_service_from_real_containers(served):
    c, result = served
    assert result.text.strip(), "no text"
    assert result.sample_rate > 0 and len(result.pcm) > 0, "no audio"
    for unit in UNITS:
        (pod,) = unit_pods(c, unit)
        (status,) = pod.status.container_statuses
        assert pod.spec.node_name == "e2e-real" and status.container_id.startswith("containerd://"), unit
        assert status.image == c.image and status.ready, (unit, status.image)
        assert ipaddress.ip_address(pod.status.pod_ip) in POD_CIDR, (unit, pod.status.pod_ip)

    # The OpenAI-compatible door, through the same Service's virtual IP.
    url = f"http://{c.service_endpoint(NS, PIPE, launch.API_PORT)}/v1/chat/completions"
    body = {"model": PIPE, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        answer = json.load(r)
    assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"].strip(), answer


# What a container's main process (PID 1) is allowed, read from inside it, and what the root filesystem takes.
PROBE = r"""
import json, os
status = dict(line.split(":", 1) for line in open("/proc/1/status").read().splitlines() if ":" in line)
def writable(path):
    try:
        with open(os.path.join(path, ".e2e-probe"), "w"):
            pass
        os.unlink(os.path.join(path, ".e2e-probe"))
        return "yes"
    except OSError as e:
        return os.strerror(e.errno)
shm = [line.split()[2] for line in open("/proc/mounts") if line.split()[1] == "/dev/shm"]
print(json.dumps({k: status[k].split() for k in ("Uid", "Gid", "CapEff", "CapPrm", "CapBnd", "NoNewPrivs", "Seccomp")}
                 | {"root": writable("/"), "app": writable("/app"), "tmp": writable("/tmp"),
                    "shm": writable("/dev/shm"), "shm_fs": shm}))
"""


def test_the_runtime_enforces_the_restricted_security_context(served):
    c, _ = served
    for unit in UNITS:
        (pod,) = unit_pods(c, unit)
        container = "orchestrator" if unit == "orchestrator" else "stage"
        seen = json.loads(c.kubectl("exec", "-n", NS, pod.metadata.name, "-c", container, "--",
                                    "python", "-c", PROBE).stdout)
        assert seen["Uid"] == ["1000"] * 4 and seen["Gid"] == ["1000"] * 4, (unit, seen)
        for caps in ("CapEff", "CapPrm", "CapBnd"):
            assert seen[caps] == ["0000000000000000"], (unit, caps, seen)
        assert seen["NoNewPrivs"] == ["1"] and seen["Seccomp"] == ["2"], (unit, seen)   # 2: a filter applies
        assert seen["root"] == seen["app"] == "Read-only file system", (unit, seen)
        assert seen["tmp"] == "yes" and seen["shm"] == "yes" and seen["shm_fs"] == ["tmpfs"], (unit, seen)


def test_a_one_stage_rollout_under_load_fails_no_request(served):
    c, _ = served
    wait_for(lambda: all(rolled_out(c, u) for u in UNITS), ROLL_TIMEOUT, "every unit rolled out")
    before = {u: {p.metadata.uid for p in unit_pods(c, u)} for u in UNITS}
    gen = c.apps.read_namespaced_deployment(f"{PIPE}-talker", NS).metadata.generation
    with SteadyLoad(c.service_endpoint(NS, PIPE), concurrency=2, request=dict(prompt="Hi", **REQUEST)) as load:
        wait_for(lambda: load.count() >= 2, 60, "the load to get going")
        c.kubectl("patch", "omnip", "-n", NS, PIPE, "--type=merge",
                  "-p", json.dumps({"spec": {"deployment": {"stages": {"talker": {"env": {"E2E_ROUND": "2"}}}}}}))
        wait_for(lambda: c.apps.read_namespaced_deployment(f"{PIPE}-talker", NS).metadata.generation > gen, 30,
                 "the talker Deployment to change")
        wait_for(lambda: rolled_out(c, "talker") and not {p.metadata.uid for p in unit_pods(c, "talker")}
                 & before["talker"], ROLL_TIMEOUT, "the talker rollout to finish")
        done = time.monotonic()
        wait_for(lambda: load.completed_after(done) >= 2, 60, "requests served after the rollout")
    assert load.failures() == [], [(f.code, f.message) for f in load.failures()]
    for u in ("thinker", "code2wav", "orchestrator"):
        assert {p.metadata.uid for p in unit_pods(c, u)} == before[u], f"{u} pods changed"


def test_a_missing_model_is_reported_in_status_from_the_containers_termination_message(operator):
    c, name = operator, "broken-model"
    doc = yaml.safe_load((REPO / "examples" / "llm-tiny.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["topology"]["stages"][0]["model"] = MISSING
    doc["spec"]["deployment"]["orchestrator"] = {"replicas": 0}
    for stage in doc["spec"]["deployment"].get("stages", {}).values():
        stage["resources"] = {"requests": dict(SMALL_REQUESTS)}
    c.kubectl("apply", "-n", NS, "-f", "-", input=yaml.safe_dump(doc))
    try:
        def last_failure() -> dict:
            stages = (c.pipeline(NS, name).get("status") or {}).get("stages") or {}
            return stages.get(STAGE, {}).get("lastFailure") or {}
        failure = wait_for(lambda: last_failure().get("exitCode") and last_failure(), 180,
                           f"{name}: status.stages.{STAGE}.lastFailure")
        assert failure["message"] == LINE and failure["exitCode"] == 2, failure
        (pod,) = c.core.list_namespaced_pod(NS, label_selector=f"omnistage.io/pipeline={name}").items
        assert pod.spec.containers[0].termination_message_path == TERMINATION_LOG
        (cs,) = pod.status.container_statuses
        terminated = cs.last_state.terminated or cs.state.terminated
        # containerd's runc wrote it, the real kubelet read it from the container's termination log
        assert (terminated.exit_code, terminated.message) == (2, LINE) and cs.container_id.startswith("containerd://")
        degraded = c.wait_condition(NS, name, "Degraded", "True", 60, reason="StageFailing")
        assert degraded["message"].endswith(f": {LINE}")
    finally:
        c.delete_pipeline(NS, name, "the broken pipeline's pods to go", timeout=180)
