"""Operator settings, read once from the environment (the Helm chart sets them from values.yaml).

OMNISTAGE_MODEL_VOLUME       where stage pods find the model store, mounted read-only at
                             OMNISTAGE_MODEL_MOUNT (default /models):
                               `pvc:CLAIM`   a PersistentVolumeClaim in the pipeline's namespace
                               `hostPath:DIR` a folder on every node (single-node and test clusters)
                               `none`        no volume (models baked into the image at the mount path)
                             default `pvc:omnistage-models`
OMNISTAGE_IMAGE_PULL_POLICY  imagePullPolicy of stage and orchestrator containers (IfNotPresent)
OMNISTAGE_RUN_AS_USER        uid (and gid) of stage and orchestrator processes (1000)
OMNISTAGE_METRICS_NAMESPACE_LABEL  `key=value` of namespaces allowed to scrape stage metrics
                             (port http) past the NetworkPolicy; empty: only the pipeline's own pods
OMNISTAGE_RESYNC_SECONDS     every pipeline is reconciled at least this often (300)
OMNISTAGE_WORKERS            pipelines reconciled at once (4)
OMNISTAGE_WEBHOOK            `managed` (kopf serves it and writes its configuration, URL from
                             OMNISTAGE_WEBHOOK_HOST), `external` (kopf serves it, the chart owns the
                             configuration), or `off`
OMNISTAGE_WEBHOOK_ADDR/PORT/HOST/CERT/KEY  listen address and port, the host in managed URLs, and the
                             PEM certificate and key (pre-generated: kopf's self-signing needs oscrypto)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ModelVolume:
    kind: str            # "pvc", "hostPath" or "none"
    source: str = ""     # claim name or host folder
    mount_path: str = "/models"

    def volume(self) -> dict | None:
        if self.kind == "pvc":
            return {"name": "models", "persistentVolumeClaim": {"claimName": self.source, "readOnly": True}}
        if self.kind == "hostPath":
            return {"name": "models", "hostPath": {"path": self.source, "type": "Directory"}}
        return None


@dataclass(frozen=True)
class OperatorConfig:
    model_volume: ModelVolume = ModelVolume("pvc", "omnistage-models")
    image_pull_policy: str = "IfNotPresent"
    run_as_user: int = 1000
    metrics_namespace_label: tuple[str, str] | None = None
    resync_seconds: float = 300.0
    workers: int = 4
    webhook: str = "managed"
    webhook_addr: str = "127.0.0.1"
    webhook_port: int = 9443
    webhook_host: str | None = None
    webhook_cert: str | None = None
    webhook_key: str | None = None


def parse_model_volume(value: str, mount_path: str = "/models") -> ModelVolume:
    kind, _, source = value.partition(":")
    if kind == "none" and not source:
        return ModelVolume("none", "", mount_path)
    if kind in ("pvc", "hostPath") and source:
        if kind == "hostPath" and not source.startswith("/"):
            raise ConfigError(f"OMNISTAGE_MODEL_VOLUME={value!r}: hostPath needs an absolute folder")
        return ModelVolume(kind, source, mount_path)
    raise ConfigError(f"OMNISTAGE_MODEL_VOLUME={value!r}: expected pvc:CLAIM, hostPath:/DIR or none")


def from_env(env: Mapping[str, str] = os.environ) -> OperatorConfig:
    d = OperatorConfig()

    def num(key: str, default, kind=int):
        raw = env.get(key)
        if raw in (None, ""):
            return default
        try:
            return kind(raw)
        except ValueError:
            raise ConfigError(f"{key}={raw!r}: not a number") from None

    label = env.get("OMNISTAGE_METRICS_NAMESPACE_LABEL", "")
    metrics = None
    if label:
        key, sep, value = label.partition("=")
        if not sep or not key:
            raise ConfigError(f"OMNISTAGE_METRICS_NAMESPACE_LABEL={label!r}: expected key=value")
        metrics = (key, value)
    webhook = env.get("OMNISTAGE_WEBHOOK", d.webhook)
    if webhook not in ("managed", "external", "off"):
        raise ConfigError(f"OMNISTAGE_WEBHOOK={webhook!r}: expected managed, external or off")
    return OperatorConfig(
        model_volume=parse_model_volume(env.get("OMNISTAGE_MODEL_VOLUME", "pvc:omnistage-models"),
                                        env.get("OMNISTAGE_MODEL_MOUNT", "/models")),
        image_pull_policy=env.get("OMNISTAGE_IMAGE_PULL_POLICY", d.image_pull_policy),
        run_as_user=num("OMNISTAGE_RUN_AS_USER", d.run_as_user),
        metrics_namespace_label=metrics,
        resync_seconds=num("OMNISTAGE_RESYNC_SECONDS", d.resync_seconds, float),
        workers=num("OMNISTAGE_WORKERS", d.workers),
        webhook=webhook,
        webhook_addr=env.get("OMNISTAGE_WEBHOOK_ADDR", d.webhook_addr),
        webhook_port=num("OMNISTAGE_WEBHOOK_PORT", d.webhook_port),
        webhook_host=env.get("OMNISTAGE_WEBHOOK_HOST") or None,
        webhook_cert=env.get("OMNISTAGE_WEBHOOK_CERT") or None,
        webhook_key=env.get("OMNISTAGE_WEBHOOK_KEY") or None,
    )
