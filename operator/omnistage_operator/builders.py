"""Pure builders: a parsed pipeline in, the Kubernetes objects it becomes out (plain dicts, no API
calls). Owner references are added by the caller (kopf.adopt), so every builder is testable alone."""

from __future__ import annotations

import copy
import hashlib
import json
import math
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Sequence

import yaml

from omnistage.api import FieldError, OrchestratorHttp, Pipeline, StageDeployment
from omnistage.api.memory_plan import memory_request, planned_bytes
from omnistage.api.model import JOBS_MODALITY
from omnistage.contract.devices import uses_gpus
from omnistage.contract.launch import (
    API_PORT_NAME,
    CLIENT_TLS_MOUNT,
    DATA_PLANE_KEY_MOUNT,
    ENV_API_KEYS,
    ENV_DATA_PLANE_KEY,
    ENV_JOBS_STORE,
    ENV_POD_IP,
    ENV_POD_NAMESPACE,
    GRPC_PORT,
    GRPC_PORT_NAME,
    HTTP_PORT,
    HTTP_PORT_NAME,
    LIVE_PATH,
    READY_PATH,
    TERMINATION_LOG,
    TLS_MOUNT,
    drain_hook_command,
    orchestrator_command,
    service_env,
    stage_command,
)
from omnistage.logs import ENV_LOG_FORMAT, POD_LOG_FORMAT
from omnistage.store_url import sqlite_file
from omnistage.tls import DATA_PLANE_KEY_FILE

from .certificates import Leaf, build_certificate, leaves
from .config import TLS_CERT_MANAGER, OperatorConfig
from .data_plane_key import data_plane_key_secret_name
from .model_sources import InitStep, model_parts
from .planning import autoscaled, starting_replicas
from .vocabulary import (
    ANNOTATION_CONFIG_HASH,
    COMPONENT_ORCHESTRATOR,
    COMPONENT_STAGE,
    LABEL_COMPONENT,
    LABEL_MANAGED_BY,
    LABEL_PIPELINE,
    LABEL_STAGE,
    MANAGED_BY,
    ORCHESTRATOR,
    PIPELINE_DIR,
    PIPELINE_FILE,
    config_map_name,
    network_policy_name,
    orchestrator_network_policy_name,
    orchestrator_object_name,
    selector,
    stage_object_name,
)

GPU_RESOURCE = "nvidia.com/gpu"
POD_PYTHON = "python"   # the image's interpreter
PIPELINE_PATH = f"{PIPELINE_DIR}/{PIPELINE_FILE}"
# Every service binds its pod's IP (from the downward API) on the fixed ports.
_POD_SERVING = {"host": f"$({ENV_POD_IP})", "port": GRPC_PORT, "http_port": HTTP_PORT}
# (name, port) every service serves: gRPC, and HTTP for metrics and probes.
_SERVING_PORTS = ((GRPC_PORT_NAME, GRPC_PORT), (HTTP_PORT_NAME, HTTP_PORT))
# Beyond the drain bound: time for the preStop call to return and the process to exit.
GRACE_MARGIN_SECONDS = 15
# Pod Security "restricted": the runtime's default seccomp filter on every pod and container, no capabilities,
# no privilege escalation, never root (checked against every example in tests/unit/test_pod_security.py).
SECCOMP = {"type": "RuntimeDefault"}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
                      "capabilities": {"drop": ["ALL"]}, "seccompProfile": SECCOMP}
# Volumes holding a pod's own mTLS certificate and the orchestrator's client-facing one; a stage's UCX data-plane key.
TLS_VOLUME, CLIENT_TLS_VOLUME, DATA_PLANE_KEY_VOLUME = "tls", "client-tls", "data-plane-key"
# The orchestrator's rollout (a stage's comes from its rollingUpdate, the same by default): a new pod is ready
# before an old one goes, so every replica keeps serving.
ORCHESTRATOR_ROLLING_UPDATE = {"maxSurge": 1, "maxUnavailable": 0}
# ... except on a job volume only one pod may hold (orchestrator_strategy): the old pod goes first. rollingUpdate
# null: the merge patch from a rolling strategy removes it (the API server refuses Recreate with one).
RECREATE = {"type": "Recreate", "rollingUpdate": None}
# A memory-backed /dev/shm for stages on GPUs or with parallelism > 1: NCCL's intra-node transport and vLLM's
# worker message queues live there, and a container runtime gives a pod 64 MiB. Its pages are charged to the
# container's memory like any other, so the size limit claims nothing extra; it bounds what a runaway writer
# may take (the kubelet evicts the pod past it). A fixed 2Gi, as in vLLM's own Kubernetes example, not one
# derived from the stage's memory: what NCCL and vLLM keep there grows with the ranks of a node, not the model.
# A canonical quantity, so the live object reads it back unchanged (compare.matches).
SHM_VOLUME, SHM_PATH, SHM_SIZE_LIMIT = "shm", "/dev/shm", "2Gi"
# The orchestrator's job volume (spec.deployment.orchestrator.jobs.contentVolume): finished content in its
# `content` folder, and a SQLite store's file beside it (sqlite:///var/lib/omnistage-jobs/jobs.db). Without a
# volume the content goes to the pod's own /tmp (an emptyDir): lost with the pod.
JOBS_VOLUME, JOBS_MOUNT = "jobs", "/var/lib/omnistage-jobs"
JOBS_CONTENT, JOBS_CONTENT_EPHEMERAL = f"{JOBS_MOUNT}/content", "/tmp/omnistage-jobs"


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
    network_policy: dict                    # the stages'
    orchestrator_network_policy: dict
    certificates: tuple[dict, ...] = ()     # cert-manager Certificates (tls issuer certManager)

    def all(self) -> list[dict]:
        out = [self.config_map, *self.orchestrator_access, self.network_policy, self.orchestrator_network_policy,
               *self.certificates]
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
        orchestrator_network_policy=build_orchestrator_network_policy(p, cfg),
        certificates=build_certificates(p, cfg),
    )


# ------------------------------------------------------------------------------ certificates

def build_tls_secret_meta(p: Pipeline, leaf: Leaf) -> dict:
    """Metadata of a leaf's Secret (the operator issues it with the chart's CA: certificates.build_tls_secret)."""
    return _meta(p, leaf.secret, leaf.component, leaf.stage)


def build_data_plane_key_meta(p: Pipeline) -> dict:
    """Metadata of the pipeline's UCX data-plane key Secret (the reconcile makes it once: data_plane_key.py)."""
    return _meta(p, data_plane_key_secret_name(p.name), COMPONENT_STAGE)


def build_certificates(p: Pipeline, cfg: OperatorConfig) -> tuple[dict, ...]:
    """cert-manager Certificates, one per unit, when cert-manager issues the pipeline's certificates."""
    if cfg.tls_issuer != TLS_CERT_MANAGER or cfg.tls_issuer_ref is None:
        return ()
    return tuple(build_certificate(_meta(p, leaf.secret, leaf.component, leaf.stage), leaf, cfg.tls_issuer_ref)
                 for leaf in leaves(p).values())


# ------------------------------------------------------------------------------ pipeline file

def build_config_map(p: Pipeline) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta(p, config_map_name(p.name), component="pipeline"),
            "data": {PIPELINE_FILE: yaml.safe_dump(dict(p.raw), sort_keys=False)}}


def set_fields(obj: Any) -> Any:
    """A model object as plain data, without the fields at their default (pure): what a pipeline says, not
    what the API version it was read with fills in."""
    if is_dataclass(obj) and not isinstance(obj, type):
        out = {}
        for f in fields(obj):
            value = getattr(obj, f.name)
            if f.default is not MISSING and value == f.default:
                continue
            if f.default_factory is not MISSING and value == f.default_factory():
                continue
            out[f.name] = set_fields(value)
        return out
    if isinstance(obj, (list, tuple)):
        return [set_fields(v) for v in obj]
    if isinstance(obj, dict):
        return {k: set_fields(v) for k, v in obj.items()}
    return obj


def config_hash(p: Pipeline, stage: str | None = None) -> str:
    """What a pod reads from the pipeline file at start, hashed: the topology and its own deployment
    entry (the orchestrator's when stage is None). Replica counts are left out: scaling never rolls; so is
    a stage's rollingUpdate, which shapes its next rollout, not its pods. The typed model is hashed, not the
    document, so a default written out (the CRD's defaulting, or a user spelling one) changes nothing; and
    fields at their default are left out, so a new API field (an operator upgrade) rolls no pod."""
    own = set_fields(p.deployment.stages[stage] if stage is not None else p.deployment.orchestrator)
    own.pop("replicas", None)
    own.pop("rolling_update", None)
    topology = {"stages": [set_fields(s) for s in p.stages], "outputs": [set_fields(o) for o in p.outputs],
                "limits": set_fields(p.limits)}
    text = json.dumps({"topology": topology, "own": own}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------- stages

def build_stage_deployment(p: Pipeline, stage: str, cfg: OperatorConfig) -> dict:
    sd = p.deployment.stages[stage]
    tls_secrets = _tls_secrets(p, cfg, stage)
    # Every stage, in every TLS mode: the pipeline's UCX data-plane key.
    secrets = [*tls_secrets, (DATA_PLANE_KEY_VOLUME, data_plane_key_secret_name(p.name), DATA_PLANE_KEY_MOUNT)]
    command = stage_command(PIPELINE_PATH, stage, python=POD_PYTHON, **_POD_SERVING,
                            tls_dir=TLS_MOUNT if tls_secrets else None)
    # The key's file by environment, not by flag: a stage on an image older than the key ignores it (and keeps
    # UCX to itself) instead of refusing an argument it does not know.
    key_env = [{"name": ENV_DATA_PLANE_KEY, "value": f"{DATA_PLANE_KEY_MOUNT}/{DATA_PLANE_KEY_FILE}"}]
    shm = needs_shm(sd)
    image = pod_image(sd.image, cfg)
    model = model_parts(p, stage, PIPELINE_PATH, POD_PYTHON)
    resources = _stage_resources(sd, stage_plan(p, stage))
    container = _container("stage", image, command, resources, {**sd.env, **model.env}, cfg, secret_env=key_env,
                           secret_mounts=secrets, shm=shm, extra_mounts=model.mounts)
    pod = _pod_spec(p, container, cfg, sd.drain_seconds, service_account=None, secrets=secrets, shm=shm,
                    extra_volumes=model.volumes)
    if model.init:
        pod["initContainers"] = [_init_container(step, image, {**sd.env, **model.env}, cfg, _without_gpus(resources))
                                 for step in model.init]
    pod.update(_stage_placement(sd))
    labels = selector(p.name, COMPONENT_STAGE, stage)
    surge = {"maxSurge": sd.rolling_update.max_surge, "maxUnavailable": sd.rolling_update.max_unavailable}
    return _deployment(p, stage_object_name(p.name, stage), labels, starting_replicas(p, stage), pod,
                       config_hash(p, stage),
                       rolling_update=surge)


def build_stage_service(p: Pipeline, stage: str) -> dict:
    # Headless: the orchestrator balances across pod IPs from Endpoints; a virtual IP would pin
    # each long-lived gRPC connection to one replica.
    labels = selector(p.name, COMPONENT_STAGE, stage)
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(p, stage_object_name(p.name, stage), COMPONENT_STAGE, stage),
            "spec": {"clusterIP": "None", "selector": labels, "ports": _service_ports()}}


def build_stage_pdb(p: Pipeline, stage: str, api_version: str = "policy/v1") -> dict:
    return {"apiVersion": api_version, "kind": "PodDisruptionBudget",
            "metadata": _meta(p, stage_object_name(p.name, stage), COMPONENT_STAGE, stage),
            "spec": {"maxUnavailable": 1,
                     "selector": {"matchLabels": selector(p.name, COMPONENT_STAGE, stage)}}}


def stage_plan(p: Pipeline, stage: str) -> int | None:
    """The stage's planned bytes from the manifest's memory-plan annotation (validation checked it), if any."""
    annotations = (p.raw.get("metadata") or {}).get("annotations")
    return planned_bytes(annotations, frozenset(s.name for s in p.stages)).get(stage)


# What the CRD wrote into spec.deployment.image while it defaulted the field (the API up to 0.1.0).
LEGACY_DEFAULT_IMAGE = "ghcr.io/omnistage/omnistage:0.1.0"


def pod_image(named: str, cfg: OperatorConfig) -> str:
    """A pipeline pod's image: the one its pipeline names, else the operator's own. A pipeline stored while the
    CRD defaulted the field wrote LEGACY_DEFAULT_IMAGE without naming it: it follows the operator's too."""
    return named if named and named != LEGACY_DEFAULT_IMAGE else cfg.image


def _without_gpus(resources: dict) -> dict:
    """A stage's cpu and memory (its init containers' share of a quota), without its GPUs."""
    out = {part: {k: v for k, v in values.items() if k != GPU_RESOURCE} for part, values in resources.items()}
    return {part: v for part, v in out.items() if v}


def _stage_resources(sd: StageDeployment, planned: int | None = None) -> dict:
    """The spec's resources and `gpus` GPUs. Also with `device: cpu`: gpus is what the pod reserves, device
    what the engine runs on; a stage meant for a cluster without GPUs says gpus: 0. A CPU stage whose file
    requests no memory requests its memory plan (`omnistage.io/memory-plan`), so the scheduler places it
    where it fits; a GPU stage's plan is GPU memory, not the container's."""
    res = {"requests": dict(sd.resources.requests), "limits": dict(sd.resources.limits)}
    if planned is not None and "memory" not in res["requests"] and not uses_gpus(sd):
        res["requests"]["memory"] = memory_request(planned)
    if sd.gpus:
        res["limits"][GPU_RESOURCE] = str(sd.gpus)
    return {part: v for part, v in res.items() if v}


def needs_shm(sd: StageDeployment) -> bool:
    """A stage on GPUs (NCCL) or with any parallelism degree above 1 (vLLM's workers) gets a larger /dev/shm."""
    par = sd.parallelism
    return sd.gpus > 0 or max(par.tensor, par.pipeline, par.data) > 1


def _stage_placement(sd: StageDeployment) -> dict:
    """Where the stage's pods may run (GPU nodes): only the fields its deployment entry sets."""
    placement = {"nodeSelector": dict(sd.node_selector), "tolerations": [t.to_dict() for t in sd.tolerations],
                 "affinity": copy.deepcopy(dict(sd.affinity)), "priorityClassName": sd.priority_class_name,
                 "runtimeClassName": sd.runtime_class_name}
    return {key: value for key, value in placement.items() if value}


# ---------------------------------------------------------------------------- orchestrator

def build_orchestrator_deployment(p: Pipeline, cfg: OperatorConfig) -> dict:
    od = p.deployment.orchestrator
    api = od.http.port if od.http.enabled else None
    secrets = _tls_secrets(p, cfg, ORCHESTRATOR)
    client_tls = od.client_tls_secret
    if client_tls:
        secrets.append((CLIENT_TLS_VOLUME, client_tls, CLIENT_TLS_MOUNT))
    jobs = orchestrator_jobs(p, cfg)
    command = orchestrator_command(PIPELINE_PATH, python=POD_PYTHON, **_POD_SERVING, discovery="kubernetes",
                                   namespace=p.namespace, api_port=api,
                                   tls_dir=TLS_MOUNT if cfg.tls_enabled else None,
                                   client_tls_dir=CLIENT_TLS_MOUNT if client_tls else None, **jobs.flags)
    # The model volume, read-only (unless OMNISTAGE_ORCHESTRATOR_MODELS=false): the orchestrator reads the limits
    # a pipeline leaves to the model from the checkpoints' configs (omnistage.checkpoints.defaults), no weights.
    models = cfg.orchestrator_models
    container = _container("orchestrator", pod_image(od.image, cfg), command, od.resources.to_dict(), {}, cfg,
                           models=models, ports=_orchestrator_ports(od.http),
                           secret_env=[*_api_key_env(od.http), *jobs.env], secret_mounts=secrets,
                           extra_mounts=jobs.mounts)
    pod = _pod_spec(p, container, cfg, od.drain_seconds, service_account=orchestrator_object_name(p.name),
                    models=models, secrets=secrets, extra_volumes=jobs.volumes)
    labels = selector(p.name, COMPONENT_ORCHESTRATOR)
    out = _deployment(p, orchestrator_object_name(p.name), labels, od.replicas, pod, config_hash(p))
    if jobs.single_writer:
        out["spec"]["strategy"] = dict(RECREATE)
    return out


@dataclass(frozen=True)
class JobsParts:
    """What the orchestrator's durable jobs add to its pod: flags, the store URL's env, the content volume."""
    flags: dict[str, Any] = field(default_factory=dict)   # launch.ORCHESTRATOR_FLAGS by name
    env: list[dict] = field(default_factory=list)
    mounts: list[dict] = field(default_factory=list)
    volumes: list[dict] = field(default_factory=list)
    # one pod at a time on the job volume: a SQLite file (two writers would corrupt its locks across nodes), or a
    # claim of one replica (ReadWriteOnce, as a single replica's may be: a surge pod on another node would stall
    # in Multi-Attach). The orchestrator is then recreated on a rollout, not surged.
    single_writer: bool = False


def jobs_errors(p: Pipeline, cfg: OperatorConfig) -> list[FieldError]:
    """What the operator's default job store (OMNISTAGE_JOBS_STORE_SECRET) cannot do for this pipeline: serve
    several orchestrator replicas without a shared content claim (OMNISTAGE_JOBS_CONTENT_CLAIM), where each
    pod's own folder would answer 404 for the videos another finished, and lose them on a rollout (the rule
    validation.jobs applies to a store the pipeline names)."""
    od = p.deployment.orchestrator
    if not _default_store(p, cfg) or od.jobs.content_volume or cfg.jobs_content_claim or od.replicas <= 1:
        return []
    return [FieldError("spec.deployment.orchestrator.jobs.contentVolume",
                       f"with {od.replicas} orchestrator replicas any of them answers a job's download, and the "
                       "operator's default job store (OMNISTAGE_JOBS_STORE_SECRET) has no content claim "
                       "(OMNISTAGE_JOBS_CONTENT_CLAIM: the chart's pipelinePods.jobs.content.persistentVolumeClaim):"
                       " run one replica, or name jobs.store and a ReadWriteMany contentVolume the replicas share")]


def _default_store(p: Pipeline, cfg: OperatorConfig) -> bool:
    """Whether the pipeline's jobs use the operator's default store: it names none and has a video output."""
    return (not p.deployment.orchestrator.jobs.store.configured and cfg.jobs_store_secret is not None
            and any(o.modality == JOBS_MODALITY for o in p.outputs))


def orchestrator_jobs(p: Pipeline, cfg: OperatorConfig) -> JobsParts:
    """The job store the pipeline names (spec.deployment.orchestrator.jobs), else, for a pipeline with a video
    output, the operator's default (the chart's jobs.*); none: no parts (the orchestrator refuses jobs). The URL
    reaches the process by environment, never on its command line (it holds a password): from the Secret by the
    kubelet, or as the pipeline writes it."""
    jobs = p.deployment.orchestrator.jobs
    volume = jobs.content_volume
    if jobs.store.configured:
        secret = jobs.store.secret
        url_env = ({"name": ENV_JOBS_STORE, "valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}}}
                   if secret else {"name": ENV_JOBS_STORE, "value": jobs.store.url})
    elif cfg.jobs_store_secret and _default_store(p, cfg):
        name, key = cfg.jobs_store_secret
        url_env = {"name": ENV_JOBS_STORE, "valueFrom": {"secretKeyRef": {"name": name, "key": key}}}
        volume = volume or cfg.jobs_content_claim
    else:
        return JobsParts()
    flags: dict[str, Any] = {"jobs_content": JOBS_CONTENT if volume else JOBS_CONTENT_EPHEMERAL,
                             "jobs_ttl_s": jobs.ttl_seconds, "jobs_concurrency": jobs.concurrency,
                             "jobs_max_queued_per_key": jobs.max_queued_per_key}
    if not volume:
        return JobsParts(flags, [url_env])
    sqlite = sqlite_file(jobs.store.url) is not None
    return JobsParts(flags, [url_env], [{"name": JOBS_VOLUME, "mountPath": JOBS_MOUNT}],
                     [{"name": JOBS_VOLUME, "persistentVolumeClaim": {"claimName": volume}}],
                     single_writer=sqlite or p.deployment.orchestrator.replicas <= 1)


def build_orchestrator_service(p: Pipeline) -> dict:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(p, orchestrator_object_name(p.name), COMPONENT_ORCHESTRATOR),
            "spec": {"type": "ClusterIP", "selector": selector(p.name, COMPONENT_ORCHESTRATOR),
                     "ports": _service_ports(_orchestrator_ports(p.deployment.orchestrator.http))}}


def _orchestrator_ports(http: OrchestratorHttp) -> tuple[tuple[str, int], ...]:
    """(name, port) of what the orchestrator serves: the gRPC and status ports, and the OpenAI-compatible API."""
    return _SERVING_PORTS + (((API_PORT_NAME, http.port),) if http.enabled else ())


def _api_key_env(http: OrchestratorHttp) -> list[dict]:
    """The API's keys from the named Secret; the operator only names it, the kubelet reads it."""
    secret = http.keys_secret
    if not http.enabled or secret is None:
        return []
    return [{"name": ENV_API_KEYS, "valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}}}]


def build_orchestrator_access(p: Pipeline) -> tuple[dict, dict, dict]:
    """The orchestrator finds stage replicas by watching the endpoints of stage Services: it may read
    those (EndpointSlices, and core Endpoints for older orchestrators), nothing else.

    Why this cannot escalate: the operator holds no `escalate` or `bind` verb, so the API server lets it
    create a Role only with rules it holds itself in that namespace, and bind only such a Role; read of
    endpoints and endpointslices is in the operator's own rules (charts/omnistage/templates/rbac.yaml) for
    exactly that reason. Nothing here reaches beyond the pipeline's namespace."""
    name = orchestrator_object_name(p.name)
    meta = _meta(p, name, COMPONENT_ORCHESTRATOR)
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
    """Stage pods accept: the pipeline's orchestrator pods on the gRPC port only; the pipeline's own stage
    pods on any port (a consumer calls its producer's gRPC and pulls chunks over UCX, whose listener and
    TCP lanes use ports picked at start, so no fixed port can name them); optionally metrics scrapes on
    `http`, and under autoscaling the operator's pods on `http` (its planner reads /metrics). Nothing else, not
    even other pipelines' pods in the same namespace."""
    ingress: list[dict] = [
        {"from": [{"podSelector": {"matchLabels": selector(p.name, COMPONENT_ORCHESTRATOR)}}],
         "ports": [_tcp(GRPC_PORT_NAME)]},
        {"from": [{"podSelector": {"matchLabels": selector(p.name, COMPONENT_STAGE)}}]},
        *_metrics_ingress(cfg),
    ]
    return _network_policy(p, network_policy_name(p.name), COMPONENT_STAGE, [*ingress, *_planner_ingress(p, cfg)])


def build_orchestrator_network_policy(p: Pipeline, cfg: OperatorConfig) -> dict:
    """Orchestrator pods accept clients on the gRPC and OpenAI-compatible API ports (from anywhere, or only
    from the peers the chart's networkPolicy.orchestratorClientsFrom names), and metrics scrapes on `http`
    from the metrics namespaces, and under autoscaling the operator's pods on `http` (its planner reads the
    latency histograms and request-class counters there). Its status port's /drain answers only a bearer of
    the process's drain token (the preStop hook) anyway."""
    client_ports = [_tcp(GRPC_PORT_NAME)]
    if p.deployment.orchestrator.http.enabled:
        client_ports.append(_tcp(API_PORT_NAME))
    clients: dict[str, Any] = {"ports": client_ports}
    if cfg.orchestrator_clients_from:
        clients["from"] = [dict(peer) for peer in cfg.orchestrator_clients_from]
    return _network_policy(p, orchestrator_network_policy_name(p.name), COMPONENT_ORCHESTRATOR,
                           [clients, *_metrics_ingress(cfg), *_planner_ingress(p, cfg)])


def _planner_ingress(p: Pipeline, cfg: OperatorConfig) -> list[dict]:
    """Under autoscaling, the operator's pods on `http`: the stage planner reads /metrics (autoscaler.py)."""
    if not (cfg.operator_peer and autoscaled(p)):
        return []
    return [{"from": [dict(cfg.operator_peer)], "ports": [_tcp(HTTP_PORT_NAME)]}]


def _metrics_ingress(cfg: OperatorConfig) -> list[dict]:
    if not cfg.metrics_namespace_label:
        return []
    key, value = cfg.metrics_namespace_label
    return [{"from": [{"namespaceSelector": {"matchLabels": {key: value}}}], "ports": [_tcp(HTTP_PORT_NAME)]}]


def _tcp(port: str) -> dict:
    return {"protocol": "TCP", "port": port}


def _network_policy(p: Pipeline, name: str, component: str, ingress: list[dict]) -> dict:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(p, name, component),
            "spec": {"podSelector": {"matchLabels": selector(p.name, component)},
                     "policyTypes": ["Ingress"], "ingress": ingress}}


# ------------------------------------------------------------------------------- shared parts

def _meta(p: Pipeline, name: str, component: str, stage: str | None = None) -> dict:
    labels = {**_common_labels(p, component), **({LABEL_STAGE: stage} if stage else {})}
    return {"name": name, "namespace": p.namespace, "labels": labels}


def _common_labels(p: Pipeline, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "omnistage", "app.kubernetes.io/instance": p.name,
            "app.kubernetes.io/component": component, LABEL_MANAGED_BY: MANAGED_BY,
            LABEL_PIPELINE: p.name, LABEL_COMPONENT: component}


def _deployment(p: Pipeline, name: str, labels: dict, replicas: int, pod: dict, cfg_hash: str,
                rolling_update: dict = ORCHESTRATOR_ROLLING_UPDATE) -> dict:
    meta = _meta(p, name, labels[LABEL_COMPONENT], labels.get(LABEL_STAGE))
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                     "strategy": {"type": "RollingUpdate", "rollingUpdate": dict(rolling_update)},
                     "revisionHistoryLimit": 3, "progressDeadlineSeconds": 600,
                     "template": {"metadata": {"labels": dict(meta["labels"]),
                                               "annotations": {ANNOTATION_CONFIG_HASH: cfg_hash}},
                                  "spec": pod}}}


def _tls_secrets(p: Pipeline, cfg: OperatorConfig, unit: str) -> list[tuple[str, str, str]]:
    """(volume, Secret, mount path) of the unit's own mTLS certificate, when the pipeline's processes use TLS."""
    if not cfg.tls_enabled:
        return []
    return [(TLS_VOLUME, leaves(p)[unit].secret, TLS_MOUNT)]


def _container(name: str, image: str, command: list[str], resources: dict, user_env: dict,
               cfg: OperatorConfig, models: bool = True, ports: tuple[tuple[str, int], ...] = (),
               secret_env: Sequence[dict] = (), secret_mounts: Sequence[tuple[str, str, str]] = (),
               shm: bool = False, extra_mounts: Sequence[dict] = ()) -> dict:
    env: list[dict[str, Any]] = [
        {"name": ENV_POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": ENV_POD_NAMESPACE, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        *secret_env,
    ]
    # HOME: the root filesystem is read-only, /tmp is the pod's own emptyDir. Log lines as JSON, what a cluster's
    # log pipeline indexes (by environment: a pipeline's env may ask for text, an older image ignores it).
    plain = {"HOME": "/tmp", ENV_LOG_FORMAT: POD_LOG_FORMAT,
             **service_env(cfg.model_volume.mount_path if models else None)}
    plain.update(user_env)   # the pipeline's own env wins over the defaults
    env += [{"name": key, "value": value} for key, value in sorted(plain.items())]
    mounts = [{"name": "pipeline", "mountPath": PIPELINE_DIR, "readOnly": True},
              {"name": "tmp", "mountPath": "/tmp"}]
    if models and cfg.model_volume.volume():
        mounts.append({"name": "models", "mountPath": cfg.model_volume.mount_path, "readOnly": True})
    mounts += [dict(m) for m in extra_mounts]   # a stage's model cache, the orchestrator's job content
    mounts += [{"name": volume, "mountPath": path, "readOnly": True} for volume, _, path in secret_mounts]
    if shm:
        mounts.append({"name": SHM_VOLUME, "mountPath": SHM_PATH})
    c = {"name": name, "image": image, "imagePullPolicy": cfg.image_pull_policy, "command": command,
         "ports": [{"name": port_name, "containerPort": port, "protocol": "TCP"}
                   for port_name, port in ports or _SERVING_PORTS],
         "env": env, "volumeMounts": mounts,
         # k8s 1.20 has no gRPC probe: the services answer /readyz on their HTTP port once serving.
         "readinessProbe": {"httpGet": {"path": READY_PATH, "port": HTTP_PORT_NAME}, "periodSeconds": 2,
                            "timeoutSeconds": 2, "failureThreshold": 2},
         # /livez fails while the engine makes no step progress (stallSeconds): the kubelet restarts it.
         "livenessProbe": {"httpGet": {"path": LIVE_PATH, "port": HTTP_PORT_NAME}, "periodSeconds": 10,
                           "timeoutSeconds": 5, "failureThreshold": 6},
         # /drain returns once admitted work is finished (bounded by drainSeconds); SIGTERM follows. An exec
         # hook, not httpGet: /drain is a POST bearing the token the process wrote in the container's /tmp.
         "lifecycle": {"preStop": {"exec": {"command": drain_hook_command(POD_PYTHON)}}},
         # A process that refuses to start (a broken checkpoint) writes one line there; else its last log lines.
         "terminationMessagePath": TERMINATION_LOG, "terminationMessagePolicy": "FallbackToLogsOnError",
         "securityContext": copy.deepcopy(CONTAINER_SECURITY)}
    if resources:
        c["resources"] = resources
    return c


def _pod_spec(p: Pipeline, container: dict, cfg: OperatorConfig, drain_seconds: float,
              service_account: str | None, models: bool = True,
              secrets: Sequence[tuple[str, str, str]] = (), shm: bool = False,
              extra_volumes: Sequence[dict] = ()) -> dict:
    volumes = [{"name": "pipeline", "configMap": {"name": config_map_name(p.name), "items": [
                   {"key": PIPELINE_FILE, "path": PIPELINE_FILE}]}},
               {"name": "tmp", "emptyDir": {}}]
    mv = cfg.model_volume.volume()
    if models and mv:
        volumes.append(mv)
    volumes += [copy.deepcopy(v) for v in extra_volumes]
    # Mounted whole, never by subPath: the kubelet then swaps a renewed certificate in place, and the
    # processes reload it, so a rotation rolls nothing. Default mode: the pod's one process reads them.
    volumes += [{"name": volume, "secret": {"secretName": secret}} for volume, secret, _ in secrets]
    if shm:
        volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE_LIMIT}})
    pod = {"containers": [container], "volumes": volumes,
           "terminationGracePeriodSeconds": int(math.ceil(drain_seconds)) + GRACE_MARGIN_SECONDS,
           "enableServiceLinks": False,
           "securityContext": {"runAsNonRoot": True, "runAsUser": cfg.run_as_user,
                               "runAsGroup": cfg.run_as_user, "fsGroup": cfg.run_as_user,
                               "seccompProfile": dict(SECCOMP)}}
    # the operator's (the chart's pipelinePods.imagePullSecrets), then the pipeline's own, each once
    pull = dict.fromkeys([*cfg.image_pull_secrets, *p.deployment.image_pull_secrets])
    if pull:
        pod["imagePullSecrets"] = [{"name": name} for name in pull]
    if service_account:
        pod["serviceAccountName"] = service_account
        pod["automountServiceAccountToken"] = True
    else:
        pod["automountServiceAccountToken"] = False   # stages never call the Kubernetes API
    return pod


def _init_container(step: InitStep, image: str, user_env: dict, cfg: OperatorConfig, resources: dict) -> dict:
    """A stage pod's init container (its model's pull and check: model_sources.py): the stage's image, user,
    restricted security context and env; its own env (which wins) and mounts; its refusal as the termination
    message."""
    own = {e["name"] for e in step.env}
    plain = {"HOME": "/tmp", **service_env(cfg.model_volume.mount_path), **user_env}
    env = [{"name": key, "value": value} for key, value in sorted(plain.items()) if key not in own]
    mounts = [{"name": "pipeline", "mountPath": PIPELINE_DIR, "readOnly": True}, {"name": "tmp", "mountPath": "/tmp"},
              *(dict(m) for m in step.mounts)]
    return {"name": step.name, "image": image, "imagePullPolicy": cfg.image_pull_policy, "command": step.command,
            "env": [*env, *(copy.deepcopy(e) for e in step.env)], "volumeMounts": mounts,
            "terminationMessagePath": TERMINATION_LOG, "terminationMessagePolicy": "FallbackToLogsOnError",
            "securityContext": copy.deepcopy(CONTAINER_SECURITY), **({"resources": resources} if resources else {})}


def _service_ports(ports: tuple[tuple[str, int], ...] = ()) -> list[dict]:
    return [{"name": name, "port": port, "targetPort": name, "protocol": "TCP"}
            for name, port in ports or _SERVING_PORTS]
