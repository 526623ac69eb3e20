"""kopf wiring, nothing else: watch OmniPipelines, their children and their failing pods into the work
queue, serve the validating webhook, start and stop the reconcile workers and the stage planner (autoscaler.py).

Run: `python -m kopf run -m omnistage_operator.handlers --all-namespaces` (or `--namespace=NS`).
Watch events only enqueue; the reconcile is level-based (reconcile.py), so kopf keeps no per-object
state: no annotations, no finalizers, no writes of its own. Several replicas share a KopfPeering
(OMNISTAGE_PEERING): the oldest reconciles, the others stand by (leadership.py); every replica serves
the webhook.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os

import kopf
import prometheus_client

from .autoscaler import Autoscaler, autoscaling_enabled
from .config import TLS_CERT_MANAGER, ConfigError, from_env
from .kube import Kube
from .leadership import follow_peering, start_priority
from .metrics import OperatorMetrics
from .pipeline_object import validation_errors
from .planning import Plans
from .reconcile import reconcile
from .status import last_failure
from .vocabulary import GROUP, LABEL_PIPELINE, PLURAL, VERSION
from .webhook_tls import ReloadingWebhookServer, ServingCertificate
from .workqueue import WorkQueue, resync, worker

# Children whose changes (or deletion) bring their pipeline back into the queue.
CHILD_RESOURCES = (
    dict(group="", version="v1", plural="configmaps"),
    dict(group="", version="v1", plural="services"),
    dict(group="", version="v1", plural="serviceaccounts"),
    dict(group="apps", version="v1", plural="deployments"),
    dict(group="policy", plural="poddisruptionbudgets"),
    dict(group="networking.k8s.io", version="v1", plural="networkpolicies"),
    dict(group="rbac.authorization.k8s.io", version="v1", plural="roles"),
    dict(group="rbac.authorization.k8s.io", version="v1", plural="rolebindings"),
)
# Pods are not children (their Deployments own them) and are only read, but a container that exits
# before it was ever ready changes no Deployment: its pod's event is what brings its termination
# message into the status. Only pods with a failing container enqueue (a pod coming up does not).
POD_RESOURCE = dict(group="", version="v1", plural="pods")
WEBHOOK_ID = "validate-omnipipeline"   # the webhook path is /validate-omnipipeline
CHILD_EVENT_DELAY = 0.5


@kopf.on.startup()
async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, logger, **_) -> None:
    cfg = from_env()
    if cfg.peering and settings.peering.clusterwide == bool(cfg.watch_namespaces):
        # leadership.py reads the peering objects kopf writes: one per namespace, or the cluster's.
        raise ConfigError("OMNISTAGE_WATCH_NAMESPACES must name the --namespace flags (and be empty with "
                          "--all-namespaces)")
    settings.posting.level = logging.WARNING    # Events come from the reconcile, not from kopf's logs
    if cfg.watch_namespaces:
        # Named namespaces only: kopf then needs no cluster-wide list of namespaces or CRDs (the chart grants
        # none); it serves the CRDs present at start.
        settings.scanning.disabled = True
    memo.tasks = []
    if cfg.webhook != "off":
        server = dict(addr=cfg.webhook_addr, port=cfg.webhook_port, host=cfg.webhook_host or cfg.webhook_addr)
        if cfg.webhook_cert and cfg.webhook_key:
            serving = ServingCertificate(cfg.webhook_cert, cfg.webhook_key)
            settings.admission.server = ReloadingWebhookServer(serving=serving, **server)
            memo.tasks.append(asyncio.create_task(serving.follow(cfg.webhook_reload_seconds)))
        else:
            settings.admission.server = kopf.WebhookServer(**server)
        if cfg.webhook == "managed":
            settings.admission.managed = f"{PLURAL}.{GROUP}"
    kube = await asyncio.to_thread(Kube, None, cfg.tls_issuer == TLS_CERT_MANAGER)
    memo.queue = WorkQueue()
    memo.seen = {}
    active = None
    if cfg.peering:
        # kopf peers by its own records in the KopfPeering objects (mandatory: no object, no work).
        settings.peering.standalone = False
        settings.peering.mandatory = True
        settings.peering.name = cfg.peering
        settings.peering.priority = start_priority()
        active = asyncio.Event()
        read = functools.partial(kube.peering_statuses, cfg.peering, cfg.watch_namespaces)
        memo.tasks.append(asyncio.create_task(
            follow_peering(read, cfg.pod_id, settings.peering.priority, active)))
    else:
        settings.peering.standalone = True      # one replica
    memo.plans = Plans()
    memo.autoscaler = Autoscaler(kube, memo.plans)
    run = functools.partial(reconcile, kube, cfg, plans=memo.plans)
    # the operator's own metrics, served with the planner's on the metrics port
    metrics = OperatorMetrics(memo.autoscaler.registry, memo.queue)
    memo.tasks += [asyncio.create_task(worker(memo.queue, run, f"worker-{i}", active, metrics))
                   for i in range(cfg.workers)]
    memo.tasks.append(asyncio.create_task(memo.autoscaler.run(memo.queue, active)))
    memo.metrics_server = None
    if cfg.metrics_port:
        memo.metrics_server, _ = prometheus_client.start_http_server(cfg.metrics_port, cfg.metrics_addr,
                                                                     memo.autoscaler.registry)
    memo.tasks.append(asyncio.create_task(resync(memo.queue, cfg.resync_seconds)))
    logger.info("omnistage operator: %d workers, PodDisruptionBudget %s, models %s, webhook %s, peering %s, "
                "pipeline TLS %s, metrics %s", cfg.workers, kube.pdb_api_version, cfg.model_volume, cfg.webhook,
                cfg.peering or "standalone", cfg.tls_issuer,
                f"{cfg.metrics_addr}:{cfg.metrics_port}" if cfg.metrics_port else "off")


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_) -> None:
    for task in getattr(memo, "tasks", ()):
        task.cancel()
    await asyncio.gather(*getattr(memo, "tasks", ()), return_exceptions=True)
    if getattr(memo, "autoscaler", None) is not None:
        memo.autoscaler.close()
    if getattr(memo, "metrics_server", None) is not None:
        memo.metrics_server.shutdown()


@kopf.on.event(GROUP, VERSION, PLURAL)
async def pipeline_event(type: str | None, body: kopf.Body, name: str, namespace: str, memo: kopf.Memo,
                         **_) -> None:
    key = (namespace, name)
    memo.autoscaler.track(key, type != "DELETED" and autoscaling_enabled(body))
    if type == "DELETED":
        memo.queue.forget(key)
        memo.seen.pop(key, None)
        return
    # Our own status writes come back as events: skip those, reconcile on anything else.
    meta = body.get("metadata", {})
    seen = json.dumps([body.get("spec"), meta.get("labels"), meta.get("annotations"),
                       meta.get("deletionTimestamp")], sort_keys=True, default=str)
    if memo.seen.get(key) != seen or type is None:
        memo.seen[key] = seen
        memo.queue.add(key)


async def child_event(labels: dict, namespace: str, memo: kopf.Memo, **_) -> None:
    # Children change in bursts (16 created at once, pods coming up): one reconcile per burst.
    memo.queue.add_after((namespace, labels[LABEL_PIPELINE]), CHILD_EVENT_DELAY)


for _resource in CHILD_RESOURCES:
    kopf.on.event(**_resource, labels={LABEL_PIPELINE: kopf.PRESENT},
                  id=f"child-{_resource['plural']}")(child_event)


def pod_failing(body: kopf.Body, **_) -> bool:
    return last_failure([body]) is not None


kopf.on.event(**POD_RESOURCE, labels={LABEL_PIPELINE: kopf.PRESENT}, when=pod_failing, id="pod-failing")(child_event)


def validate(body: kopf.Body, **_) -> None:
    errors = validation_errors(body)
    if errors:
        raise kopf.AdmissionError("\n".join(str(e) for e in errors), code=422)


# kopf refuses to start with admission handlers but no webhook server: register only when served.
if os.environ.get("OMNISTAGE_WEBHOOK", "managed") != "off":
    kopf.on.validate(GROUP, VERSION, PLURAL, id=WEBHOOK_ID, operations=["CREATE", "UPDATE"])(validate)
