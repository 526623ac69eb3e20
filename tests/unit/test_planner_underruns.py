"""Audio underruns as a planner input (targets.underruns): the orchestrator counts every audio chunk it delivers
and the late ones apart, the planner reads both from its real metrics text, takes their share over the window
(per orchestrator replica, a restart counting from zero), and while the share is over the target presses the
busiest growable stage on the audio path only: a stage that never feeds the audio never grows for it. The
target is validated by field path and carried by the CRD; the operator's scrape and graph hand it over."""

from __future__ import annotations

import copy

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from omnistage.api import SpecError, parse_pipeline, validate
from omnistage.api.crd import crd
from omnistage.api.model import Autoscaling, AutoscalingTargets, StageAutoscaling
from omnistage.contract.launch import ReadyPorts
from omnistage.local.autoscale import LocalAutoscaler
from omnistage.local.serve import LocalPipeline, Proc
from omnistage.planner.controller import Planner
from omnistage.planner.graph import audio_path, feeding
from omnistage.planner.latency import MAX_PRESSURE, MIN_CHUNKS, counted_since, underrun_pressure, underruns_missed
from omnistage.planner.load import ReplicaCounters
from omnistage.planner.scrape import AUDIO_CHUNKS, AUDIO_UNDERRUNS, orchestrator_buckets, orchestrator_counters
from omnistage.serving import HttpStatusServer
from omnistage_operator.autoscaler import Autoscaler
from omnistage_operator.planning import Plans
from orchestrator_service.metrics import OrchestratorMetrics
from orchestrator_service.playback import Playback

from ..conftest import EXAMPLES
from .test_operator_planning import StillKube, doc, pod

AUTO = "spec.deployment.autoscaling"


def example(name: str):
    return parse_pipeline(yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text()))


def counts(late: float, chunks: float) -> dict[str, float]:
    return {AUDIO_UNDERRUNS: late, AUDIO_CHUNKS: chunks}


# ------------------------------------------------------------------------------ the pressure

@pytest.mark.parametrize("target, late, chunks, want", [
    (0.0, 500, 1000, 1.0),                     # no target: underruns are not looked at
    (0.01, 50, MIN_CHUNKS - 1, 1.0),           # too few chunks to say
    (0.01, 0, 1000, 1.0),
    (0.01, 10, 1000, 1.0),                     # met at the target
    (0.01, 15, 1000, 1.5),
    (0.01, 2, MIN_CHUNKS, 2.0),                # the fewest chunks that say anything
    (0.01, 500, 1000, MAX_PRESSURE),           # capped
    (1.0, 1000, 1000, 1.0),                    # every chunk late allowed: never missed
])
def test_underrun_pressure_table(target, late, chunks, want):
    assert underrun_pressure(target, late, chunks) == pytest.approx(want)


@given(st.floats(0.001, 1.0), st.integers(0, 5000), st.integers(0, 5000), st.integers(0, 5000))
def test_underrun_pressure_is_monotone_in_the_late_chunks_capped_and_1_when_met(target, late, more, chunks):
    late, chunks = min(late, chunks), max(chunks, 1)
    f = underrun_pressure(target, late, chunks)
    assert 1.0 <= f <= MAX_PRESSURE
    assert (f > 1.0) == (chunks >= MIN_CHUNKS and late / chunks > target)
    assert underrun_pressure(target, min(late + more, chunks), chunks) >= f


def test_a_miss_is_told_as_a_share_and_a_met_target_says_nothing():
    targets = AutoscalingTargets(underruns=0.02)
    assert underruns_missed(targets, counts(30, 1000)) == (
        pytest.approx(1.5), "underruns 3.0% of 1000 audio chunks over the 2.0% target")
    assert underruns_missed(targets, counts(20, 1000)) == (1.0, "")
    assert underruns_missed(targets, {}) == (1.0, "")                       # no orchestrator read
    assert underruns_missed(AutoscalingTargets(), counts(900, 1000)) == (1.0, "")   # no target


# ----------------------------------------------------------------------- counter deltas, resets

@pytest.mark.parametrize("readings, want", [
    ([], {}),
    ([{"o": counts(1, 10)}], {}),                                                          # one reading: nothing
    ([{"o": counts(1, 10)}, {"o": counts(4, 110)}], {AUDIO_UNDERRUNS: 3.0, AUDIO_CHUNKS: 100.0}),
    # restarted between the readings: it counted from zero, its newest values are what it counted since
    ([{"o": counts(0, 10000)}, {"o": counts(60, 200)}], {AUDIO_UNDERRUNS: 60.0, AUDIO_CHUNKS: 200.0}),
    # restarted inside the window and past its old totals by the newest reading: each step's increase counts
    # (the oldest and newest alone, 0/100 -> 3/400, would read 3 of 300)
    ([{"o": counts(0, 100)}, {"o": counts(5, 300)}, {"o": counts(1, 50)}, {"o": counts(3, 400)}],
     {AUDIO_UNDERRUNS: 8.0, AUDIO_CHUNKS: 600.0}),
    # two replicas, one restarted: the other's counts stand
    ([{"a": counts(5, 500), "b": counts(0, 9000)}, {"a": counts(7, 600), "b": counts(1, 50)}],
     {AUDIO_UNDERRUNS: 3.0, AUDIO_CHUNKS: 150.0}),
    # a replica missing from the oldest reading (its scrape failed) is counted from the oldest that holds it,
    # and is not read as the others' restart
    ([{"a": counts(0, 100)}, {"a": counts(1, 200), "b": counts(10, 5000)},
      {"a": counts(2, 300), "b": counts(12, 5100)}], {AUDIO_UNDERRUNS: 4.0, AUDIO_CHUNKS: 300.0}),
    # one gone in the newest reading adds nothing, and a new one seen once adds nothing yet
    ([{"a": counts(0, 100), "b": counts(0, 100)}, {"a": counts(1, 300), "c": counts(9, 90)}],
     {AUDIO_UNDERRUNS: 1.0, AUDIO_CHUNKS: 200.0}),
])
def test_counted_since_table(readings, want):
    assert counted_since(readings) == want


# ------------------------------------------------------------------- the orchestrator's counters

def test_the_orchestrator_counts_each_chunk_and_the_late_ones_and_the_planner_reads_them():
    m = OrchestratorMetrics(CollectorRegistry())
    playback = Playback()
    # 1 s chunks: the third arrives after the first two finished playing (at 2.0), the rest keep ahead
    for at in (0.0, 0.5, 2.5, 3.0, 3.2):
        m.observe_audio_chunk(playback.arrived(at, 1.0))
    got = orchestrator_counters(generate_latest(m.registry).decode())
    assert got == {AUDIO_CHUNKS: 5.0, AUDIO_UNDERRUNS: 1.0}
    assert orchestrator_counters("") == {AUDIO_CHUNKS: 0.0, AUDIO_UNDERRUNS: 0.0}   # one without them


# ------------------------------------------------------------------------------ the audio path

@pytest.mark.parametrize("name, want", [
    ("qwen3-omni-tiny", {"thinker", "talker", "code2wav"}),
    ("qwen3-omni-encoders-tiny", {"encoder", "thinker", "talker", "code2wav"}),
    ("llm-tiny", set()),                       # text out only
    ("text-to-image-tiny", set()),             # an image is not played
])
def test_the_audio_path_of_the_examples(name, want):
    assert audio_path(example(name)) == want


def test_feeding_is_the_stages_and_everything_upstream_of_them():
    up = {"thinker": (), "talker": ("thinker",), "code2wav": ("talker",), "captioner": ("thinker",),
          "mixer": ("code2wav", "captioner")}
    assert feeding(up, ["code2wav"]) == {"thinker", "talker", "code2wav"}
    assert feeding(up, ["mixer"]) == set(up)
    assert feeding(up, []) == set()


# ------------------------------------------------------------------------------ the controller

# A pipeline whose Thinker feeds both the speech stages and a text-only captioner (off the audio path).
GRAPH = {"thinker": (), "talker": ("thinker",), "code2wav": ("talker",), "captioner": ("thinker",)}
SPEECH = frozenset({"thinker", "talker", "code2wav"})
# busy seconds per second of each stage's one replica: the captioner the busiest, all under the 0.8 target
BUSY = {"thinker": 0.3, "talker": 0.5, "code2wav": 0.2, "captioner": 0.7}


def planner(underruns=0.0, ttfp_ms=0.0, path=SPEECH) -> Planner:
    auto = Autoscaling(enabled=True, targets=AutoscalingTargets(ttfp_p95_ms=ttfp_ms, underruns=underruns),
                       stages={s: StageAutoscaling(1, 4, 0.0) for s in GRAPH})
    return Planner(auto, dict.fromkeys(GRAPH, 1), upstream=GRAPH, audio_path=path)


def drive(p: Planner, late_per_s: float, chunks_per_s: float = 40.0, seconds: int = 12, first_packet_ms=100.0,
          restart_at: int | None = None):
    """Every stage at its BUSY utilisation; the orchestrator delivering `chunks_per_s` audio chunks, of them
    `late_per_s` late, and answering first packets in `first_packet_ms`; with `restart_at`, it restarts then
    (its counters from zero). Its counters and histograms are read back from its real metrics text."""
    orch = OrchestratorMetrics(CollectorRegistry())
    units = dict.fromkeys(GRAPH, 0.0)
    for t in range(seconds + 1):
        if t == restart_at:
            orch = OrchestratorMetrics(CollectorRegistry())
        for stage in GRAPH:
            p.observe(stage, {f"{stage}-0": ReplicaCounters(float(t), units[stage], t * BUSY[stage], t * 2.0, 0, 1,
                                                            steps=t * 10.0)}, "frames")
            units[stage] += 50.0
        text = generate_latest(orch.registry).decode()
        p.observe_audio({"orch-0": orchestrator_counters(text)}, float(t))
        p.observe_orchestrators({"orch-0": orchestrator_buckets(text)}, float(t))
        for i in range(int(chunks_per_s)):
            orch.observe_audio_chunk(i < late_per_s)
        for _ in range(4):
            orch.first_output_seconds.observe(first_packet_ms / 1e3)
    return p.decide(float(seconds))


def grown(d) -> list[tuple[str, int]]:
    return [(c.stage, c.after) for c in d.changes]


def test_underruns_over_the_target_grow_the_busiest_stage_on_the_audio_path_not_the_busiest_overall():
    d = drive(planner(underruns=0.01), late_per_s=4.0)     # 10% late against 1%
    assert grown(d) == [("talker", 2)]                     # the captioner, busier, is off the audio path
    assert d.plan.reason.endswith("; underruns 10.0% of 400 audio chunks over the 1.0% target: talker planned at "
                                  "2.00x its load")


def test_a_text_only_stage_never_grows_for_underruns():
    # only the captioner may still grow: every stage on the audio path is at its maximum
    auto = Autoscaling(enabled=True, targets=AutoscalingTargets(underruns=0.01),
                       stages={s: StageAutoscaling(1, 1 if s in SPEECH else 4, 0.0) for s in GRAPH})
    d = drive(Planner(auto, dict.fromkeys(GRAPH, 1), upstream=GRAPH, audio_path=SPEECH), late_per_s=20.0)
    assert grown(d) == [] and "underruns" not in d.plan.reason
    # a pipeline without audio out has no audio path: nothing is pressed whatever is counted
    d = drive(planner(underruns=0.01, path=frozenset()), late_per_s=20.0)
    assert grown(d) == [] and "underruns" not in d.plan.reason


@pytest.mark.parametrize("target, late_per_s, chunks_per_s", [
    (0.0, 20.0, 40.0),        # no target
    (0.05, 1.0, 40.0),        # 2.5% late: met
    (0.01, 4.0, 8.0),         # 50% late, but 96 chunks over the window: too few to say
])
def test_nothing_grows_for_underruns_met_unset_or_too_few_to_say(target, late_per_s, chunks_per_s):
    d = drive(planner(underruns=target), late_per_s, chunks_per_s)
    assert grown(d) == [] and "underruns" not in d.plan.reason


def test_an_orchestrator_restart_counts_from_zero_not_as_a_drop():
    # 10000 chunks, none late, before the restart; after it, 40 a second of which 10 late. Read as one running
    # count the window would hold a negative number of chunks and never press; from zero it is 25% late.
    p = planner(underruns=0.01)
    orch = OrchestratorMetrics(CollectorRegistry())
    for _ in range(10000):
        orch.observe_audio_chunk(False)
    p.observe_audio({"orch-0": orchestrator_counters(generate_latest(orch.registry).decode())}, 0.0)
    d = drive(p, late_per_s=10.0, seconds=12)
    assert grown(d) == [("talker", 2)] and "underruns 25.0% of" in d.plan.reason


def test_underrun_counts_read_before_the_orchestrators_stopped_answering_press_no_more_once_a_window_old():
    p = planner(underruns=0.01)
    assert "underruns" in drive(p, late_per_s=4.0).plan.reason
    assert "underruns" not in p.decide(12.0 + p.window_s + 1).plan.reason


def test_a_latency_miss_and_underruns_press_their_own_stages_and_one_stage_once():
    # first packets late: the busiest stage overall (the captioner); underruns: the busiest on the audio path
    d = drive(planner(underruns=0.01, ttfp_ms=50), late_per_s=4.0, first_packet_ms=1000.0)
    assert sorted(grown(d)) == [("captioner", 2), ("talker", 2)]
    assert "first packet p95 1000 ms over the 50 ms target: captioner planned at 2.00x its load" in d.plan.reason
    assert "underruns 10.0% of 400 audio chunks over the 1.0% target: talker planned at 2.00x" in d.plan.reason
    # with the captioner at its maximum both press the talker: planned once, both misses named
    auto = Autoscaling(enabled=True, targets=AutoscalingTargets(ttfp_p95_ms=50, underruns=0.01),
                       stages={s: StageAutoscaling(1, 1 if s == "captioner" else 4, 0.0) for s in GRAPH})
    d = drive(Planner(auto, dict.fromkeys(GRAPH, 1), upstream=GRAPH, audio_path=SPEECH), late_per_s=4.0,
              first_packet_ms=1000.0)
    assert grown(d) == [("talker", 2)]
    assert d.plan.reason.endswith("; first packet p95 1000 ms over the 50 ms target, underruns 10.0% of 400 audio "
                                  "chunks over the 1.0% target: talker planned at 2.00x its load")


# ------------------------------------------------------------------------------ the API

BASE = yaml.safe_load((EXAMPLES / "qwen3-omni-tiny.yaml").read_text())


def with_targets(targets) -> dict:
    doc = copy.deepcopy(BASE)
    doc["spec"]["deployment"]["autoscaling"] = {"enabled": True, "targets": targets}
    return doc


def test_the_underruns_target_loads_and_defaults_to_none():
    assert parse_pipeline(BASE).deployment.autoscaling.targets.underruns == 0.0
    got = parse_pipeline(with_targets({"underruns": 0.02, "rtf": 0.8})).deployment.autoscaling.targets
    assert got.underruns == 0.02 and got.rtf == 0.8
    assert [str(e) for e in validate(with_targets({"underruns": 1}))] == []      # the edges are valid
    assert [str(e) for e in validate(with_targets({"underruns": 0}))] == []


@pytest.mark.parametrize("value, message", [
    (-0.01, f"{AUTO}.targets.underruns: must be >= 0, got -0.01"),
    (1.5, f"{AUTO}.targets.underruns: must be <= 1, got 1.5"),
    ("1%", f'{AUTO}.targets.underruns: must be a number, got "1%"'),
])
def test_a_bad_underruns_target_is_refused_naming_the_field(value, message):
    doc = with_targets({"underruns": value})
    with pytest.raises(SpecError):
        parse_pipeline(doc)
    assert [str(e) for e in validate(doc) if str(e).startswith(AUTO)] == [message]


def test_the_crd_carries_the_underruns_target_with_its_bounds():
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    targets = (schema["properties"]["spec"]["properties"]["deployment"]["properties"]["autoscaling"]["properties"]
               ["targets"]["properties"])
    got = targets["underruns"]
    assert (got["type"], got["minimum"], got["maximum"]) == ("number", 0, 1) and "audio path" in got["description"]


# ------------------------------------------------------------------------------ the operator

class Recording(Planner):
    """The real planner, keeping the audio counters the orchestrators' scrape handed it."""

    def observe_audio(self, readings, at):
        self.audio_readings = readings
        super().observe_audio(readings, at)


def test_the_operator_scrape_hands_the_planner_the_orchestrators_audio_counters():
    orch = OrchestratorMetrics(CollectorRegistry())
    for late in (False, True, False):
        orch.observe_audio_chunk(late)
    texts = {"orch": generate_latest(orch.registry).decode(), "t-a": ""}
    p = Recording(Autoscaling(enabled=True), {"thinker": 1, "talker": 1, "code2wav": 1})
    autoscaler = Autoscaler(None, Plans(), lambda target: texts[target.pod], clock=lambda: 0.0)
    try:
        autoscaler._observe(p, [pod("t-a"), pod("orch", component="orchestrator")])
    finally:
        autoscaler.close()
    assert p.audio_readings == {"orch": {AUDIO_CHUNKS: 3.0, AUDIO_UNDERRUNS: 1.0}}


def test_the_cluster_planner_is_given_the_pipelines_audio_path():
    body = doc({"enabled": True, "targets": {"underruns": 0.01}})
    body["metadata"].setdefault("namespace", "ns")
    key = ("ns", body["metadata"]["name"])
    autoscaler = Autoscaler(StillKube(body), Plans(), lambda t: "", clock=lambda: 0.0)
    try:
        autoscaler.tracked.add(key)
        autoscaler.step(key)
    finally:
        autoscaler.close()
    assert autoscaler.pipelines[key].planner.audio_path == {"thinker", "talker", "code2wav"}


# ------------------------------------------------------------------------------ serve --autoscale

def test_serve_hands_its_planner_the_audio_path_and_the_orchestrators_audio_counters(tmp_path):
    """The local scraper reads the orchestrator's /metrics from a real status server (no stage process runs:
    only the orchestrator's counters are read here)."""
    path = EXAMPLES / "qwen3-omni-tiny.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["deployment"]["autoscaling"] = {"enabled": True, "targets": {"underruns": 0.01}}
    local = LocalPipeline(path, parse_pipeline(doc), tmp_path, log_dir=tmp_path / "logs", progress=lambda m: None)
    orch = OrchestratorMetrics(CollectorRegistry())
    status = HttpStatusServer("127.0.0.1", 0, orch.registry, lambda: True).start()
    auto = LocalAutoscaler(local, progress=lambda m: None, clock=lambda: 5.0)
    try:
        local.orchestrator = Proc("orchestrator", [], tmp_path / "orch.log", tmp_path / "orch.ready",
                                  ports=ReadyPorts(0, status.port))
        for late in (False, False, True, False):
            orch.observe_audio_chunk(late)
        auto._observe()
    finally:
        auto.close()
        status.stop()
    assert auto.planner.audio_path == {"thinker", "talker", "code2wav"}
    assert auto.planner._audio[-1] == (5.0, {"orchestrator": {AUDIO_CHUNKS: 4.0, AUDIO_UNDERRUNS: 1.0}})
