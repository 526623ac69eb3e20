"""Pure builders: a parsed pipeline in, the Kubernetes objects it becomes out (plain dicts, no API
calls). Owner references are added by the caller (kopf.adopt), so every builder is testable alone."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

import yaml

from omnistage.spec import Pipeline, StageDeployment

from . import spec as k
from .config import OperatorConfig

GPU_RESOURCE = "nvidia.com/gpu"
# Beyond the drain bound: time for the preStop call to return and the process to exit.
GRACE_MARGIN_SECONDS = 15


@dataclass(frozen=True)
class StageChildren:
    deployment: dict
    service: dict
    pdb: dict


@dataclass(frozen=True)
class Children:
    """Everything one OmniPipeline owns."""
    config_map: dict
    stages: dict[str, StageChildren]
    orchestrator_deployment: dict
    orchestrator_service: dict
    orchestrator_access: tuple[dict, ...]   # ServiceAccount, Role, RoleBinding
    network_policy: dict

    def all(self) -> list[dict]:
        out = [self.config_map, *self.orchestrator_access, self.network_policy]
        for sc in self.stages.values():
            out += [sc.service, sc.pdb, sc.deployment]
        return out + [self.orchestrator_service, self.orchestrator_deployment]


def build_children(p: Pipeline, cfg: OperatorConfig, pdb_api_version: str = "policy/v1") -> Children:
    return Children(
        config_map=build_config_map(p),
        stages={s.name: StageChildren(build_stage_deployment(p, s.name, cfg), build_stage_service(p, s.name),
                                      build_stage_pdb(p, s.name, pdb_api_version)) for s in p.stages},
        orchestrator_deployment=build_orchestrator_deployment(p, cfg),
        orchestrator_service=build_orchestrator_service(p),
        orchestrator_access=build_orchestrator_access(p),
        network_policy=build_network_policy(p, cfg),
    )


# ------------------------------------------------------------------------------ pipeline file

def build_config_map(p: Pipeline) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta(p, k.config_map_name(p.name), component="pipeline"),
            "data": {k.PIPELINE_FILE: yaml.safe_dump(dict(p.raw), sort_keys=False)}}


def config_hash(p: Pipeline, stage: str | None = None) -> str:
    """What a pod reads from the pipeline file at start, hashed: the topology and its own deployment
    entry (the orchestrator's when stage is None). Replica counts are left out: scaling never rolls."""
    spec = p.raw["spec"]
    dep = spec["deployment"]
    own = (dep["stages"].get(stage) if stage is not None else dep.get("orchestrator")) or {}
    own = {key: v for key, v in own.items() if key != "replicas"}
    text = json.dumps({"topology": spec["topology"], "own": own, "image": dep.get("image")}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------- stages

def build_stage_deployment(p: Pipeline, stage: str, cfg: OperatorConfig) -> dict:
    sd = p.deployment.stages[stage]
    command = ["python", "-m", "stage_service", "--pipeline", f"{k.PIPELINE_DIR}/{k.PIPELINE_FILE}",
               "--stage", stage, "--host", "$(POD_IP)", "--port", str(k.GRPC_PORT),
               "--http-port", str(k.HTTP_PORT)]
    container = _container("stage", sd.image, command, _stage_resources(sd), sd.env, cfg)
    pod = _pod_spec(p, container, cfg, sd.drain_seconds, service_account=None)
    labels = k.selector(p.name, k.COMPONENT_STAGE, stage)
    return _deployment(p, k.stage_object_name(p.name, stage), labels, sd.replicas, pod, config_hash(p, stage))


def build_stage_service(p: Pipeline, stage: str) -> dict:
    # Headless: the orchestrator balances across pod IPs from Endpoints; a virtual IP would pin
    # each long-lived gRPC connection to one replica.
    labels = k.selector(p.name, k.COMPONENT_STAGE, stage)
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(p, k.stage_object_name(p.name, stage), k.COMPONENT_STAGE, stage),
            "spec": {"clusterIP": "None", "selector": labels, "ports": _service_ports()}}


def build_stage_pdb(p: Pipeline, stage: str, api_version: str = "policy/v1") -> dict:
    return {"apiVersion": api_version, "kind": "PodDisruptionBudget",
            "metadata": _meta(p, k.stage_object_name(p.name, stage), k.COMPONENT_STAGE, stage),
            "spec": {"maxUnavailable": 1,
                     "selector": {"matchLabels": k.selector(p.name, k.COMPONENT_STAGE, stage)}}}


def _stage_resources(sd: StageDeployment) -> dict:
    res = {part: dict(sd.resources.get(part) or {}) for part in ("requests", "limits")}
    if sd.gpus:
        res["limits"][GPU_RESOURCE] = str(sd.gpus)
    return {part: v for part, v in res.items() if v}


# ---------------------------------------------------------------------------- orchestrator

def build_orchestrator_deployment(p: Pipeline, cfg: OperatorConfig) -> dict:
    od = p.deployment.orchestrator
    command = ["python", "-m", "orchestrator_service", "--pipeline", f"{k.PIPELINE_DIR}/{k.PIPELINE_FILE}",
               "--host", "$(POD_IP)", "--port", str(k.GRPC_PORT), "--http-port", str(k.HTTP_PORT),
               "--discovery", "kubernetes", "--namespace", p.namespace]
    container = _container("orchestrator", od.image, command, _plain_resources(od.resources), {}, cfg,
                           models=False)
    pod = _pod_spec(p, container, cfg, od.drain_seconds, service_account=k.orchestrator_object_name(p.name),
                    models=False)
    labels = k.selector(p.name, k.COMPONENT_ORCHESTRATOR)
    return _deployment(p, k.orchestrator_object_name(p.name), labels, od.replicas, pod, config_hash(p))


def build_orchestrator_service(p: Pipeline) -> dict:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(p, k.orchestrator_object_name(p.name), k.COMPONENT_ORCHESTRATOR),
            "spec": {"type": "ClusterIP", "selector": k.selector(p.name, k.COMPONENT_ORCHESTRATOR),
                     "ports": _service_ports()}}


def build_orchestrator_access(p: Pipeline) -> tuple[dict, dict, dict]:
    """The orchestrator finds stage replicas by watching the endpoints of stage Services: it may read
    those (EndpointSlices, and core Endpoints for older orchestrators), nothing else."""
    name = k.orchestrator_object_name(p.name)
    meta = _meta(p, name, k.COMPONENT_ORCHESTRATOR)
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta,
            "rules": [{"apiGroups": [""], "resources": ["endpoints"], "verbs": ["get", "list", "watch"]},
                      {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                       "verbs": ["get", "list", "watch"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
               "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": p.namespace}]}
    return sa, role, binding


# ---------------------------------------------------------------------------------- network

def build_network_policy(p: Pipeline, cfg: OperatorConfig) -> dict:
    """Stage pods accept traffic only from pods of the same pipeline (the orchestrator and peer
    stages, whose connectors pull chunks from each other); optionally metrics scrapes on `http`."""
    ingress: list[dict] = [{"from": [{"podSelector": {"matchLabels": {k.LABEL_PIPELINE: p.name}}}]}]
    if cfg.metrics_namespace_label:
        key, value = cfg.metrics_namespace_label
        ingress.append({"from": [{"namespaceSelector": {"matchLabels": {key: value}}}],
                        "ports": [{"protocol": "TCP", "port": "http"}]})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(p, k.network_policy_name(p.name), k.COMPONENT_STAGE),
            "spec": {"podSelector": {"matchLabels": {k.LABEL_PIPELINE: p.name,
                                                     k.LABEL_COMPONENT: k.COMPONENT_STAGE}},
                     "policyTypes": ["Ingress"], "ingress": ingress}}


# ------------------------------------------------------------------------------- shared parts

def _meta(p: Pipeline, name: str, component: str, stage: str | None = None) -> dict:
    labels = {**_common_labels(p, component), **({k.LABEL_STAGE: stage} if stage else {})}
    return {"name": name, "namespace": p.namespace, "labels": labels}


def _common_labels(p: Pipeline, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "omnistage", "app.kubernetes.io/instance": p.name,
            "app.kubernetes.io/component": component, k.LABEL_MANAGED_BY: k.MANAGED_BY,
            k.LABEL_PIPELINE: p.name, k.LABEL_COMPONENT: component}


def _deployment(p: Pipeline, name: str, labels: dict, replicas: int, pod: dict, cfg_hash: str) -> dict:
    meta = _meta(p, name, labels[k.LABEL_COMPONENT], labels.get(k.LABEL_STAGE))
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                     "strategy": {"type": "RollingUpdate",
                                  "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                     "revisionHistoryLimit": 3, "progressDeadlineSeconds": 600,
                     "template": {"metadata": {"labels": dict(meta["labels"]),
                                               "annotations": {k.ANNOTATION_CONFIG_HASH: cfg_hash}},
                                  "spec": pod}}}


def _container(name: str, image: str, command: list[str], resources: dict, user_env: dict,
               cfg: OperatorConfig, models: bool = True) -> dict:
    env: list[dict[str, Any]] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    plain = {"HOME": "/tmp", "OMP_NUM_THREADS": "1"}
    if models:
        plain["OMNISTAGE_MODEL_DIR"] = cfg.model_volume.mount_path
    plain.update(user_env)   # the pipeline's own env wins over the defaults
    env += [{"name": key, "value": value} for key, value in sorted(plain.items())]
    mounts = [{"name": "pipeline", "mountPath": k.PIPELINE_DIR, "readOnly": True},
              {"name": "tmp", "mountPath": "/tmp"}]
    if models and cfg.model_volume.volume():
        mounts.append({"name": "models", "mountPath": cfg.model_volume.mount_path, "readOnly": True})
    c = {"name": name, "image": image, "imagePullPolicy": cfg.image_pull_policy, "command": command,
         "ports": [{"name": "grpc", "containerPort": k.GRPC_PORT, "protocol": "TCP"},
                   {"name": "http", "containerPort": k.HTTP_PORT, "protocol": "TCP"}],
         "env": env, "volumeMounts": mounts,
         # k8s 1.20 has no gRPC probe: the services answer /readyz on their HTTP port once serving.
         "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 2,
                            "timeoutSeconds": 2, "failureThreshold": 2},
         "livenessProbe": {"httpGet": {"path": "/livez", "port": "http"}, "periodSeconds": 10,
                           "timeoutSeconds": 5, "failureThreshold": 6},
         # /drain returns once admitted work is finished (bounded by drainSeconds); SIGTERM follows.
         "lifecycle": {"preStop": {"httpGet": {"path": "/drain", "port": "http"}}},
         "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                             "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}}
    if resources:
        c["resources"] = resources
    return c


def _pod_spec(p: Pipeline, container: dict, cfg: OperatorConfig, drain_seconds: float,
              service_account: str | None, models: bool = True) -> dict:
    volumes = [{"name": "pipeline", "configMap": {"name": k.config_map_name(p.name), "items": [
                   {"key": k.PIPELINE_FILE, "path": k.PIPELINE_FILE}]}},
               {"name": "tmp", "emptyDir": {}}]
    mv = cfg.model_volume.volume()
    if models and mv:
        volumes.append(mv)
    pod = {"containers": [container], "volumes": volumes,
           "terminationGracePeriodSeconds": int(math.ceil(drain_seconds)) + GRACE_MARGIN_SECONDS,
           "enableServiceLinks": False,
           "securityContext": {"runAsNonRoot": True, "runAsUser": cfg.run_as_user,
                               "runAsGroup": cfg.run_as_user, "fsGroup": cfg.run_as_user}}
    if service_account:
        pod["serviceAccountName"] = service_account
        pod["automountServiceAccountToken"] = True
    else:
        pod["automountServiceAccountToken"] = False   # stages never call the Kubernetes API
    return pod


def _service_ports() -> list[dict]:
    return [{"name": "grpc", "port": k.GRPC_PORT, "targetPort": "grpc", "protocol": "TCP"},
            {"name": "http", "port": k.HTTP_PORT, "targetPort": "http", "protocol": "TCP"}]


def _plain_resources(res: Any) -> dict:
    return {part: dict(res[part]) for part in ("requests", "limits") if res.get(part)}
