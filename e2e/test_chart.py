"""`helm install` of charts/omnistage brings the operator up as two peered pods (through the node agent,
with their ServiceAccount token, the chart's namespaced RBAC and webhook), one of them leads and serves
OmniPipelines in its namespace, issuing each pipeline's certificates with the chart's CA, and
`helm uninstall` removes it.

The apiserver reaches a webhook behind a Service through the Service's Endpoints, and Endpoints refuse
loopback addresses, which is all the e2e pods have. So the install uses failurePolicy=Ignore and the
test speaks to the operator pod's webhook itself, exactly as the apiserver would: an AdmissionReview
over TLS, checked against the chart's CA for the name `<service>.<namespace>.svc`."""

from __future__ import annotations

import base64
import copy
import json
import uuid

import kubernetes
import pytest
import urllib3
import yaml
from cryptography import x509

from omnistage import tls

from .conftest import HELM_NS, NS
from .harness import REPO, wait_for

RELEASE, SYSTEM_NS = "omnistage", "omnistage-system"
CHART = REPO / "charts" / "omnistage"


@pytest.fixture
def chart_only(operator):
    """The session operator (and its webhook) out of the way, so only the chart's answer counts."""
    operator.stop_operator()
    operator.namespace(HELM_NS)
    yield operator
    operator.helm("uninstall", RELEASE, "-n", SYSTEM_NS, check=False)
    operator.start_operator([NS])




def pipeline_doc(name: str) -> dict:
    d = copy.deepcopy(yaml.safe_load((REPO / "examples" / "qwen3-omni-tiny.yaml").read_text()))
    d["metadata"]["name"] = name
    for stage in d["spec"]["deployment"]["stages"].values():
        stage["replicas"] = 0
    d["spec"]["deployment"]["orchestrator"]["replicas"] = 0
    return d


def test_helm_install_serves_pipelines_and_uninstall_removes_it(chart_only):
    c = chart_only
    c.helm("install", RELEASE, str(CHART), "-n", SYSTEM_NS, "--create-namespace", "--wait", "--timeout", "3m",
           "--set", f"models.hostPath={REPO / 'models'}", "--set", f"watchNamespaces={{{HELM_NS}}}",
           "--set", "image.tag=e2e", "--set", "webhook.failurePolicy=Ignore")
    dep = c.apps.read_namespaced_deployment(f"{RELEASE}", SYSTEM_NS)
    assert dep.status.available_replicas == 2
    pods = c.core.list_namespaced_pod(SYSTEM_NS, label_selector="app.kubernetes.io/component=operator").items
    assert len(pods) == 2
    pod = pods[0]
    assert pod.spec.containers[0].command[:4] == ["python", "-m", "kopf", "run"]
    assert pod.spec.security_context.run_as_user == 1000
    assert pod.spec.security_context.seccomp_profile.type == "RuntimeDefault"
    # Both replicas keep their records in the chart's KopfPeering (the older one leads, leadership.py).
    custom = kubernetes.client.CustomObjectsApi(c.api)

    def peering():
        return custom.get_namespaced_custom_object("kopf.dev", "v1", HELM_NS, "kopfpeerings", RELEASE)

    wait_for(lambda: {p.metadata.name for p in pods} <= set(peering().get("status") or {}), 60,
             "both operator replicas in the KopfPeering")

    # The chart registered its webhook for OmniPipelines, with a CA bundle and the Service path ...
    admission = kubernetes.client.AdmissionregistrationV1Api(c.api)
    (hook,) = admission.read_validating_webhook_configuration(RELEASE).webhooks
    assert hook.client_config.service.name == f"{RELEASE}-webhook"
    assert hook.client_config.service.path == "/validate-omnipipeline"
    assert hook.rules[0].resources == ["omnipipelines"] and hook.failure_policy == "Ignore"
    # ... and the operator pod answers it as the apiserver would ask, refusing a bad one by field path.
    bad = pipeline_doc("helm-bad")
    bad["spec"]["topology"]["stages"][1]["inputs"][0]["stage"] = "talkr"
    answer = admission_review(c, pod.status.pod_ip, hook.client_config.ca_bundle, bad)
    assert answer["allowed"] is False and answer["status"]["code"] == 422
    assert 'spec.topology.stages[1].inputs[0]: unknown stage "talkr"' in answer["status"]["message"]
    assert admission_review(c, pod.status.pod_ip, hook.client_config.ca_bundle, pipeline_doc("fine"))["allowed"]

    # It reconciles with the chart's RBAC alone.
    c.kubectl("apply", "-n", HELM_NS, "-f", "-", input=yaml.safe_dump(pipeline_doc("helm-good")))
    c.wait_condition(HELM_NS, "helm-good", "Ready", "False", 60, reason="ScaledToZero")
    names = {d.metadata.name for d in c.apps.list_namespaced_deployment(
        HELM_NS, label_selector="omnistage.io/pipeline=helm-good").items}
    assert names == {f"helm-good-{u}" for u in ("thinker", "talker", "code2wav", "orchestrator")}

    # Each unit's certificate: issued with the chart's CA, naming the unit, mounted by its pods.
    ca = base64.b64decode(c.core.read_namespaced_secret(f"{RELEASE}-pipeline-ca", SYSTEM_NS).data["tls.crt"])
    for unit, role in (("thinker", tls.stage_role("thinker")), ("orchestrator", tls.ORCHESTRATOR_ROLE)):
        secret = c.core.read_namespaced_secret(f"helm-good-tls-{unit}", HELM_NS)
        cert = base64.b64decode(secret.data["tls.crt"])
        assert base64.b64decode(secret.data["ca.crt"]) == ca
        assert tls.uri_of(cert) == tls.identity(HELM_NS, "helm-good", role)
        x509.load_pem_x509_certificate(cert).verify_directly_issued_by(x509.load_pem_x509_certificate(ca))
        assert secret.metadata.owner_references[0].name == "helm-good"
        d = c.apps.read_namespaced_deployment(f"helm-good-{unit}", HELM_NS)
        assert any(v.secret and v.secret.secret_name == f"helm-good-tls-{unit}"
                   for v in d.spec.template.spec.volumes)
    # The pipeline's UCX data-plane key (every TLS mode): one Secret it owns, mounted by stage pods only.
    key = c.core.read_namespaced_secret("helm-good-data-plane-key", HELM_NS)
    assert len(tls.parse_data_plane_key(base64.b64decode(key.data[tls.DATA_PLANE_KEY_FILE]).decode(), "e2e")) == 32
    assert key.metadata.owner_references[0].name == "helm-good"
    for unit, mounted in (("thinker", True), ("orchestrator", False)):
        d = c.apps.read_namespaced_deployment(f"helm-good-{unit}", HELM_NS)
        assert any(v.secret and v.secret.secret_name == "helm-good-data-plane-key"
                   for v in d.spec.template.spec.volumes) == mounted

    c.helm("uninstall", RELEASE, "-n", SYSTEM_NS, "--wait", "--timeout", "2m")
    wait_for(lambda: not c.apps.list_namespaced_deployment(SYSTEM_NS).items, 60, "the operator Deployment to go")
    wait_for(lambda: not c.core.list_namespaced_pod(SYSTEM_NS).items, 60, "the operator pod to go")
    assert RELEASE not in {w.metadata.name for w in admission.list_validating_webhook_configuration().items}
    rbac = kubernetes.client.RbacAuthorizationV1Api(c.api)
    assert RELEASE not in {r.metadata.name for r in rbac.list_cluster_role().items}
    # The CRD stays (Helm never deletes crds/), and so do the pipelines in it.
    c.kubectl("get", "crd", "omnipipelines.omnistage.io")
    c.kubectl("delete", "omnip", "-n", HELM_NS, "helm-good", "--wait=true")


def admission_review(c, pod_ip: str, ca_bundle: str, obj: dict) -> dict:
    """POST an AdmissionReview to the operator pod's webhook port over TLS verified against the chart's
    CA for the Service's DNS name, as kube-apiserver does; return the response part."""
    ca = base64.b64decode(ca_bundle).decode() if not ca_bundle.startswith("-----") else ca_bundle
    name = f"{RELEASE}-webhook.{SYSTEM_NS}.svc"
    pool = urllib3.HTTPSConnectionPool(pod_ip, 9443, ca_cert_data=ca, cert_reqs="CERT_REQUIRED",
                                       server_hostname=name, assert_hostname=name)
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": str(uuid.uuid4()), "operation": "CREATE", "namespace": HELM_NS, "name": obj["metadata"]["name"],
        "kind": {"group": "omnistage.io", "version": "v1alpha1", "kind": "OmniPipeline"},
        "resource": {"group": "omnistage.io", "version": "v1alpha1", "resource": "omnipipelines"},
        "userInfo": {"username": "e2e"}, "object": obj, "dryRun": False}}
    r = pool.request("POST", "/validate-omnipipeline", body=json.dumps(review),
                     headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status == 200, r.data
    return json.loads(r.data)["response"]
