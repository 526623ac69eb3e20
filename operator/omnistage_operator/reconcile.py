"""One reconcile of one OmniPipeline, as a short narrative: read -> parse -> build -> adopt ->
apply (rollout-gated for Deployments) -> prune -> status (with the pods' own account of why replicas
are missing, when some are). Level-based and idempotent: a pass with nothing to change makes no API
writes at all."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import kopf

from omnistage import tls
from omnistage.api import Pipeline, SpecError
from omnistage.tls import TlsError

from .builders import Children, build_children, build_data_plane_key_meta, build_tls_secret_meta, jobs_errors
from .certificates import CertificateAuthority, build_tls_secret, ca_from_secret, leaves, needs_reissue, tls_secret_name
from .compare import matches
from .conditions import now_rfc3339
from .config import TLS_CHART, OperatorConfig
from .data_plane_key import build_data_plane_key_secret, data_plane_key_secret_name, holds_usable_key, new_key
from .kube import Kube, controller_uid, owned_by
from .pipeline_object import parse, plain
from .planning import Plans, autoscaled, planned_replicas, ready_floor
from .rollout import RolloutPlan, UnitState, deployment_rolled_out, plan_rollout, rollout_order
from .status import build_status, conflict_status, invalid_status, new_failures, pods_by_unit, status_patch, unit_counts
from .vocabulary import (
    LABEL_MANAGED_BY,
    LABEL_STAGE,
    MANAGED_BY,
    ORCHESTRATOR,
    R_CHILD_CONFLICT,
    R_INVALID_SPEC,
    R_STAGE_FAILING,
    orchestrator_endpoint,
)

log = logging.getLogger("omnistage.operator")
# While something rolls, look again this often even if no watch event arrives.
PROGRESS_REQUEUE_SECONDS = 10.0
# The chart's CA Secret missing or unusable: look again this often (it is made at install).
CA_MISSING_RETRY_SECONDS = 30.0


# A child's name taken by an object this pipeline may not adopt: look again this often (the user renames or
# deletes one; nothing the operator does frees it).
CONFLICT_RETRY_SECONDS = 30.0


class ChildConflict(Exception):
    """A child's name is taken by an object the operator did not make, or another object controls."""


@dataclass
class Outcome:
    writes: int = 0
    gone: bool = False            # the pipeline no longer exists: stop tracking it
    requeue_after: float | None = None
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)


def reconcile(kube: Kube, cfg: OperatorConfig, namespace: str, name: str, plans: Plans | None = None) -> Outcome:
    body = kube.get_pipeline(namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return Outcome(gone=True)   # the garbage collector removes what it owned
    out = Outcome()
    writes_before = kube.thread_writes()
    generation = body["metadata"].get("generation", 0)
    try:
        pipeline = parse(body)
        if errors := jobs_errors(pipeline, cfg):   # what this operator's settings cannot serve
            raise SpecError(errors)
    except SpecError as e:
        _refuse(kube, body, [str(x) for x in e.errors])
        raise kopf.PermanentError(f"{namespace}/{name}: invalid spec: {e}") from None

    children = build_children(pipeline, cfg, kube.pdb_api_version)
    kopf.adopt(children.all(), owner=body)
    live = kube.list_children(namespace, name)
    uid = body["metadata"]["uid"]
    try:
        plan, observed = _apply(kube, cfg, pipeline, body, children, live, out)
    except ChildConflict as e:   # never adopted, never overwritten: the user frees the name
        _refuse_conflict(kube, body, str(e))
        raise kopf.TemporaryError(str(e), delay=CONFLICT_RETRY_SECONDS) from None

    wanted = {(o["kind"], o["metadata"]["name"]) for o in children.all()}
    for (kind, child), obj in sorted(live.items()):
        if (kind, child) not in wanted and owned_by(obj, uid):   # e.g. a stage taken out of the topology
            kube.delete(kind, namespace, child)
            out.deleted.append(f"{kind}/{child}")
            stage = (obj["metadata"].get("labels") or {}).get(LABEL_STAGE)
            if kind == "Deployment" and stage and cfg.tls_issuer == TLS_CHART:   # Secrets are never listed
                secret = kube.get_secret(namespace, tls_secret_name(name, stage))
                if secret is not None and controller_uid(secret) == uid:   # only its own
                    kube.delete("Secret", namespace, tls_secret_name(name, stage))
                    out.deleted.append(f"Secret/{tls_secret_name(name, stage)}")

    if out.created or out.updated or out.deleted:
        kube.post_event(body, "Normal", "ChildrenApplied", _summary(out))
    counts = _unit_counts(kube, pipeline, observed)
    view = plans.get((namespace, name)) if plans is not None else None
    new = build_status(
        body.get("status"), generation=generation, stages={s.name: counts[s.name] for s in pipeline.stages},
        orchestrator=counts[ORCHESTRATOR], deployments=observed, plan=plan,
        endpoint=orchestrator_endpoint(pipeline.name, namespace), now=now_rfc3339(),
        floors={s.name: ready_floor(pipeline, s.name, counts[s.name]["replicas"]) for s in pipeline.stages},
        autoscaled=autoscaled(pipeline), planned=view)
    if _write_status(kube, body, new):
        for failure in new_failures(body.get("status"), new):   # once per new message, not per restart
            kube.post_event(body, "Warning", R_STAGE_FAILING, failure)
    out.writes = kube.thread_writes() - writes_before
    out.requeue_after = PROGRESS_REQUEUE_SECONDS if plan.progressing else None
    return out


def _apply(kube: Kube, cfg: OperatorConfig, pipeline: Pipeline, body: dict, children: Children, live: dict,
           out: Outcome) -> tuple[RolloutPlan, dict[str, dict | None]]:
    """Every child in place (Deployments as the rollout plan allows); the plan and the live Deployments by unit."""
    uid = body["metadata"]["uid"]
    # before the Deployments: every stage pod mounts it. Under the chart issuer a new Secret holds the key the
    # pipeline's CA derives, the one its leaf Secrets carried before this Secret existed: stages started
    # before and after it share one key (no window in which UCX gets between them fail).
    seed = (lambda: tls.data_plane_key(_read_ca(kube, cfg).key_pem, pipeline.namespace, pipeline.name).hex()) \
        if cfg.tls_issuer == TLS_CHART else new_key
    try:
        _ensure_data_plane_key(kube, pipeline, body, out, seed)
        if cfg.tls_issuer == TLS_CHART:   # before the Deployments: their pods mount these
            _ensure_leaf_secrets(kube, cfg, pipeline, body, out)
    except TlsError as e:          # an unusable CA (e.g. its key and certificate do not match)
        raise kopf.TemporaryError(f"pipeline certificates: {e}", delay=CA_MISSING_RETRY_SECONDS) from None

    for obj in children.all():   # everything but Deployments goes in place at once
        if obj["kind"] != "Deployment":
            _ensure(kube, obj, live, uid, out)

    deployments = _unit_deployments(pipeline, children)
    observed = {unit: live.get(("Deployment", d["metadata"]["name"])) for unit, d in deployments.items()}
    if autoscaled(pipeline):   # the planner owns the count (autoscaler.py): set at creation, never written after
        for s in pipeline.stages:
            if observed[s.name] is not None:
                del deployments[s.name]["spec"]["replicas"]
    units = [UnitState(unit, exists=observed[unit] is not None,
                       in_sync=observed[unit] is not None and matches(d, observed[unit]),
                       rolled_out=deployment_rolled_out(observed[unit])[0])
             for unit, d in deployments.items()]
    plan = plan_rollout(units, pipeline.deployment.rollout.strategy, rollout_order(pipeline))
    for unit in plan.apply:
        observed[unit] = _ensure(kube, deployments[unit], live, uid, out)
    return plan, observed


def _ensure(kube: Kube, desired: dict, live: dict, owner_uid: str, out: Outcome) -> dict:
    """Create the child, or patch it back to what we want; leave it alone when it already is."""
    key = (desired["kind"], desired["metadata"]["name"])
    current = live.get(key)
    if current is None:
        created = kube.create(desired)
        if created is not None:
            out.created.append("/".join(key))
            return created
        # It exists without our label (edited by hand, or someone else's): look at it.
        current = kube.get(desired["kind"], desired["metadata"]["namespace"], desired["metadata"]["name"])
        if current is None:
            raise kopf.TemporaryError(f"{'/'.join(key)} vanished while being created", delay=1)
    other = controller_uid(current)
    if other != owner_uid:
        why = _foreign(current, other)
        if why is not None:
            raise ChildConflict(f"{'/'.join(key)} {why}: rename the pipeline or stage, or delete that object")
    if matches(desired, current):
        return current
    out.updated.append("/".join(key))
    return kube.patch(desired)


def _foreign(current: dict, controller: str | None) -> str | None:
    """Why an existing object of a child's name is not this pipeline's to patch (None: it is). Only what the
    operator made (its managed-by label) and nothing else controls is adopted: a Deployment or Service that
    Helm or a person made keeps its shape, and is never collected with the pipeline."""
    if controller is not None:
        return "exists and is controlled by another object"
    if (current["metadata"].get("labels") or {}).get(LABEL_MANAGED_BY) != MANAGED_BY:
        return f"exists and was not made by the operator (no label {LABEL_MANAGED_BY}={MANAGED_BY})"
    return None


def _ensure_leaf_secrets(kube: Kube, cfg: OperatorConfig, p: Pipeline, body: dict, out: Outcome) -> None:
    """Each unit's certificate Secret, issued with the chart's CA: created when missing, issued again when
    certificates.needs_reissue says so (near its end, another identity, the CA replaced), else left alone."""
    ca = _read_ca(kube, cfg)
    uid = body["metadata"]["uid"]
    for leaf in leaves(p).values():
        live = kube.get_secret(p.namespace, leaf.secret)
        if live is not None:
            _check_own_secret(live, uid)
            if not needs_reissue(live, leaf, ca):
                continue
        secret = build_tls_secret(build_tls_secret_meta(p, leaf), leaf, ca)
        kopf.adopt(secret, owner=body)
        if live is None and kube.create(secret) is not None:
            out.created.append(f"Secret/{leaf.secret}")
        else:
            kube.patch(secret)
            out.updated.append(f"Secret/{leaf.secret}")


def _ensure_data_plane_key(kube: Kube, p: Pipeline, body: dict, out: Outcome, seed: Callable[[], str]) -> None:
    """The pipeline's UCX data-plane key Secret, in every TLS mode: made with `seed()` (a new random key, or the
    chart CA's derived one) when missing or when its key is unusable, else left alone (the key the running
    stages hold stays theirs)."""
    name = data_plane_key_secret_name(p.name)
    live = kube.get_secret(p.namespace, name)
    if live is not None:
        _check_own_secret(live, body["metadata"]["uid"])
        if holds_usable_key(live):
            return
    secret = build_data_plane_key_secret(build_data_plane_key_meta(p), seed())
    kopf.adopt(secret, owner=body)
    if live is not None:
        kube.patch(secret)
        out.updated.append(f"Secret/{name}")
    elif kube.create(secret) is not None:
        out.created.append(f"Secret/{name}")
    else:   # made by someone else since the read: never overwritten; the next pass looks at it
        raise kopf.TemporaryError(f"Secret/{name} appeared while being created", delay=1)


def _check_own_secret(live: dict, uid: str) -> None:
    """Only a Secret this pipeline owns is written: another one of that name (someone's ingress certificate,
    another controller's) is never overwritten or adopted (and so never collected)."""
    if controller_uid(live) != uid:
        raise ChildConflict(f"Secret/{live['metadata']['name']} exists and is not this pipeline's: rename the "
                            "pipeline or stage, or delete that object")


def _read_ca(kube: Kube, cfg: OperatorConfig) -> CertificateAuthority:
    assert cfg.tls_ca_secret is not None   # config.from_env requires it with the chart issuer
    namespace, name = cfg.tls_ca_secret
    secret = kube.get_secret(namespace, name)
    if secret is None:
        raise kopf.TemporaryError(f"the pipelines' CA Secret {namespace}/{name} does not exist (tls.issuer chart)",
                                  delay=CA_MISSING_RETRY_SECONDS)
    return ca_from_secret(secret, f"{namespace}/{name}")


def _unit_counts(kube: Kube, p: Pipeline, observed: dict[str, dict | None]) -> dict[str, dict]:
    """Each unit's status entry; when any is short of ready replicas, its pods say why (one list of
    the pipeline's pods, only then: a settled pipeline costs no pod reads)."""
    desired = {s.name: planned_replicas(p, s.name, observed[s.name]) for s in p.stages}
    desired[ORCHESTRATOR] = p.deployment.orchestrator.replicas
    counts = {unit: unit_counts(want, observed[unit]) for unit, want in desired.items()}
    if all(c["readyReplicas"] >= c["replicas"] for c in counts.values()):
        return counts
    pods = pods_by_unit(kube.list_pods(p.namespace, p.name))
    return {unit: unit_counts(want, observed[unit], pods.get(unit, ())) for unit, want in desired.items()}


def _unit_deployments(p: Pipeline, children: Children) -> dict[str, dict]:
    units = {name: sc.deployment for name, sc in children.stages.items()}
    units[ORCHESTRATOR] = children.orchestrator_deployment
    return units


def _refuse(kube: Kube, body: dict, errors: list[str]) -> None:
    """Ready=False/InvalidSpec and a Warning Event, once per distinct problem; nothing is created."""
    new = invalid_status(body.get("status"), generation=body["metadata"].get("generation", 0), errors=errors,
                         now=now_rfc3339())
    if _write_status(kube, body, new):
        kube.post_event(body, "Warning", R_INVALID_SPEC, "; ".join(errors))
    log.warning("%s/%s: invalid spec: %s", body["metadata"]["namespace"], body["metadata"]["name"],
                "; ".join(errors))


def _refuse_conflict(kube: Kube, body: dict, message: str) -> None:
    """Ready=False/ChildConflict naming the object, and a Warning Event, once per distinct conflict."""
    new = conflict_status(body.get("status"), generation=body["metadata"].get("generation", 0), message=message,
                          now=now_rfc3339())
    if _write_status(kube, body, new):
        kube.post_event(body, "Warning", R_CHILD_CONFLICT, message)
    log.warning("%s/%s: %s", body["metadata"]["namespace"], body["metadata"]["name"], message)


def _write_status(kube: Kube, body: dict, new: dict) -> bool:
    patch = status_patch(plain(body.get("status")), new)
    if patch is None:
        return False
    kube.patch_status(body["metadata"]["namespace"], body["metadata"]["name"], patch)
    return True


def _summary(out: Outcome) -> str:
    parts = [f"{verb}: {', '.join(items)}" for verb, items in
             (("created", out.created), ("updated", out.updated), ("deleted", out.deleted)) if items]
    return "; ".join(parts)
