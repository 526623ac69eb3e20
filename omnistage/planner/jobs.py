"""Queued jobs in the planner: work that waits in the job store (/v1/videos) before it reaches any stage.

A durable job waits in the store until an orchestrator replica has a free job slot (`jobs.concurrency`), and
only then enters the pipeline as a request. While it waits no stage counts it: their queues are empty. So the
orchestrators export the jobs queued in the store (scrape.JOBS_QUEUED: every replica counts the same store,
so the readings are not summed), their job slots (scrape.JOBS_SLOTS) and the jobs they run (scrape.JOBS_RUNNING),
both summed over the replicas. At most as many jobs run at once as there are slots: a queued job reaches the
pipeline only through a free slot. So the planner adds to each stage, as backlog like the stage's own queue,
only the jobs the free slots take now (`jobs_entering`): their work at the stage spread over the drain time
(load.drain_seconds), and at most one replica per job (a job's request runs on one replica at a time, so more
would idle). With every slot busy none is added: the jobs in flight are in the stages' own counts, and a stage
that keeps up with them would gain nothing from more replicas until a slot frees.

A queued job's work at a stage is what a job of its kind takes there: the demand of the request classes whose
outputs are the job's modality (classes.py: "text->video"), weighted by how many of each finished; before
such a class is known, the average request's (graph.demand_per_request), which in a video pipeline is a
video request's. Its work is large where the job's time goes: the denoise loop of a video pipeline takes
its steps at every latent frame, the text encoder one pass; so the backlog sizes the bottleneck stage up and
leaves the light ones as they are.

Pure: numbers in, numbers out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from omnistage.api.model import JOBS_MODALITY
from omnistage.planner.classes import ClassDemand
from omnistage.planner.load import drain_seconds


@dataclass(frozen=True)
class JobsReading:
    """The job gauges of an orchestrator replica (scrape.orchestrator_jobs), or of all of them merged."""

    queued: float          # jobs queued in the job store, as the replica last counted them
    slots: float = 0.0     # jobs it runs at once at most (--jobs-concurrency; 0: it runs none)
    running: float = 0.0   # jobs it runs now


def merged_jobs(readings: Iterable[JobsReading]) -> JobsReading:
    """The replicas' readings as one: the one store's queue (the largest count stands: they count alike, some a
    little later), the slots and the running jobs summed."""
    rs = list(readings)
    return JobsReading(max((r.queued for r in rs), default=0.0), sum(r.slots for r in rs), sum(r.running for r in rs))


def jobs_entering(reading: JobsReading) -> float:
    """How many queued jobs the free job slots take into the pipeline now."""
    return max(min(reading.queued, reading.slots - reading.running), 0.0)


def job_classes(classes: Iterable[str], modality: str = JOBS_MODALITY) -> list[str]:
    """The request classes ("<inputs>-><outputs>", orchestrator_service/request_class.py) whose outputs include
    the jobs' modality."""
    return [c for c in classes if modality in c.partition("->")[2].split("+")]


def job_demand(classes: Mapping[str, ClassDemand], average: Mapping[str, float],
               modality: str = JOBS_MODALITY) -> dict[str, float]:
    """Per stage, the work units one queued job takes there: the known job classes' demand, weighted by their
    finished requests; none known yet: `average` (the pipeline's average request, graph.demand_per_request)."""
    known = [classes[c] for c in job_classes(classes, modality) if classes[c].known]
    total = sum(d.finished for d in known)
    if not known or total <= 0:
        return dict(average)
    stages = {s for d in known for s in d.units}
    return {s: sum(d.finished * d.units.get(s, 0.0) for d in known) / total for s in stages}


def jobs_backlog(entering: float, demand: Mapping[str, float], queue_seconds: float,
                 per_replica: Mapping[str, float]) -> dict[str, float]:
    """Per stage, work units per second of `entering` jobs taking `demand` units each, spread over the drain
    time (the stage's backlog term, load.offered_parts), at most what `entering` replicas serve (`per_replica`,
    units per second; a backlog is planned at full utilisation): one job's request runs on one replica at a
    time. A stage
    without a `per_replica` figure (capacity not measured yet) gets none."""
    if entering <= 0:
        return {}
    drain = drain_seconds(queue_seconds)
    return {s: min(entering * units / drain, entering * per_replica[s]) for s, units in demand.items()
            if units > 0 and per_replica.get(s, 0.0) > 0}
