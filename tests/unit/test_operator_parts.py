"""The operator's small parts: live-vs-desired comparison, settings, cluster naming rules and the
webhook's answer, and the work queue."""

from __future__ import annotations

import asyncio
import copy

import kopf
import pytest
import yaml
from prometheus_client import CollectorRegistry

from omnistage.api import SpecError
from omnistage_operator.compare import matches
from omnistage_operator.config import ConfigError, ModelVolume, from_env
from omnistage_operator.handlers import validate
from omnistage_operator.metrics import OperatorMetrics
from omnistage_operator.pipeline_object import parse
from omnistage_operator.workqueue import WorkQueue, worker

from ..conftest import EXAMPLES
from ..polling import wait_until

BASE = yaml.safe_load((EXAMPLES / "qwen3-omni-tiny.yaml").read_text())


# ---------------------------------------------------------------------------------- compare

DESIRED = {"metadata": {"name": "a", "labels": {"x": "1"}},
           "spec": {"replicas": 1, "template": {"spec": {
               "containers": [{"name": "c", "image": "i:1", "env": [],
                               "resources": {"requests": {"cpu": "0.5", "memory": "1024Mi"}}}]}}}}


def live_with(edit):
    obj = copy.deepcopy(DESIRED)
    obj["metadata"]["uid"] = "u"                     # server-set fields
    obj["metadata"]["annotations"] = {"deployment.kubernetes.io/revision": "2"}
    c = obj["spec"]["template"]["spec"]["containers"][0]
    c.update(terminationMessagePath="/dev/termination-log", imagePullPolicy="IfNotPresent")
    c.pop("env")                                      # the apiserver drops empty lists
    c["resources"]["requests"] = {"cpu": "500m", "memory": "1Gi"}   # canonical quantities
    edit(obj)
    return obj


@pytest.mark.parametrize("edit, same", [
    (lambda o: None, True),
    (lambda o: o["metadata"]["labels"].update(extra="added by hand"), True),       # not ours: left alone
    (lambda o: o["spec"].update(replicas=3), False),                                # scaled by hand
    (lambda o: o["spec"]["template"]["spec"]["containers"][0].update(image="i:2"), False),
    (lambda o: o["metadata"]["labels"].pop("x"), False),
    (lambda o: o["spec"]["template"]["spec"]["containers"].append({"name": "sidecar"}), False),
    (lambda o: o["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"].update(cpu="1"), False),
    (lambda o: o["spec"]["template"]["spec"]["containers"][0].update(env=[{"name": "A", "value": "b"}]), False),
])
def test_matches(edit, same):
    assert matches(DESIRED, live_with(edit)) is same


def test_matches_scalars_and_missing():
    assert matches({"a": {}}, {})
    assert matches({"a": False}, {})          # omitted false booleans
    assert not matches({"a": True}, {})
    assert not matches({"a": 0}, {})
    assert not matches({"a": 1}, {})
    assert not matches({"a": [1]}, {"a": [1, 2]})
    assert matches({"a": "grpc"}, {"a": "grpc"})
    assert not matches({"a": 50051}, {"a": "50051"})


# --------------------------------------------------------------------------------- settings

def test_settings_defaults():
    cfg = from_env({})
    assert cfg.model_volume == ModelVolume("pvc", "omnistage-models", "/models")
    assert cfg.webhook == "managed" and cfg.workers == 4 and cfg.metrics_namespace_label is None


def test_settings_from_env():
    cfg = from_env({"OMNISTAGE_MODEL_VOLUME": "hostPath:/work/models", "OMNISTAGE_MODEL_MOUNT": "/m",
                    "OMNISTAGE_METRICS_NAMESPACE_LABEL": "team=monitoring", "OMNISTAGE_WORKERS": "8",
                    "OMNISTAGE_WEBHOOK": "external", "OMNISTAGE_RESYNC_SECONDS": "30"})
    assert cfg.model_volume == ModelVolume("hostPath", "/work/models", "/m")
    assert cfg.metrics_namespace_label == ("team", "monitoring")
    assert (cfg.workers, cfg.webhook, cfg.resync_seconds) == (8, "external", 30.0)


@pytest.mark.parametrize("env, words", [
    ({"OMNISTAGE_MODEL_VOLUME": "s3:bucket"}, "OMNISTAGE_MODEL_VOLUME"),
    ({"OMNISTAGE_MODEL_VOLUME": "hostPath:relative"}, "absolute"),
    ({"OMNISTAGE_MODEL_VOLUME": "pvc:"}, "pvc:CLAIM"),
    ({"OMNISTAGE_WORKERS": "many"}, "OMNISTAGE_WORKERS"),
    ({"OMNISTAGE_WEBHOOK": "on"}, "OMNISTAGE_WEBHOOK"),
    ({"OMNISTAGE_METRICS_NAMESPACE_LABEL": "monitoring"}, "key=value"),
])
def test_bad_settings_name_the_variable(env, words):
    with pytest.raises(ConfigError, match=words):
        from_env(env)


# ----------------------------------------------------------------- cluster rules and webhook

def doc_with(edit):
    doc = copy.deepcopy(BASE)
    edit(doc)
    return doc


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["spec"]["topology"]["stages"][1]["inputs"].__setitem__(0, {"stage": "talkr"}),
     'spec.topology.stages[1].inputs[0]: unknown stage "talkr" (did you mean "talker"?)'),
    (lambda d: d["metadata"].update(name="9lives"),
     'metadata.name: "9lives" must be lower-case letters, digits and "-", start with a letter'),
    (lambda d: d["spec"]["topology"]["stages"][2].update(name="orchestrator") or
     d["spec"]["deployment"]["stages"].update(orchestrator=d["spec"]["deployment"]["stages"].pop("code2wav")) or
     d["spec"]["topology"]["outputs"][1].update(stage="orchestrator"),
     'spec.topology.stages[2].name: "orchestrator" is reserved'),
    (lambda d: d["metadata"].update(name="p" * 40) or _rename_stage(d, 0, "t" * 30),
     "spec.topology.stages[0].name: \"" + "p" * 40 + "-" + "t" * 30 + "\" (pipeline name"),
    # valid for `omnistage serve`, never on a cluster: every request would fail to fetch its inputs
    (lambda d: d["spec"]["topology"]["stages"][1]["inputs"][0].update(transport="shm"),
     "spec.topology.stages[1].inputs[0].transport: shm cannot cross pods"),
])
def test_webhook_refuses_with_field_paths(edit, message):
    with pytest.raises(kopf.AdmissionError) as err:
        validate(body=doc_with(edit))
    assert err.value.code == 422
    assert message in str(err.value)


def _rename_stage(d, i, new):
    old = d["spec"]["topology"]["stages"][i]["name"]
    d["spec"]["topology"]["stages"][i]["name"] = new
    for st in d["spec"]["topology"]["stages"]:
        for e in st.get("inputs", []):
            if e["stage"] == old:
                e["stage"] = new
    for o in d["spec"]["topology"]["outputs"]:
        if o["stage"] == old:
            o["stage"] = new
    d["spec"]["deployment"]["stages"][new] = d["spec"]["deployment"]["stages"].pop(old)


def test_webhook_accepts_examples_and_ignores_status():
    for path in EXAMPLES.glob("*.yaml"):
        doc = yaml.safe_load(path.read_text())
        doc["status"] = {"observedGeneration": 1}
        doc["metadata"].update(uid="x", resourceVersion="1", managedFields=[{"manager": "kubectl"}])
        assert validate(body=doc) is None


def test_parse_reports_every_error():
    doc = doc_with(lambda d: d["spec"]["topology"]["stages"][0].update(kind="x", engine="y"))
    with pytest.raises(SpecError) as err:
        parse(doc)
    assert len(err.value.errors) == 2


# ------------------------------------------------------------------------------- work queue

async def test_queue_deduplicates_and_reruns_a_key_changed_during_its_pass():
    q = WorkQueue()
    q.add("a")
    q.add("a")
    q.add("b")
    assert await q.get() == "a"
    q.add("a")                      # an event while "a" is being reconciled
    assert await q.get() == "b"
    q.done("b")
    q.done("a")                     # ... runs "a" once more
    assert await asyncio.wait_for(q.get(), 1) == "a"
    q.done("a")
    assert q.pending() == 0


async def test_queue_add_after_keeps_the_earliest():
    q = WorkQueue()
    q.add_after("a", 30)
    q.add_after("a", 0.01)
    q.add_after("a", 60)
    assert await asyncio.wait_for(q.get(), 1) == "a"


async def test_queue_backoff_grows_and_resets():
    q = WorkQueue()
    assert [q.backoff("a") for _ in range(4)] == [0.5, 1.0, 2.0, 4.0]
    q.succeeded("a")
    assert q.backoff("a") == 0.5


class _Result:
    def __init__(self, requeue_after=None, gone=False):
        self.requeue_after, self.gone = requeue_after, gone


async def test_worker_retries_failures_and_stops_on_permanent_errors():
    calls = []
    seen = asyncio.Event()

    def reconcile(ns, name):
        calls.append(name)
        if name == "flaky" and calls.count("flaky") == 1:
            raise RuntimeError("apiserver hiccup")
        if name == "bad":
            raise kopf.PermanentError("invalid spec")
        if calls.count("flaky") == 2:
            seen.set()
        return _Result(gone=name == "deleted")

    q = WorkQueue()
    task = asyncio.create_task(worker(q, reconcile, "w"))
    for name in ("flaky", "bad", "deleted"):
        q.add(("ns", name))
    await asyncio.wait_for(seen.wait(), 5)
    task.cancel()
    assert calls.count("flaky") == 2 and calls.count("bad") == 1
    assert ("ns", "deleted") not in q.known and ("ns", "bad") in q.known


async def test_worker_counts_each_reconcile_by_result_with_its_time_and_the_queue_read_when_scraped():
    seen = asyncio.Event()

    def reconcile(ns, name):
        if name == "flaky":
            raise RuntimeError("apiserver hiccup")
        if name == "bad":
            raise kopf.PermanentError("invalid spec")
        if name == "later":
            raise kopf.TemporaryError("waiting on a Secret", delay=3600)
        seen.set()
        return _Result()

    registry = CollectorRegistry()
    q = WorkQueue()
    metrics = OperatorMetrics(registry, q)
    for name in ("flaky", "bad", "later", "ok"):   # one worker: taken in order, "ok" last
        q.add(("ns", name))

    def value(name, labels=None):
        return registry.get_sample_value(name, labels or {}) or 0.0

    assert value("omnistage_operator_queue_depth") == 4 and value("omnistage_operator_reconciles_inflight") == 0
    task = asyncio.create_task(worker(q, reconcile, "w", metrics=metrics))
    await asyncio.wait_for(seen.wait(), 30)
    await wait_until(lambda: q.active() == 0, 30, what="the last pass done")   # then counted too
    task.cancel()
    results = {r: value("omnistage_operator_reconciles_total", {"result": r}) for r in ("ok", "error", "invalid",
                                                                                         "waiting")}
    assert results == {"ok": 1, "error": 1, "invalid": 1, "waiting": 1}
    assert value("omnistage_operator_reconcile_seconds_count") == 4
    assert value("omnistage_operator_queue_depth") == 0
    assert value("omnistage_operator_queue_delayed") == 2    # "flaky" backing off, "later" after its delay
