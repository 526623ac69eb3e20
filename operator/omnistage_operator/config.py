"""Operator settings, read once from the environment (the Helm chart sets them from values.yaml).

OMNISTAGE_MODEL_VOLUME       where stage pods find the model store, mounted read-only at
                             OMNISTAGE_MODEL_MOUNT (default /models):
                               `pvc:CLAIM`   a PersistentVolumeClaim in the pipeline's namespace
                               `hostPath:DIR` a folder on every node (single-node and test clusters)
                               `none`        no volume (models baked into the image at the mount path)
                             default `pvc:omnistage-models`
OMNISTAGE_ORCHESTRATOR_MODELS  `true` (default): the orchestrator mounts the model volume too, read-only, to
                             read the limits a pipeline leaves to the model from its checkpoints' configs;
                             `false` where the volume cannot reach the orchestrator's node (a ReadWriteOnce
                             claim, a hostPath on the GPU nodes only): the fallback limits apply
OMNISTAGE_IMAGE              the image of stage and orchestrator pods whose pipeline names none
                             (spec.deployment.image): the chart sets the operator's own (image.*)
OMNISTAGE_IMAGE_PULL_POLICY  imagePullPolicy of stage and orchestrator containers (IfNotPresent)
OMNISTAGE_IMAGE_PULL_SECRETS  comma-separated Secret names every pipeline pod pulls its image with (each must
                             exist in the pipeline's namespace), besides spec.deployment.imagePullSecrets
OMNISTAGE_RUN_AS_USER        uid (and gid) of stage and orchestrator processes (1000)
OMNISTAGE_METRICS_NAMESPACE_LABEL  `key=value` of namespaces allowed to scrape stage metrics
                             (port http) past the NetworkPolicy; empty: only the pipeline's own pods
OMNISTAGE_ORCHESTRATOR_CLIENTS_FROM  a JSON list of NetworkPolicy peers allowed to the orchestrators' client
                             ports (gRPC, OpenAI-compatible API); empty: from anywhere
OMNISTAGE_OPERATOR_PEER      a JSON NetworkPolicy peer naming the operator's pods: autoscaled pipelines' stage
                             pods accept it on port http (the stage planner reads their /metrics); empty:
                             no such rule (a cluster without NetworkPolicy enforcement needs none)
OMNISTAGE_METRICS_ADDR/PORT  where the operator serves its Prometheus metrics (the stage planner's decisions,
                             /metrics); port 0 or unset: not served
OMNISTAGE_JOBS_STORE_SECRET  `NAME` or `NAME:KEY` (key default `url`) of a Secret in the pipeline's namespace
                             holding a job store URL (postgresql://...): the durable job store of every
                             pipeline with a video output that names none (spec.deployment.orchestrator.jobs);
                             empty: such pipelines refuse jobs unless they name a store
OMNISTAGE_JOBS_CONTENT_CLAIM  a PersistentVolumeClaim in the pipeline's namespace for their finished content
                             (with OMNISTAGE_JOBS_STORE_SECRET, where the pipeline names no contentVolume)
OMNISTAGE_RESYNC_SECONDS     every pipeline is reconciled at least this often (300)
OMNISTAGE_WORKERS            pipelines reconciled at once (4)
OMNISTAGE_WEBHOOK            `managed` (kopf serves it and writes its configuration, URL from
                             OMNISTAGE_WEBHOOK_HOST), `external` (kopf serves it, the chart owns the
                             configuration), or `off`
OMNISTAGE_WEBHOOK_ADDR/PORT/HOST/CERT/KEY  listen address and port, the host in managed URLs, and the
                             PEM certificate and key (pre-generated: kopf's self-signing needs oscrypto);
                             the operator reloads them when the files change
OMNISTAGE_WEBHOOK_RELOAD_SECONDS  how often the webhook certificate files are checked for a change (10)
OMNISTAGE_PEERING            name of the KopfPeering (ClusterKopfPeering with every namespace) that several
                             operator replicas share: the oldest live one reconciles (leadership.py); empty:
                             one replica, standalone. Needs POD_ID (kopf's identity of this replica) and
                             OMNISTAGE_WATCH_NAMESPACES (comma-separated; empty: every namespace)
OMNISTAGE_TLS_ISSUER         who issues the pipelines' mTLS certificates (certificates.py): `off` (none:
                             plaintext between the pipeline's processes), `chart` (the operator signs them
                             with the CA in OMNISTAGE_TLS_CA_SECRET, `NAMESPACE/NAME`, a kubernetes.io/tls
                             Secret) or `certManager` (Certificates for OMNISTAGE_TLS_ISSUER_REF,
                             `KIND/NAME` or `KIND/NAME/GROUP`, group default cert-manager.io)
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Mapping

from omnistage.api import DEFAULT_IMAGE
from omnistage.api.model import (
    DEFAULT_JOBS_STORE_KEY,
    SECRET_KEY,
    SECRET_KEY_HINT,
    SECRET_NAME,
    SECRET_NAME_HINT,
)


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


TLS_OFF, TLS_CHART, TLS_CERT_MANAGER = "off", "chart", "certManager"
TLS_ISSUERS = (TLS_OFF, TLS_CHART, TLS_CERT_MANAGER)


@dataclass(frozen=True)
class IssuerRef:
    """A cert-manager issuer: `kind` Issuer (in the pipeline's namespace), ClusterIssuer, or an external
    issuer's kind with its `group`."""
    kind: str
    name: str
    group: str = "cert-manager.io"


@dataclass(frozen=True)
class OperatorConfig:
    model_volume: ModelVolume = ModelVolume("pvc", "omnistage-models")
    orchestrator_models: bool = True
    image: str = DEFAULT_IMAGE
    image_pull_policy: str = "IfNotPresent"
    image_pull_secrets: tuple[str, ...] = ()
    run_as_user: int = 1000
    metrics_namespace_label: tuple[str, str] | None = None
    orchestrator_clients_from: tuple[dict, ...] = ()
    operator_peer: dict | None = None
    metrics_addr: str = "127.0.0.1"
    metrics_port: int = 0
    resync_seconds: float = 300.0
    workers: int = 4
    webhook: str = "managed"
    webhook_addr: str = "127.0.0.1"
    webhook_port: int = 9443
    webhook_host: str | None = None
    webhook_cert: str | None = None
    webhook_key: str | None = None
    webhook_reload_seconds: float = 10.0
    peering: str | None = None
    pod_id: str | None = None
    watch_namespaces: tuple[str, ...] = ()
    tls_issuer: str = TLS_OFF
    tls_ca_secret: tuple[str, str] | None = None     # (namespace, name), with tls_issuer chart
    tls_issuer_ref: IssuerRef | None = None          # with tls_issuer certManager
    jobs_store_secret: tuple[str, str] | None = None  # (name, key): the default job store's URL
    jobs_content_claim: str = ""                     # the default job content volume

    @property
    def tls_enabled(self) -> bool:
        return self.tls_issuer != TLS_OFF


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
    clients_raw = env.get("OMNISTAGE_ORCHESTRATOR_CLIENTS_FROM", "")
    try:
        clients = json.loads(clients_raw) if clients_raw.strip() else []
    except ValueError as e:
        raise ConfigError(f"OMNISTAGE_ORCHESTRATOR_CLIENTS_FROM: not JSON ({e})") from None
    if not isinstance(clients, list) or not all(isinstance(c, dict) and c for c in clients):
        raise ConfigError("OMNISTAGE_ORCHESTRATOR_CLIENTS_FROM: expected a JSON list of NetworkPolicy peers "
                          "(objects with podSelector, namespaceSelector or ipBlock)")
    peer_raw = env.get("OMNISTAGE_OPERATOR_PEER", "")
    try:
        peer = json.loads(peer_raw) if peer_raw.strip() else None
    except ValueError as e:
        raise ConfigError(f"OMNISTAGE_OPERATOR_PEER: not JSON ({e})") from None
    if peer is not None and not (isinstance(peer, dict) and peer):
        raise ConfigError("OMNISTAGE_OPERATOR_PEER: expected a JSON NetworkPolicy peer (an object with "
                          "podSelector and/or namespaceSelector)")
    peering = env.get("OMNISTAGE_PEERING") or None
    if peering and not env.get("POD_ID"):
        raise ConfigError(f"OMNISTAGE_PEERING={peering!r} needs POD_ID (this replica's name, kopf's identity)")
    namespaces = tuple(n.strip() for n in env.get("OMNISTAGE_WATCH_NAMESPACES", "").split(",") if n.strip())
    issuer = env.get("OMNISTAGE_TLS_ISSUER") or TLS_OFF
    if issuer not in TLS_ISSUERS:
        raise ConfigError(f"OMNISTAGE_TLS_ISSUER={issuer!r}: expected {', '.join(TLS_ISSUERS)}")
    ca_secret = issuer_ref = None
    if issuer == TLS_CHART:
        raw = env.get("OMNISTAGE_TLS_CA_SECRET", "")
        ns, sep, name = raw.partition("/")
        if not (sep and ns and name) or "/" in name:
            raise ConfigError(f"OMNISTAGE_TLS_CA_SECRET={raw!r}: expected NAMESPACE/NAME of the CA Secret "
                              f"(needed with OMNISTAGE_TLS_ISSUER={TLS_CHART})")
        ca_secret = (ns, name)
    elif issuer == TLS_CERT_MANAGER:
        raw = env.get("OMNISTAGE_TLS_ISSUER_REF", "")
        parts = raw.split("/")
        if len(parts) not in (2, 3) or not all(parts):
            raise ConfigError(f"OMNISTAGE_TLS_ISSUER_REF={raw!r}: expected KIND/NAME, e.g. ClusterIssuer/NAME "
                              f"(optionally /GROUP; needed with OMNISTAGE_TLS_ISSUER={TLS_CERT_MANAGER})")
        issuer_ref = IssuerRef(*parts)
    pull_secrets = tuple(s.strip() for s in env.get("OMNISTAGE_IMAGE_PULL_SECRETS", "").split(",") if s.strip())
    for s in pull_secrets:
        if not re.match(SECRET_NAME, s):
            raise ConfigError(f"OMNISTAGE_IMAGE_PULL_SECRETS: {s!r} {SECRET_NAME_HINT}")
    jobs_secret = _secret_key(env.get("OMNISTAGE_JOBS_STORE_SECRET", "").strip(), "OMNISTAGE_JOBS_STORE_SECRET")
    jobs_claim = env.get("OMNISTAGE_JOBS_CONTENT_CLAIM", "").strip()
    if jobs_claim and not re.match(SECRET_NAME, jobs_claim):
        raise ConfigError(f"OMNISTAGE_JOBS_CONTENT_CLAIM: {jobs_claim!r} {SECRET_NAME_HINT}")
    if jobs_claim and not jobs_secret:
        raise ConfigError("OMNISTAGE_JOBS_CONTENT_CLAIM keeps a job store's content: set "
                          "OMNISTAGE_JOBS_STORE_SECRET too")
    models = env.get("OMNISTAGE_ORCHESTRATOR_MODELS", "true").strip().lower()
    if models not in ("true", "false"):
        raise ConfigError(f"OMNISTAGE_ORCHESTRATOR_MODELS={models!r}: expected true or false")
    return OperatorConfig(
        model_volume=parse_model_volume(env.get("OMNISTAGE_MODEL_VOLUME", "pvc:omnistage-models"),
                                        env.get("OMNISTAGE_MODEL_MOUNT", "/models")),
        orchestrator_models=models == "true",
        image=env.get("OMNISTAGE_IMAGE") or d.image,
        image_pull_policy=env.get("OMNISTAGE_IMAGE_PULL_POLICY", d.image_pull_policy),
        image_pull_secrets=pull_secrets,
        run_as_user=num("OMNISTAGE_RUN_AS_USER", d.run_as_user),
        metrics_namespace_label=metrics,
        orchestrator_clients_from=tuple(clients),
        operator_peer=peer,
        metrics_addr=env.get("OMNISTAGE_METRICS_ADDR") or d.metrics_addr,
        metrics_port=num("OMNISTAGE_METRICS_PORT", d.metrics_port),
        resync_seconds=num("OMNISTAGE_RESYNC_SECONDS", d.resync_seconds, float),
        workers=num("OMNISTAGE_WORKERS", d.workers),
        webhook=webhook,
        webhook_addr=env.get("OMNISTAGE_WEBHOOK_ADDR", d.webhook_addr),
        webhook_port=num("OMNISTAGE_WEBHOOK_PORT", d.webhook_port),
        webhook_host=env.get("OMNISTAGE_WEBHOOK_HOST") or None,
        webhook_cert=env.get("OMNISTAGE_WEBHOOK_CERT") or None,
        webhook_key=env.get("OMNISTAGE_WEBHOOK_KEY") or None,
        webhook_reload_seconds=num("OMNISTAGE_WEBHOOK_RELOAD_SECONDS", d.webhook_reload_seconds, float),
        peering=peering,
        pod_id=env.get("POD_ID") or None,
        watch_namespaces=namespaces,
        tls_issuer=issuer,
        tls_ca_secret=ca_secret,
        tls_issuer_ref=issuer_ref,
        jobs_store_secret=jobs_secret,
        jobs_content_claim=jobs_claim,
    )


def _secret_key(raw: str, var: str) -> tuple[str, str] | None:
    """`NAME` or `NAME:KEY` of a Secret's key (key default DEFAULT_JOBS_STORE_KEY); empty: None."""
    if not raw:
        return None
    name, _, key = raw.partition(":")
    key = key or DEFAULT_JOBS_STORE_KEY
    if not re.match(SECRET_NAME, name):
        raise ConfigError(f"{var}={raw!r}: {name!r} {SECRET_NAME_HINT}")
    if not re.match(SECRET_KEY, key):
        raise ConfigError(f"{var}={raw!r}: key {key!r} {SECRET_KEY_HINT}")
    return name, key
