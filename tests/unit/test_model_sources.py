"""Model sources (omnistage/api/model_sources.py): a folder, pvc://CLAIM/PATH or hf://ORG/NAME@REVISION, read
in one place; bad forms refused by validation at the stage's `model` with what is wrong; the operator's stage
pods for each (operator/omnistage_operator/model_sources.py): the claim mounted read-only, the hf:// cache
filled by an init container with the token from its Secret and read-only for the stage, every pod restricted."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from omnistage.api.model_sources import (
    CLAIM_MOUNT_ROOT,
    ENV_HUB_CACHE,
    ClaimSource,
    HubSource,
    LocalSource,
    SourceError,
    local_path,
    parse_source,
)
from omnistage.api.validation import validate
from omnistage.contract import launch
from omnistage_operator.builders import build_children
from omnistage_operator.config import ModelVolume, OperatorConfig
from omnistage_operator.model_sources import (
    CACHE_VOLUME,
    CHECK_CONTAINER,
    CLAIM_VOLUME,
    HUB_CACHE_MOUNT,
    PULL_CONTAINER,
)
from omnistage_operator.pipeline_object import parse

from ..conftest import EXAMPLES
from .test_pod_security import restricted_violations

LLM = yaml.safe_load((EXAMPLES / "llm-tiny.yaml").read_text())   # one stage, "llm"
CFG = OperatorConfig(model_volume=ModelVolume("pvc", "omnistage-models", "/models"))
HF = "hf://omnistage-tests/qwen2-tiny@main"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
HF_PINNED = f"hf://omnistage-tests/qwen2-tiny@{COMMIT}"   # a shared cache takes commits only


@pytest.mark.parametrize("text, source", [
    ("qwen2-tiny", LocalSource("qwen2-tiny")),
    ("/srv/models/qwen2-tiny", LocalSource("/srv/models/qwen2-tiny")),
    ("pvc://weights/qwen/2-tiny", ClaimSource("weights", "qwen/2-tiny")),
    ("pvc://team.weights/qwen/", ClaimSource("team.weights", "qwen")),
    ("hf://Qwen/Qwen2.5-Omni-7B@main", HubSource("Qwen", "Qwen2.5-Omni-7B", "main")),
    ("hf://org/name@v1.0", HubSource("org", "name", "v1.0")),
    ("hf://org/name@refs/pr/1", HubSource("org", "name", "refs/pr/1")),
    ("hf://org/name@0123456789abcdef0123456789abcdef01234567",
     HubSource("org", "name", "0123456789abcdef0123456789abcdef01234567")),
])
def test_every_form_parses_to_its_source(text, source):
    assert parse_source(text) == source


@pytest.mark.parametrize("text, says", [
    ("", "must name a model"),
    ("hf://Qwen/Qwen2-0.5B", "needs a revision"),
    ("hf://Qwen/Qwen2-0.5B@", "needs a revision"),
    ("hf://Qwen@main", 'must be ORG/NAME'),
    ("hf://a/b/c@main", 'must be ORG/NAME'),
    ("hf://a--b/c@main", 'no "--"'),
    ("hf://org/na me@main", "letters, digits"),
    ("hf://org/name@../x", "must be a branch, tag or commit"),
    ("pvc://", "needs the claim's name"),
    ("pvc://weights", "needs the model's folder"),
    ("pvc://Weights_1/x", "must be a PersistentVolumeClaim name"),
    ("pvc://weights/../etc", 'without "." or ".."'),
    ("pvc://weights/./x", 'without "." or ".."'),
    ("s3://bucket/model", 'unknown model source scheme "s3://"'),
])
def test_bad_forms_are_refused_saying_what_is_wrong(text, says):
    with pytest.raises(SourceError) as e:
        parse_source(text)
    assert says in str(e.value)


def test_each_source_resolves_to_one_folder_shared_by_puller_and_stage(tmp_path):
    store = tmp_path / "models"
    assert local_path("qwen2-tiny", store, {}) == store / "qwen2-tiny"
    assert local_path("/abs/m", store, {}) == Path("/abs/m")
    assert local_path("pvc://weights/qwen", store, {}) == Path(CLAIM_MOUNT_ROOT) / "weights" / "qwen"
    assert local_path(HF, store, {}) == store / "hub" / "omnistage-tests" / "qwen2-tiny" / "main"
    assert local_path(HF, store, {ENV_HUB_CACHE: "/cache"}) == Path("/cache/omnistage-tests/qwen2-tiny/main")
    # a revision with "/" is one folder, not three
    assert local_path("hf://o/n@refs/pr/1", store, {}).parent == store / "hub" / "o" / "n"
    # the stage process and `models check` resolve through the process contract, to the same folder
    stage = parse(_with_model(HF)).stage("llm")
    assert launch.checkpoint_dir(stage, store, {}) == local_path(HF, store, {})


# ------------------------------------------------------------------------------ validation

def _with_model(model: str, **deployment) -> dict:
    doc = copy.deepcopy(LLM)
    doc["spec"]["topology"]["stages"][0]["model"] = model
    doc["spec"]["deployment"].update(deployment)
    return doc


def _errors(doc: dict) -> list[str]:
    return [str(e) for e in validate(doc)]


def test_a_pipeline_with_hf_and_pvc_models_and_their_settings_is_valid():
    assert _errors(_with_model(HF_PINNED, modelCache={"persistentVolumeClaim": "hub-cache"},
                               hub={"endpoint": "https://hub.example", "tokenSecret": {"name": "hf"}})) == []
    assert _errors(_with_model(HF, hub={"endpoint": "http://mirror.local"})) == []   # a branch, in the pod's own cache


def test_a_shared_cache_takes_commits_only_and_a_token_never_goes_over_plain_http():
    (err,) = _errors(_with_model(HF, modelCache={"hostPath": "/var/cache/hub"}))
    assert err.startswith('spec.topology.stages[0].model: "main" is a branch or tag; with spec.deployment.modelCache')
    (err,) = _errors(_with_model(HF, hub={"endpoint": "http://mirror.local", "tokenSecret": {"name": "hf"}}))
    assert err.startswith('spec.deployment.hub.endpoint: "http://mirror.local" is plain HTTP')
    assert _errors(_with_model("pvc://weights/qwen2-tiny", modelCache={"hostPath": "/var/cache/hub"})) == []


@pytest.mark.parametrize("model, says", [
    ("hf://omnistage-tests/qwen2-tiny", "needs a revision: hf://ORG/NAME@REVISION"),
    ("hf://qwen2-tiny@main", 'hf:// repository "qwen2-tiny" must be ORG/NAME'),
    ("pvc://Weights/x", 'pvc:// claim "Weights" must be a PersistentVolumeClaim name'),
    ("ftp://x/y", 'unknown model source scheme "ftp://"'),
])
def test_a_bad_model_source_is_refused_at_the_stages_model(model, says):
    (err,) = _errors(_with_model(model))
    assert err.startswith("spec.topology.stages[0].model: ") and says in err


def test_bad_cache_and_hub_settings_are_refused_by_field():
    errors = _errors(_with_model(HF_PINNED, modelCache={"persistentVolumeClaim": "c", "hostPath": "cache"},
                                 hub={"endpoint": "hub.example", "tokenSecret": {"key": "token"}, "tken": 1}))
    assert sorted(errors) == sorted([
        "spec.deployment.modelCache: name one of persistentVolumeClaim or hostPath, not both",
        'spec.deployment.modelCache.hostPath: "cache" must be an absolute folder',
        'spec.deployment.hub.endpoint: "hub.example" must be an http:// or https:// URL',
        "spec.deployment.hub.tokenSecret.name: required field is missing",
        "spec.deployment.hub.tken: unknown field",
    ])


# ------------------------------------------------------------------------------ operator

def _pod(doc: dict, cfg: OperatorConfig = CFG) -> dict:
    return build_children(parse(doc), cfg).stages["llm"].deployment["spec"]["template"]["spec"]


def _env(c: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def _volume(pod: dict, name: str) -> dict:
    (v,) = [v for v in pod["volumes"] if v["name"] == name]
    return v


def _mount(c: dict, name: str) -> dict:
    (m,) = [m for m in c["volumeMounts"] if m["name"] == name]
    return m


def test_a_folder_model_adds_nothing_to_the_pod():
    pod = _pod(_with_model("qwen2-tiny"))
    assert "initContainers" not in pod
    assert {v["name"] for v in pod["volumes"]}.isdisjoint({CLAIM_VOLUME, CACHE_VOLUME})


def test_a_pvc_model_mounts_its_claim_read_only_where_the_stage_reads_it():
    pod = _pod(_with_model("pvc://weights/qwen2-tiny"))
    assert _volume(pod, CLAIM_VOLUME) == {"name": CLAIM_VOLUME,
                                          "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}
    (stage,) = pod["containers"]
    mount = _mount(stage, CLAIM_VOLUME)
    assert mount["readOnly"] is True
    assert Path(mount["mountPath"]) / "qwen2-tiny" == local_path("pvc://weights/qwen2-tiny", "/models", {})
    assert "initContainers" not in pod


def test_an_hf_model_is_pulled_then_checked_by_init_containers_into_the_cache():
    doc = _with_model(HF_PINNED, modelCache={"persistentVolumeClaim": "hub-cache"},
                      hub={"endpoint": "https://hub.example", "tokenSecret": {"name": "hf-token", "key": "t"}})
    doc["spec"]["deployment"]["stages"]["llm"]["env"] = {"HF_HUB_OFFLINE": "1", "EXTRA": "x"}
    pod = _pod(doc)
    pull, check = pod["initContainers"]
    (stage,) = pod["containers"]
    assert [pull["name"], check["name"]] == [PULL_CONTAINER, CHECK_CONTAINER]
    assert pull["command"][-5:] == ["models", "pull", "/etc/omnistage/pipeline.yaml", "--stage", "llm"]
    assert check["command"][-5:] == ["models", "check", "/etc/omnistage/pipeline.yaml", "--stage", "llm"]
    # same image and security context as the stage; refusals land in the termination message
    for init in (pull, check):
        assert init["image"] == stage["image"] and init["securityContext"] == stage["securityContext"]
        assert init["terminationMessagePath"] == stage["terminationMessagePath"]
        assert _env(init)[ENV_HUB_CACHE] == HUB_CACHE_MOUNT and _env(init)["EXTRA"] == "x"
    # the cache: the claim, written by the pull alone, read-only for the check and the stage
    assert _volume(pod, CACHE_VOLUME) == {"name": CACHE_VOLUME, "persistentVolumeClaim": {"claimName": "hub-cache"}}
    assert "readOnly" not in _mount(pull, CACHE_VOLUME)
    assert _mount(check, CACHE_VOLUME)["readOnly"] is True and _mount(stage, CACHE_VOLUME)["readOnly"] is True
    assert _env(stage)[ENV_HUB_CACHE] == HUB_CACHE_MOUNT
    # the token from its Secret, to the pull only; the endpoint; downloads allowed whatever the pipeline's env
    pull_env = _env(pull)
    assert pull_env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "t", "optional": False}}
    assert pull_env["HF_ENDPOINT"] == "https://hub.example" and pull_env["HF_HUB_OFFLINE"] == "0"
    assert [e["name"] for e in pull["env"]].count("HF_HUB_OFFLINE") == 1
    assert "HF_TOKEN" not in _env(check) and "HF_TOKEN" not in _env(stage)


@pytest.mark.parametrize("cache, volume", [
    ({}, {"emptyDir": {}}),
    # a node's folder per namespace: pods of every namespace run as one uid
    ({"hostPath": "/var/cache/hub"}, {"hostPath": {"path": "/var/cache/hub/default", "type": "DirectoryOrCreate"}}),
])
def test_the_cache_is_the_pods_own_without_a_setting_or_the_nodes_folder(cache, volume):
    pod = _pod(_with_model(HF_PINNED, modelCache=cache) if cache else _with_model(HF))
    assert _volume(pod, CACHE_VOLUME) == {"name": CACHE_VOLUME, **volume}
    assert "HF_TOKEN" not in _env(pod["initContainers"][0])   # no Secret named: none sent
    assert "HF_ENDPOINT" not in _env(pod["initContainers"][0])


@pytest.mark.parametrize("model, cache", [
    (HF, {}), (HF_PINNED, {"persistentVolumeClaim": "hub-cache"}), ("pvc://weights/qwen2-tiny", {})])
def test_stage_pods_with_every_source_stay_restricted(model, cache):
    pod = _pod(_with_model(model, modelCache=cache, hub={"tokenSecret": {"name": "hf"}}))
    assert restricted_violations(pod) == []
