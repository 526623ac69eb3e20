"""spec.deployment.autoscaling (the stage planner's bounds and targets) and the planner's status fields: the
defaults, a full block loaded into the model, `bounds()`, every cross-field rule refused by field path, and the
generated CRD carrying all of it."""

from __future__ import annotations

import copy

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnistage.api import SpecError, parse_pipeline, validate
from omnistage.api.crd import crd
from omnistage.api.model import (
    CONDITION_TYPES,
    Autoscaling,
    AutoscalingBudget,
    AutoscalingTargets,
    ReplicaStatus,
    StageAutoscaling,
)

from ..conftest import EXAMPLES

BASE = yaml.safe_load((EXAMPLES / "qwen3-omni-tiny.yaml").read_text())   # thinker -> talker -> code2wav
AUTO = "spec.deployment.autoscaling"

FULL = {
    "enabled": True,
    "mode": "Recommend",
    "intervalSeconds": 2,
    "targets": {"ttfpP95Ms": 2000, "rtf": 0.8, "queueSeconds": 0.5, "utilization": 0.7},
    "budget": {"maxGpus": 8, "maxReplicas": 12},
    "stages": {"talker": {"minReplicas": 2, "maxReplicas": 4, "scaleDownDelaySeconds": 30}},
}


def with_autoscaling(auto, gpus=None) -> dict:
    """The example with `auto` as spec.deployment.autoscaling and `gpus` per replica by stage name."""
    doc = copy.deepcopy(BASE)
    doc["spec"]["deployment"]["autoscaling"] = auto
    for name, n in (gpus or {}).items():
        doc["spec"]["deployment"]["stages"][name]["gpus"] = n
    return doc


def errors(doc) -> list[str]:
    return [str(e) for e in validate(doc)]


# ------------------------------------------------------------------------------ good documents

def test_absent_is_off_with_the_defaults():
    got = parse_pipeline(BASE).deployment.autoscaling
    assert got == Autoscaling()
    assert (got.enabled, got.interval_seconds, got.stages) == (False, 1.0, {})
    assert got.mode == "Scale" and got.scales
    assert got.targets == AutoscalingTargets(ttfp_p95_ms=0.0, rtf=0.0, queue_seconds=1.0, utilization=0.8)
    assert got.budget == AutoscalingBudget(max_gpus=0, max_replicas=0)


@pytest.mark.parametrize("auto", [{}, {"enabled": False}, {"targets": {}, "budget": {}, "stages": {}}])
def test_an_empty_block_takes_the_defaults(auto):
    assert parse_pipeline(with_autoscaling(auto)).deployment.autoscaling == Autoscaling(enabled=auto.get("enabled",
                                                                                                         False))


def test_a_full_block_loads_into_the_model():
    got = parse_pipeline(with_autoscaling(FULL, gpus={"thinker": 1, "talker": 1})).deployment.autoscaling
    assert got.enabled is True and got.interval_seconds == 2.0 and isinstance(got.interval_seconds, float)
    assert got.mode == "Recommend" and not got.scales   # decides and reports; the user's autoscaler acts
    assert got.targets == AutoscalingTargets(ttfp_p95_ms=2000.0, rtf=0.8, queue_seconds=0.5, utilization=0.7)
    assert got.budget == AutoscalingBudget(max_gpus=8, max_replicas=12)
    assert got.stages == {"talker": StageAutoscaling(min_replicas=2, max_replicas=4, scale_down_delay_seconds=30.0)}


@pytest.mark.parametrize("stage, expected", [
    ("talker", StageAutoscaling(min_replicas=2, max_replicas=4, scale_down_delay_seconds=30.0)),   # listed
    ("code2wav", StageAutoscaling(min_replicas=1, max_replicas=8, scale_down_delay_seconds=60.0)),  # defaults
])
def test_bounds_of_a_listed_and_an_unlisted_stage(stage, expected):
    assert parse_pipeline(with_autoscaling(FULL)).deployment.autoscaling.bounds(stage) == expected


@pytest.mark.parametrize("auto, gpus", [
    ({"stages": {"talker": {"minReplicas": 3, "maxReplicas": 3}}}, None),                       # min == max
    ({"budget": {"maxReplicas": 3}}, None),                                                     # exactly the mins
    ({"budget": {"maxGpus": 3}}, {"thinker": 1, "talker": 1, "code2wav": 1}),                  # exactly the GPUs
    ({"budget": {"maxGpus": 1}}, None),                                                         # CPU stages
    ({"targets": {"utilization": 1, "queueSeconds": 0}, "intervalSeconds": 0.1}, None),         # edge bounds
])
def test_edges_that_are_valid(auto, gpus):
    assert errors(with_autoscaling(auto, gpus)) == []


def test_replicas_outside_the_bounds_are_a_starting_point_not_an_error():
    doc = with_autoscaling({"enabled": True, "stages": {"talker": {"minReplicas": 2, "maxReplicas": 3}}})
    doc["spec"]["deployment"]["stages"]["talker"]["replicas"] = 7
    assert errors(doc) == []


# ------------------------------------------------------------------------------- bad documents

BAD = [
    ("unknown stage, with a suggestion",
     {"stages": {"talkr": {"maxReplicas": 2}}}, None,
     [f'{AUTO}.stages.talkr: unknown stage "talkr" (did you mean "talker"?)']),
    ("min above max",
     {"stages": {"talker": {"minReplicas": 5, "maxReplicas": 2}}}, None,
     [f"{AUTO}.stages.talker.minReplicas: must be <= maxReplicas (2), got 5"]),
    ("min above the default max",
     {"stages": {"talker": {"minReplicas": 9}}}, None,
     [f"{AUTO}.stages.talker.minReplicas: must be <= maxReplicas (8, the default), got 9"]),
    ("maxReplicas below the sum of the mins",
     {"budget": {"maxReplicas": 4}, "stages": {"talker": {"minReplicas": 3}}}, None,
     [f"{AUTO}.budget.maxReplicas: must be >= 5, the sum of every stage's minReplicas (thinker 1, talker 3, "
      "code2wav 1), got 4: the planner could not keep every stage at its minimum"]),
    ("maxGpus below the GPUs at the mins",
     {"budget": {"maxGpus": 2}, "stages": {"thinker": {"minReplicas": 2}}}, {"thinker": 1, "talker": 1},
     [f"{AUTO}.budget.maxGpus: must be >= 3, the GPUs every stage needs at its minReplicas (minReplicas x gpus: "
      "thinker 2 x 1, talker 1 x 1), got 2"]),
    ("a stage needing more GPUs than maxGpus (said once: not the sum as well)",
     {"budget": {"maxGpus": 1}}, {"talker": 2},
     [f'{AUTO}.budget.maxGpus: stage "talker" needs 2 GPUs per replica (spec.deployment.stages.talker.gpus), more '
      "than maxGpus (1): it could never get a replica"]),
    ("negative ttfp target",
     {"targets": {"ttfpP95Ms": -1}}, None,
     [f"{AUTO}.targets.ttfpP95Ms: must be >= 0, got -1"]),
    ("negative rtf target",
     {"targets": {"rtf": -0.5}}, None,
     [f"{AUTO}.targets.rtf: must be >= 0, got -0.5"]),
    ("negative queue target",
     {"targets": {"queueSeconds": -1}}, None,
     [f"{AUTO}.targets.queueSeconds: must be >= 0, got -1"]),
    ("utilization 0",
     {"targets": {"utilization": 0}}, None,
     [f"{AUTO}.targets.utilization: must be >= 0.05, got 0"]),
    ("utilization above 1",
     {"targets": {"utilization": 1.5}}, None,
     [f"{AUTO}.targets.utilization: must be <= 1, got 1.5"]),
    ("interval too short",
     {"intervalSeconds": 0.01}, None,
     [f"{AUTO}.intervalSeconds: must be >= 0.1, got 0.01"]),
    ("interval too long",
     {"intervalSeconds": 120}, None,
     [f"{AUTO}.intervalSeconds: must be <= 60, got 120"]),
    ("scale to zero",
     {"stages": {"talker": {"minReplicas": 0}}}, None,
     [f"{AUTO}.stages.talker.minReplicas: must be >= 1, got 0"]),
    ("negative scale-down delay",
     {"stages": {"talker": {"scaleDownDelaySeconds": -1}}}, None,
     [f"{AUTO}.stages.talker.scaleDownDelaySeconds: must be >= 0, got -1"]),
    ("negative budget",
     {"budget": {"maxGpus": -1}}, None,
     [f"{AUTO}.budget.maxGpus: must be >= 0, got -1"]),
    ("enabled not a boolean",
     {"enabled": "yes"}, None,
     [f'{AUTO}.enabled: must be true or false, got "yes"']),
    ("min replicas not an integer",
     {"stages": {"talker": {"minReplicas": "two"}}}, None,
     [f'{AUTO}.stages.talker.minReplicas: must be an integer, got "two"']),
    ("budget not an integer",
     {"budget": {"maxReplicas": 2.5}}, None,
     [f"{AUTO}.budget.maxReplicas: must be an integer, got 2.5"]),
    ("stages not a mapping",
     {"stages": ["talker"]}, None,
     [f"{AUTO}.stages: must be a mapping, got a list"]),
    ("stage entry not a mapping",
     {"stages": {"talker": 3}, "budget": {"maxReplicas": 1}}, None,
     [f"{AUTO}.stages.talker: must be a mapping, got int"]),
    ("autoscaling not a mapping",
     True, None,
     [f"{AUTO}: must be a mapping, got bool"]),
    ("unknown mode",
     {"mode": "Auto"}, None,
     [f'{AUTO}.mode: "Auto" is not one of Scale, Recommend']),
    ("typo in a field name",
     {"stages": {"talker": {"maxReplica": 2}}}, None,
     [f'{AUTO}.stages.talker.maxReplica: unknown field (did you mean "maxReplicas"?)']),
]


@pytest.mark.parametrize("auto, gpus, expected", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_autoscaling_is_refused_with_field_paths(auto, gpus, expected):
    doc = with_autoscaling(auto, gpus)
    with pytest.raises(SpecError):
        parse_pipeline(doc)
    # Exactly these under autoscaling: a rule skipped on a wrong type, and no error said twice. (Other paths may
    # have their own say: a transformers stage with gpus 2 is refused at its gpus.)
    assert [m for m in errors(doc) if m.startswith(AUTO)] == expected


@pytest.mark.parametrize("name, edit, expected", [
    ("gpus of the wrong type: only pass 1 speaks",
     lambda d: d["spec"]["deployment"]["stages"]["talker"].update(gpus="two"),
     ['spec.deployment.stages.talker.gpus: must be an integer, got "two"']),
    ("a stage entry that is null counts 0 GPUs",
     lambda d: d["spec"]["deployment"]["stages"].update(code2wav=None), []),
    ("an unknown stage's bounds count toward nothing",
     lambda d: d["spec"]["deployment"]["autoscaling"]["stages"].update(vocoder={"minReplicas": 50}),
     [f'{AUTO}.stages.vocoder: unknown stage "vocoder"']),
])
def test_the_budget_rules_skip_what_pass_1_refuses(name, edit, expected):
    doc = with_autoscaling({"budget": {"maxGpus": 2, "maxReplicas": 3}, "stages": {}}, gpus={"thinker": 1, "talker": 1})
    edit(doc)
    assert errors(doc) == expected


# Any value where a key of the block is expected: pass 2 reads only what pass 1 accepts, and never raises.
_values = st.one_of(st.none(), st.booleans(), st.integers(-5, 2**70), st.floats(), st.text(max_size=6),
                    st.sampled_from(["talker", "thinker", "code2wav"]))
_keys = st.sampled_from(["enabled", "intervalSeconds", "targets", "budget", "stages", "maxGpus", "maxReplicas",
                         "minReplicas", "talker", "thinker", "code2wav", "talkr", "utilization"]) | st.integers(0, 2)
_blocks = st.recursive(_values, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_keys, inner, max_size=4),
                       max_leaves=15)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(auto=_blocks, gpus=st.dictionaries(st.sampled_from(["thinker", "talker", "code2wav"]), _values, max_size=3))
def test_any_block_gives_errors_by_path_or_a_pipeline(auto, gpus):
    doc = with_autoscaling(auto, gpus)
    found = validate(doc)
    assert all(e.path and e.message for e in found)
    if not found:
        assert isinstance(parse_pipeline(doc).deployment.autoscaling, Autoscaling)


# ------------------------------------------------------------------------------------ status

def test_the_planner_reports_in_the_stage_status():
    assert "Planned" in CONDITION_TYPES
    s = ReplicaStatus()
    assert (s.desired_replicas, s.capacity, s.capacity_unit, s.utilization) == (0, 0.0, "", 0.0)


# --------------------------------------------------------------------------------------- CRD

def _node(schema: dict, *path: str) -> dict:
    for key in path:
        schema = schema["additionalProperties"] if key == "{}" else schema["items"] if key == "[]" else \
            schema["properties"][key]
    return schema


ROOT = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_the_crd_carries_the_autoscaling_schema():
    auto = _node(ROOT, "spec", "deployment", "autoscaling")
    assert list(auto["properties"]) == ["enabled", "mode", "intervalSeconds", "targets", "budget", "stages"]
    assert auto["properties"]["enabled"]["default"] is False
    assert (auto["properties"]["mode"]["enum"], auto["properties"]["mode"]["default"]) == (["Scale", "Recommend"],
                                                                                           "Scale")
    assert {k: auto["properties"]["intervalSeconds"].get(k) for k in ("minimum", "maximum", "default")} == {
        "minimum": 0.1, "maximum": 60, "default": 1.0}
    targets = auto["properties"]["targets"]["properties"]
    assert {k: (v["minimum"], v.get("maximum"), v["default"]) for k, v in targets.items()} == {
        "ttfpP95Ms": (0, None, 0.0), "rtf": (0, None, 0.0), "underruns": (0, 1, 0.0), "queueSeconds": (0, None, 1.0),
        "utilization": (0.05, 1, 0.8)}
    budget = auto["properties"]["budget"]["properties"]
    assert {k: (v["type"], v["minimum"], v["default"]) for k, v in budget.items()} == {
        "maxGpus": ("integer", 0, 0), "maxReplicas": ("integer", 0, 0)}
    stage = _node(auto, "stages", "{}")["properties"]
    assert {k: (v["minimum"], v.get("maximum"), v["default"]) for k, v in stage.items()} == {
        "minReplicas": (1, 1000, 1), "maxReplicas": (1, 1000, 8), "scaleDownDelaySeconds": (0, None, 60.0)}
    for node in (auto, *auto["properties"].values(), *targets.values(), *budget.values(), *stage.values()):
        assert node["description"], node


def test_the_crd_carries_the_planner_status():
    stage = _node(ROOT, "status", "stages", "{}")["properties"]
    assert stage["desiredReplicas"]["type"] == "integer" and stage["desiredReplicas"]["format"] == "int32"
    assert stage["capacity"]["type"] == stage["utilization"]["type"] == "number"
    assert stage["capacityUnit"] == {"description": stage["capacityUnit"]["description"], "type": "string"}
    assert "Planned" in _node(ROOT, "status", "conditions", "[]", "type")["enum"]


def test_the_committed_crd_takes_a_full_block_and_refuses_a_bad_one():
    from .test_crd import schema_errors  # the committed CRD as the apiserver reads it

    assert schema_errors(with_autoscaling(FULL)) == []
    assert schema_errors(with_autoscaling({"targets": {"utilization": 0}}))
    assert schema_errors(with_autoscaling({"stages": {"talker": {"minReplicas": 0}}}))
