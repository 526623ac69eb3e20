"""The OmniPipeline CRD is generated from the API model (omnistage/api/model.py): the committed file is
the generated one, every example validates against its schema, bad documents are refused by both the
schema and omnistage.api.validate where a v1.20 schema can say so, and a field added to the model
reaches validation, defaults, the CRD and `omnistage explain` with no other edit."""

from __future__ import annotations

import copy
import dataclasses

import jsonschema
import pytest
import yaml

from omnistage import api as omnispec
from omnistage.api import model
from omnistage.api.crd import crd_yaml
from omnistage.api.explain import UnknownField, explain
from omnistage.api.fields import api_field, api_fields

from ..conftest import EXAMPLES, REPO

CRD_PATH = REPO / "crds" / "omnipipelines.yaml"
CRD = yaml.safe_load(CRD_PATH.read_text())
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]
BASE = yaml.safe_load((EXAMPLES / "qwen3-omni-tiny.yaml").read_text())


# ------------------------------------------------------- schema as the apiserver reads it

def to_json_schema(node: dict) -> dict:
    """An openAPIV3Schema node as JSON Schema, keeping what the apiserver enforces."""
    out = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {k: to_json_schema(v) for k, v in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = to_json_schema(value)
        elif key == "nullable":
            continue
        elif key == "x-kubernetes-int-or-string":
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        elif key.startswith("x-kubernetes-") and key not in ("x-kubernetes-list-type", "x-kubernetes-list-map-keys"):
            continue
        else:
            out[key] = value
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def _list_type(validator, list_type, instance, schema):
    """x-kubernetes-list-type as the apiserver enforces it: map keys and set items are unique."""
    if not isinstance(instance, list):
        return
    if list_type == "set":
        seen = []
        for item in instance:
            if item in seen:
                yield jsonschema.ValidationError(f"duplicate entry {item!r}")
            seen.append(item)
    elif list_type == "map":
        keys = schema.get("x-kubernetes-list-map-keys", [])
        seen = set()
        for item in instance:
            if isinstance(item, dict):
                k = tuple(item.get(key) for key in keys)
                if k in seen:
                    yield jsonschema.ValidationError(f"duplicate entry for key {dict(zip(keys, k))}")
                seen.add(k)


Validator = jsonschema.validators.extend(jsonschema.Draft4Validator, {"x-kubernetes-list-type": _list_type})


def schema_errors(doc: dict) -> list[str]:
    v = Validator(to_json_schema(SCHEMA))
    return ["/".join(map(str, e.absolute_path)) + ": " + e.message for e in v.iter_errors(doc)]


# ---------------------------------------------------------------------------- the CRD itself

def test_crd_identity():
    assert CRD["apiVersion"] == "apiextensions.k8s.io/v1"
    assert CRD["metadata"]["name"] == "omnipipelines.omnistage.io"
    s = CRD["spec"]
    assert s["group"] == omnispec.API_GROUP and s["scope"] == "Namespaced"
    assert s["names"]["plural"] == "omnipipelines" and s["names"]["kind"] == omnispec.KIND
    assert s["names"]["shortNames"] == ["omnip"]
    assert [v["name"] for v in s["versions"]] == [omnispec.API_VERSION]
    assert VERSION["served"] and VERSION["storage"] and VERSION["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in VERSION["additionalPrinterColumns"]}
    assert columns["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert {"Stages", "Age", "Endpoint"} <= set(columns)


def _walk_schema(node: dict, path: str = "<root>"):
    yield path, node
    for key, sub in node.get("properties", {}).items():
        yield from _walk_schema(sub, f"{path}.{key}" if path != "<root>" else key)
    if isinstance(node.get("items"), dict):
        yield from _walk_schema(node["items"], path + "[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk_schema(node["additionalProperties"], path + "{}")


def test_schema_is_structural_for_v1_20():
    """Every node has a type (or int-or-string / preserve-unknown-fields), no CEL rules (v1.20 has none),
    and no type inside logical junctors."""
    for path, node in _walk_schema(SCHEMA):
        assert "x-kubernetes-validations" not in node, path
        assert ("type" in node or node.get("x-kubernetes-int-or-string")
                or node.get("x-kubernetes-preserve-unknown-fields")), f"{path}: no type"
        for junctor in ("anyOf", "oneOf", "allOf", "not"):
            assert junctor not in node, f"{path}: {junctor} gives unhelpful errors; the webhook says it better"
        if path.startswith("spec") and "properties" in node:
            # Unknown fields are kept for the webhook to refuse by name, never pruned in silence.
            assert node.get("x-kubernetes-preserve-unknown-fields") is True, f"{path}: would prune"
        if node.get("x-kubernetes-list-type") == "map":
            keys = node["x-kubernetes-list-map-keys"]
            assert set(keys) <= set(node["items"].get("required", [])), f"{path}: map keys must be required"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_validate_against_the_crd(path):
    doc = yaml.safe_load(path.read_text())
    assert schema_errors(doc) == []
    assert omnispec.validate(doc) == []


# ------------------------------------------------------- generated from the model, never by hand

def test_committed_crd_is_the_generated_one():
    assert CRD_PATH.read_text() == crd_yaml(), "the CRD differs from the model: run `make crd`"


def test_every_default_satisfies_its_own_schema():
    """The apiserver refuses a CRD whose defaults do not validate against their own node."""
    for path, node in _walk_schema(SCHEMA):
        if "default" in node:
            assert Validator(to_json_schema({k: v for k, v in node.items() if k != "default"})).is_valid(
                node["default"]), path


def test_a_new_stage_field_is_one_edit_in_the_model(monkeypatch):
    """Add `warmupRequests` to spec.deployment.stages.<name> as a later change would: one field in the
    model. Validation, defaults, the CRD schema and `explain` all follow."""
    extended = dataclasses.make_dataclass(
        "StageDeployment", [("warmup_requests", int, api_field("Requests sent before the stage reports ready.",
                                                                default=2, minimum=0, maximum=64))],
        bases=(model.StageDeployment,), frozen=True)
    extended.__module__ = model.__name__
    monkeypatch.setattr(model, "StageDeployment", extended)
    api_fields.cache_clear()
    try:
        loaded = omnispec.parse_pipeline(BASE)
        assert loaded.deployment.stages["talker"].warmup_requests == 2          # the default
        doc = variant(lambda d: dep(d)["stages"]["talker"].update(warmupRequests=5))
        assert omnispec.parse_pipeline(doc).deployment.stages["talker"].warmup_requests == 5
        bad = variant(lambda d: dep(d)["stages"]["talker"].update(warmupRequests=65))
        assert [str(e) for e in omnispec.validate(bad)] == [
            "spec.deployment.stages.talker.warmupRequests: must be <= 64, got 65"]
        typo = variant(lambda d: dep(d)["stages"]["talker"].update(warmupRequest=5))
        assert 'unknown field (did you mean "warmupRequests"?)' in str(omnispec.validate(typo)[0])
        node = yaml.safe_load(crd_yaml())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        node = node["properties"]["spec"]["properties"]["deployment"]["properties"]["stages"]
        assert node["additionalProperties"]["properties"]["warmupRequests"] == {
            "description": "Requests sent before the stage reports ready.", "type": "integer", "minimum": 0,
            "maximum": 64, "default": 2}
        assert "warmupRequests\t<integer>" in explain("spec.deployment.stages")
        assert "Default: 2. Bounds: >= 0, <= 64." in explain("spec.deployment.stages.warmupRequests")
    finally:
        monkeypatch.undo()
        api_fields.cache_clear()
    assert "warmupRequests" not in crd_yaml()


def test_explain_names_a_missing_field_with_a_hint():
    with pytest.raises(UnknownField, match='field "replica" does not exist in spec.deployment.stages '
                                           r'\(did you mean "replicas"\?\)'):
        explain("spec.deployment.stages.replica")


def test_explain_walks_lists_and_maps():
    text = explain("spec.topology.stages.inputs")
    assert "FIELD:    inputs <[]object>" in text and 'Unique by "stage".' in text
    assert "transport\t<string>" in text and "One of: auto, inline, shm, ucx." in text
    tree = explain(recursive=True)
    assert "      deployment\t<object> -required-" in tree and "            maxBatch\t<integer>" in tree


def _schema_at(path: str) -> dict:
    return dict(_walk_schema(SCHEMA))[path]


def test_stage_and_pipeline_names_fit_service_names():
    # "<pipeline>-orchestrator" and "<pipeline>-<stage>" must fit in a Service name.
    assert _schema_at("metadata.name")["maxLength"] == omnispec.MAX_NAME_LEN - len("-orchestrator")
    assert _schema_at("spec.topology.stages[].name")["maxLength"] == omnispec.MAX_NAME_LEN - 2


# ------------------------------------------------------------------------ bad documents

def variant(edit) -> dict:
    doc = copy.deepcopy(BASE)
    edit(doc)
    return doc


def st(d, i):
    return d["spec"]["topology"]["stages"][i]


def dep(d):
    return d["spec"]["deployment"]


# (id, edit, the schema can say it, field path spec.py names)
BAD = [
    ("bad kind", lambda d: st(d, 0).update(kind="transformer"), True, "spec.topology.stages[0].kind"),
    ("bad engine", lambda d: st(d, 0).update(engine="tgi"), True, "spec.topology.stages[0].engine"),
    ("bad emits", lambda d: st(d, 2).update(emits=["wav"]), True, "spec.topology.stages[2].emits[0]"),
    ("empty emits", lambda d: st(d, 2).update(emits=[]), True, "spec.topology.stages[2].emits"),
    ("missing model", lambda d: st(d, 1).pop("model"), True, "spec.topology.stages[1].model"),
    ("empty model", lambda d: st(d, 1).update(model=""), True, "spec.topology.stages[1].model"),
    ("upper-case stage name", lambda d: st(d, 0).update(name="Thinker"), True, "spec.topology.stages[0].name"),
    ("negative chunkSize", lambda d: st(d, 0).update(chunkSize=-1), True, "spec.topology.stages[0].chunkSize"),
    ("string chunkSize", lambda d: st(d, 0).update(chunkSize="4"), True, "spec.topology.stages[0].chunkSize"),
    ("bad transport", lambda d: st(d, 1).update(inputs=[{"stage": "thinker", "transport": "rdma"}]), True,
     "spec.topology.stages[1].inputs[0].transport"),
    ("duplicate stage name", lambda d: st(d, 1).update(name="thinker"), True, "spec.topology.stages[1].name"),
    ("duplicate output modality", lambda d: d["spec"]["topology"]["outputs"].append(
        {"modality": "text", "stage": "thinker"}), True, "spec.topology.outputs[2].modality"),
    ("bad modality", lambda d: d["spec"]["topology"]["outputs"][1].update(modality="hologram"), True,
     "spec.topology.outputs[1].modality"),
    ("no outputs", lambda d: d["spec"]["topology"].update(outputs=[]), True, "spec.topology.outputs"),
    ("limit zero", lambda d: d["spec"]["topology"]["limits"].update(maxCodecFrames=0), True,
     "spec.topology.limits.maxCodecFrames"),
    ("limit negative", lambda d: d["spec"]["topology"]["limits"].update(maxTokens=-1), True,
     "spec.topology.limits.maxTokens"),
    ("missing deployment", lambda d: d["spec"].pop("deployment"), True, "spec.deployment"),
    ("negative replicas", lambda d: dep(d)["stages"]["talker"].update(replicas=-1), True,
     "spec.deployment.stages.talker.replicas"),
    ("too many gpus", lambda d: dep(d)["stages"]["talker"].update(gpus=65), True,
     "spec.deployment.stages.talker.gpus"),
    ("bad dtype", lambda d: dep(d)["stages"]["talker"].update(dtype="fp8"), True,
     "spec.deployment.stages.talker.dtype"),
    ("bad quantity", lambda d: dep(d)["stages"]["talker"]["resources"]["requests"].update(cpu="lots"), True,
     "spec.deployment.stages.talker.resources.requests.cpu"),
    ("zero tensor parallel", lambda d: dep(d)["stages"]["talker"].update(parallelism={"tensor": 0}), True,
     "spec.deployment.stages.talker.parallelism.tensor"),
    ("env not a string", lambda d: dep(d)["stages"]["talker"].update(env={"N": 3}), True,
     "spec.deployment.stages.talker.env.N"),
    ("scheduler maxBatch zero", lambda d: dep(d)["stages"]["talker"].update(scheduler={"maxBatch": 0}), True,
     "spec.deployment.stages.talker.scheduler.maxBatch"),
    ("negative drainSeconds", lambda d: dep(d)["stages"]["talker"].update(drainSeconds=-5), True,
     "spec.deployment.stages.talker.drainSeconds"),
    ("bad strategy", lambda d: dep(d)["rollout"].update(strategy="AllAtOnce"), True,
     "spec.deployment.rollout.strategy"),
    ("order twice", lambda d: dep(d)["rollout"].update(order=["talker", "talker"]), True,
     "spec.deployment.rollout.order[1]"),
    ("bad fairness", lambda d: dep(d)["orchestrator"].update(fairness="Random"), True,
     "spec.deployment.orchestrator.fairness"),
    ("maxRetries too high", lambda d: dep(d)["orchestrator"].update(maxRetries=11), True,
     "spec.deployment.orchestrator.maxRetries"),
    ("long pipeline name", lambda d: d["metadata"].update(name="p" * 51), True, "metadata.name"),
    # Cross-field rules, which a v1.20 schema cannot express, and unknown fields, which it keeps
    # (see the CRD's header): the webhook (spec.py) refuses them.
    ("unknown input stage", lambda d: st(d, 1).update(inputs=[{"stage": "talkr"}]), False,
     "spec.topology.stages[1].inputs[0]"),
    ("cycle", lambda d: st(d, 0).update(inputs=[{"stage": "code2wav"}]), False, "spec.topology.stages"),
    ("engine cannot serve kind", lambda d: st(d, 0).update(engine="diffusers"), False,
     "spec.topology.stages[0].engine"),
    ("missing deployment entry", lambda d: dep(d)["stages"].pop("talker"), False, "spec.deployment.stages"),
    ("deployment entry for unknown stage", lambda d: dep(d)["stages"].update(talkr={}), False,
     "spec.deployment.stages.talkr"),
    ("output from stage that does not emit it", lambda d: d["spec"]["topology"]["outputs"][0].update(
        stage="talker"), False, "spec.topology.outputs[0].stage"),
    ("order names unknown stage", lambda d: dep(d)["rollout"].update(order=["talkr"]), False,
     "spec.deployment.rollout.order[0]"),
    ("default above max", lambda d: d["spec"]["topology"]["limits"].update(defaultMaxTokens=600), False,
     "spec.topology.limits.defaultMaxTokens"),
    ("unknown stage field", lambda d: st(d, 0).update(chunksize=4), False, "spec.topology.stages[0].chunksize"),
    ("unknown limit", lambda d: d["spec"]["topology"]["limits"].update(maxTokenz=3), False,
     "spec.topology.limits.maxTokenz"),
    ("unknown deployment field", lambda d: dep(d)["stages"]["talker"].update(replica=2), False,
     "spec.deployment.stages.talker.replica"),
]


@pytest.mark.parametrize("edit, schema_says, field", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_documents(edit, schema_says, field):
    doc = variant(edit)
    errors = [str(e) for e in omnispec.validate(doc)]
    assert any(e.startswith(field) for e in errors), errors
    if schema_says:
        assert schema_errors(doc), "the CRD schema accepted it"
    else:
        assert schema_errors(doc) == [], "expected only the webhook to catch this"


def test_input_shorthand_is_refused_by_both():
    doc = variant(lambda d: st(d, 1).update(inputs=["thinker"]))
    assert schema_errors(doc)
    assert omnispec.validate(doc)


def test_helm_chart_ships_the_same_crd():
    chart_crd = REPO / "charts" / "omnistage" / "crds" / "omnipipelines.yaml"
    assert chart_crd.read_text() == CRD_PATH.read_text(), "copy crds/omnipipelines.yaml into the chart"



def apply_defaults(node: dict, value):
    """The apiserver's structural defaulting: a missing field with a default gets it, in every object."""
    if isinstance(value, dict):
        for key, sub in node.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                apply_defaults(sub, value[key])
        if isinstance(node.get("additionalProperties"), dict):
            for v in value.values():
                apply_defaults(node["additionalProperties"], v)
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for v in value:
            apply_defaults(node["items"], v)
    return value


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_defaulting_by_the_apiserver_changes_no_pipeline_and_rolls_no_pod(path):
    from omnistage_operator.builders import config_hash

    doc = yaml.safe_load(path.read_text())
    defaulted = apply_defaults(SCHEMA["properties"]["spec"], copy.deepcopy(doc["spec"]))
    assert defaulted != doc["spec"]                 # the CRD does fill fields in
    before, after = omnispec.parse_pipeline(doc), omnispec.parse_pipeline({**doc, "spec": defaulted})
    assert after == before
    for stage in [s.name for s in before.stages] + [None]:
        assert config_hash(after, stage) == config_hash(before, stage)


def undeclared(node: dict, value, path: str = "status") -> list[str]:
    """Keys of `value` that the schema node does not declare (the apiserver would prune them)."""
    out = []
    if isinstance(value, dict):
        props, extra = node.get("properties"), node.get("additionalProperties")
        for key, v in value.items():
            sub = props.get(key) if props is not None else extra if isinstance(extra, dict) else None
            if sub is None:
                out.append(f"{path}.{key}")
            else:
                out += undeclared(sub, v, f"{path}.{key}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += undeclared(node["items"], v, f"{path}[{i}]")
    return out


def test_the_status_the_operator_writes_is_the_modelled_one():
    from omnistage_operator.rollout import RolloutPlan
    from omnistage_operator.status import build_status, invalid_status, unit_counts

    live = {"status": {"readyReplicas": 1, "updatedReplicas": 1}}
    status = build_status(None, generation=2, stages={"thinker": unit_counts(1, live), "talker": unit_counts(2, live)},
                          orchestrator=unit_counts(1, live), deployments={}, plan=RolloutPlan((), (), ()),
                          endpoint="p-orchestrator.ns:50051", now="2024-01-01T00:00:00Z")
    node = SCHEMA["properties"]["status"]
    for st in (status, invalid_status(status, generation=3, errors=["x: bad"], now="2024-01-01T00:01:00Z")):
        assert list(Validator(to_json_schema(node)).iter_errors(st)) == []
        assert undeclared(node, st) == []
