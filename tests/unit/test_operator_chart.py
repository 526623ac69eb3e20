"""The Helm chart: every value documented and checked by values.schema.json; `helm lint` and
`helm template` render objects that say what the operator needs (helm from $OMNISTAGE_HELM, PATH or
~/.cache/omnistage/helm; `make test` fetches it, and under CI these fail rather than skip without it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from ..conftest import REPO
from ..harness import example

CHART = REPO / "charts" / "omnistage"
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
SCHEMA = json.loads((CHART / "values.schema.json").read_text())


def helm_binary() -> str | None:
    """$OMNISTAGE_HELM (`make test` fetches helm and names it there), helm on PATH, or the cache
    e2e/cluster/get-helm.sh fills."""
    cached = Path(os.environ.get("OMNISTAGE_CACHE", Path.home() / ".cache" / "omnistage")) / "helm" / "helm"
    return os.environ.get("OMNISTAGE_HELM") or shutil.which("helm") or (str(cached) if cached.exists() else None)


HELM = helm_binary()
# Under CI, or where helm was named, a missing helm fails these tests; elsewhere they are skipped.
HELM_REQUIRED = bool(os.environ.get("CI") or os.environ.get("OMNISTAGE_HELM"))
needs_helm = pytest.mark.skipif(HELM is None and not HELM_REQUIRED,
                                reason="no helm binary (e2e/cluster/get-helm.sh fetches one)")


FREE_FORM = {"resources", "issuerRef"}   # maps passed through as they are (Kubernetes resource requests and limits)


def test_every_value_is_documented_in_values_yaml():
    """Each key has a `# --` comment in the block right above it (keys inside a free-form map excepted)."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    ancestors: list[tuple[int, str]] = []
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or stripped.startswith("-") or ":" not in stripped:
            continue
        indent, key = len(line) - len(line.lstrip()), stripped.split(":", 1)[0]
        ancestors = [(n, k) for n, k in ancestors if n < indent]
        block, j = [], i - 1
        while j >= 0 and lines[j].strip().startswith("#"):
            block.append(lines[j].strip())
            j -= 1
        inside_free_form = any(k in FREE_FORM for _, k in ancestors)
        assert inside_free_form or any(c.startswith("# --") for c in block), \
            f"values.yaml line {i + 1} ({key}) has no '# --' comment above it"
        ancestors.append((indent, key))


def test_values_yaml_satisfies_its_schema_and_schema_covers_every_value():
    jsonschema.validate(VALUES, SCHEMA)
    def walk(values, schema, path):
        props = schema.get("properties", {})
        for key, value in values.items():
            assert key in props, f"values.schema.json does not describe {path}{key}"
            if isinstance(value, dict) and props[key].get("properties"):
                walk(value, props[key], f"{path}{key}.")
    walk(VALUES, SCHEMA, "")


@pytest.mark.parametrize("override, field", [
    ({"webhook": {"failurePolicy": "Sometimes"}}, "failurePolicy"),
    ({"operator": {"workers": 0}}, "workers"),
    ({"models": {"hostPath": "relative/path"}}, "hostPath"),
    ({"pipelinePods": {"runAsUser": 0}}, "runAsUser"),
    ({"watchNamespaces": ["Bad_Name"]}, "watchNamespaces"),
    ({"operator": {"wrokers": 2}}, "wrokers"),
    ({"models": {"quickstart": {"accessMode": "ReadSometimes"}}}, "accessMode"),
])
def test_schema_refuses_bad_values(override, field):
    values = json.loads(json.dumps(VALUES))
    for key, sub in override.items():
        if isinstance(sub, dict):
            values[key].update(sub)
        else:
            values[key] = sub
    with pytest.raises(jsonschema.ValidationError) as err:
        jsonschema.validate(values, SCHEMA)
    assert field in str(err.value)


def helm(*args: str) -> subprocess.CompletedProcess:
    assert HELM and Path(HELM).is_file(), \
        f"no helm binary ({HELM or 'none found'}): e2e/cluster/get-helm.sh fetches one"
    return subprocess.run([HELM, *args], capture_output=True, text=True)


def render_all(*sets: str) -> list[dict]:
    args = ["template", "omnistage", str(CHART), "--namespace", "omnistage-system"]
    for s in sets:
        args += ["--set", s]
    r = helm(*args)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def render(*sets: str) -> dict[tuple[str, str], dict]:
    """The rendered objects by (kind, name): namespaced copies of one name (a Role per watched namespace)
    need render_all."""
    return {(d["kind"], d["metadata"]["name"]): d for d in render_all(*sets)}


@needs_helm
def test_helm_lint():
    r = helm("lint", "--strict", str(CHART))
    assert r.returncode == 0, r.stdout + r.stderr


@needs_helm
def test_helm_refuses_values_the_schema_refuses():
    r = helm("template", "x", str(CHART), "--set", "webhook.failurePolicy=Sometimes")
    assert r.returncode != 0 and "failurePolicy" in r.stderr


@needs_helm
def test_rendered_objects():
    objs = render("clusterWide=true")   # the default, the release namespace only: further down
    assert set(objs) == {("ServiceAccount", "omnistage"), ("ClusterRole", "omnistage"),
                         ("ClusterRoleBinding", "omnistage"), ("Deployment", "omnistage"),
                         ("Secret", "omnistage-webhook-cert"), ("Service", "omnistage-webhook"),
                         ("ValidatingWebhookConfiguration", "omnistage"), ("Secret", "omnistage-pipeline-ca"),
                         ("Role", "omnistage-pipeline-ca"), ("RoleBinding", "omnistage-pipeline-ca"),
                         ("NetworkPolicy", "omnistage"), ("ClusterKopfPeering", "omnistage"),
                         ("PodDisruptionBudget", "omnistage"), ("ClusterRole", "omnistage-omnipipelines-view"),
                         ("ClusterRole", "omnistage-omnipipelines-edit")}
    dep = objs[("Deployment", "omnistage")]
    # two peered replicas; a new one comes up (as a standby) before an old one goes
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate",
                                       "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"][:6] == ["python", "-m", "kopf", "run", "-m", "omnistage_operator.handlers"]
    assert "--standalone" not in c["command"] and "--all-namespaces" in c["command"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["OMNISTAGE_MODEL_VOLUME"] == "pvc:omnistage-models" and env["OMNISTAGE_WEBHOOK"] == "external"
    assert env["OMNISTAGE_PEERING"] == "omnistage" and env["OMNISTAGE_WATCH_NAMESPACES"] == ""
    pod_id = next(e for e in c["env"] if e["name"] == "POD_ID")
    assert pod_id["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["OMNISTAGE_TLS_ISSUER"] == "chart"
    assert env["OMNISTAGE_TLS_CA_SECRET"] == "omnistage-system/omnistage-pipeline-ca"
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"]["readOnlyRootFilesystem"] and pod["securityContext"]["runAsNonRoot"]
    hook = objs[("ValidatingWebhookConfiguration", "omnistage")]["webhooks"][0]
    assert hook["clientConfig"]["service"] == {"name": "omnistage-webhook", "namespace": "omnistage-system",
                                               "path": "/validate-omnipipeline", "port": 443}
    assert hook["rules"][0]["operations"] == ["CREATE", "UPDATE"]
    secret = objs[("Secret", "omnistage-webhook-cert")]
    assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]


@needs_helm
def test_rendered_rbac_covers_every_child_kind_the_operator_writes():
    from omnistage_operator.handlers import CHILD_RESOURCES
    rules = render("clusterWide=true")[("ClusterRole", "omnistage")]["rules"]
    for res in CHILD_RESOURCES:
        rule = next((r for r in rules if res["plural"] in r["resources"] and res["group"] in r["apiGroups"]), None)
        assert rule, f"no rule for {res}"
        assert {"get", "list", "watch", "create", "patch", "delete"} <= set(rule["verbs"])
    assert any("omnipipelines/status" in r["resources"] and "patch" in r["verbs"] for r in rules)
    # never more than needed: no wildcards, nothing that escalates; Secrets only by name (never listed)
    assert all("*" not in r["verbs"] and "*" not in r["resources"] and "*" not in r["apiGroups"] for r in rules)
    assert not {"escalate", "bind", "impersonate"} & {v for r in rules for v in r["verbs"]}
    secret_verbs = {v for r in rules if "secrets" in r["resources"] for v in r["verbs"]}
    assert secret_verbs == {"get", "create", "patch", "delete"}


@needs_helm
def test_rendered_rbac_lets_the_operator_read_pods_and_nothing_more():
    from omnistage_operator.handlers import POD_RESOURCE
    rules = render("clusterWide=true")[("ClusterRole", "omnistage")]["rules"]
    verbs = {v for r in rules if POD_RESOURCE["plural"] in r["resources"] and POD_RESOURCE["group"] in r["apiGroups"]
             for v in r["verbs"]}
    assert verbs == {"get", "list", "watch"}   # status only: the Deployments own the pods


def rules_by_resource(rules: list[dict]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for r in rules:
        for g in r["apiGroups"]:
            for res in r["resources"]:
                out.setdefault(f"{g}/{res}" if g else res, set()).update(r["verbs"])
    return out


@needs_helm
def test_watch_namespaces_gives_roles_in_those_namespaces_and_nothing_cluster_wide():
    docs = render_all("watchNamespaces={team-a,team-b}")
    objs = {(d["kind"], d["metadata"]["name"]): d for d in docs if d["metadata"].get("namespace") in
            (None, "omnistage-system")}
    assert not [k for k in objs if k[0] in ("ClusterRoleBinding", "ClusterKopfPeering")]
    assert not [k for k in objs if k[0] == "ClusterRole" and "omnipipelines-" not in k[1]]   # users' only
    for ns in ("team-a", "team-b"):
        role = next(o for o in docs if o["kind"] == "Role" and o["metadata"].get("namespace") == ns)
        binding = next(o for o in docs if o["kind"] == "RoleBinding" and o["metadata"].get("namespace") == ns)
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "omnistage"}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "omnistage",
                                        "namespace": "omnistage-system"}]
        rules = rules_by_resource(role["rules"])
        assert rules["apps/deployments"] == {"get", "list", "watch", "create", "patch", "delete"}
        assert rules["secrets"] == {"get", "create", "patch", "delete"}
        assert rules["kopf.dev/kopfpeerings"] == {"get", "list", "watch", "patch"}
        assert "apiextensions.k8s.io/customresourcedefinitions" not in rules and "namespaces" not in rules
        peering = [o for o in docs if o["kind"] == "KopfPeering" and o["metadata"]["namespace"] == ns]
        assert [p["metadata"]["name"] for p in peering] == ["omnistage"]
    # The CA: get, by name, in the release namespace; nothing else there.
    ca_role = objs[("Role", "omnistage-pipeline-ca")]
    assert ca_role["metadata"]["namespace"] == "omnistage-system"
    assert ca_role["rules"] == [{"apiGroups": [""], "resources": ["secrets"],
                                 "resourceNames": ["omnistage-pipeline-ca"], "verbs": ["get"]}]
    (c,) = objs[("Deployment", "omnistage")]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["OMNISTAGE_WATCH_NAMESPACES"] == "team-a,team-b"


@needs_helm
def test_operator_rbac_covers_what_it_grants_each_orchestrator():
    """The operator may only create a Role with rules it holds (no escalate verb): each orchestrator's."""
    from omnistage_operator.builders import build_orchestrator_access
    from omnistage_operator.pipeline_object import parse
    doc = yaml.safe_load((REPO / "examples" / "qwen3-omni-tiny.yaml").read_text())
    _, role, _ = build_orchestrator_access(parse(doc))
    for sets in ((), ("watchNamespaces={a}",)):
        rules = rules_by_resource(next(o for o in render_all(*sets) if o["kind"] in ("Role", "ClusterRole")
                                       and o["metadata"]["name"] == "omnistage")["rules"])
        for r in role["rules"]:
            for g in r["apiGroups"]:
                for res in r["resources"]:
                    assert set(r["verbs"]) <= rules[f"{g}/{res}" if g else res]


@needs_helm
def test_cert_manager_issuer_grants_certificates_and_secrets_for_the_data_plane_keys_only():
    objs = render("tls.issuer=certManager", "tls.certManager.issuerRef.name=pipelines-ca", "clusterWide=true")
    rules = rules_by_resource(objs[("ClusterRole", "omnistage")]["rules"])
    assert rules["secrets"] == {"get", "create", "patch"}   # each pipeline's UCX key: made once, never deleted
    assert rules["cert-manager.io/certificates"] == {"get", "list", "watch", "create", "patch", "delete"}
    assert ("Secret", "omnistage-pipeline-ca") not in objs and ("Role", "omnistage-pipeline-ca") not in objs
    (c,) = objs[("Deployment", "omnistage")]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["OMNISTAGE_TLS_ISSUER"] == "certManager"
    assert env["OMNISTAGE_TLS_ISSUER_REF"] == "ClusterIssuer/pipelines-ca/cert-manager.io"


@needs_helm
def test_tls_off_and_a_pre_created_ca():
    objs = render("tls.enabled=false", "clusterWide=true")
    (c,) = objs[("Deployment", "omnistage")]["spec"]["template"]["spec"]["containers"]
    assert {e["name"]: e.get("value") for e in c["env"]}["OMNISTAGE_TLS_ISSUER"] == "off"
    assert rules_by_resource(objs[("ClusterRole", "omnistage")]["rules"])["secrets"] == {"get", "create", "patch"}
    objs = render("tls.caSecretName=my-ca")
    assert ("Secret", "omnistage-pipeline-ca") not in objs   # the user's, not rendered
    assert objs[("Role", "omnistage-pipeline-ca")]["rules"][0]["resourceNames"] == ["my-ca"]


@needs_helm
def test_pipeline_ca_is_a_ca_kept_by_helm():
    import base64

    from cryptography import x509
    secret = render()[("Secret", "omnistage-pipeline-ca")]
    assert secret["type"] == "kubernetes.io/tls"
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


@needs_helm
def test_webhook_certificate_from_cert_manager_is_stable_across_renders():
    # (a GitOps render names its pipelines' CA too: tls.caSecretName)
    first, second = (render("webhook.certManager.enabled=true", "tls.caSecretName=ca") for _ in range(2))
    assert first == second   # nothing generated at render time
    assert ("Secret", "omnistage-webhook-cert") not in first
    cert = first[("Certificate", "omnistage-webhook")]
    assert cert["spec"]["secretName"] == "omnistage-webhook-cert"
    assert "omnistage-webhook.omnistage-system.svc" in cert["spec"]["dnsNames"]
    assert cert["spec"]["issuerRef"] == {"kind": "Issuer", "name": "omnistage-webhook-selfsigned",
                                         "group": "cert-manager.io"}
    assert first[("Issuer", "omnistage-webhook-selfsigned")]["spec"] == {"selfSigned": {}}
    hook = first[("ValidatingWebhookConfiguration", "omnistage")]
    assert hook["metadata"]["annotations"] == {"cert-manager.io/inject-ca-from": "omnistage-system/omnistage-webhook"}
    assert "caBundle" not in hook["webhooks"][0]["clientConfig"]
    named = render("webhook.certManager.enabled=true", "webhook.certManager.issuerRef.kind=ClusterIssuer",
                   "webhook.certManager.issuerRef.name=corp-ca")
    assert named[("Certificate", "omnistage-webhook")]["spec"]["issuerRef"] == {"kind": "ClusterIssuer",
                                                                               "name": "corp-ca"}
    assert not [k for k in named if k[0] == "Issuer"]


@needs_helm
def test_webhook_certificate_from_an_existing_secret_is_stable_across_renders():
    sets = ("webhook.existingSecret=my-webhook-cert", "webhook.caBundle=Q0FCVU5ETEU=", "tls.caSecretName=ca")
    first, second = render(*sets), render(*sets)
    assert first == second
    assert not [k for k in first if k[0] == "Secret" and "webhook" in k[1]]
    hook = first[("ValidatingWebhookConfiguration", "omnistage")]
    assert hook["webhooks"][0]["clientConfig"]["caBundle"] == "Q0FCVU5ETEU="
    volumes = first[("Deployment", "omnistage")]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "webhook-cert", "secret": {"secretName": "my-webhook-cert"}} in volumes
    r = helm("template", "x", str(CHART), "--set", "webhook.existingSecret=my-webhook-cert")
    assert r.returncode != 0 and "caBundle" in r.stderr


@needs_helm
def test_operator_network_policy():
    np = render()[("NetworkPolicy", "omnistage")]
    assert np["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
    assert np["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": "webhook"}]}]
    np = render("pipelinePods.metricsNamespaceLabel=team=monitoring",
                "networkPolicy.webhookFrom[0].ipBlock.cidr=10.0.0.0/16")[("NetworkPolicy", "omnistage")]
    assert np["spec"]["ingress"] == [
        {"ports": [{"protocol": "TCP", "port": "webhook"}], "from": [{"ipBlock": {"cidr": "10.0.0.0/16"}}]},
        {"ports": [{"protocol": "TCP", "port": "health"}, {"protocol": "TCP", "port": "metrics"}],
         "from": [{"namespaceSelector": {"matchLabels": {"team": "monitoring"}}}]}]
    assert ("NetworkPolicy", "omnistage") not in render("networkPolicy.enabled=false")


@needs_helm
def test_orchestrator_clients_reach_the_operator_as_json():
    objs = render("networkPolicy.orchestratorClientsFrom[0].namespaceSelector.matchLabels.role=gateway")
    (c,) = objs[("Deployment", "omnistage")]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    env["POD_ID"] = "omnistage-0"   # the downward API's part
    from omnistage_operator.config import from_env
    assert from_env(env).orchestrator_clients_from == ({"namespaceSelector": {"matchLabels": {"role": "gateway"}}},)


@needs_helm
def test_the_operator_names_its_own_pods_for_the_stage_planners_scrapes_and_may_scale_deployments():
    objs = render("clusterWide=true")
    dep = objs[("Deployment", "omnistage")]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    env["POD_ID"] = "omnistage-0"
    from omnistage_operator.config import from_env
    peer = from_env(env).operator_peer
    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "omnistage-system"}}
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert peer["podSelector"]["matchLabels"].items() <= pod_labels.items()
    verbs = rules_by_resource(objs[("ClusterRole", "omnistage")]["rules"])
    assert verbs["apps/deployments/scale"] == {"get", "patch", "update"}
    # the planner's decisions as Prometheus metrics, on the container's metrics port
    cfg = from_env({**env, "POD_IP": "10.1.2.3"})
    assert cfg.metrics_port == 8081 and {"name": "metrics", "containerPort": 8081} in c["ports"]


@needs_helm
def test_one_standalone_replica_without_leader_election():
    objs = render("operator.leaderElection.enabled=false", "operator.replicas=1")
    dep = objs[("Deployment", "omnistage")]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert "OMNISTAGE_PEERING" not in {e["name"] for e in c["env"]}
    assert ("ClusterKopfPeering", "omnistage") not in objs
    r = helm("template", "x", str(CHART), "--set", "operator.leaderElection.enabled=false")
    assert r.returncode != 0 and "replicas" in r.stderr   # two replicas need peering


@needs_helm
@pytest.mark.parametrize("sets", [(), ("watchNamespaces={a,b}",),
                                  ("tls.issuer=certManager", "tls.certManager.issuerRef.name=ca"),
                                  ("webhook.existingSecret=wh", "webhook.caBundle=QUJD"),
                                  ("webhook.certManager.enabled=true",)])
def test_helm_lint_with_each_option(sets):
    args = ["lint", "--strict", str(CHART)]
    for s in sets:
        args += ["--set", s]
    r = helm(*args)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_helm
def test_values_change_what_renders():
    objs = render("models.hostPath=/srv/models", "watchNamespaces={a,b}", "webhook.enabled=false")
    (c,) = objs[("Deployment", "omnistage")]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["OMNISTAGE_MODEL_VOLUME"] == "hostPath:/srv/models" and env["OMNISTAGE_WEBHOOK"] == "off"
    assert "--namespace=a" in c["command"] and "--namespace=b" in c["command"]
    assert "--all-namespaces" not in c["command"]
    assert ("ValidatingWebhookConfiguration", "omnistage") not in objs


def test_chart_crd_is_the_crd():
    assert (CHART / "crds" / "omnipipelines.yaml").read_text() == (REPO / "crds" / "omnipipelines.yaml").read_text()


@needs_helm
@pytest.mark.parametrize("value, mounted", [(None, True), ("false", False)])
def test_the_orchestrator_mounts_the_model_volume_unless_the_chart_says_not(value, mounted):
    objs = render(*([f"models.orchestrator={value}"] if value else []))
    (c,) = objs[("Deployment", "omnistage")]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    env["POD_ID"] = "omnistage-0"
    from omnistage_operator.builders import build_orchestrator_deployment
    from omnistage_operator.config import from_env

    cfg = from_env(env)
    assert cfg.orchestrator_models is mounted
    pod = build_orchestrator_deployment(example("qwen3-omni-tiny"), cfg)["spec"]["template"]["spec"]
    assert ("models" in {v["name"] for v in pod["volumes"]}) is mounted
    assert ("models" in {m["name"] for m in pod["containers"][0]["volumeMounts"]}) is mounted


def test_a_bad_orchestrator_models_setting_is_refused_naming_it():
    from omnistage_operator.config import ConfigError, from_env

    with pytest.raises(ConfigError, match="OMNISTAGE_ORCHESTRATOR_MODELS='yes': expected true or false"):
        from_env({"OMNISTAGE_ORCHESTRATOR_MODELS": "yes"})


@needs_helm
def test_by_default_the_operator_serves_the_release_namespace_with_a_role_there_and_nothing_cluster_wide():
    docs = render_all()
    kinds = {(d["kind"], d["metadata"]["name"], d["metadata"].get("namespace")) for d in docs}
    # the only ClusterRoles are users' (aggregated into view/edit/admin, bound by nobody here)
    assert not [k for k in kinds if k[0] in ("ClusterRoleBinding", "ClusterKopfPeering")]
    assert {k[1] for k in kinds if k[0] == "ClusterRole"} == {"omnistage-omnipipelines-view",
                                                              "omnistage-omnipipelines-edit"}
    assert ("Role", "omnistage", "omnistage-system") in kinds
    assert ("KopfPeering", "omnistage", "omnistage-system") in kinds
    role = next(d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "omnistage")
    rules = rules_by_resource(role["rules"])
    assert rules["secrets"] == {"get", "create", "patch", "delete"}   # in this namespace only; never listed
    (c,) = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"]
    assert "--namespace=omnistage-system" in c["command"] and "--all-namespaces" not in c["command"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["OMNISTAGE_WATCH_NAMESPACES"] == "omnistage-system"


@needs_helm
def test_cluster_wide_is_an_explicit_value_and_excludes_watch_namespaces():
    objs = render("clusterWide=true")
    assert ("ClusterRole", "omnistage") in objs and ("ClusterKopfPeering", "omnistage") in objs
    r = helm("template", "x", str(CHART), "--set", "clusterWide=true", "--set", "watchNamespaces={a}")
    assert r.returncode != 0 and "clusterWide" in r.stderr


@needs_helm
def test_the_stage_planner_may_read_replica_sets_to_scrape_only_its_own_pods():
    rules = rules_by_resource(next(d for d in render_all() if d["kind"] == "Role"
                                   and d["metadata"]["name"] == "omnistage")["rules"])
    assert rules["apps/replicasets"] == {"get", "list"}


@needs_helm
def test_an_image_digest_pins_the_operator_image():
    (c,) = render("image.digest=sha256:" + "a" * 64)[("Deployment", "omnistage")]["spec"]["template"]["spec"][
        "containers"]
    assert c["image"] == "ghcr.io/omnistage/omnistage@sha256:" + "a" * 64
    (c,) = render()[("Deployment", "omnistage")]["spec"]["template"]["spec"]["containers"]
    assert c["image"].startswith("ghcr.io/omnistage/omnistage:") and "@" not in c["image"]


@needs_helm
def test_two_operator_replicas_are_drained_one_at_a_time_and_one_has_no_budget():
    pdb = render()[("PodDisruptionBudget", "omnistage")]
    dep = render()[("Deployment", "omnistage")]
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert pdb["apiVersion"] == "policy/v1"   # policy/v1beta1 on Kubernetes 1.20, which has no policy/v1
    objs = render("operator.leaderElection.enabled=false", "operator.replicas=1")
    assert not [k for k in objs if k[0] == "PodDisruptionBudget"]   # one replica: a budget would block drains
    assert not [k for k in render("operator.podDisruptionBudget.enabled=false") if k[0] == "PodDisruptionBudget"]


@needs_helm
def test_omnipipelines_join_the_default_view_edit_and_admin_roles():
    objs = render()
    view = objs[("ClusterRole", "omnistage-omnipipelines-view")]
    edit = objs[("ClusterRole", "omnistage-omnipipelines-edit")]
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert {k: v for k, v in edit["metadata"]["labels"].items() if "aggregate" in k} == {
        "rbac.authorization.k8s.io/aggregate-to-edit": "true", "rbac.authorization.k8s.io/aggregate-to-admin": "true"}
    assert rules_by_resource(view["rules"]) == {"omnistage.io/omnipipelines": {"get", "list", "watch"},
                                                "omnistage.io/omnipipelines/status": {"get", "list", "watch"}}
    assert rules_by_resource(edit["rules"])["omnistage.io/omnipipelines"] >= {"create", "update", "patch", "delete"}
    assert rules_by_resource(edit["rules"])["omnistage.io/omnipipelines/status"] == {"get", "list", "watch"}
    assert not [k for k in render("rbac.aggregateToDefaultRoles=false") if "omnipipelines" in k[1]]


def test_the_chart_readme_lists_every_value_as_values_yaml_documents_it():
    """charts/omnistage/README.md's table is generated from values.yaml (`python scripts/chart_values.py`)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("chart_values", REPO / "scripts" / "chart_values.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    values_text, readme = (CHART / "values.yaml").read_text(), (CHART / "README.md").read_text()
    assert gen.readme_with_table(readme, values_text) == readme, "run: python scripts/chart_values.py"
    keys = [row[0] for row in gen.values_rows(values_text)]
    assert "operator.podDisruptionBudget.enabled" in keys and "image.digest" in keys
    # every leaf value of values.yaml has its row
    def leaves(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict) and v and k not in FREE_FORM:
                yield from leaves(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}"
    assert [k for k in leaves(VALUES) if k not in keys] == []


# ------------------------------------------------------------------ models.quickstart

QUICKSTART = ("models.quickstart.enabled=true", "models.quickstart.size=3Gi", "models.quickstart.storageClass=fast")


@needs_helm
def test_the_model_quickstart_is_off_by_default():
    assert not [key for key in render() if key[0] in ("PersistentVolumeClaim", "Job")]


@needs_helm
def test_the_model_quickstart_makes_the_claim_and_a_restricted_job_that_fills_it():
    from .test_pod_security import restricted_violations

    objs = render(*QUICKSTART)
    claim = objs[("PersistentVolumeClaim", "omnistage-models")]
    assert claim["metadata"]["namespace"] == "omnistage-system"
    assert claim["spec"] == {"accessModes": ["ReadWriteOnce"], "storageClassName": "fast",
                             "resources": {"requests": {"storage": "3Gi"}}}
    (job,) = [o for (kind, _), o in objs.items() if kind == "Job"]
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    operator = objs[("Deployment", "omnistage")]["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == operator["image"]   # the operator's own image
    assert c["command"][-3:] == ["models", "build", VALUES["models"]["mountPath"]]
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "omnistage-models"}} in pod["volumes"]
    assert pod["securityContext"]["runAsUser"] == VALUES["pipelinePods"]["runAsUser"] != 0
    assert pod["securityContext"]["fsGroup"] == VALUES["pipelinePods"]["runAsUser"]
    assert restricted_violations(pod) == []


@needs_helm
@pytest.mark.parametrize("extra, says", [
    ("models.persistentVolumeClaim=", "models.quickstart needs models.persistentVolumeClaim"),
    ("models.hostPath=/srv/models", "leave models.hostPath empty"),
])
def test_the_model_quickstart_refuses_a_store_it_cannot_fill(extra, says):
    r = helm("template", "x", str(CHART), "--set", "models.quickstart.enabled=true", "--set", extra)
    assert r.returncode != 0 and says in r.stderr
