"""`omnistage serve --autoscale`: the stage planner over local processes.

Every `spec.deployment.autoscaling.intervalSeconds` it reads each stage replica's counters from its status
port (`/metrics`), lets the planner (`omnistage.planner`) decide, and makes each stage run as many
replicas as the planner wants: a new replica process joins the orchestrator's replicas once ready (the
endpoints file, `--discovery file`); a replica removed leaves them first and is drained after (SIGTERM:
it finishes what it was given, then exits), so scaling down fails no request. A stage on GPUs keeps the
replicas it started with (serve places GPUs at start). The planner is given the stage graph (each
stage's inputs), so a stage's upstream catch-up is not read as a rise in its load, and the stages the audio
passes through, the only ones a missed underrun target grows; from the orchestrator it also reads the jobs
queued in its job store (a video pipeline's), backlog to the stages they will load. The planner's
decisions are served as Prometheus metrics on a status port of their own
(`omnistage_planner_desired_replicas`, ...).
"""

from __future__ import annotations

import http.client
import time
import urllib.request
from typing import Callable

from omnistage.contract.devices import uses_gpus
from omnistage.contract.launch import METRICS_PATH, http_url
from omnistage.local.serve import LaunchError, LocalPipeline
from omnistage.planner.controller import Planner
from omnistage.planner.graph import audio_path, upstream_of
from omnistage.planner.load import ReplicaCounters
from omnistage.planner.metrics import PlannerMetrics
from omnistage.planner.scrape import (
    orchestrator_buckets,
    orchestrator_classes,
    orchestrator_counters,
    orchestrator_jobs,
    replica_counters,
)
from omnistage.serving import HttpStatusServer

SCRAPE_TIMEOUT_S = 1.0


class LocalAutoscaler:
    def __init__(self, local: LocalPipeline, progress: Callable[[str], None] = lambda m: print(m, flush=True),
                 clock: Callable[[], float] = time.monotonic):
        self.local = local
        self.progress = progress
        self.clock = clock
        dep = local.pipeline.deployment
        self.config = dep.autoscaling
        self.fixed = {s.name for s in local.pipeline.stages if uses_gpus(dep.stages[s.name])}
        gpus = {s.name: dep.stages[s.name].gpus if s.name in self.fixed else 0 for s in local.pipeline.stages}
        self.planner = Planner(self.config, self._in_service(), gpus, fixed=frozenset(self.fixed),
                               upstream=upstream_of(local.pipeline), audio_path=audio_path(local.pipeline))
        self.metrics = PlannerMetrics(local.pipeline.name)
        self.http = HttpStatusServer(local.host, 0, self.metrics.registry, lambda: True).start()
        self.metrics_url = http_url(local.host, self.http.port, METRICS_PATH)
        self._next = 0.0
        self._in_hand: dict[str, int] = {}   # per replica, the requests it held (queued, running) when last read

    def _in_service(self) -> dict[str, int]:
        counts = {s.name: 0 for s in self.local.pipeline.stages}
        for p in self.local.stages:
            counts[p.stage] += 1
        return counts

    def tick(self) -> None:
        """When an interval has passed, observe, decide and act. The replicas it starts and drains are
        advanced by `LocalPipeline.supervise` (one loop owns every process's life, so each event is seen
        and told once)."""
        now = self.clock()
        if now < self._next:
            return
        self._next = now + self.config.interval_seconds
        self._observe()
        d = self.planner.decide(now)
        self.metrics.record(self.planner, d)
        scales = self.config.scales   # mode Recommend: decisions are printed and exported, nothing is started
        for c in d.changes:
            self.progress(f"planner: {c.stage} {c.before} -> {c.after} replicas{'' if scales else ' recommended'} "
                          f"({c.stage}: {d.figures(c.stage)}; {d.plan.reason})")
        if scales:
            self._reconcile()

    def _observe(self) -> None:
        by_stage: dict[str, dict[str, ReplicaCounters]] = {}
        units: dict[str, str] = {}
        for p in self.local.stages:
            try:
                text = self._read(http_url(self.local.host, p.ports.http, METRICS_PATH))
                counters, unit = replica_counters(text, self.clock())
            except (OSError, http.client.HTTPException, ValueError):
                continue  # a replica that does not answer (or answers half) this time is measured next time
            by_stage.setdefault(p.stage, {})[p.name] = counters
            self._in_hand[p.name] = counters.queued + counters.running
            units[p.stage] = unit or units.get(p.stage, "")
        for stage, counters in by_stage.items():
            self.planner.observe(stage, counters, units.get(stage, ""))
        orch = self.local.orchestrator
        # the targets' measures and the request classes at the front door (not while it restarts)
        if orch is not None and orch.ports is not None:
            try:
                text = self._read(http_url(self.local.host, orch.ports.http, METRICS_PATH))
                buckets, classes, audio = orchestrator_buckets(text), orchestrator_classes(text), \
                    orchestrator_counters(text)
                jobs = orchestrator_jobs(text)
            except (OSError, http.client.HTTPException, ValueError):
                return
            self.planner.observe_orchestrators({orch.name: buckets}, self.clock())
            self.planner.observe_classes({orch.name: classes}, self.clock())
            self.planner.observe_audio({orch.name: audio}, self.clock())
            if jobs is not None:   # an orchestrator with a job store (serve gives a video pipeline one)
                self.planner.observe_jobs({orch.name: jobs}, self.clock())

    @staticmethod
    def _read(url: str) -> str:
        with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as r:
            return r.read().decode()

    def _reconcile(self) -> None:
        """Start or drain replicas until each stage runs what the planner wants (starting ones count)."""
        for stage, want in self.planner.desired().items():  # GPU stages are planned at what they run
            have = sum(p.stage == stage for p in [*self.local.stages, *self.local.starting])
            for _ in range(want - have):
                try:
                    p = self.local.add_replica(stage)
                except LaunchError as e:
                    self.progress(f"planner: {e}")
                    break
                self.progress(f"  {p.name}: starting (pid {p.popen.pid})")
            for _ in range(have - want):  # a replica still starting goes first: it serves nothing yet
                p = self.local.cancel_starting(stage)
                if p is not None:
                    self.progress(f"  {p.name}: no longer needed while starting, stopped")
                    continue
                p = self.local.drain_replica(stage)
                if p is None:
                    break
                held = self._in_hand.pop(p.name, None)  # read this interval, just before the decision
                self.progress(f"  {p.name}: out of service, draining"
                              + (f" (holding {held} request{'s' if held != 1 else ''})" if held is not None else ""))

    def close(self) -> None:
        self.http.stop()
