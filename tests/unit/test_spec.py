"""The pipeline spec model: good files load, bad files are refused with every error by field path."""

from __future__ import annotations

import copy

import pytest
import yaml

from omnistage.api import SpecError, load_pipeline, parse_pipeline, parse_pipeline_yaml, validate

from ..conftest import EXAMPLES

BASE = yaml.safe_load((EXAMPLES / "qwen3-omni-tiny.yaml").read_text())


def variant(edit) -> dict:
    doc = copy.deepcopy(BASE)
    edit(doc)
    return doc


def stages(doc):
    return doc["spec"]["topology"]["stages"]


def deploy(doc):
    return doc["spec"]["deployment"]


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_are_valid(path):
    p = load_pipeline(path)
    assert p.stages and p.outputs
    assert set(p.deployment.stages) == {s.name for s in p.stages}


def test_model_reads_the_fields():
    p = parse_pipeline(BASE)
    assert [s.name for s in p.topo_order()] == ["thinker", "talker", "code2wav"]
    talker = p.stage("talker")
    assert talker.kind == "ar" and talker.engine == "transformers" and talker.component == "talker"
    assert [e.source for e in talker.inputs] == ["thinker"] and talker.chunk_size == 25
    assert [s.name for s in p.consumers("thinker")] == ["talker"]
    assert [s.name for s in p.entry_stages] == ["thinker"]
    assert p.limits.default_max_tokens == 16 and p.limits.max_tokens == 512
    assert p.deployment.orchestrator.max_inflight == 32
    assert p.deployment.rollout.strategy == "OneStageAtATime"
    assert p.deployment.stages["code2wav"].resources.requests["cpu"] == "500m"


BAD = [
    ("unknown input stage",
     lambda d: stages(d)[1]["inputs"].__setitem__(0, {"stage": "talkr"}),
     ['spec.topology.stages[1].inputs[0]: unknown stage "talkr"']),
    ("input given as a bare name",
     lambda d: stages(d)[2].__setitem__("inputs", ["talker"]),
     ["spec.topology.stages[2].inputs[0]: must be a mapping, got a string"]),
    ("reserved stage name",
     lambda d: stages(d)[2].__setitem__("name", "orchestrator"),
     ['spec.topology.stages[2].name: "orchestrator" is reserved']),
    ("object name too long",
     lambda d: stages(d)[0].__setitem__("name", "t" * 50),
     ['spec.topology.stages[0].name: "qwen3-omni-tiny-' + "t" * 50 + '" (pipeline name + "-" + stage name) is longer '
      "than 63 characters"]),
    ("pipeline name starting with a digit",
     lambda d: d["metadata"].__setitem__("name", "3omni"),
     ['metadata.name: "3omni" must be lower-case letters']),
    ("cycle",
     lambda d: stages(d)[0].__setitem__("inputs", [{"stage": "talker"}]),
     ["spec.topology.stages: the stage graph has a cycle: "]),
    ("self loop",
     lambda d: stages(d)[0].__setitem__("inputs", [{"stage": "thinker"}]),
     ['spec.topology.stages[0].inputs[0]: stage "thinker" cannot take its own output as input']),
    ("unknown kind",
     lambda d: stages(d)[0].__setitem__("kind", "autoregressive"),
     ['spec.topology.stages[0].kind: "autoregressive" is not one of ar, diffusion, generation']),
    ("unknown engine",
     lambda d: stages(d)[0].__setitem__("engine", "tensorrt"),
     ['spec.topology.stages[0].engine: "tensorrt" is not one of vllm, transformers, diffusers']),
    ("engine cannot serve kind",
     lambda d: stages(d)[2].__setitem__("engine", "vllm"),
     ['spec.topology.stages[2].engine: engine "vllm" cannot serve a "generation" stage']),
    ("duplicate stage",
     lambda d: stages(d)[2].__setitem__("name", "talker"),
     ['spec.topology.stages[2].name: duplicate stage name "talker"']),
    ("bad stage name",
     lambda d: stages(d)[0].__setitem__("name", "Thinker_1"),
     ['spec.topology.stages[0].name: "Thinker_1" must be lower-case']),
    ("missing deployment entry",
     lambda d: deploy(d)["stages"].pop("talker"),
     ['spec.deployment.stages: missing entry for stage "talker"']),
    ("deployment entry for unknown stage",
     lambda d: deploy(d)["stages"].__setitem__("talkr", {"replicas": 1}),
     ['spec.deployment.stages.talkr: unknown stage "talkr" (did you mean "talker"?)']),
    ("negative replicas",
     lambda d: deploy(d)["stages"]["thinker"].__setitem__("replicas", -1),
     ["spec.deployment.stages.thinker.replicas: must be >= 0, got -1"]),
    ("replicas not an int",
     lambda d: deploy(d)["stages"]["thinker"].__setitem__("replicas", "two"),
     ['spec.deployment.stages.thinker.replicas: must be an integer, got "two"']),
    ("output modality not emitted",
     lambda d: d["spec"]["topology"]["outputs"].append({"modality": "image", "stage": "code2wav"}),
     ['spec.topology.outputs[2].stage: stage "code2wav" does not emit image']),
    ("output from unknown stage",
     lambda d: d["spec"]["topology"]["outputs"][1].__setitem__("stage", "vocoder"),
     ['spec.topology.outputs[1].stage: unknown stage "vocoder"']),
    ("stage feeding no output",
     lambda d: d["spec"]["topology"]["outputs"].pop(1),
     ['spec.topology.stages[1]: stage "talker" feeds no pipeline output',
      'spec.topology.stages[2]: stage "code2wav" feeds no pipeline output']),
    ("typo in a field name",
     lambda d: stages(d)[0].__setitem__("chunksize", 4),
     ['spec.topology.stages[0].chunksize: unknown field (did you mean "chunkSize"?)']),
    ("negative chunk size",
     lambda d: stages(d)[0].__setitem__("chunkSize", -4),
     ["spec.topology.stages[0].chunkSize: must be >= 0, got -4"]),
    ("unknown emit",
     lambda d: stages(d)[0].__setitem__("emits", ["text", "smell"]),
     ['spec.topology.stages[0].emits[1]: "smell" is not one of']),
    ("bad transport",
     lambda d: stages(d)[1]["inputs"][0].__setitem__("transport", "carrier-pigeon"),
     ['spec.topology.stages[1].inputs[0].transport: "carrier-pigeon" is not one of auto, inline, shm, ucx']),
    ("bad rollout strategy",
     lambda d: deploy(d)["rollout"].__setitem__("strategy", "AllAtOnce"),
     ['spec.deployment.rollout.strategy: "AllAtOnce" is not one of OneStageAtATime, Parallel']),
    ("rollout order names unknown stage",
     lambda d: deploy(d)["rollout"].__setitem__("order", ["talker", "vocoder"]),
     ['spec.deployment.rollout.order[1]: unknown stage "vocoder"']),
    ("bad quantity",
     lambda d: deploy(d)["stages"]["thinker"]["resources"]["requests"].__setitem__("memory", "lots"),
     ['spec.deployment.stages.thinker.resources.requests.memory: not a resource quantity: "lots"']),
    ("bad dtype",
     lambda d: deploy(d)["stages"]["thinker"].__setitem__("dtype", "int4"),
     ['spec.deployment.stages.thinker.dtype: "int4" is not one of auto, float32, float16, bfloat16']),
    ("scheduler bound",
     lambda d: deploy(d)["stages"]["thinker"].__setitem__("scheduler", {"maxBatch": 0}),
     ["spec.deployment.stages.thinker.scheduler.maxBatch: must be >= 1, got 0"]),
    ("stall bound not positive",
     lambda d: deploy(d)["stages"]["thinker"].__setitem__("scheduler", {"stallSeconds": 0}),
     ["spec.deployment.stages.thinker.scheduler.stallSeconds: must be >= 0.001, got 0"]),
    ("negative request timeout",
     lambda d: d["spec"]["topology"]["limits"].__setitem__("requestTimeoutSeconds", -1),
     ["spec.topology.limits.requestTimeoutSeconds: must be >= 0, got -1"]),
    ("request timeout not a number",
     lambda d: d["spec"]["topology"]["limits"].__setitem__("requestTimeoutSeconds", "ten minutes"),
     ["spec.topology.limits.requestTimeoutSeconds: must be a number"]),
    ("limits default above max",
     lambda d: d["spec"]["topology"]["limits"].__setitem__("maxTokens", 8),
     ["spec.topology.limits.defaultMaxTokens: must be <= maxTokens (8), got 16"]),
    ("wrong apiVersion",
     lambda d: d.__setitem__("apiVersion", "omnistage.io/v1"),
     ['apiVersion: must be "omnistage.io/v1alpha1", got "omnistage.io/v1"']),
    ("no stages",
     lambda d: d["spec"]["topology"].__setitem__("stages", []),
     ["spec.topology.stages: must not be empty"]),
    ("stages not a list",
     lambda d: d["spec"]["topology"].__setitem__("stages", {"thinker": {}}),
     ["spec.topology.stages: must be a list, got a mapping"]),
    ("stage claims to emit what its adapter does not",
     lambda d: stages(d)[1].__setitem__("emits", ["codes", "audio"]),
     ['spec.topology.stages[1].emits[1]: the qwen3-omni-talker adapter does not emit "audio" (it emits codes)']),
    ("edge carries nothing the consumer reads",
     lambda d: stages(d)[2]["inputs"].__setitem__(0, {"stage": "thinker"}),
     ['spec.topology.stages[2].inputs[0]: stage "code2wav" (qwen3-omni-code2wav) reads codes, but stage "thinker" '
      "emits hidden, text, tokens"]),
    ("consumer without the input it needs",
     lambda d: stages(d)[1].pop("inputs"),
     ['spec.topology.stages[1]: stage "talker" (qwen3-omni-talker) needs an input edge carrying hidden']),
    ("thinker given an edge it cannot read",
     lambda d: stages(d)[0].__setitem__("inputs", [{"stage": "code2wav"}]),
     ['spec.topology.stages[0].inputs[0]: stage "thinker" (qwen3-omni-thinker) reads media, but stage "code2wav" '
      'emits audio']),
    ("entry adapter given an input",
     lambda d: stages(d).append({"name": "encoder", "kind": "encoder", "engine": "transformers",
                                 "model": "qwen3-omni-tiny", "component": "encoder", "emits": ["media"],
                                 "inputs": [{"stage": "code2wav"}]}),
     ['spec.topology.stages[3].inputs[0]: stage "encoder" (qwen3-omni-encoder) takes no input edges']),
    ("media limits past one message",
     lambda d: d["spec"]["topology"].setdefault("limits", {}).update(maxParts=64, maxPartBytes=16 << 20),
     ["spec.topology.limits.maxPartBytes: maxParts x maxPartBytes is 1073741824 bytes; a request must fit the "
      "512 MiB one message between services may carry"]),
    ("no adapter for the component",
     lambda d: stages(d)[1].__setitem__("component", "vocoder"),
     ['spec.topology.stages[1].component: no transformers adapter serves a "ar" stage with component "vocoder" '
      "(components: none, thinker, talker, asr, tts_talker)"]),
    ("duplicate input edge",
     lambda d: stages(d)[1].__setitem__("inputs", [{"stage": "thinker"}, {"stage": "thinker"}]),
     ['spec.topology.stages[1].inputs[1].stage: duplicate input stage "thinker"']),
    ("missing required stage fields",
     lambda d: stages(d).__setitem__(0, {"name": "thinker"}),
     ["spec.topology.stages[0].kind: required field is missing",
      "spec.topology.stages[0].engine: required field is missing",
      "spec.topology.stages[0].model: required field is missing",
      "spec.topology.stages[0].emits: required field is missing"]),
]


@pytest.mark.parametrize("name,edit,expected", BAD, ids=[b[0] for b in BAD])
def test_bad_files_are_refused_with_field_paths(name, edit, expected):
    doc = variant(edit)
    with pytest.raises(SpecError) as exc:
        parse_pipeline(doc)
    messages = [str(e) for e in exc.value.errors]
    for want in expected:
        assert any(m.startswith(want) for m in messages), f"{want!r} not in {messages}"


def test_every_error_is_reported_at_once():
    def many(d):
        stages(d)[1]["inputs"][0]["stage"] = "talkr"
        deploy(d)["stages"]["thinker"]["replicas"] = -2
        stages(d)[0]["kind"] = "x"

    errors = validate(variant(many))
    assert len(errors) >= 3
    paths = {e.path for e in errors}
    assert {"spec.topology.stages[1].inputs[0]", "spec.deployment.stages.thinker.replicas",
            "spec.topology.stages[0].kind"} <= paths


def test_yaml_errors_name_the_source():
    with pytest.raises(SpecError, match="x.yaml: not valid YAML"):
        parse_pipeline_yaml("spec: [unclosed", source="x.yaml")
    with pytest.raises(SpecError, match="expected exactly one YAML document, found 2"):
        parse_pipeline_yaml("a: 1\n---\nb: 2\n", source="x.yaml")


def test_missing_file_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError, match="cannot read file"):
        load_pipeline(tmp_path / "nope.yaml")


def test_not_a_mapping():
    assert [str(e) for e in validate([1, 2])] == ["<root>: must be a mapping, got a list"]


def test_defaults_fill_in():
    doc = variant(lambda d: deploy(d).__setitem__("stages", {"thinker": None, "talker": {}, "code2wav": {}}))
    p = parse_pipeline(doc)
    t = p.deployment.stages["thinker"]
    assert t.replicas == 1 and t.dtype == "auto" and t.scheduler.max_batch == 8 and t.parallelism.tensor == 1
    assert t.scheduler.stall_seconds == 300.0


@pytest.mark.parametrize("limits, expected", [({}, 600.0), ({"requestTimeoutSeconds": 0}, 0.0),
                                              ({"requestTimeoutSeconds": 2.5}, 2.5)])
def test_request_timeout(limits, expected):
    p = parse_pipeline(variant(lambda d: d["spec"]["topology"].__setitem__("limits", limits)))
    assert p.limits.request_timeout_seconds == expected


def orchestrator_http(**http):
    return lambda d: deploy(d).setdefault("orchestrator", {}).__setitem__("http", http)


@pytest.mark.parametrize("http, enabled, port, secret", [
    (None, True, 8000, None),                                        # absent: served on the default port
    ({}, True, 8000, None),
    ({"enabled": False}, False, 8000, None),
    ({"port": 9000}, True, 9000, None),
    ({"apiKeySecret": {"name": "llm-keys"}}, True, 8000, ("llm-keys", "api-keys")),   # key defaults
    ({"apiKeySecret": {"name": "s.v1", "key": "keys.txt"}}, True, 8000, ("s.v1", "keys.txt")),
])
def test_orchestrator_http_api_settings(http, enabled, port, secret):
    doc = variant(orchestrator_http(**http) if http is not None else lambda d: None)
    got = parse_pipeline(doc).deployment.orchestrator.http
    assert (got.enabled, got.port) == (enabled, port)
    ref = got.keys_secret
    assert (None if ref is None else (ref.name, ref.key)) == secret


@pytest.mark.parametrize("http, expected", [
    ({"port": 0}, "spec.deployment.orchestrator.http.port: must be >= 1, got 0"),
    ({"port": 70000}, "spec.deployment.orchestrator.http.port: must be <= 65535, got 70000"),
    ({"port": "8000"}, 'spec.deployment.orchestrator.http.port: must be an integer, got "8000"'),
    ({"port": 50051}, "spec.deployment.orchestrator.http.port: 50051 is the gRPC port (grpc) of the orchestrator"),
    ({"port": 8080}, "spec.deployment.orchestrator.http.port: 8080 is the HTTP status port (http) of the "
                     "orchestrator"),
    ({"enabled": "yes"}, 'spec.deployment.orchestrator.http.enabled: must be true or false, got "yes"'),
    ({"apiKeySecret": {}}, "spec.deployment.orchestrator.http.apiKeySecret.name: required field is missing"),
    ({"apiKeySecret": {"name": "Keys_1"}}, 'spec.deployment.orchestrator.http.apiKeySecret.name: "Keys_1" must be '
                                           "lower-case letters"),
    ({"apiKeySecret": {"name": "k", "key": "a/b"}}, 'spec.deployment.orchestrator.http.apiKeySecret.key: "a/b" '
                                                    "must be letters"),
    ({"prot": 9000}, 'spec.deployment.orchestrator.http.prot: unknown field (did you mean "port"?)'),
])
def test_orchestrator_http_api_errors(http, expected):
    messages = [str(e) for e in validate(variant(orchestrator_http(**http)))]
    assert any(m.startswith(expected) for m in messages), f"{expected!r} not in {messages}"


def test_a_disabled_api_may_keep_any_port():
    assert validate(variant(orchestrator_http(enabled=False, port=8080))) == []
