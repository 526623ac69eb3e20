"""The concurrency curve's pure parts: which level a side runs next (the ladder, its stop, the bisection),
streams at RTF p95 below 1, underruns, the points and the headline figures (logic only, no model)."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from concurrency import (
    LEVELS,
    VARIANTS,
    arrival_times,
    headline_figures,
    next_level,
    point,
    requests_at,
    server_parts,
    streams_at,
    underruns,
)
from omni_load import OMNI


@pytest.mark.parametrize(("rtf_p95", "expected"), [
    ({}, 0),
    ({1: 1.2}, 0),                                    # not even one stream in real time
    ({1: 0.2, 2: 0.4, 4: 0.9}, 4),                    # all passed: the largest measured
    ({1: 0.2, 2: 0.4, 4: 0.9, 8: 1.3, 6: 0.95}, 6),   # bisected between 4 and 8
    ({1: 0.2, 2: 1.1, 4: 0.9}, 1),                    # a noisy pass above a failure does not count
    ({1: 0.2, 2: 0.5, 4: 1.0}, 2),                    # 1.0 is not below 1
    ({1: 0.2, 2: math.nan}, 1),                       # no figure is no pass
])
def test_streams_at(rtf_p95, expected):
    assert streams_at(rtf_p95) == expected


def test_the_ladder_climbs_in_order():
    assert next_level({}) == 1
    assert next_level({1: 0.2}) == 2
    assert next_level({1: 0.2, 2: 0.3, 4: 0.4, 8: 0.6}) == 16


def test_the_ladder_stops_climbing_past_the_stop_and_bisects():
    """c8 fails hard: no c16..c64, but the level between c4 (passed) and c8 (failed)."""
    done = {1: 0.2, 2: 0.4, 4: 0.8, 8: 1.9}
    assert next_level(done) == 6
    assert next_level({**done, 6: 0.95}) == 7      # the second probe, between 6 and 8
    assert next_level({**done, 6: 1.2}) == 5
    assert next_level({**done, 6: 0.95, 7: 1.1}) is None   # two probes: done
    assert next_level({**done, 6: 0.95}, max_probes=1) is None


def test_a_failure_below_the_stop_keeps_climbing_then_bisects():
    """RTF p95 1.2 at c16 fails the figure but is not past the stop: c32 still runs (the curve goes on)."""
    done = {1: 0.2, 2: 0.3, 4: 0.4, 8: 0.7, 16: 1.2}
    assert next_level(done) == 32
    assert next_level({**done, 32: 2.5}) == 12


def test_required_levels_run_even_past_the_stop():
    done = {1: 0.2, 2: 0.4, 4: 0.8, 8: 1.9}
    assert next_level(done, required=(1, 32)) == 32
    assert next_level({**done, 32: 4.0}, required=(1, 32)) == 6


def test_no_bisection_without_a_pass_or_without_a_failure():
    assert next_level({1: 1.7}) is None                             # c1 already fails hard
    assert next_level(dict.fromkeys(LEVELS, 0.5)) is None           # every level passed
    assert next_level({1: 0.2, 2: 1.6}) is None                     # nothing between 1 and 2


def test_a_capped_ladder_ends_at_its_cap():
    assert next_level({1: 0.3, 2: 0.5, 4: 0.9}, levels=[1, 2, 4]) is None


def test_every_probe_lands_strictly_between_a_pass_and_a_failure():
    """Any sequence of results: the ladder ends (each level at most once) and each probe is off the ladder."""
    import random

    rng = random.Random(0)
    for _ in range(300):
        done: dict[int, float] = {}
        while (c := next_level(done, required=(1, 32))) is not None:
            assert c not in done
            done[c] = rng.choice([0.3, 0.8, 1.2, 2.0])
            assert len(done) <= len(LEVELS) + 2


def test_requests_at_a_level():
    assert [requests_at(c, quick=False) for c in (1, 4, 8, 32)] == [8, 8, 16, 64]
    assert [requests_at(c, quick=True) for c in (1, 16)] == [4, 16]


def test_underruns_count_late_chunks_per_request():
    on_time = [(0.5, 1.2), (1.0, 2.0), (2.5, 0.8)]            # each arrives before the audio ends
    late = [(0.5, 1.2), (2.0, 2.0), (4.5, 0.8)]               # 0.3 s and 0.5 s of silence
    assert underruns([on_time, late, []]) == (2, 1)


def test_point_percentiles():
    result = {"n": 20, "rps": 3.0, "ttfp": [0.1 * i for i in range(1, 21)], "rtfs": [0.05 * i for i in range(1, 21)]}
    p = point(result)
    assert p["ttfp_p50_ms"] == pytest.approx(1e3 * statistics.median(result["ttfp"]))
    assert 1850 <= p["ttfp_p95_ms"] <= 2000
    assert p["rtf_p50"] == pytest.approx(statistics.median(result["rtfs"]))
    assert p["underruns"] == 0                               # the monolith: audio whole, nothing to count


def test_headline_figures():
    def pts(rtfs: dict[int, float], ttfp=None, under=0):
        return {c: {"rtf_p95": r, "ttfp_p95_ms": (ttfp or {}).get(c, 500.0), "underruns": under}
                for c, r in rtfs.items()}

    points = {"staged": pts({1: 0.2, 8: 0.6, 16: 0.9, 32: 1.6, 24: 1.1}, {1: 500.0, 32: 3000.0}, under=3),
              "monolith": pts({1: 0.3, 2: 0.7, 4: 1.6, 3: 1.1}),
              "monolith_x2": pts({1: 0.3, 4: 0.8, 8: 1.7, 6: 1.2}),
              "staged_planner": pts({1: 0.2, 16: 0.9, 32: 0.95}, {1: 400.0, 32: 1200.0})}
    got = {f["name"]: f["value"] for f in headline_figures(points)}
    assert got == {
        "concurrency.staged.streams_at_rtf_p95_below_1": 16,
        "concurrency.monolith.streams_at_rtf_p95_below_1": 2,
        "concurrency.monolith_x2.streams_at_rtf_p95_below_1": 4,
        "concurrency.staged_over_monolith_x2.streams_at_rtf_p95_below_1": 4.0,
        "concurrency.ttfp_p95_ms_c32_over_c1": 6.0,
        "concurrency.underruns_c32": 3,
        "concurrency.staged.streams_at_rtf_p95_below_1_planner": 32,
        "concurrency.staged_over_monolith_x2.streams_at_rtf_p95_below_1_planner": 8.0,
        "concurrency.ttfp_p95_ms_c32_over_c1_planner": 3.0,
        "concurrency.underruns_c32_planner": 0,
    }


def test_poisson_arrivals_are_seeded_and_at_the_rate():
    a = arrival_times(4.0, 2000, 7)
    assert a == arrival_times(4.0, 2000, 7) and a[0] == 0.0
    assert all(x <= y for x, y in zip(a, a[1:]))
    assert 3.6 <= (len(a) - 1) / a[-1] <= 4.4


def test_server_parts_between_two_scrapes():
    def key(name, **labels):
        return name, tuple(sorted(labels.items()))

    before = {key("omnistage_audio_underruns_total"): 2.0,
              key("omnistage_stage_time_seconds_sum", stage="thinker", part="queue"): 1.0,
              key("omnistage_stage_time_seconds_count", stage="thinker", part="queue"): 10.0}
    after = {key("omnistage_audio_underruns_total"): 5.0,
             key("omnistage_stage_time_seconds_sum", stage="thinker", part="queue"): 3.0,
             key("omnistage_stage_time_seconds_count", stage="thinker", part="queue"): 14.0,
             key("omnistage_admission_wait_seconds_sum"): 0.8,
             key("omnistage_admission_wait_seconds_count"): 4.0}
    assert server_parts(before, after) == {"underruns": 3, "admission_wait_ms": 200.0,
                                           "stage_ms": {"thinker": {"queue": 500.0}}}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_variant_is_a_valid_pipeline(name):
    """A variant is the example pipeline with one edit: it must still be a pipeline `omnistage serve` takes."""
    import yaml

    from omnistage.api import parse_pipeline

    doc = yaml.safe_load(OMNI.read_text())
    VARIANTS[name](doc)
    parse_pipeline(doc)
