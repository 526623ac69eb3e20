"""The OmniPipeline CRD and omnistage/spec.py describe one API: every example validates against the
CRD's schema, bad documents are refused by both where a v1.20 schema can say so, and the field names
and enums of the two are walked side by side so they cannot drift apart."""

from __future__ import annotations

import copy
import re

import jsonschema
import pytest
import yaml

from omnistage import spec as omnispec

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


# ------------------------------------------------------------- spec.py and the schema, walked

def maximal_document() -> dict:
    """The example with every optional field spec.py knows, so validating it visits every mapping."""
    doc = copy.deepcopy(BASE)
    topo, dep = doc["spec"]["topology"], doc["spec"]["deployment"]
    topo["stages"][1]["inputs"] = [{"stage": "thinker", "transport": "ucx"}]
    topo["limits"] = {k: 4 for k in omnispec._LIMIT_FIELDS}
    dep["image"] = "example.org/omnistage:1"
    dep["stages"]["talker"] = {
        "replicas": 2, "image": "example.org/omnistage:2",
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
        "gpus": 1, "parallelism": {"tensor": 1, "pipeline": 1, "data": 1}, "dtype": "bfloat16",
        "engineArgs": {"max_model_len": 512}, "scheduler": {"maxBatch": 4, "maxQueued": 8, "maxWaitMs": 1.5},
        "drainSeconds": 10, "env": {"A": "b"}, "transfer": {"maxBufferedBytes": 64 << 20, "ttlSeconds": 30}}
    dep["orchestrator"] = {"replicas": 1, "image": "example.org/omnistage:3",
                           "resources": {"requests": {"cpu": "250m"}, "limits": {"cpu": "1"}}, "maxInflight": 8, "maxQueued": 16,
                           "maxRetries": 1, "fairness": "ShortestFirst", "drainSeconds": 5}
    dep["rollout"] = {"strategy": "Parallel", "order": ["talker"]}
    return doc


def spec_py_mappings(doc: dict) -> dict[str, set[str]]:
    """Which keys spec.py allows at each mapping it checks, by normalized path."""
    seen: dict[str, set[str]] = {}
    original = omnispec._Checker.mapping

    def recording(self, value, path, allowed, required=()):
        free_form = allowed is value  # engineArgs, env, quantities: spec.py allows the keys it is given
        allowed = list(allowed)
        norm = re.sub(r"\[\d+\]", "[]", path)
        norm = re.sub(r"^spec\.deployment\.stages\.[^.]+", "spec.deployment.stages{}", norm)
        seen[norm] = {"<free-form>"} if free_form else set(allowed)
        return original(self, value, path, allowed, required)

    omnispec._Checker.mapping = recording
    try:
        assert omnispec.validate(doc) == []
    finally:
        omnispec._Checker.mapping = original
    return seen


def schema_mappings() -> dict[str, set[str]]:
    out = {}
    for path, node in _walk_schema(SCHEMA):
        if path.startswith("status") or path.startswith("metadata"):
            continue
        if isinstance(node.get("additionalProperties"), dict) and "properties" in node["additionalProperties"]:
            continue  # a map keyed by data (stage names): its entries are walked on their own
        if node.get("type") == "object" or "properties" in node:
            if "properties" in node:
                out[path] = set(node["properties"])
            else:
                out[path] = {"<free-form>"}
    return out


def test_every_field_spec_py_accepts_is_in_the_schema_and_back():
    from_spec = spec_py_mappings(maximal_document())
    from_schema = schema_mappings()
    from_schema["<root>"] = set(SCHEMA["properties"])
    assert sorted(from_spec) == sorted(from_schema)
    for path in from_spec:
        assert from_spec[path] == from_schema[path], path


def _schema_at(path: str) -> dict:
    return dict(_walk_schema(SCHEMA))[path]


@pytest.mark.parametrize("path, values", [
    ("spec.topology.stages[].kind", omnispec.STAGE_KINDS),
    ("spec.topology.stages[].engine", omnispec.ENGINES),
    ("spec.topology.stages[].emits[]", omnispec.EMITS),
    ("spec.topology.stages[].inputs[].transport", omnispec.TRANSPORTS),
    ("spec.topology.outputs[].modality", omnispec.MODALITIES),
    ("spec.deployment.stages{}.dtype", omnispec.DTYPES),
    ("spec.deployment.rollout.strategy", omnispec.ROLLOUT_STRATEGIES),
    ("spec.deployment.orchestrator.fairness", omnispec.FAIRNESS_POLICIES),
])
def test_enums_match_spec_py(path, values):
    assert _schema_at(path)["enum"] == list(values)


def test_quantity_pattern_matches_spec_py():
    pattern = _schema_at("spec.deployment.stages{}.resources.requests{}")["pattern"]
    assert pattern == omnispec._QUANTITY.pattern


def test_name_pattern_matches_spec_py():
    for path in ("metadata.name", "spec.topology.stages[].name"):
        node = _schema_at(path)
        assert node["pattern"] == omnispec._DNS_LABEL.pattern
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
    ("bad modality", lambda d: d["spec"]["topology"]["outputs"][1].update(modality="video"), True,
     "spec.topology.outputs[1].modality"),
    ("no outputs", lambda d: d["spec"]["topology"].update(outputs=[]), True, "spec.topology.outputs"),
    ("limit zero", lambda d: d["spec"]["topology"]["limits"].update(maxTokens=0), True,
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

