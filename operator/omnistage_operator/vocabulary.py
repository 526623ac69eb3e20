"""The operator's vocabulary, shared by builders, rollout, status and handlers: the API it serves,
the names of the children it owns, their labels and annotations, and its conditions and reasons.
Ports and probe paths are the process contract's (`omnistage.contract.launch`)."""

from __future__ import annotations

from omnistage import api as omnispec
from omnistage.contract.launch import GRPC_PORT, stage_service_name

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
R_STAGE_FAILING = "StageFailing"          # a unit short of replicas has a failing container
R_PROGRESS_DEADLINE = "ProgressDeadlineExceeded"
R_REPLICA_FAILURE = "ReplicaFailure"
R_CHILD_CONFLICT = "ChildConflict"       # a child's name is taken by an object the operator does not manage
# The stage planner's condition (autoscaling enabled) and its reasons; its events say Scaled.
PLANNED = "Planned"
R_SIZED = "Sized"                    # every stage has what it needs at the target utilisation
R_BUDGET_LIMITED = "BudgetLimited"   # the budget cannot meet the target: the best goodput within it
R_NO_LOAD = "NoLoad"                 # nothing offered: every stage at its minimum
R_MEASURING = "Measuring"            # no stage has shown its capacity yet
R_SCALED = "Scaled"
R_RECOMMENDED = "Recommended"        # mode Recommend: what it would set, for the user's own autoscaler

PIPELINE_DIR, PIPELINE_FILE = "/etc/omnistage", "pipeline.yaml"
K8S_NAME_MAX = 63


def stage_object_name(pipeline: str, stage: str) -> str:
    """Deployment, Service and PodDisruptionBudget of one stage: `<pipeline>-<stage>`."""
    return stage_service_name(pipeline, stage)


def orchestrator_object_name(pipeline: str) -> str:
    return f"{pipeline}-{ORCHESTRATOR}"


def config_map_name(pipeline: str) -> str:
    return f"{pipeline}-pipeline"


def network_policy_name(pipeline: str) -> str:
    return f"{pipeline}-stages"


def orchestrator_network_policy_name(pipeline: str) -> str:
    return orchestrator_object_name(pipeline)


def orchestrator_endpoint(pipeline: str, namespace: str) -> str:
    return f"{orchestrator_object_name(pipeline)}.{namespace}.svc:{GRPC_PORT}"


def selector(pipeline: str, component: str, stage: str | None = None) -> dict[str, str]:
    labels = {LABEL_PIPELINE: pipeline, LABEL_COMPONENT: component}
    if stage is not None:
        labels[LABEL_STAGE] = stage
    return labels
