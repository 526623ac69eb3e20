"""Queued jobs as a planner input: the jobs waiting in the job store size up the stage a video job spends its
time in (the denoise loop), and leave the light stages as they are."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from omnistage.planner.classes import MIN_FINISHED, ClassCounts, ClassDemand
from omnistage.planner.controller import Planner
from omnistage.planner.jobs import JobsReading, job_classes, job_demand, jobs_backlog, jobs_entering
from omnistage.planner.load import MIN_DRAIN_S
from omnistage.planner.scrape import (
    JOBS_QUEUED,
    JOBS_RUNNING,
    JOBS_SLOTS,
    orchestrator_jobs,
    orchestrator_jobs_queued,
)

from .test_planner_controller import Replicas, config

# A text-to-video pipeline as the planner sees it: units per request and per busy second of one replica. The
# denoise loop takes 40 steps a job at 40 steps/s; the text encoder one pass, the VAE 21 frames at 100/s.
VIDEO = {"text-encoder": (50.0, 1.0), "denoise": (40.0, 40.0), "vae-decode": (100.0, 21.0)}
UPSTREAM = {"text-encoder": (), "denoise": ("text-encoder",), "vae-decode": ("denoise",)}
# The runners hand the pipeline this many jobs a second: all their job slots busy, each job's time mostly out of
# the denoise loop (the VAE, the muxing), which runs at half its capacity, under the 0.8 target.
JOBS_PER_S = 0.5
# Two orchestrator replicas of two job slots each (--jobs-concurrency 2), every slot busy (the feed above).
BUSY = {"orch-0": (2.0, 2.0), "orch-1": (2.0, 2.0)}


def run(queued: float | None, seconds: float = 30.0, jobs_from: float = 10.0,
        slots: dict[str, tuple[float, float]] = BUSY) -> tuple[Planner, object]:
    """The planner over `seconds` of the runners' steady feed; from `jobs_from` on, `queued` jobs wait in the
    store (None: no job store reading at all), each orchestrator replica with its (slots, running) jobs."""
    planner = Planner(config(**{"text-encoder": (1, 8, 10.0), "denoise": (1, 8, 10.0), "vae-decode": (1, 8, 10.0)}),
                      dict.fromkeys(VIDEO, 1), upstream=UPSTREAM)
    stages = {s: Replicas(capacity, per_request) for s, (capacity, per_request) in VIDEO.items()}
    decision = None
    for tick in range(int(seconds / 0.5)):
        now = tick * 0.5
        for stage, reps in stages.items():
            names = [f"{stage}-{i}" for i in range(planner.desired()[stage])]
            planner.observe(stage, reps.run(names, now, 0.5, JOBS_PER_S * reps.per_request), "units")
        if queued is not None and now >= jobs_from:   # every orchestrator replica counts the one store
            readings = {r: JobsReading(queued - i, n, busy) for i, (r, (n, busy)) in enumerate(slots.items())}
            planner.observe_jobs(readings, now)
        decision = planner.decide(now)
    return planner, decision


def test_jobs_the_busy_slots_keep_out_of_the_pipeline_grow_nothing():
    calm, _ = run(None)
    assert calm.desired() == {"text-encoder": 1, "denoise": 1, "vae-decode": 1}
    # 60 jobs wait, but every job slot is busy and the denoise loop keeps up with what they hand it: more
    # replicas would idle until a slot frees, and then the stage's own flow shows the job that enters
    waiting, d = run(60.0)
    assert waiting.desired() == {"text-encoder": 1, "denoise": 1, "vae-decode": 1}
    assert d.jobs == {}


def test_queued_jobs_free_slots_take_size_up_the_denoise_stage_only():
    # a new orchestrator replica with 24 free slots: 24 of the 60 queued jobs enter the pipeline at once
    waiting, d = run(60.0, slots={**BUSY, "orch-2": (24.0, 0.0)})
    # 24 jobs of 40 steps over the 30 s drain time: 32 steps/s on top of the 20 arriving, at 40 a replica
    assert waiting.desired() == {"text-encoder": 1, "denoise": 2, "vae-decode": 1}
    assert d.plan.bottleneck == "denoise"
    assert "60 jobs queued, 24 entering free job slots" in d.plan.reason
    assert d.jobs["denoise"] == pytest.approx(24 * 40 / MIN_DRAIN_S, rel=0.05)
    assert "queued jobs" in d.figures("denoise")


def test_jobs_grow_a_stage_no_more_than_their_requests_need():
    # jobs of 4000 steps each (100 s on one replica of 40 steps/s): 2 entering take at most one replica each
    assert jobs_backlog(2, {"denoise": 4000.0}, 1.0, {"denoise": 40.0}) == {"denoise": 2 * 40.0}
    assert jobs_entering(JobsReading(60, slots=4, running=2)) == 2
    assert jobs_entering(JobsReading(1, slots=4, running=2)) == 1
    assert jobs_entering(JobsReading(60, slots=4, running=4)) == 0   # all busy: none can enter
    assert jobs_entering(JobsReading(60)) == 0   # a replica with no slots (no store, concurrency 0) runs none


def test_jobs_of_a_stage_the_planner_does_not_know_are_left_out():
    # an orchestrator still counts a stage renamed by a rollout ("denoise-old"): its jobs' work there is no stage's
    planner = Planner(config(denoise=(1, 8, 10.0)), {"denoise": 1})
    reps = Replicas(40.0, 40.0)
    old = ClassCounts(finished={"text->video": 0.0}, units={("text->video", "denoise-old"): 0.0})
    new = ClassCounts(finished={"text->video": MIN_FINISHED * 2.0},
                      served={("text->video", "denoise-old"): MIN_FINISHED * 2.0,
                              ("text->video", "denoise"): MIN_FINISHED * 2.0},
                      units={("text->video", "denoise-old"): MIN_FINISHED * 80.0,
                             ("text->video", "denoise"): MIN_FINISHED * 80.0})
    d = None
    for tick in range(30):
        now = tick * 0.5
        planner.observe("denoise", reps.run(["denoise-0"], now, 0.5, 20.0), "units")
        planner.observe_classes({"orch-0": old if tick < 10 else new}, now)
        planner.observe_jobs({"orch-0": JobsReading(30, slots=8, running=0)}, now)
        d = planner.decide(now)
    assert d is not None and "denoise-old" not in d.jobs and d.jobs["denoise"] > 0


def test_a_stale_jobs_reading_counts_nothing():
    planner, _ = run(60.0, seconds=14.0, slots={**BUSY, "orch-2": (24.0, 0.0)})
    assert planner.desired()["denoise"] > 1
    d = planner.decide(14.0 + 60.0)   # no orchestrator answered for a minute: the reading says nothing of now
    assert d.jobs == {}


def test_jobs_gauge_read_from_an_orchestrators_metrics():
    text = f"# TYPE {JOBS_QUEUED} gauge\n{JOBS_QUEUED} 7.0\n"
    assert orchestrator_jobs_queued(text) == 7.0
    assert orchestrator_jobs(text) == JobsReading(7.0, 0.0, 0.0)   # no slots exported: it runs no jobs
    assert orchestrator_jobs(jobs_exposition(7, slots=2, running=1)) == JobsReading(7.0, 2.0, 1.0)
    assert orchestrator_jobs_queued("# TYPE omnistage_audio_chunks counter\nomnistage_audio_chunks_total 3\n") is None


def test_a_queued_jobs_work_is_its_video_classes_demand():
    video = ClassDemand("text->video", MIN_FINISHED * 3, {"text-encoder": 1.0, "denoise": 50.0, "vae-decode": 21.0})
    i2v = ClassDemand("text+image->video", MIN_FINISHED, {"text-encoder": 1.0, "denoise": 30.0, "vae-decode": 21.0})
    image = ClassDemand("text->image", 100.0, {"text-encoder": 1.0, "denoise": 5.0})
    classes = {c.cls: c for c in (video, i2v, image)}
    assert job_classes(classes) == ["text->video", "text+image->video"]
    # weighted by the finished requests of each video class; the image class counts nothing
    assert job_demand(classes, {"denoise": 999.0})["denoise"] == pytest.approx((3 * 50 + 30) / 4)
    # before a video class is known, the average request's
    unknown = {"text->video": ClassDemand("text->video", MIN_FINISHED - 1, {"denoise": 50.0})}
    assert job_demand(unknown, {"denoise": 44.0}) == {"denoise": 44.0}


def test_jobs_backlog_spreads_their_work_over_the_drain_time():
    per_replica = {"denoise": 1000.0, "text-encoder": 1000.0}
    assert jobs_backlog(30, {"denoise": 40.0, "text-encoder": 0.0}, 1.0, per_replica) == \
        {"denoise": 30 * 40 / MIN_DRAIN_S}
    assert jobs_backlog(30, {"denoise": 40.0}, 2 * MIN_DRAIN_S, per_replica) == \
        {"denoise": 30 * 40 / (2 * MIN_DRAIN_S)}
    assert jobs_backlog(0, {"denoise": 40.0}, 1.0, per_replica) == {}
    assert jobs_backlog(30, {"denoise": 40.0}, 1.0, {}) == {}   # a stage without a measured capacity: none


# ------------------------------------------------------------------------------ both scrapers

def jobs_exposition(queued: float, slots: float = 2, running: float = 2) -> str:
    """An orchestrator's /metrics with the job gauges (what orchestrator_service/metrics.py serves)."""
    registry = CollectorRegistry()
    Gauge(JOBS_QUEUED, "Jobs queued in the job store", registry=registry).set(queued)
    Gauge(JOBS_SLOTS, "Jobs this replica runs at once at most", registry=registry).set(slots)
    Gauge(JOBS_RUNNING, "Jobs this replica runs now", registry=registry).set(running)
    return generate_latest(registry).decode()


class Recording(Planner):
    """The real planner, keeping what the scrape handed it."""

    jobs_readings: dict | None = None

    def observe_jobs(self, readings, at):
        self.jobs_readings = dict(readings)
        super().observe_jobs(readings, at)


def test_the_operator_reads_each_orchestrators_queued_jobs():
    from omnistage_operator.autoscaler import Autoscaler
    from omnistage_operator.planning import Plans

    from .test_operator_planning import pod

    texts = {"orch-a": jobs_exposition(12), "orch-b": jobs_exposition(11), "old": ""}   # "old": no job store
    planner = Recording(config(denoise=(1, 4, 10.0)), {"denoise": 1})
    autoscaler = Autoscaler(None, Plans(), lambda target: texts[target.pod], clock=lambda: 0.0)
    try:
        autoscaler._observe(planner, [pod(n, component="orchestrator") for n in texts])
    finally:
        autoscaler.close()
    assert planner.jobs_readings == {"orch-a": JobsReading(12.0, 2.0, 2.0), "orch-b": JobsReading(11.0, 2.0, 2.0)}


def test_serve_reads_its_orchestrators_queued_jobs(tmp_path):
    from omnistage.api import parse_pipeline
    from omnistage.contract.launch import ReadyPorts
    from omnistage.local.autoscale import LocalAutoscaler
    from omnistage.local.serve import Proc
    from omnistage.serving import HttpStatusServer

    from .test_operator_jobs import video_doc

    registry = CollectorRegistry()
    Gauge(JOBS_QUEUED, "Jobs queued in the job store", registry=registry).set(5)
    Gauge(JOBS_SLOTS, "Jobs this replica runs at once at most", registry=registry).set(2)
    status = HttpStatusServer("127.0.0.1", 0, registry, lambda: True).start()
    orch = Proc("orchestrator", [], tmp_path / "o.log", tmp_path / "o.ready", ports=ReadyPorts(1, status.port))
    doc = video_doc()
    doc["spec"]["deployment"]["autoscaling"] = {"enabled": True}
    local = SimpleNamespace(pipeline=parse_pipeline(doc), stages=[], starting=[], host="127.0.0.1",
                            orchestrator=orch)
    autoscaler = LocalAutoscaler(local, progress=lambda m: None, clock=lambda: 0.0)   # type: ignore[arg-type]
    autoscaler.planner = Recording(autoscaler.config, {s.name: 1 for s in local.pipeline.stages})
    try:
        autoscaler._observe()
    finally:
        autoscaler.close()
        status.stop()
    assert autoscaler.planner.jobs_readings == {"orchestrator": JobsReading(5.0, 2.0, 0.0)}
