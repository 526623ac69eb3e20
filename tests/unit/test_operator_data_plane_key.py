"""Each pipeline's UCX data-plane key on a cluster, in every TLS mode (chart, certManager, off): one Secret per
pipeline that the operator owns (random, made once, kept across reconciles, made again only when deleted or
unusable), mounted read-only into every stage pod and named by the stage's --data-plane-key flag, never into
the orchestrator; and so an explicit `transport: ucx` edge is admitted whatever the issuer.

The API server is the in-memory store of test_operator_adoption (the reads and writes `reconcile` makes)."""

from __future__ import annotations

import base64
import copy

import kopf
import pytest
import yaml

from omnistage import tls
from omnistage.contract import launch
from omnistage_operator import handlers
from omnistage_operator.builders import build_children, build_data_plane_key_meta
from omnistage_operator.config import IssuerRef, ModelVolume, OperatorConfig
from omnistage_operator.data_plane_key import build_data_plane_key_secret, data_plane_key_secret_name, new_key
from omnistage_operator.pipeline_object import parse
from omnistage_operator.reconcile import reconcile
from omnistage_operator.vocabulary import LABEL_MANAGED_BY, LABEL_PIPELINE, MANAGED_BY, R_CHILD_CONFLICT

from ..conftest import EXAMPLES
from .test_operator_adoption import NS, PIPE, MemoryApi

BASE = yaml.safe_load((EXAMPLES / f"{PIPE}.yaml").read_text())
BASE["metadata"]["namespace"] = NS
MODELS = ModelVolume("hostPath", "/srv/models", "/models")
CA_SECRET = ("omnistage-system", "pipelines-ca")
CONFIGS = {
    "off": OperatorConfig(model_volume=MODELS),
    "chart": OperatorConfig(model_volume=MODELS, tls_issuer="chart", tls_ca_secret=CA_SECRET),
    "certManager": OperatorConfig(model_volume=MODELS, tls_issuer="certManager",
                                  tls_issuer_ref=IssuerRef("ClusterIssuer", "pipelines-ca")),
}
KEY_FILE = f"{launch.DATA_PLANE_KEY_MOUNT}/{tls.DATA_PLANE_KEY_FILE}"
SECRET = data_plane_key_secret_name(PIPE)


def _pod(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def _key_mounts(deployment: dict) -> list[dict]:
    """The container's mounts of a volume made from the pipeline's key Secret."""
    (c,) = _pod(deployment)["containers"]
    volumes = {v["name"] for v in _pod(deployment)["volumes"] if (v.get("secret") or {}).get("secretName") == SECRET}
    return [m for m in c["volumeMounts"] if m["name"] in volumes]


def _flags(deployment: dict, parser) -> object:
    """The stage's settings as it reads them: its flags, and its environment for what has none."""
    (c,) = _pod(deployment)["containers"]
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    return parser(env=env).parse_args(c["command"][3:])


@pytest.mark.parametrize("issuer", sorted(CONFIGS))
def test_every_stage_pod_mounts_the_key_read_only_and_is_told_its_file(issuer):
    children = build_children(parse(BASE), CONFIGS[issuer])
    for name, sc in children.stages.items():
        assert _key_mounts(sc.deployment) == [{"name": _key_mounts(sc.deployment)[0]["name"],
                                               "mountPath": launch.DATA_PLANE_KEY_MOUNT, "readOnly": True}], name
        assert _flags(sc.deployment, launch.stage_parser).data_plane_key == KEY_FILE
        # by environment, not by flag: a stage on an image from before the key ignores it rather than refusing
        assert "--data-plane-key" not in _pod(sc.deployment)["containers"][0]["command"]
    # The orchestrator moves no tensors over UCX: it gets neither the key nor a flag naming it.
    assert _key_mounts(children.orchestrator_deployment) == []
    assert "--data-plane-key" not in " ".join(_pod(children.orchestrator_deployment)["containers"][0]["command"])
    # The Secret is made by the reconcile, never by a builder: a build makes no key (pure, the same each time).
    assert all(o["kind"] != "Secret" for o in children.all())
    assert build_children(parse(BASE), CONFIGS[issuer]) == children


def test_the_key_secret_holds_random_hex_and_is_labelled_as_the_pipelines_child():
    p = parse(BASE)
    key = new_key()
    secret = build_data_plane_key_secret(build_data_plane_key_meta(p), key)
    assert secret["kind"] == "Secret" and secret["type"] == "Opaque"
    meta = secret["metadata"]
    assert meta["name"] == SECRET and meta["namespace"] == NS
    assert meta["labels"][LABEL_MANAGED_BY] == MANAGED_BY and meta["labels"][LABEL_PIPELINE] == PIPE
    assert set(secret["data"]) == {tls.DATA_PLANE_KEY_FILE}
    assert len(tls.parse_data_plane_key(base64.b64decode(secret["data"][tls.DATA_PLANE_KEY_FILE]).decode(),
                                        "the Secret")) == 32
    assert len({new_key() for _ in range(16)}) == 16


class SecretsUnlisted(MemoryApi):
    """As the operator's Kube: Secrets are read one by one by name, never listed with the children."""

    def list_children(self, namespace, pipeline):
        return {k: o for k, o in super().list_children(namespace, pipeline).items() if k[0] != "Secret"}


def _api(issuer: str) -> SecretsUnlisted:
    body = copy.deepcopy(BASE)
    body["metadata"].update(uid="pipeline-uid", generation=1)
    api = SecretsUnlisted(body)
    if issuer == "chart":   # the CA the chart keeps (the store holds one namespace: the name is what counts)
        cert, key = tls.new_ca("test pipelines CA")
        api.objects[("Secret", CA_SECRET[1])] = {
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": CA_SECRET[1], "namespace": CA_SECRET[0]},
            "data": {tls.CERT_FILE: base64.b64encode(cert).decode(), tls.KEY_FILE: base64.b64encode(key).decode()}}
    return api


def _key(api: MemoryApi) -> bytes:
    data = api.objects[("Secret", SECRET)]["data"][tls.DATA_PLANE_KEY_FILE]
    return tls.parse_data_plane_key(base64.b64decode(data).decode(), SECRET)


@pytest.mark.parametrize("issuer", sorted(CONFIGS))
def test_the_reconcile_makes_the_key_once_and_keeps_it(issuer):
    api = _api(issuer)
    reconcile(api, CONFIGS[issuer], NS, PIPE)
    secret = api.objects[("Secret", SECRET)]
    assert [r["uid"] for r in secret["metadata"]["ownerReferences"] if r.get("controller")] == ["pipeline-uid"]
    key = _key(api)
    assert len(key) == 32
    for _ in range(2):   # later passes: the same key, the Secret not written
        reconcile(api, CONFIGS[issuer], NS, PIPE)
    assert _key(api) == key and f"Secret/{SECRET}" not in api.patched
    if issuer == "chart":   # the key its CA derives: the one stage pods had before the Secret existed
        ca_key = base64.b64decode(api.objects[("Secret", CA_SECRET[1])]["data"]["tls.key"])
        assert key == tls.data_plane_key(ca_key, NS, PIPE)
    # Rotation: a new key put into the Secret is kept; the Secret deleted, the next pass makes one again.
    api.objects[("Secret", SECRET)]["data"][tls.DATA_PLANE_KEY_FILE] = base64.b64encode(b"ab" * 32).decode()
    reconcile(api, CONFIGS[issuer], NS, PIPE)
    assert _key(api) == bytes.fromhex("ab" * 32) and f"Secret/{SECRET}" not in api.patched
    del api.objects[("Secret", SECRET)]
    reconcile(api, CONFIGS[issuer], NS, PIPE)
    assert len(_key(api)) == 32 and (_key(api) == key) == (issuer == "chart")


def test_an_unusable_key_of_its_own_is_made_again():
    api = _api("off")
    reconcile(api, CONFIGS["off"], NS, PIPE)
    api.objects[("Secret", SECRET)]["data"][tls.DATA_PLANE_KEY_FILE] = base64.b64encode(b"not hex").decode()
    reconcile(api, CONFIGS["off"], NS, PIPE)
    assert f"Secret/{SECRET}" in api.patched and len(_key(api)) == 32


def test_a_secret_of_the_keys_name_it_did_not_make_is_refused_by_name():
    api = _api("off")
    theirs = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": SECRET, "namespace": NS, "uid": "theirs"},
              "data": {"password": base64.b64encode(b"hunter2").decode()}}
    api.objects[("Secret", SECRET)] = copy.deepcopy(theirs)
    with pytest.raises(kopf.TemporaryError):
        reconcile(api, CONFIGS["off"], NS, PIPE)
    assert api.objects[("Secret", SECRET)] == theirs   # neither patched nor adopted
    ready = next(c for c in api.pipeline["status"]["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == R_CHILD_CONFLICT and f"Secret/{SECRET}" in ready["message"]
    # Nothing that would mount it was made.
    assert not [k for k in api.objects if k[0] == "Deployment"]


class _NoApiServer:
    """What the operator's startup reads of its API client; the webhook itself calls no API."""

    pdb_api_version = "policy/v1"

    def __init__(self, *_):
        pass


@pytest.mark.parametrize("issuer, env", [
    ("off", {}),
    ("certManager", {"OMNISTAGE_TLS_ISSUER_REF": "ClusterIssuer/pipelines-ca"}),
    ("chart", {"OMNISTAGE_TLS_CA_SECRET": "/".join(CA_SECRET)}),
])
async def test_the_webhook_of_an_operator_started_under_any_issuer_admits_explicit_ucx_edges(issuer, env, monkeypatch):
    for name, value in {"OMNISTAGE_TLS_ISSUER": issuer, "OMNISTAGE_WEBHOOK": "off", "OMNISTAGE_METRICS_PORT": "0",
                        "OMNISTAGE_MODEL_VOLUME": "hostPath:/srv/models", **env}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(handlers, "Kube", _NoApiServer)
    memo = kopf.Memo()
    await handlers.start(settings=kopf.OperatorSettings(), memo=memo, logger=handlers.logging.getLogger("test"))
    try:
        doc = copy.deepcopy(BASE)
        for stage in doc["spec"]["topology"]["stages"]:
            for edge in stage.get("inputs") or []:
                edge["transport"] = "ucx"
        handlers.validate(body=doc, memo=memo)   # admitted: no AdmissionError
    finally:
        await handlers.stop(memo=memo)
