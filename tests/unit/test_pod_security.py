"""Pod Security "restricted" on every pod omnistage puts on a cluster: the operator's stage and orchestrator
pods for every example pipeline (with and without TLS), and the chart's operator pod. The checker is the
profile's rules (Kubernetes Pod Security Standards, restricted = baseline + the restricted controls), written
out here so an apiserver is not needed to enforce it; its own table tests show it refuses what the profile
refuses."""

from __future__ import annotations

import copy

import pytest
import yaml

from omnistage_operator.builders import build_children
from omnistage_operator.config import IssuerRef, ModelVolume, OperatorConfig
from omnistage_operator.pipeline_object import parse

from ..conftest import EXAMPLES
from .test_operator_chart import needs_helm, render

# restricted: only these volume types.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
ALLOWED_ADDED_CAPABILITIES = {"NET_BIND_SERVICE"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
SECCOMP_OK = {"RuntimeDefault", "Localhost"}


def restricted_violations(pod: dict) -> list[str]:
    """What in a pod spec the Pod Security "restricted" level refuses (empty: admitted)."""
    out: list[str] = []
    psc = pod.get("securityContext") or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            out.append(f"{field}: true")
    for v in pod.get("volumes") or ():
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {v['name']}: type {sorted(kinds - RESTRICTED_VOLUMES)} not allowed")
    for s in psc.get("sysctls") or ():
        if s.get("name") not in SAFE_SYSCTLS:
            out.append(f"sysctl {s.get('name')}: not a safe sysctl")
    if (psc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("pod: hostProcess")
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    if pod_seccomp is not None and pod_seccomp not in SECCOMP_OK:
        out.append(f"pod: seccompProfile {pod_seccomp}")
    if psc.get("runAsUser") == 0:
        out.append("pod: runAsUser 0")
    if (psc.get("seLinuxOptions") or {}).get("type") not in SELINUX_TYPES:
        out.append("pod: seLinuxOptions.type")
    containers = [*(pod.get("initContainers") or ()), *(pod.get("containers") or ()),
                  *(pod.get("ephemeralContainers") or ())]
    for c in containers:
        sc = c.get("securityContext") or {}
        name = f"container {c['name']}"
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"{name}: hostProcess")
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"{name}: procMount {sc['procMount']}")
        if (sc.get("seLinuxOptions") or {}).get("type") not in SELINUX_TYPES:
            out.append(f"{name}: seLinuxOptions.type")
        if any(p.get("hostPort") for p in c.get("ports") or ()):
            out.append(f"{name}: hostPort")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation must be false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or ()):
            out.append(f"{name}: capabilities must drop ALL")
        added = set(caps.get("add") or ()) - ALLOWED_ADDED_CAPABILITIES
        if added:
            out.append(f"{name}: capabilities add {sorted(added)}")
        if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
            out.append(f"{name}: runAsNonRoot must be true (pod or container)")
        if sc.get("runAsUser") == 0:
            out.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in SECCOMP_OK:
            out.append(f"{name}: seccompProfile must be RuntimeDefault or Localhost (pod or container), is {seccomp}")
    return out


# ------------------------------------------------------------------ the checker refuses what the profile refuses

GOOD_POD = {
    "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
    "volumes": [{"name": "tmp", "emptyDir": {}}, {"name": "cert", "secret": {"secretName": "x"}}],
    "containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": False,
                                                     "capabilities": {"drop": ["ALL"]}}}],
}


def edited(fn):
    pod = copy.deepcopy(GOOD_POD)
    fn(pod)
    return pod


def container_sc(pod):
    return pod["containers"][0]["securityContext"]


@pytest.mark.parametrize("edit, words", [
    (lambda p: p["securityContext"].pop("seccompProfile"), "seccompProfile must be"),
    (lambda p: container_sc(p).__setitem__("seccompProfile", {"type": "Unconfined"}), "seccompProfile must be"),
    (lambda p: container_sc(p).__setitem__("capabilities", {}), "drop ALL"),
    (lambda p: container_sc(p)["capabilities"].__setitem__("add", ["SYS_ADMIN"]), "SYS_ADMIN"),
    (lambda p: container_sc(p).pop("allowPrivilegeEscalation"), "allowPrivilegeEscalation"),
    (lambda p: p["securityContext"].pop("runAsNonRoot"), "runAsNonRoot"),
    (lambda p: p["volumes"].append({"name": "models", "hostPath": {"path": "/srv"}}), "volume models"),
    (lambda p: p.__setitem__("hostNetwork", True), "hostNetwork"),
    (lambda p: container_sc(p).__setitem__("privileged", True), "privileged"),
    (lambda p: p["containers"][0].__setitem__("ports", [{"containerPort": 80, "hostPort": 80}]), "hostPort"),
])
def test_checker_refuses_what_restricted_refuses(edit, words):
    assert restricted_violations(GOOD_POD) == []
    problems = restricted_violations(edited(edit))
    assert any(words in p for p in problems), problems


def test_checker_accepts_container_level_settings_in_place_of_pod_level_ones():
    def move(p):
        p["securityContext"] = {}
        container_sc(p).update(runAsNonRoot=True, seccompProfile={"type": "Localhost", "localhostProfile": "x"})
    assert restricted_violations(edited(move)) == []


# ------------------------------------------------------------------ every pod omnistage makes passes

CONFIGS = {
    "no-tls": OperatorConfig(model_volume=ModelVolume("pvc", "omnistage-models", "/models")),
    "chart-tls": OperatorConfig(model_volume=ModelVolume("pvc", "omnistage-models", "/models"),
                                tls_issuer="chart", tls_ca_secret=("omnistage-system", "ca")),
    "cert-manager": OperatorConfig(model_volume=ModelVolume("none", "", "/models"), tls_issuer="certManager",
                                   tls_issuer_ref=IssuerRef("ClusterIssuer", "ca")),
}
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))


@pytest.mark.parametrize("cfg", sorted(CONFIGS))
@pytest.mark.parametrize("example", EXAMPLE_FILES, ids=lambda p: p.stem)
def test_operator_pods_pass_restricted(example, cfg):
    doc = yaml.safe_load(example.read_text())
    doc["spec"]["deployment"].setdefault("orchestrator", {})["tls"] = {"secretName": "client-cert"}
    children = build_children(parse(doc), CONFIGS[cfg])
    deployments = [sc.deployment for sc in children.stages.values()] + [children.orchestrator_deployment]
    assert len(deployments) >= 2
    for d in deployments:
        assert restricted_violations(d["spec"]["template"]["spec"]) == [], d["metadata"]["name"]


def on_gpu_nodes(doc: dict) -> dict:
    """Every stage of an example on GPU nodes: one GPU per torch stage, tensor parallel 2 on vLLM, and the
    placement fields a GPU pool needs (the memory-backed /dev/shm comes with them)."""
    engines = {s["name"]: s["engine"] for s in doc["spec"]["topology"]["stages"]}
    entries = doc["spec"]["deployment"].setdefault("stages", {})
    for name, engine in engines.items():
        entry = entries.setdefault(name, {}) or {}
        entries[name] = entry
        entry.update(gpus=1, nodeSelector={"nvidia.com/gpu.present": "true"}, runtimeClassName="nvidia",
                     tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                     priorityClassName="gpu-serving", rollingUpdate={"maxSurge": 0, "maxUnavailable": 1})
        if engine == "vllm":
            entry.update(gpus=2, parallelism={"tensor": 2})
    return doc


@pytest.mark.parametrize("cfg", sorted(CONFIGS))
@pytest.mark.parametrize("example", EXAMPLE_FILES, ids=lambda p: p.stem)
def test_gpu_stage_pods_pass_restricted(example, cfg):
    doc = on_gpu_nodes(yaml.safe_load(example.read_text()))
    children = build_children(parse(doc), CONFIGS[cfg])
    for sc in children.stages.values():
        pod = sc.deployment["spec"]["template"]["spec"]
        assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in pod["volumes"])   # /dev/shm
        assert restricted_violations(pod) == [], sc.deployment["metadata"]["name"]


def test_a_host_path_model_store_is_the_one_setting_restricted_refuses():
    """hostPath (single-node and test clusters) is outside the profile: the checker says so."""
    doc = yaml.safe_load((EXAMPLES / "qwen3-omni-tiny.yaml").read_text())
    cfg = OperatorConfig(model_volume=ModelVolume("hostPath", "/srv/models", "/models"))
    d = next(iter(build_children(parse(doc), cfg).stages.values())).deployment
    assert restricted_violations(d["spec"]["template"]["spec"]) == [
        "volume models: type ['hostPath'] not allowed"]


@needs_helm
@pytest.mark.parametrize("sets", [(), ("watchNamespaces={a,b}",), ("webhook.enabled=false",),
                                  ("tls.issuer=certManager", "tls.certManager.issuerRef.name=ca",
                                   "webhook.certManager.enabled=true")])
def test_chart_operator_pod_passes_restricted(sets):
    pods = [o["spec"]["template"]["spec"] for o in render(*sets).values() if o["kind"] == "Deployment"]
    assert pods
    for pod in pods:
        assert restricted_violations(pod) == []
