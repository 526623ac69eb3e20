"""An OmniPipeline object as the operator receives it (a kopf body or an API object): cleaned down
to what the user wrote, validated by `omnistage.api` (never re-validated here) and parsed into the
typed pipeline."""

from __future__ import annotations

from typing import Any, Mapping

from omnistage import api as omnispec
from omnistage.api import FieldError, Pipeline, SpecError
from omnistage.store_url import sqlite_file, sqlite_file_under

from .builders import JOBS_MOUNT
from .vocabulary import API_VERSION


def clean_document(body: Mapping[str, Any]) -> dict:
    """The OmniPipeline as the user wrote it: no status, no server-set metadata. This is what the
    services read from the ConfigMap, so a status update never touches it."""
    meta = body.get("metadata") or {}
    # Metadata of another shape (never from the API server; a direct call) goes on as it is: the validator
    # names it, rather than this failing on it.
    kept = {"name": meta.get("name"), "namespace": meta.get("namespace", "default")} if isinstance(meta, Mapping) \
        else meta
    return {"apiVersion": body.get("apiVersion", API_VERSION), "kind": body.get("kind", omnispec.KIND),
            "metadata": kept,
            "spec": plain(body.get("spec"))}


def validation_errors(body: Mapping[str, Any]) -> list[FieldError]:
    """Every reason this object cannot be served, as field-path errors (the webhook's answer)."""
    doc = clean_document(body)
    return omnispec.validate(doc) or cluster_errors(doc)


def cluster_errors(doc: Mapping[str, Any]) -> list[FieldError]:
    """What a valid pipeline cannot do on a cluster (`omnistage serve` can): an edge that forces shared memory,
    which stays inside one pod, where every stage runs in pods of its own (every request would fail to fetch
    its inputs), and a SQLite job store off the job volume. UCX edges are fine in every TLS mode: every stage
    pod gets the pipeline's data-plane key (data_plane_key.py)."""
    stages = ((doc.get("spec") or {}).get("topology") or {}).get("stages") or []
    edges = [(f"spec.topology.stages[{i}].inputs[{j}].transport", edge.get("transport"))
             for i, stage in enumerate(stages) for j, edge in enumerate(stage.get("inputs") or [])]
    return [FieldError(path, "shm cannot cross pods, and on a cluster every stage runs in pods of its own: use "
                             "auto (UCX between pods), ucx or inline")
            for path, transport in edges if transport == "shm"] + _sqlite_errors(doc)


def _sqlite_errors(doc: Mapping[str, Any]) -> list[FieldError]:
    """A SQLite job store's file must be on the job volume (mounted at JOBS_MOUNT): anywhere else it is in the
    pod's read-only root (every job creation would fail) or lost with the pod."""
    orchestrator = ((doc.get("spec") or {}).get("deployment") or {}).get("orchestrator") or {}
    url = ((orchestrator.get("jobs") or {}).get("store") or {}).get("url")
    if not isinstance(url, str) or sqlite_file(url) is None or sqlite_file_under(url, JOBS_MOUNT):
        return []
    return [FieldError("spec.deployment.orchestrator.jobs.store.url",
                       f"{sqlite_file(url)!r} is not on the job volume: a SQLite file must be under {JOBS_MOUNT}, "
                       f"where contentVolume is mounted (e.g. sqlite://{JOBS_MOUNT}/jobs.db)")]


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
