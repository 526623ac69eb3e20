"""Request classes in the planner: the front door's admissions per class and each class's demand per stage,
so a shift in the request mix reaches the stage it loads before that stage's own counters show it."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from omnistage.api.model import Autoscaling, AutoscalingBudget, AutoscalingTargets, StageAutoscaling
from omnistage.planner.classes import DEMAND_MEMORY, MIN_FINISHED, ClassCounts, ClassDemand, counted, demand, forecast
from omnistage.planner.controller import Planner
from omnistage.planner.load import ReplicaCounters
from omnistage.planner.metrics import PlannerMetrics
from omnistage.planner.scrape import orchestrator_classes
from orchestrator_service.metrics import OrchestratorMetrics

CHAIN = {"thinker": (), "talker": ("thinker",), "code2wav": ("talker",)}
SPEECH, TEXT = "text->text+audio", "text->text"


def counts(admitted=None, finished=None, served=None, units=None, ended=None) -> ClassCounts:
    return ClassCounts(admitted or {}, finished or {}, served or {}, units or {}, ended or {})


# ------------------------------------------------------------------------------------ counting


@pytest.mark.parametrize("name, before, after, admitted", [
    ("two replicas: their counts added", {"a": counts({SPEECH: 4}), "b": counts({SPEECH: 1})},
     {"a": counts({SPEECH: 10}), "b": counts({SPEECH: 3, TEXT: 2})}, {SPEECH: 8, TEXT: 2}),
    ("a replica not read before (new, or its scrape failed): its history is not the window's",
     {"a": counts({SPEECH: 4})}, {"a": counts({SPEECH: 6}), "b": counts({SPEECH: 500})}, {SPEECH: 2}),
    ("a replica not read now: the others still count", {"a": counts({SPEECH: 4}), "b": counts({SPEECH: 9})},
     {"a": counts({SPEECH: 6})}, {SPEECH: 2}),
    ("a replica that restarted (a counter went back) adds nothing",
     {"a": counts({SPEECH: 40}), "b": counts({SPEECH: 1})}, {"a": counts({SPEECH: 3}), "b": counts({SPEECH: 2})},
     {SPEECH: 1}),
])
def test_what_the_orchestrators_counted_between_two_readings(name, before, after, admitted):
    assert counted(before, after).admitted == admitted, name


def test_a_class_demand_is_its_finished_requests_work_per_stage_including_those_a_stage_did_not_serve():
    # 10 speech requests finished: all served by the Thinker (24 tokens each) and the Talker (120 frames),
    # 8 by Code2Wav (2 stopped before it)
    d = counts(finished={SPEECH: 10}, served={(SPEECH, "thinker"): 10, (SPEECH, "talker"): 10,
                                              (SPEECH, "code2wav"): 8},
               units={(SPEECH, "thinker"): 240, (SPEECH, "talker"): 1200, (SPEECH, "code2wav"): 960})
    got = demand({}, d)[SPEECH]
    assert got.finished == 10 and got.known
    assert got.units == pytest.approx({"thinker": 24, "talker": 120, "code2wav": 96})
    assert got.reach == pytest.approx({"thinker": 1.0, "talker": 1.0, "code2wav": 0.8})
    # the next requests were longer: smoothed, not taken as they are, by as much as their number says
    d2 = counts(finished={SPEECH: 5}, served={(SPEECH, "thinker"): 5}, units={(SPEECH, "thinker"): 200})
    again = demand({SPEECH: got}, d2)[SPEECH]
    keep = DEMAND_MEMORY ** 5
    assert again.finished == 15
    assert again.units["thinker"] == pytest.approx(keep * 24 + (1 - keep) * 40)
    # a stage none of the window's requests reached reads 0 for them: the average moves towards 0
    assert again.units["talker"] == pytest.approx(keep * 120)
    # one request moves it less than five
    one = demand({SPEECH: got}, counts(finished={SPEECH: 1}, served={(SPEECH, "thinker"): 1},
                                       units={(SPEECH, "thinker"): 40}))[SPEECH]
    assert 24 < one.units["thinker"] < again.units["thinker"]
    # a window in which no request of a class finished leaves its demand as it was
    assert demand({SPEECH: got}, counts(admitted={SPEECH: 3}))[SPEECH] == got


def test_requests_that_did_not_finish_count_no_work_so_admissions_are_not_charged_for_it():
    # 10 speech requests ended: 5 finished (24 tokens, 120 frames each), 5 cancelled (a stop string, a client
    # gone): the forecast multiplies admissions by the demand, so the cancelled ones must count 0
    d = counts(finished={SPEECH: 5}, ended={SPEECH: 10},
               served={(SPEECH, "thinker"): 5, (SPEECH, "talker"): 5},
               units={(SPEECH, "thinker"): 120, (SPEECH, "talker"): 600})
    got = demand({}, d)[SPEECH]
    assert got.finished == 5 and got.known
    assert got.units == pytest.approx({"thinker": 12, "talker": 60})
    assert got.reach == pytest.approx({"thinker": 0.5, "talker": 0.5})
    # 20 admitted a second: 10 finish, and they bring the Talker 10 x 120 frames
    fc = forecast({SPEECH: got}, counts(admitted={SPEECH: 20}), 1.0, ["talker"])["talker"]
    assert fc.load == pytest.approx(1200) and fc.requests_per_s == pytest.approx(10)
    # a window in which all that ended were cancelled moves the demand towards none
    assert demand({SPEECH: got}, counts(ended={SPEECH: 5}))[SPEECH].units["talker"] < 60


def test_a_class_is_forecast_from_once_enough_of_its_requests_finished():
    assert not ClassDemand(SPEECH, MIN_FINISHED - 1).known and ClassDemand(SPEECH, MIN_FINISHED).known


def test_the_forecast_is_what_the_admitted_mix_sends_each_stage_at_each_class_demand():
    demands = {SPEECH: ClassDemand(SPEECH, 50, {"thinker": 24, "talker": 120}, {"thinker": 1.0, "talker": 1.0}),
               TEXT: ClassDemand(TEXT, 50, {"thinker": 256, "talker": 0.0}, {"thinker": 1.0, "talker": 0.0}),
               "image->text": ClassDemand("image->text", 2, {"thinker": 999}, {"thinker": 1.0})}   # not known yet
    d = counts(admitted={SPEECH: 30, TEXT: 10, "image->text": 4})
    f = forecast(demands, d, 10.0, ["thinker", "talker"])
    assert f["talker"].admitted == 40   # the unknown class is left out
    assert f["talker"].requests_per_s == pytest.approx(3.0) and f["talker"].load == pytest.approx(360.0)
    assert f["thinker"].requests_per_s == pytest.approx(4.0)
    assert f["thinker"].load == pytest.approx((30 * 24 + 10 * 256) / 10)
    # one kind of request at the Talker: its units vary as a Poisson count of requests of 120 frames
    assert f["talker"].per_count == pytest.approx(120.0)
    # two kinds at the Thinker: the long text answers make its load vary more than its mean request says
    mean = f["thinker"].load * 10 / 40
    assert f["thinker"].per_count == pytest.approx((30 * 24 ** 2 + 10 * 256 ** 2) / (30 * 24 + 10 * 256))
    assert f["thinker"].per_count > mean
    # the binomial spread of which admitted requests reach the Talker (3 of 4) bounds its steady arrivals
    assert 3.0 < f["talker"].arrivals_bound(1.5) < 4.0 and f["thinker"].arrivals_bound(1.5) == pytest.approx(4.0)


def test_the_class_counters_are_read_back_from_an_orchestrators_metrics():
    m = OrchestratorMetrics(CollectorRegistry())
    m.class_requests.labels(SPEECH).inc(3)
    m.class_finished.labels(SPEECH).inc(2)
    m.class_ended.labels(SPEECH).inc(3)
    m.class_stage_requests.labels(SPEECH, "talker").inc(2)
    m.class_stage_units.labels(SPEECH, "talker", "frames").inc(240)
    got = orchestrator_classes(generate_latest(m.registry).decode())
    assert got.admitted == {SPEECH: 3} and got.finished == {SPEECH: 2} and got.ended == {SPEECH: 3}
    assert got.served == {(SPEECH, "talker"): 2} and got.units == {(SPEECH, "talker"): 240}
    assert orchestrator_classes("") == counts()   # an orchestrator without them


# ------------------------------------------------------------------------------------ the planner


def config(budget: int = 12) -> Autoscaling:
    return Autoscaling(enabled=True, targets=AutoscalingTargets(queue_seconds=1.0, utilization=0.8),
                       budget=AutoscalingBudget(max_replicas=budget),
                       stages={s: StageAutoscaling(1, 8, 30.0) for s in CHAIN})


class Pipeline:
    """Thinker -> Talker -> Code2Wav counters advanced by hand, one reading a second: per stage the requests
    that arrive and end (units per request and capacity per replica below), and the front door's counters
    (speech requests take 24 tokens, 120 frames, 120 frames; text requests 256 tokens and stop there)."""

    UNITS = {"thinker": 1.0, "talker": 120.0, "code2wav": 120.0}
    CAPACITY = {"thinker": 400.0, "talker": 200.0, "code2wav": 1000.0}
    DEMAND = {SPEECH: {"thinker": 24.0, "talker": 120.0, "code2wav": 120.0}, TEXT: {"thinker": 256.0}}

    def __init__(self):
        self.t = 0.0
        self.stages = {s: ReplicaCounters(0.0) for s in CHAIN}
        self.front = counts()

    def second(self, planners, admitted: dict[str, float], reaching: dict[str, tuple[float, float]]) -> None:
        """One second: `admitted` per class at the front door, finishing at the same rate; per stage
        (requests, units per request) arriving and ending."""
        self.t += 1.0
        for s, (n, per) in reaching.items():
            c = self.stages[s]
            self.stages[s] = ReplicaCounters(self.t, c.units + n * per, c.busy_seconds + n * per / self.CAPACITY[s],
                                             c.finished + n, 0, 0)
        f = self.front
        adm, fin, served, units = dict(f.admitted), dict(f.finished), dict(f.served), dict(f.units)
        for cls, n in admitted.items():
            adm[cls] = adm.get(cls, 0.0) + n
            fin[cls] = fin.get(cls, 0.0) + n   # and every request that ends finishes
            for s, per in self.DEMAND[cls].items():
                served[(cls, s)] = served.get((cls, s), 0.0) + n
                units[(cls, s)] = units.get((cls, s), 0.0) + n * per
        self.front = ClassCounts(adm, fin, served, units, dict(fin))
        for p, with_classes in planners:
            for s, c in self.stages.items():
                p.observe(s, {f"{s}-0": c}, "units")
            if with_classes:
                p.observe_classes({"orchestrator-0": self.front}, self.t)
            p.decide(self.t)


def reaching(speech: float, text: float, talker_speech: float | None = None) -> dict[str, tuple[float, float]]:
    """Per stage (requests/s, units per request) for a mix; the Talker and Code2Wav may still receive the
    old mix's speech rate (`talker_speech`: the Thinker has not passed the new one on yet)."""
    down = speech if talker_speech is None else talker_speech
    thinker_units = (speech * 24 + text * 256) / (speech + text)
    return {"thinker": (speech + text, thinker_units), "talker": (down, 120.0), "code2wav": (down, 120.0)}


def test_a_shift_to_speech_grows_the_talker_before_its_own_counters_show_it():
    """60 s of a text-heavy mix (0.72 speech and 4.08 text requests a second: the Talker at 86 frames/s, one
    replica), then 90% speech (4.32 a second: 518 frames/s, four replicas at the target). For the next 8 s
    the Talker still receives the old mix's requests (the Thinker's latency). The front door's classes
    grow it within 5 s; its own counters alone cannot until the requests reach it."""
    with_classes = Planner(config(), {s: 1 for s in CHAIN}, upstream=CHAIN)
    alone = Planner(config(), {s: 1 for s in CHAIN}, upstream=CHAIN)
    planners = [(with_classes, True), (alone, False)]
    pipe = Pipeline()
    for _ in range(60):
        pipe.second(planners, {SPEECH: 0.72, TEXT: 4.08}, reaching(0.72, 4.08))
    assert with_classes.desired()["talker"] == alone.desired()["talker"] == 1
    assert with_classes.classes[SPEECH].units == pytest.approx(Pipeline.DEMAND[SPEECH])
    grown_at = None
    for i in range(8):
        pipe.second(planners, {SPEECH: 4.32, TEXT: 0.48}, reaching(4.32, 0.48, talker_speech=0.72))
        if grown_at is None and with_classes.desired()["talker"] > 1:
            grown_at = i + 1
    assert grown_at is not None and grown_at <= 5, with_classes.estimates["talker"]
    assert alone.desired()["talker"] == 1
    d = with_classes.decide(pipe.t)
    assert d.forecast["talker"] > d.estimates["talker"].load
    assert "on their way from the front door's request mix" in d.figures("talker")
    m = PlannerMetrics("p")
    m.record(with_classes, d)
    text = generate_latest(m.registry).decode()
    exported = re.search(rf'omnistage_planner_class_demand{{class="{re.escape(SPEECH)}",'
                         rf'pipeline="p",stage="talker"}} (\S+)', text)
    assert exported and float(exported.group(1)) == pytest.approx(120.0)
    assert 'omnistage_planner_forecast_load{pipeline="p",stage="talker"}' in text
    # no orchestrator answers from now on: once the last reading is a window old, what they admitted
    # then forecasts nothing (it would hold the Talker's replicas up)
    for _ in range(int(with_classes.window_s) + 1):
        pipe.second([(with_classes, False)], {SPEECH: 4.32, TEXT: 0.48}, reaching(4.32, 0.48))
    assert with_classes.decide(pipe.t).forecast == {}


@settings(max_examples=25, deadline=None)
@given(mixes=st.lists(st.tuples(st.floats(0.0, 6.0), st.floats(0.0, 6.0), st.floats(0.0, 1.0)),
                      min_size=3, max_size=6),
       seconds=st.integers(3, 15))
def test_the_classes_only_ever_add_replicas(mixes, seconds):
    """Whatever the mix and however far the stages lag it, a planner that reads the front door's classes
    plans no stage fewer replicas than one that reads the stages alone while the budget does not bind
    (under a binding budget a stage the forecast grows takes the next replica from another)."""
    with_classes = Planner(config(budget=100), {s: 1 for s in CHAIN}, upstream=CHAIN)
    alone = Planner(config(budget=100), {s: 1 for s in CHAIN}, upstream=CHAIN)
    pipe = Pipeline()
    for speech, text, lag in mixes:
        for _ in range(seconds):
            if speech + text <= 0:
                pipe.second([(with_classes, True), (alone, False)], {}, {})
                continue
            pipe.second([(with_classes, True), (alone, False)], {SPEECH: speech, TEXT: text},
                        reaching(speech, text, talker_speech=speech * lag))
            got, base = with_classes.desired(), alone.desired()
            assert all(got[s] >= base[s] for s in CHAIN), (got, base)
