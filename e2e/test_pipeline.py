"""examples/qwen3-omni-tiny.yaml on a real API server: it becomes Ready with one Deployment per stage
and serves Generate through the orchestrator pod; hand edits are put back; a reconcile with nothing
to change writes nothing; an image change rolls that stage alone under load with zero failures;
two changes roll one stage at a time; a killed stage pod costs only clean refusals."""

from __future__ import annotations

import base64
import io
import json
import time
import wave

import grpc
import pytest

from omnistage import tls
from omnistage.client import OmniClient
from omnistage.contract import launch
from omnistage.v1 import stage_pb2, stage_pb2_grpc

from .conftest import NS
from .harness import OPERATOR_USER, REPO, wait_for
from .load import CLEAN_FAILURES, SteadyLoad

PIPE = "qwen3-omni-tiny"
EXAMPLE = REPO / "examples" / f"{PIPE}.yaml"
STAGES = ("thinker", "talker", "code2wav")
UNITS = (*STAGES, "orchestrator")
READY_TIMEOUT = 300      # first start: four Python processes importing torch and loading models on 2 cores
ROLL_TIMEOUT = 240
REQUEST = {"max_tokens": 8, "max_codec_frames": 25}


@pytest.fixture(scope="module")
def pipeline(operator):
    operator.kubectl("apply", "-n", NS, "-f", str(EXAMPLE))
    yield operator
    operator.kubectl("delete", "-n", NS, "omnipipeline", PIPE, "--ignore-not-found", "--wait=true")
    wait_for(lambda: not operator.apps.list_namespaced_deployment(
        NS, label_selector=f"omnistage.io/pipeline={PIPE}").items, 120, "the garbage collector to remove children")


def deployment(c, unit):
    return c.apps.read_namespaced_deployment(f"{PIPE}-{unit}", NS)


def rolled_out(d) -> bool:
    s = d.status
    return (s.observed_generation or 0) >= d.metadata.generation and (s.updated_replicas or 0) == d.spec.replicas \
        and (s.replicas or 0) == d.spec.replicas and (s.available_replicas or 0) == d.spec.replicas


def unit_pods(c, unit):
    component = "orchestrator" if unit == "orchestrator" else "stage"
    sel = f"omnistage.io/pipeline={PIPE},omnistage.io/component={component}"
    if component == "stage":
        sel += f",omnistage.io/stage={unit}"
    return [p for p in c.core.list_namespaced_pod(NS, label_selector=sel).items if not p.metadata.deletion_timestamp]


def settled(c) -> bool:
    """Ready, nothing rolling, every unit's pods exactly its replicas."""
    ready = c.condition(NS, PIPE, "Ready").get("status") == "True"
    progressing = c.condition(NS, PIPE, "Progressing").get("status") == "False"
    return ready and progressing and all(rolled_out(deployment(c, u)) for u in UNITS) and \
        all(len(unit_pods(c, u)) == 1 for u in UNITS)


def wait_settled(c, timeout=ROLL_TIMEOUT):
    wait_for(lambda: settled(c), timeout, f"{PIPE} Ready, rolled out, one pod per unit")


def generate(c, prompt="Hello there"):
    with OmniClient(c.orchestrator_endpoint(NS, PIPE)) as client:
        return client.generate(prompt, timeout=60, **REQUEST)


# ---------------------------------------------------------------------------------- apply

def test_apply_becomes_ready_with_one_deployment_per_stage(pipeline):
    c = pipeline
    ready = c.wait_condition(NS, PIPE, "Ready", "True", READY_TIMEOUT)
    assert ready["reason"] == "AllStagesReady"
    body = c.pipeline(NS, PIPE)
    uid = body["metadata"]["uid"]
    deps = c.apps.list_namespaced_deployment(NS, label_selector=f"omnistage.io/pipeline={PIPE}").items
    assert sorted(d.metadata.name for d in deps) == sorted(f"{PIPE}-{u}" for u in UNITS)
    for d in deps:
        (ref,) = d.metadata.owner_references
        assert (ref.kind, ref.uid, ref.controller) == ("OmniPipeline", uid, True)
    svcs = {s.metadata.name: s for s in c.core.list_namespaced_service(
        NS, label_selector=f"omnistage.io/pipeline={PIPE}").items}
    assert sorted(svcs) == sorted(f"{PIPE}-{u}" for u in UNITS)
    for stage in STAGES:
        assert svcs[f"{PIPE}-{stage}"].spec.cluster_ip == "None"
        assert [(p.name, p.port) for p in svcs[f"{PIPE}-{stage}"].spec.ports] == [
            (launch.GRPC_PORT_NAME, launch.GRPC_PORT), (launch.HTTP_PORT_NAME, launch.HTTP_PORT)]
    assert [(p.name, p.port) for p in svcs[f"{PIPE}-orchestrator"].spec.ports] == [
        (launch.GRPC_PORT_NAME, launch.GRPC_PORT), (launch.HTTP_PORT_NAME, launch.HTTP_PORT),
        (launch.API_PORT_NAME, launch.API_PORT)]   # the OpenAI-compatible API, on by default
    pdbs = c.kubectl("get", "pdb", "-n", NS, "-l", f"omnistage.io/pipeline={PIPE}", "-o", "json").stdout
    assert sorted(p["metadata"]["name"] for p in json.loads(pdbs)["items"]) == sorted(f"{PIPE}-{s}" for s in STAGES)
    cm = c.core.read_namespaced_config_map(f"{PIPE}-pipeline", NS)
    assert "talker" in cm.data["pipeline.yaml"] and "status" not in cm.data["pipeline.yaml"]
    c.kubectl("get", "networkpolicy", "-n", NS, f"{PIPE}-stages", f"{PIPE}-orchestrator")
    c.kubectl("get", "role,rolebinding,serviceaccount", "-n", NS, f"{PIPE}-orchestrator")

    wait_settled(c)
    st = c.pipeline(NS, PIPE)["status"]
    assert st["observedGeneration"] == c.pipeline(NS, PIPE)["metadata"]["generation"]
    assert st["stagesReady"] == "3/3"
    assert st["stages"] == {s: {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1} for s in STAGES}
    assert st["orchestratorEndpoint"] == f"{PIPE}-orchestrator.{NS}.svc:{launch.GRPC_PORT}"
    assert c.condition(NS, PIPE, "Degraded")["status"] == "False"
    table = c.kubectl("get", "omnip", "-n", NS, PIPE).stdout.split("\n")[1].split()
    assert table[:4] == [PIPE, "True", "AllStagesReady", "3/3"]


def test_stage_pods_run_as_the_spec_says(pipeline):
    c = pipeline
    (pod,) = unit_pods(c, "talker")
    (container,) = pod.spec.containers
    assert container.command[:3] == ["python", "-m", launch.STAGE_MODULE]
    assert container.security_context.read_only_root_filesystem is True
    assert pod.spec.security_context.run_as_user == 1000
    assert pod.status.pod_ip.startswith("127.")
    assert pod.spec.termination_grace_period_seconds > 30   # beyond the default drainSeconds


def test_stage_pods_speak_only_mutual_tls_with_the_identity_the_operator_issued(pipeline):
    c = pipeline
    (pod,) = unit_pods(c, "talker")
    secret = c.core.read_namespaced_secret(f"{PIPE}-tls-talker", NS)
    leaf = base64.b64decode(secret.data["tls.crt"])
    assert tls.uri_of(leaf) == tls.identity(NS, PIPE, tls.stage_role("talker"))
    ca = base64.b64decode(secret.data["ca.crt"])
    assert not tls.needs_renewal(leaf, ca)
    # A caller without a certificate (the whole network, as far as the stage knows) gets nowhere.
    with grpc.insecure_channel(f"{pod.status.pod_ip}:{launch.GRPC_PORT}") as ch:
        with pytest.raises(grpc.RpcError) as e:
            stage_pb2_grpc.StageServiceStub(ch).GetLoad(stage_pb2.GetLoadRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_generate_through_the_orchestrator_pod_returns_text_and_audio(pipeline):
    r = generate(pipeline)
    assert r.text.strip(), "no text"
    assert r.sample_rate > 0 and r.audio_chunks >= 1 and len(r.pcm) > 0
    with wave.open(io.BytesIO(r.wav_bytes())) as w:
        assert w.getframerate() == r.sample_rate and w.getnframes() == len(r.pcm) // 2


# ---------------------------------------------------------------------- idle reconciles

def test_reconcile_with_nothing_to_change_writes_nothing(pipeline):
    c = pipeline
    wait_settled(c)
    log = c.run / "log" / "operator.log"
    mark, since = log.stat().st_size, time.time()
    c.kubectl("annotate", "omnip", "-n", NS, PIPE, f"e2e/touched={time.time_ns()}", "--overwrite")

    def reconciled():
        with open(log) as f:
            f.seek(mark)
            return [line for line in f if f"reconciled {NS}/{PIPE} in " in line]
    lines = wait_for(reconciled, 30, "the operator to reconcile after the annotation")
    assert all(": 0 writes" in line for line in lines), lines
    writes = c.audit_writes(OPERATOR_USER, since)
    assert writes == [], [f"{w['verb']} {w['objectRef']}" for w in writes]


# --------------------------------------------------------------------------- hand edits

def test_children_edited_or_deleted_by_hand_are_put_back(pipeline):
    c = pipeline
    wait_settled(c)
    svc_uid = c.core.read_namespaced_service(f"{PIPE}-talker", NS).metadata.uid
    c.kubectl("delete", "service", "-n", NS, f"{PIPE}-talker")
    wait_for(lambda: c.core.read_namespaced_service(f"{PIPE}-talker", NS).metadata.uid != svc_uid, 30,
             "the deleted talker Service to come back")
    c.kubectl("delete", "configmap", "-n", NS, f"{PIPE}-pipeline")
    wait_for(lambda: "thinker" in c.core.read_namespaced_config_map(f"{PIPE}-pipeline", NS).data["pipeline.yaml"],
             30, "the deleted ConfigMap to come back")
    c.kubectl("patch", "pdb", "-n", NS, f"{PIPE}-code2wav", "--type=merge", "-p", '{"spec":{"maxUnavailable":0}}')
    pdb = lambda: json.loads(c.kubectl("get", "pdb", "-n", NS, f"{PIPE}-code2wav", "-o", "json").stdout)  # noqa: E731
    wait_for(lambda: pdb()["spec"]["maxUnavailable"] == 1, 30, "the edited PDB to be put back")
    c.kubectl("scale", "deployment", "-n", NS, f"{PIPE}-thinker", "--replicas=2")
    wait_for(lambda: deployment(c, "thinker").spec.replicas == 1, 30, "the scaled Deployment to be put back")
    wait_settled(c)


# ------------------------------------------------------------------------------ rollouts

def test_image_change_rolls_only_that_stage_under_load_with_zero_failures(pipeline):
    c = pipeline
    wait_settled(c)
    others = ("thinker", "code2wav", "orchestrator")
    before_pods = {u: {p.metadata.uid for p in unit_pods(c, u)} for u in UNITS}
    before_gen = {u: deployment(c, u).metadata.generation for u in others}
    image = "ghcr.io/omnistage/omnistage:0.1.1-e2e"
    with SteadyLoad(c.orchestrator_endpoint(NS, PIPE), concurrency=2, request=dict(prompt="Hi", **REQUEST)) as load:
        wait_for(lambda: load.count() >= 2, 60, "the load to get going")
        c.kubectl("patch", "omnip", "-n", NS, PIPE, "--type=merge",
                  "-p", json.dumps({"spec": {"deployment": {"stages": {"talker": {"image": image}}}}}))
        wait_for(lambda: deployment(c, "talker").spec.template.spec.containers[0].image == image, 30,
                 "the talker Deployment to get the new image")
        wait_for(lambda: rolled_out(deployment(c, "talker")) and settled(c), ROLL_TIMEOUT,
                 "the talker rollout to finish")
        done = time.monotonic()
        wait_for(lambda: load.completed_after(done) >= 2, 60, "requests served after the rollout")
    assert load.failures() == [], [(f.code, f.message) for f in load.failures()]
    assert load.count() >= 6
    (new_talker,) = unit_pods(c, "talker")
    assert new_talker.metadata.uid not in before_pods["talker"]
    assert new_talker.spec.containers[0].image == image
    for u in others:
        assert {p.metadata.uid for p in unit_pods(c, u)} == before_pods[u], f"{u} pods changed"
        assert deployment(c, u).metadata.generation == before_gen[u], f"{u} Deployment was written"


def test_two_changed_stages_roll_one_at_a_time(pipeline):
    c = pipeline
    wait_settled(c)
    g0 = {u: deployment(c, u).metadata.generation for u in ("thinker", "code2wav")}
    c.kubectl("patch", "omnip", "-n", NS, PIPE, "--type=merge", "-p", json.dumps({"spec": {"deployment": {"stages": {
        "thinker": {"env": {"E2E_ROUND": "2"}}, "code2wav": {"env": {"E2E_ROUND": "2"}}}}}}))
    seen: dict[str, float] = {}
    messages: set[str] = set()

    def observe():
        t = time.monotonic()
        th, cw = deployment(c, "thinker"), deployment(c, "code2wav")
        messages.add(c.condition(NS, PIPE, "Progressing").get("message", ""))
        if th.metadata.generation > g0["thinker"]:
            seen.setdefault("thinker_written", t)
            if rolled_out(th):
                seen.setdefault("thinker_done", t)
        if cw.metadata.generation > g0["code2wav"]:
            seen.setdefault("code2wav_written", t)
            # the second stage must not move while the first is still rolling
            assert "thinker_done" in seen, "code2wav was written before thinker finished rolling out"
            if rolled_out(cw):
                seen.setdefault("code2wav_done", t)
        return "code2wav_done" in seen and settled(c)
    wait_for(observe, 2 * ROLL_TIMEOUT, "thinker, then code2wav, to roll out")
    assert seen["thinker_written"] <= seen["thinker_done"] <= seen["code2wav_written"] <= seen["code2wav_done"]
    assert any("waiting their turn: code2wav" in m for m in messages), messages


# ------------------------------------------------------------------------------ failures

def test_killed_stage_pod_costs_only_clean_refusals_and_the_pipeline_recovers(pipeline):
    c = pipeline
    wait_settled(c)
    (victim,) = unit_pods(c, "talker")
    with SteadyLoad(c.orchestrator_endpoint(NS, PIPE), concurrency=2, request=dict(prompt="Hi", **REQUEST)) as load:
        wait_for(lambda: load.count() >= 2, 60, "the load to get going")
        c.core.delete_namespaced_pod(victim.metadata.name, NS, grace_period_seconds=0)
        c.wait_condition(NS, PIPE, "Ready", "False", 60, reason="StagesNotReady")
        c.wait_condition(NS, PIPE, "Ready", "True", ROLL_TIMEOUT)
        back = time.monotonic()
        wait_for(lambda: load.completed_after(back) >= 2, 60, "requests served after the recovery")
    for f in load.failures():
        assert f.code in CLEAN_FAILURES, (f.code, f.message)
        if f.code == grpc.StatusCode.UNAVAILABLE:
            assert "talker" in f.message, f.message
        assert f.finished - f.started < load.deadline_s, "a request hung until its deadline"
    assert c.condition(NS, PIPE, "Degraded")["status"] == "False"
    (replacement,) = unit_pods(c, "talker")
    assert replacement.metadata.uid != victim.metadata.uid
    assert generate(c).text.strip()
