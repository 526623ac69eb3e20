"""Invalid pipelines: refused at `kubectl apply` with field paths (schema or webhook) and nothing is
created; one that slips past a missing webhook gets Ready=False/InvalidSpec, an Event, no children."""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from .conftest import NS
from .harness import REPO, wait_for

BASE = yaml.safe_load((REPO / "examples" / "qwen3-omni-tiny.yaml").read_text())


def doc(name: str, edit) -> dict:
    d = copy.deepcopy(BASE)
    d["metadata"]["name"] = name
    for stage in d["spec"]["deployment"]["stages"].values():
        stage["replicas"] = 0   # nothing here needs running pods
    d["spec"]["deployment"]["orchestrator"]["replicas"] = 0
    edit(d)
    return d


def children(c, name: str) -> list[str]:
    sel = f"omnistage.io/pipeline={name}"
    out = [f"Deployment/{d.metadata.name}" for d in c.apps.list_namespaced_deployment(NS, label_selector=sel).items]
    out += [f"Service/{s.metadata.name}" for s in c.core.list_namespaced_service(NS, label_selector=sel).items]
    out += [f"ConfigMap/{m.metadata.name}" for m in c.core.list_namespaced_config_map(NS, label_selector=sel).items]
    return out


@pytest.mark.parametrize("name, edit, message", [
    ("bad-edge", lambda d: d["spec"]["topology"]["stages"][1]["inputs"].__setitem__(0, {"stage": "talkr"}),
     'admission webhook "validate-omnipipeline.omnipipelines.omnistage.io" denied the request: '
     'spec.topology.stages[1].inputs[0]: unknown stage "talkr" (did you mean "talker"?)'),
    ("bad-typo", lambda d: d["spec"]["deployment"]["stages"]["talker"].update(replicsa=2),
     'spec.deployment.stages.talker.replicsa: unknown field (did you mean "replicas"?)'),
    ("bad-kind", lambda d: d["spec"]["topology"]["stages"][0].update(engine="diffusers"),
     'spec.topology.stages[0].engine: engine "diffusers" cannot serve a "ar" stage'),
    ("bad-batch", lambda d: d["spec"]["deployment"]["stages"]["talker"].update(scheduler={"maxBatch": 0}),
     "spec.deployment.stages.talker.scheduler.maxBatch: Invalid value: 0"),   # the CRD schema's answer
    ("bad-reserved", lambda d: d["spec"]["topology"]["stages"][2].update(name="orchestrator") or
     d["spec"]["deployment"]["stages"].update(orchestrator=d["spec"]["deployment"]["stages"].pop("code2wav")) or
     d["spec"]["topology"]["outputs"][1].update(stage="orchestrator"),
     'spec.topology.stages[2].name: "orchestrator" is reserved'),
])
def test_invalid_pipeline_is_refused_at_apply_and_nothing_is_created(operator, name, edit, message):
    c = operator
    r = c.kubectl("apply", "-n", NS, "-f", "-", input=yaml.safe_dump(doc(name, edit)), check=False)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr
    assert c.kubectl("get", "omnip", "-n", NS, name, check=False).returncode != 0
    assert children(c, name) == []


def test_valid_pipeline_passes_the_webhook(operator):
    c = operator
    d = doc("good-zero", lambda d: None)
    c.kubectl("apply", "-n", NS, "-f", "-", input=yaml.safe_dump(d))
    try:
        c.wait_condition(NS, "good-zero", "Ready", "False", 60, reason="ScaledToZero")
        assert len(children(c, "good-zero")) == 4 + 4 + 1
    finally:
        c.kubectl("delete", "omnip", "-n", NS, "good-zero", "--wait=true")


@pytest.fixture
def operator_without_webhook(operator):
    """The session operator stopped (a clean stop removes its webhook), one without a webhook in its
    place; the session operator is back afterwards."""
    operator.stop_operator()
    assert not operator._webhook_registered()
    operator.start_operator([NS], webhook="off")
    yield operator
    operator.stop_operator()
    operator.start_operator([NS])


def test_invalid_spec_that_slips_through_is_reported_and_creates_nothing(operator_without_webhook):
    c = operator_without_webhook
    name = "slipped"
    bad = doc(name, lambda d: d["spec"]["topology"]["stages"][1]["inputs"].__setitem__(0, {"stage": "talkr"}))
    c.custom.create_namespaced_custom_object("omnistage.io", "v1alpha1", NS, "omnipipelines", bad)
    try:
        ready = c.wait_condition(NS, name, "Ready", "False", 30, reason="InvalidSpec")
        assert 'spec.topology.stages[1].inputs[0]: unknown stage "talkr"' in ready["message"]
        assert c.pipeline(NS, name)["status"]["observedGeneration"] == 1
        events = wait_for(lambda: [e for e in c.core.list_namespaced_event(
            NS, field_selector=f"involvedObject.name={name}").items if e.reason == "InvalidSpec"], 30,
            "an InvalidSpec Event")
        assert events[0].type == "Warning" and "talkr" in events[0].message
        assert children(c, name) == []
        # Fixed, it is served: children appear and the InvalidSpec condition goes away.
        fixed = [{"op": "replace", "path": "/spec/topology/stages/1/inputs/0/stage", "value": "thinker"}]
        c.kubectl("patch", "omnip", "-n", NS, name, "--type=json", "-p", json.dumps(fixed))
        c.wait_condition(NS, name, "Ready", "False", 60, reason="ScaledToZero")
        assert len(children(c, name)) == 9
    finally:
        c.kubectl("delete", "omnip", "-n", NS, name, "--wait=true")
