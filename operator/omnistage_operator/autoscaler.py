"""The stage planner in the cluster: every autoscaled OmniPipeline's stages measured from their pods'
/metrics, sized together by omnistage.planner, and scaled through their Deployments' scale subresource
(docs/planner.md).

One asyncio task on the leading replica. Every `TICK_S` it looks at the pipelines whose
`spec.deployment.autoscaling.enabled` the watch has seen (`track`); for each whose `intervalSeconds` is
due it reads the pipeline, its stage Deployments and pods, scrapes the ready stage and orchestrator pods (in
threads, at once; the orchestrators for the targets' measures, the request classes and the jobs queued in
their job store), lets the planner decide, sets each stage Deployment whose replicas differ from the planner's, and
posts an Event per change. A Deployment scaled down deletes pods the usual way: each is drained by its
preStop hook (it leaves the orchestrator's endpoints and finishes what it holds), so a scale-down fails
no request. The planner's view (desired replicas, capacity, utilisation, the Planned condition) goes to
`Plans`; the pipeline is queued for a reconcile, the status's one writer, when the view changed. Its
decisions are also Prometheus metrics (`registry`: `omnistage_planner_desired_replicas{pipeline="NS/NAME",
stage}` and the rest of omnistage.planner.metrics), served on the operator's metrics port when it has one.

The planner's memory lives in this process: a new leader, or a changed `autoscaling` section, starts
measuring afresh (each stage held where it is until measured over a window).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable, Hashable, Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from omnistage.api import Pipeline, SpecError
from omnistage.contract.launch import METRICS_PATH
from omnistage.planner.classes import ClassCounts
from omnistage.planner.controller import Planner
from omnistage.planner.graph import audio_path, upstream_of
from omnistage.planner.jobs import JobsReading
from omnistage.planner.load import ReplicaCounters
from omnistage.planner.metrics import PlannerMetrics
from omnistage.planner.scrape import (
    orchestrator_buckets,
    orchestrator_classes,
    orchestrator_counters,
    orchestrator_jobs,
    replica_counters,
)

from .kube import Kube
from .pipeline_object import parse
from .planning import Plans, ScrapeTarget, autoscaled, change_message, owned_pods, planned_view, scrape_targets
from .vocabulary import (
    COMPONENT_STAGE,
    LABEL_COMPONENT,
    LABEL_STAGE,
    ORCHESTRATOR,
    R_RECOMMENDED,
    R_SCALED,
    stage_object_name,
)
from .workqueue import WorkQueue

log = logging.getLogger("omnistage.operator.autoscaler")
TICK_S = 0.25
# A scrape of a tenant's pod ends within this, whole (connect, headers and body; a body drip-fed a byte at a
# time included): a stage answers /metrics in milliseconds, and the 16 threads are shared by every pipeline.
SCRAPE_DEADLINE_S = 2.0
# The most a pod's /metrics may send: a stage's or orchestrator's exposition is tens of KiB (a few hundred
# series); a larger one is not ours, and the operator (512 Mi) must not hold it.
SCRAPE_MAX_BYTES = 4 * 1024 * 1024
SCRAPE_THREADS = 16
RETRY_S = 5.0   # after a failed step (the API server unreachable, say), the pipeline's next look
_READ_PIECE = 65536


class ScrapeRefused(ValueError):
    """A pod's /metrics answer that is not read: past the deadline, over the size cap, or not a 200."""


def fetch_metrics(target: ScrapeTarget) -> str:
    """One pod's /metrics, bounded in time (SCRAPE_DEADLINE_S over the whole exchange) and in size
    (SCRAPE_MAX_BYTES): past either, ScrapeRefused and nothing kept."""
    deadline_s, max_bytes = SCRAPE_DEADLINE_S, SCRAPE_MAX_BYTES
    conn = http.client.HTTPConnection(target.host, target.port, timeout=deadline_s)
    expired = threading.Event()
    opened: list[socket.socket] = []   # the socket itself: the connection drops it once the response has it

    def cut() -> None:   # ends a read blocked on a peer that sends slowly: per-read timeouts never would
        expired.set()
        for sock in opened:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(deadline_s, cut)
    timer.daemon = True
    timer.start()
    try:
        conn.connect()
        opened.append(conn.sock)
        if expired.is_set():
            raise ScrapeRefused(f"no whole answer within {deadline_s} s")
        conn.request("GET", METRICS_PATH)
        r = conn.getresponse()
        if r.status != 200:
            raise ScrapeRefused(f"HTTP {r.status}")
        body = bytearray()
        while len(body) <= max_bytes and not expired.is_set():
            piece = r.read1(_READ_PIECE)
            if not piece:
                break
            body += piece
        if expired.is_set():
            raise ScrapeRefused(f"no whole answer within {deadline_s} s")
        if len(body) > max_bytes:
            raise ScrapeRefused(f"more than {max_bytes} bytes")
        return body.decode()
    except (OSError, http.client.HTTPException):
        if expired.is_set():
            raise ScrapeRefused(f"no whole answer within {deadline_s} s") from None
        raise
    finally:
        timer.cancel()
        conn.close()
        for sock in opened:
            sock.close()


def signature(p: Pipeline) -> str:
    """What the planner is built from (the autoscaling section, GPUs per stage, the stage graph, the audio
    path): a change starts it afresh."""
    return json.dumps([asdict(p.deployment.autoscaling), [(s.name, p.deployment.stages[s.name].gpus) for s in p.stages],
                       upstream_of(p), sorted(audio_path(p))], sort_keys=True, default=str)


@dataclass
class PipelinePlanner:
    planner: Planner
    signature: str
    next_at: float = 0.0


class Autoscaler:
    def __init__(self, kube: Kube, plans: Plans, fetch: Callable[[ScrapeTarget], str] = fetch_metrics,
                 clock: Callable[[], float] = time.monotonic):
        self.kube, self.plans, self.fetch, self.clock = kube, plans, fetch, clock
        self.tracked: set[Hashable] = set()
        self.pipelines: dict[Hashable, PipelinePlanner] = {}
        self._pool = ThreadPoolExecutor(SCRAPE_THREADS, thread_name_prefix="planner-scrape")
        self._retry_at: dict[Hashable, float] = {}
        self.metrics: dict[Hashable, PlannerMetrics] = {}   # per pipeline: its planner's decisions
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Merged(self.metrics))
        # `track` (the event loop) and `step` (a worker thread) both change what is kept of a pipeline: a step
        # keeps its results only while the pipeline is still tracked, so one turned off (or deleted) while
        # it was measured leaves no view or metrics behind.
        self._lock = threading.Lock()

    def track(self, key: Hashable, enabled: bool) -> None:
        """From the watch: the pipeline exists with autoscaling `enabled` (or was deleted: False). Turned off,
        its view is dropped at once, so the reconcile that follows writes a status without it."""
        with self._lock:
            if enabled:
                self.tracked.add(key)
                return
            self.tracked.discard(key)
            self._retry_at.pop(key, None)
            self._forget(key)

    def forget_all(self) -> None:
        """This replica no longer leads: what it measured and exported goes (the new leader measures afresh)."""
        with self._lock:
            for key in {*self.pipelines, *self.metrics}:
                self._forget(key)

    def _forget(self, key: Hashable) -> bool:
        self.pipelines.pop(key, None)
        self.metrics.pop(key, None)
        return self.plans.drop(key)

    def step(self, key: Hashable) -> bool:
        """One look at one pipeline, when due (blocking: run it in a thread); True when its status should be
        written again."""
        now = self.clock()
        state = self.pipelines.get(key)
        if state is not None and now < state.next_at:
            return False
        namespace, name = key
        body = self.kube.get_pipeline(namespace, name)
        try:
            p = parse(body) if body is not None and not body["metadata"].get("deletionTimestamp") else None
        except SpecError:
            p = None   # the reconcile reports it; nothing is scaled until it is fixed
        if p is None or not autoscaled(p):
            with self._lock:
                return self._forget(key)
        deployments = self.kube.list_kind("Deployment", namespace, name)
        live = _stage_replicas(deployments)
        if any(s.name not in live for s in p.stages):
            return False   # not created yet: the reconcile makes them
        sig = signature(p)
        if state is None or state.signature != sig:
            gpus = {s.name: p.deployment.stages[s.name].gpus for s in p.stages}
            state = self.pipelines[key] = PipelinePlanner(
                Planner(p.deployment.autoscaling, {s.name: live[s.name] for s in p.stages}, gpus,
                        upstream=upstream_of(p), audio_path=audio_path(p)), sig)
        state.next_at = now + p.deployment.autoscaling.interval_seconds
        pods = owned_pods(self.kube.list_pods(namespace, name), self.kube.list_replica_sets(namespace, name),
                          deployments, body["metadata"].get("uid", ""))
        self._observe(state.planner, pods)
        decision = state.planner.decide(self.clock())
        desired = state.planner.desired()
        scales = p.deployment.autoscaling.scales   # mode Recommend: an autoscaler of the user's own acts
        for stage, want in desired.items():   # also puts back a count edited by hand, as an HPA does
            if scales and live[stage] != want and key in self.tracked:
                self.kube.scale("Deployment", namespace, stage_object_name(name, stage), want)
        for c in decision.changes:
            why = change_message(decision, c, scales)
            log.info("%s/%s: %s", namespace, name, why)
            self.kube.post_event(body, "Normal", R_SCALED if scales else R_RECOMMENDED, why)
        with self._lock:
            if key not in self.tracked:   # turned off or deleted meanwhile: keep nothing
                self.pipelines.pop(key, None)
                return False
            if key not in self.metrics:
                self.metrics[key] = PlannerMetrics(f"{namespace}/{name}")
            self.metrics[key].record(state.planner, decision)
            return self.plans.put(key, planned_view(decision, desired), now)

    def _observe(self, planner: Planner, pods: list[dict]) -> None:
        targets = scrape_targets(pods)
        flat = [(unit, t) for unit, ts in targets.items() if unit in planner.estimates or unit == ORCHESTRATOR
                for t in ts]
        read = list(self._pool.map(lambda ut: self._read(ut[1]), flat))
        by_stage: dict[str, dict[str, ReplicaCounters]] = {}
        units: dict[str, str] = {}
        orchestrators: dict[str, dict[str, dict[float, float]]] = {}
        classes: dict[str, ClassCounts] = {}
        audio: dict[str, dict[str, float]] = {}
        jobs: dict[str, JobsReading] = {}
        for (unit, target), text in zip(flat, read):
            if text is None:
                continue   # a pod that does not answer this time is measured next time
            try:
                if unit == ORCHESTRATOR:   # the targets' measures and the request classes
                    orchestrators[target.pod] = orchestrator_buckets(text)
                    classes[target.pod] = orchestrator_classes(text)
                    audio[target.pod] = orchestrator_counters(text)
                    if (reading := orchestrator_jobs(text)) is not None:
                        jobs[target.pod] = reading
                    continue
                counters, work = replica_counters(text, self.clock())
            except ValueError:
                continue
            by_stage.setdefault(unit, {})[target.pod] = counters
            units[unit] = work or units.get(unit, "")
        for stage, counters in by_stage.items():
            planner.observe(stage, counters, units.get(stage, ""))
        planner.observe_orchestrators(orchestrators, self.clock())
        planner.observe_classes(classes, self.clock())
        planner.observe_audio(audio, self.clock())
        planner.observe_jobs(jobs, self.clock())

    def _read(self, target: ScrapeTarget) -> str | None:
        try:
            return self.fetch(target)
        except (OSError, http.client.HTTPException, ValueError):
            return None

    async def run(self, queue: WorkQueue, active: asyncio.Event | None = None) -> None:
        """Forever: step every tracked pipeline; queue a reconcile where the status should change. With
        `active`, only while this replica leads (a standby forgets what it measured)."""
        while True:
            await asyncio.sleep(TICK_S)
            for key in list(self.tracked):
                if active is not None and not active.is_set():   # looked at before every step: a step is long
                    if self.pipelines or self.metrics:
                        self.forget_all()
                    break
                if self.clock() < self._retry_at.get(key, 0.0):
                    continue
                try:
                    if await asyncio.to_thread(self.step, key):
                        queue.add(key)
                except Exception:
                    self._retry_at[key] = self.clock() + RETRY_S
                    log.exception("planning %s/%s failed; again in %.0f s", *key, RETRY_S)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _stage_replicas(deployments: list[dict]) -> dict[str, int]:
    out = {}
    for d in deployments:
        labels = d["metadata"].get("labels") or {}
        if labels.get(LABEL_COMPONENT) == COMPONENT_STAGE and labels.get(LABEL_STAGE):
            out[labels[LABEL_STAGE]] = int((d.get("spec") or {}).get("replicas", 1))
    return out


class _Merged:
    """Every pipeline's planner metrics as one exposition: each PlannerMetrics has a registry of its own (its
    `pipeline` label is `namespace/name`), so families of the same name are joined here."""

    def __init__(self, by_pipeline: Mapping[Hashable, PlannerMetrics]):
        self.by_pipeline = by_pipeline

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for m in list(self.by_pipeline.values()):
            for family in m.registry.collect():
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                into.samples.extend(family.samples)
        yield from merged.values()


def autoscaling_enabled(body: Mapping) -> bool:
    """Whether an OmniPipeline object asks for autoscaling (read from the raw object: the watch calls this
    for every event, valid or not)."""
    deployment = (body.get("spec") or {}).get("deployment") or {}
    return bool((deployment.get("autoscaling") or {}).get("enabled"))
