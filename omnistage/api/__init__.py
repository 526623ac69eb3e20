"""The OmniPipeline API: one model (`model.py`), and from it validation, typed loading, the CRD schema
(`omnistage crd`) and `omnistage explain`. Both `kubectl apply -f` and `omnistage serve` take the same
file; every error names its field path, and all errors are reported at once."""

from omnistage.api.fields import QUANTITY_PATTERN
from omnistage.api.loading import dump_pipeline, load_pipeline, parse_pipeline, parse_pipeline_yaml
from omnistage.api.model import (
                    API_GROUP,
                    API_VERSION,
                    CONDITION_STATUSES,
                    CONDITION_TYPES,
                    DEFAULT_IMAGE,
                    DNS_LABEL,
                    DTYPES,
                    EMITS,
                    ENGINES,
                    FAIRNESS_POLICIES,
                    KIND,
                    MAX_MESSAGE_BYTES,
                    MAX_NAME_LEN,
                    MODALITIES,
                    MODEL_LIMIT_FALLBACKS,
                    PLURAL,
                    ROLLOUT_STRATEGIES,
                    STAGE_KINDS,
                    TRANSFORMERS_QUANTIZATION,
                    TRANSPORTS,
                    ApiKeySecret,
                    Condition,
                    Deployment,
                    Edge,
                    Limits,
                    Metadata,
                    OrchestratorDeployment,
                    OrchestratorHttp,
                    Output,
                    Parallelism,
                    Pipeline,
                    ReplicaStatus,
                    Resources,
                    Rollout,
                    SchedulerSettings,
                    Spec,
                    Stage,
                    StageDeployment,
                    Status,
                    Topology,
                    TransferSettings,
                    accepted_inputs,
                    stage_inputs,
)
from omnistage.api.validation import FieldError, SpecError, validate

__all__ = [
    "API_GROUP", "API_VERSION", "CONDITION_STATUSES", "CONDITION_TYPES", "DEFAULT_IMAGE", "DNS_LABEL",
    "DTYPES", "EMITS", "ENGINES", "FAIRNESS_POLICIES", "KIND", "MAX_MESSAGE_BYTES", "MAX_NAME_LEN", "MODALITIES",
    "MODEL_LIMIT_FALLBACKS", "PLURAL", "QUANTITY_PATTERN", "ROLLOUT_STRATEGIES", "STAGE_KINDS",
    "TRANSFORMERS_QUANTIZATION", "TRANSPORTS", "ApiKeySecret", "Condition",
    "Deployment", "Edge", "FieldError", "Limits", "Metadata", "OrchestratorDeployment", "OrchestratorHttp", "Output",
    "Parallelism", "Pipeline",
    "ReplicaStatus", "Resources", "Rollout", "SchedulerSettings", "Spec", "SpecError", "Stage", "StageDeployment",
    "Status", "Topology", "TransferSettings", "accepted_inputs", "dump_pipeline", "load_pipeline",
    "parse_pipeline", "parse_pipeline_yaml", "stage_inputs", "validate",
]
