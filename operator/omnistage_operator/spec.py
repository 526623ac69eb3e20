"""What the operator reads from an OmniPipeline object: the typed pipeline (validated by
`omnistage.spec`, never re-validated here), the Kubernetes naming rules that only matter on a
cluster, and the names, labels and condition vocabulary shared by builders, rollout and status."""

from __future__ import annotations

from typing import Any, Mapping

from omnistage import spec as omnispec
from omnistage.spec import FieldError, Pipeline, SpecError

GROUP, VERSION, PLURAL = omnispec.API_GROUP, omnispec.API_VERSION, "omnipipelines"
API_VERSION = f"{GROUP}/{VERSION}"

# Labels on every child; selectors use PIPELINE + COMPONENT (+ STAGE).
LABEL_PIPELINE = "omnistage.io/pipeline"
LABEL_COMPONENT = "omnistage.io/component"      # "stage" or "orchestrator"
LABEL_STAGE = "omnistage.io/stage"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "omnistage-operator"
# On pod templates: a hash of the pipeline parts a pod reads at start, so such a change rolls it.
ANNOTATION_CONFIG_HASH = "omnistage.io/config-hash"

COMPONENT_STAGE, COMPONENT_ORCHESTRATOR = "stage", "orchestrator"
# The orchestrator rolls out like a stage, after the stages; its name is therefore reserved.
ORCHESTRATOR = "orchestrator"

# Conditions and their CamelCase reasons.
READY, PROGRESSING, DEGRADED = "Ready", "Progressing", "Degraded"
R_ALL_READY = "AllStagesReady"
R_NOT_READY = "StagesNotReady"
R_SCALED_TO_ZERO = "ScaledToZero"
R_INVALID_SPEC = "InvalidSpec"
R_ROLLING_OUT = "RollingOut"
R_ROLLOUT_COMPLETE = "RolloutComplete"
R_AS_EXPECTED = "AsExpected"
R_STAGE_UNAVAILABLE = "StageUnavailable"
R_PROGRESS_DEADLINE = "ProgressDeadlineExceeded"
R_REPLICA_FAILURE = "ReplicaFailure"

# Ports every omnistage service listens on (pod IP from the downward API keeps pods apart).
GRPC_PORT, HTTP_PORT = 50051, 8080
PIPELINE_DIR, PIPELINE_FILE = "/etc/omnistage", "pipeline.yaml"
K8S_NAME_MAX = 63


def stage_object_name(pipeline: str, stage: str) -> str:
    """Deployment, Service and PodDisruptionBudget of one stage: `<pipeline>-<stage>`."""
    return f"{pipeline}-{stage}"


def orchestrator_object_name(pipeline: str) -> str:
    return f"{pipeline}-{ORCHESTRATOR}"


def config_map_name(pipeline: str) -> str:
    return f"{pipeline}-pipeline"


def network_policy_name(pipeline: str) -> str:
    return f"{pipeline}-stages"


def orchestrator_endpoint(pipeline: str, namespace: str) -> str:
    return f"{orchestrator_object_name(pipeline)}.{namespace}.svc:{GRPC_PORT}"


def selector(pipeline: str, component: str, stage: str | None = None) -> dict[str, str]:
    labels = {LABEL_PIPELINE: pipeline, LABEL_COMPONENT: component}
    if stage is not None:
        labels[LABEL_STAGE] = stage
    return labels


def clean_document(body: Mapping[str, Any]) -> dict:
    """The OmniPipeline as the user wrote it: no status, no server-set metadata. This is what the
    services read from the ConfigMap, so a status update never touches it."""
    meta = body.get("metadata") or {}
    return {"apiVersion": body.get("apiVersion", API_VERSION), "kind": body.get("kind", omnispec.KIND),
            "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace", "default")},
            "spec": plain(body.get("spec"))}


def validation_errors(body: Mapping[str, Any]) -> list[FieldError]:
    """Every reason this object cannot be served, as field-path errors (the webhook's answer)."""
    return omnispec.validate(clean_document(body))


def parse(body: Mapping[str, Any]) -> Pipeline:
    """The typed pipeline of an OmniPipeline object; SpecError lists every problem."""
    doc = clean_document(body)
    errors = validation_errors(doc)
    if errors:
        raise SpecError(errors)
    return omnispec.parse_pipeline(doc)


def plain(value: Any) -> Any:
    """kopf bodies and API objects hold views and models: copy them into plain dicts and lists."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
