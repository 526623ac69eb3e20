"""The memory plan as a manifest carries it (omnistage/api/memory_plan.py, the `omnistage.io/memory-plan`
annotation): validation refuses a malformed one and a CPU stage whose memory limit is below its plan; the
operator requests the planned memory for a CPU stage whose file requests none."""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from omnistage.api import parse_pipeline, validate
from omnistage.api.memory_plan import ANNOTATION_MEMORY_PLAN, annotate, memory_request, planned_bytes
from omnistage_operator.builders import build_stage_deployment
from omnistage_operator.config import OperatorConfig

from ..conftest import EXAMPLES

PATH = f'metadata.annotations["{ANNOTATION_MEMORY_PLAN}"]'
MiB = 1 << 20


def doc_with(plan, edit=None) -> dict:
    doc = yaml.safe_load((EXAMPLES / "qwen3-omni-tiny.yaml").read_text())
    if plan is not None:
        doc["metadata"]["annotations"] = {ANNOTATION_MEMORY_PLAN: plan if isinstance(plan, str) else json.dumps(plan)}
    if edit:
        edit(doc)
    return doc


def errors(doc) -> list[str]:
    return [str(e) for e in validate(doc)]


@pytest.mark.parametrize("plan, message", [
    ("{not json", "is not JSON"),
    ('["thinker"]', "must be a JSON object of stage names to planned bytes"),
    ({"thinker": 0}, "must be a JSON object of stage names to planned bytes"),
    ({"thinker": "1Gi"}, "must be a JSON object of stage names to planned bytes"),
    ({"thinker": 10, "decoder": 10}, "names stages the pipeline does not have: decoder"),
])
def test_a_malformed_plan_is_refused_naming_the_annotation(plan, message):
    (error,) = errors(doc_with(plan))
    assert error.startswith(f"{PATH}: {message}")


def test_a_cpu_stage_whose_memory_limit_is_below_its_plan_is_refused_with_the_numbers():
    def limit(doc):
        doc["spec"]["deployment"]["stages"]["talker"]["resources"]["limits"] = {"memory": "1Gi"}
    assert errors(doc_with({"talker": 1 << 30}, limit)) == []  # exactly full fits
    assert errors(doc_with({"talker": 3 << 29}, limit)) == [
        f"spec.deployment.stages.talker.resources.limits.memory: talker needs 1.5 GiB by its memory plan ({PATH}); "
        "the limit 1Gi gives 1.0 GiB"]

    def on_gpu(doc):
        limit(doc)
        doc["spec"]["deployment"]["stages"]["talker"]["gpus"] = 1
    assert errors(doc_with({"talker": 3 << 29}, on_gpu)) == []  # its plan is GPU memory, not the container's


def test_the_operator_requests_the_planned_memory_where_the_file_requests_none():
    def no_requests(doc):
        doc["spec"]["deployment"]["stages"]["talker"]["resources"] = {}
        doc["spec"]["deployment"]["stages"]["code2wav"].update(gpus=1, resources={})
    doc = doc_with({"thinker": 700 * MiB, "talker": 300 * MiB + 1, "code2wav": 50 * MiB}, no_requests)
    p = parse_pipeline(doc)
    cfg = OperatorConfig()

    def resources(stage):
        return build_stage_deployment(p, stage, cfg)["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources("talker")["requests"] == {"memory": "301Mi"}  # planned, rounded up to whole MiB
    assert resources("thinker")["requests"]["memory"] == "1Gi"  # the file's own request wins
    assert "requests" not in resources("code2wav")  # on a GPU: its plan is GPU memory, not the pod's
    plain = parse_pipeline(doc_with(None, no_requests))
    assert "requests" not in build_stage_deployment(plain, "talker", cfg)["spec"]["template"]["spec"][
        "containers"][0].get("resources", {})


def test_annotate_writes_what_planned_bytes_reads():
    doc = annotate(copy.deepcopy(doc_with(None)), {"thinker": 5, "talker": 7})
    assert planned_bytes(doc["metadata"]["annotations"], {"thinker", "talker", "code2wav"}) == {"thinker": 5,
                                                                                                 "talker": 7}
    assert planned_bytes({}, {"thinker"}) == {} and memory_request(1) == "1Mi" and memory_request(MiB) == "1Mi"
