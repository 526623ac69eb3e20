"""Pure: what a stage pod needs to read its model from the stage's source (omnistage.api.model_sources).

- a folder: nothing beyond the model store volume every stage pod mounts (builders);
- `pvc://CLAIM/PATH`: the claim, mounted read-only at the folder `sources` resolves it to;
- `hf://ORG/NAME@REVISION`: the cache volume (spec.deployment.modelCache: a claim, a node folder, or the pod's
  own emptyDir), and two init containers in the stage's image and security context: `omnistage models pull`
  for the stage (the only writer of the cache, with HF_TOKEN from the Secret and HF_ENDPOINT), then
  `omnistage models check` for it, each writing its one-line refusal to the termination log, which the
  operator's status reports. The stage container mounts the cache read-only and resolves the same folder
  ($OMNISTAGE_HUB_CACHE, set on every container here).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omnistage.api import Pipeline
from omnistage.api.model import Deployment
from omnistage.api.model_sources import ENV_HUB_CACHE, ClaimSource, HubSource, parse_source
from omnistage.checkpoints.pull import ENV_HF_ENDPOINT, ENV_HF_OFFLINE, ENV_HF_TOKEN

CLAIM_VOLUME, CACHE_VOLUME = "model-claim", "model-cache"
# Where the hf:// cache is mounted in a stage pod (read-write in the pull container only).
HUB_CACHE_MOUNT = "/var/cache/omnistage-hub"
PULL_CONTAINER, CHECK_CONTAINER = "pull-model", "check-model"
CLI_MODULE = "omnistage.local.cli"


@dataclass(frozen=True)
class InitStep:
    """One init container: its name, command, and the env and mounts of its own."""

    name: str
    command: list[str]
    env: list[dict]
    mounts: list[dict]


@dataclass(frozen=True)
class ModelParts:
    """What a stage's source adds to its pod: volumes, the stage container's mounts and env, and the init
    containers (the caller builds them around these steps)."""

    volumes: list[dict] = field(default_factory=list)
    mounts: list[dict] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    init: list[InitStep] = field(default_factory=list)


def model_parts(p: Pipeline, stage: str, pipeline_path: str, python: str) -> ModelParts:
    source = parse_source(p.stage(stage).model)
    if isinstance(source, ClaimSource):
        return ModelParts(
            volumes=[{"name": CLAIM_VOLUME,
                      "persistentVolumeClaim": {"claimName": source.claim, "readOnly": True}}],
            mounts=[{"name": CLAIM_VOLUME, "mountPath": source.mount_path, "readOnly": True}])
    if isinstance(source, HubSource):
        read_only = {"name": CACHE_VOLUME, "mountPath": HUB_CACHE_MOUNT, "readOnly": True}
        return ModelParts(
            volumes=[cache_volume(p.deployment, p.namespace)],
            mounts=[read_only],
            env={ENV_HUB_CACHE: HUB_CACHE_MOUNT},
            # the token reaches the pull alone; only the pull writes the cache
            init=[InitStep(PULL_CONTAINER, models_command(python, "pull", pipeline_path, stage),
                           hub_env(p.deployment), [{"name": CACHE_VOLUME, "mountPath": HUB_CACHE_MOUNT}]),
                  InitStep(CHECK_CONTAINER, models_command(python, "check", pipeline_path, stage), [],
                           [dict(read_only)])])
    return ModelParts()


def models_command(python: str, action: str, pipeline_path: str, stage: str) -> list[str]:
    return [python, "-m", CLI_MODULE, "models", action, pipeline_path, "--stage", stage]


def cache_volume(d: Deployment, namespace: str) -> dict:
    """The hf:// cache: the named claim (read-write: the pull container writes it; a claim is its namespace's
    own), a node folder of the pipeline's namespace (pods of every namespace run as the same uid: one
    namespace's pull must not fill another's cache), or the pod's own emptyDir."""
    cache = d.model_cache
    if cache.persistent_volume_claim:
        return {"name": CACHE_VOLUME, "persistentVolumeClaim": {"claimName": cache.persistent_volume_claim}}
    if cache.host_path:
        path = f"{cache.host_path.rstrip('/')}/{namespace}"
        return {"name": CACHE_VOLUME, "hostPath": {"path": path, "type": "DirectoryOrCreate"}}
    return {"name": CACHE_VOLUME, "emptyDir": {}}


def hub_env(d: Deployment) -> list[dict]:
    """The pull's Hub settings: the token from its Secret (the kubelet reads it; a missing Secret or key
    keeps the pod from starting, said in its status), the endpoint, and downloads allowed whatever the
    image or the pipeline's env says (HF_HUB_OFFLINE=0)."""
    env: list[dict] = [{"name": ENV_HF_OFFLINE, "value": "0"}]
    if d.hub.endpoint:
        env.append({"name": ENV_HF_ENDPOINT, "value": d.hub.endpoint})
    token = d.hub.token
    if token is not None:
        env.append({"name": ENV_HF_TOKEN, "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key,
                                                                          "optional": False}}})
    return env
