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


FREE_FORM = {"resources"}   # maps passed through as they are (Kubernetes resource requests and limits)


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


def render(*sets: str) -> dict[tuple[str, str], dict]:
    args = ["template", "omnistage", str(CHART), "--namespace", "omnistage-system"]
    for s in sets:
        args += ["--set", s]
    r = helm(*args)
    assert r.returncode == 0, r.stderr
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(r.stdout) if d}


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
    objs = render()
    assert set(objs) == {("ServiceAccount", "omnistage"), ("ClusterRole", "omnistage"),
                         ("ClusterRoleBinding", "omnistage"), ("Deployment", "omnistage"),
                         ("Secret", "omnistage-webhook-cert"), ("Service", "omnistage-webhook"),
                         ("ValidatingWebhookConfiguration", "omnistage")}
    dep = objs[("Deployment", "omnistage")]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"][:7] == ["python", "-m", "kopf", "run", "--standalone", "-m", "omnistage_operator.handlers"]
    assert "--all-namespaces" in c["command"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["OMNISTAGE_MODEL_VOLUME"] == "pvc:omnistage-models" and env["OMNISTAGE_WEBHOOK"] == "external"
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
    rules = render()[("ClusterRole", "omnistage")]["rules"]
    for res in CHILD_RESOURCES:
        rule = next((r for r in rules if res["plural"] in r["resources"] and res["group"] in r["apiGroups"]), None)
        assert rule, f"no rule for {res}"
        assert {"get", "list", "watch", "create", "patch", "delete"} <= set(rule["verbs"])
    assert any("omnipipelines/status" in r["resources"] and "patch" in r["verbs"] for r in rules)
    # never more than needed: no wildcards, no secrets
    assert all("*" not in r["verbs"] and "*" not in r["resources"] and "secrets" not in r["resources"] for r in rules)


@needs_helm
def test_rendered_rbac_lets_the_operator_read_pods_and_nothing_more():
    from omnistage_operator.handlers import POD_RESOURCE
    rules = render()[("ClusterRole", "omnistage")]["rules"]
    verbs = {v for r in rules if POD_RESOURCE["plural"] in r["resources"] and POD_RESOURCE["group"] in r["apiGroups"]
             for v in r["verbs"]}
    assert verbs == {"get", "list", "watch"}   # status only: the Deployments own the pods


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
