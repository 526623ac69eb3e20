"""A child's name taken by an object the operator did not make (a Helm- or hand-made Service or Deployment)
is refused with a condition naming it: never patched, never adopted (so never collected with the pipeline).

The API server here is a small in-memory store with the operator's `Kube` methods the reconcile calls
(create answers None on a taken name, as a 409 does); the e2e suite runs the same reconcile against a real one.
"""

from __future__ import annotations

import copy
import itertools

import kopf
import pytest
import yaml

from omnistage_operator.config import ModelVolume, OperatorConfig
from omnistage_operator.reconcile import reconcile
from omnistage_operator.vocabulary import LABEL_MANAGED_BY, LABEL_PIPELINE, MANAGED_BY, R_CHILD_CONFLICT

from ..conftest import EXAMPLES

NS, PIPE = "team-a", "qwen3-omni-tiny"
CFG = OperatorConfig(model_volume=ModelVolume("hostPath", "/srv/models", "/models"))


class MemoryApi:
    """The objects of one namespace by (kind, name), with the reads and writes `reconcile` makes."""

    pdb_api_version = "policy/v1"

    def __init__(self, pipeline: dict):
        self.pipeline = pipeline
        self.objects: dict[tuple[str, str], dict] = {}
        self.patched: list[str] = []
        self.events: list[tuple[str, str, str]] = []
        self._uids = itertools.count(1)

    def thread_writes(self) -> int:
        return 0

    def get_pipeline(self, namespace, name):
        return copy.deepcopy(self.pipeline)

    def list_children(self, namespace, pipeline):
        return {k: copy.deepcopy(o) for k, o in self.objects.items()
                if (o["metadata"].get("labels") or {}).get(LABEL_PIPELINE) == pipeline}

    def list_pods(self, namespace, pipeline):
        return []

    def get(self, kind, namespace, name):
        obj = self.objects.get((kind, name))
        return copy.deepcopy(obj) if obj is not None else None

    def get_secret(self, namespace, name):
        return self.get("Secret", namespace, name)

    def create(self, obj):
        key = (obj["kind"], obj["metadata"]["name"])
        if key in self.objects:
            return None
        self.objects[key] = copy.deepcopy(obj)
        self.objects[key]["metadata"]["uid"] = f"uid-{next(self._uids)}"
        return copy.deepcopy(self.objects[key])

    def patch(self, obj):
        key = (obj["kind"], obj["metadata"]["name"])
        self.patched.append("/".join(key))
        self.objects[key] = {**self.objects[key], **copy.deepcopy(obj)}
        return copy.deepcopy(self.objects[key])

    def delete(self, kind, namespace, name):
        self.objects.pop((kind, name), None)

    def patch_status(self, namespace, name, patch):
        self.pipeline["status"] = {**(self.pipeline.get("status") or {}), **patch}

    def post_event(self, owner, type_, reason, message):
        self.events.append((type_, reason, message))


def _api() -> MemoryApi:
    body = yaml.safe_load((EXAMPLES / f"{PIPE}.yaml").read_text())
    body["metadata"].update(namespace=NS, uid="pipeline-uid", generation=1)
    return MemoryApi(body)


def _someone_elses_service(labels: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": f"{PIPE}-talker", "namespace": NS, "labels": labels, "uid": "theirs"},
            "spec": {"selector": {"app": "their-app"}, "ports": [{"port": 80}]}}


def _ready(api: MemoryApi) -> dict:
    return next(c for c in api.pipeline["status"]["conditions"] if c["type"] == "Ready")


def test_an_object_of_a_childs_name_the_operator_did_not_make_is_refused_by_name():
    api = _api()
    api.objects[("Service", f"{PIPE}-talker")] = _someone_elses_service({"app.kubernetes.io/managed-by": "Helm"})
    before = copy.deepcopy(api.objects[("Service", f"{PIPE}-talker")])
    with pytest.raises(kopf.TemporaryError):
        reconcile(api, CFG, NS, PIPE)
    assert api.objects[("Service", f"{PIPE}-talker")] == before   # not patched, not adopted
    assert f"Service/{PIPE}-talker" not in api.patched
    ready = _ready(api)
    assert ready["status"] == "False" and ready["reason"] == R_CHILD_CONFLICT
    assert f"Service/{PIPE}-talker exists and was not made by the operator" in ready["message"]
    assert [(t, r) for t, r, _ in api.events] == [("Warning", R_CHILD_CONFLICT)]


def test_a_child_the_operator_made_but_nothing_controls_is_adopted():
    """An orphan of the operator's own (its managed-by label, no controller: e.g. a pipeline deleted with
    orphan propagation and applied again) is taken back."""
    api = _api()
    api.objects[("Service", f"{PIPE}-talker")] = _someone_elses_service({LABEL_MANAGED_BY: MANAGED_BY})
    reconcile(api, CFG, NS, PIPE)
    refs = api.objects[("Service", f"{PIPE}-talker")]["metadata"]["ownerReferences"]
    assert [r["uid"] for r in refs if r.get("controller")] == ["pipeline-uid"]
    assert _ready(api)["reason"] != R_CHILD_CONFLICT


def test_an_object_another_controller_owns_is_refused_by_name():
    api = _api()
    svc = _someone_elses_service({LABEL_MANAGED_BY: MANAGED_BY})
    svc["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "X", "name": "x", "uid": "other",
                                           "controller": True}]
    api.objects[("Service", f"{PIPE}-talker")] = svc
    with pytest.raises(kopf.TemporaryError):
        reconcile(api, CFG, NS, PIPE)
    assert f"Service/{PIPE}-talker" not in api.patched
    assert f"Service/{PIPE}-talker exists and is controlled by another object" in _ready(api)["message"]
