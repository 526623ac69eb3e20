"""The planner's measurements: per-stage windows from replica counters, and the estimates built on them."""

from __future__ import annotations

import pytest

from omnistage.planner.load import (CAPACITY_MEMORY, MIN_DRAIN_S, PER_REQUEST_MEMORY, ReplicaCounters, StageEstimate,
                                    StageWindow, estimate, need, recent_load, window)


def C(at, units=0.0, busy=0.0, finished=0.0, queued=0, running=0):
    return ReplicaCounters(at, units, busy, finished, queued, running)


def test_window_sums_replicas_over_the_span():
    before = {"r1": C(10, units=100, busy=1, finished=10), "r2": C(10, units=50, busy=2, finished=5)}
    after = {"r1": C(12, units=300, busy=2.5, finished=14, queued=3, running=2),
             "r2": C(12, units=150, busy=3, finished=7, queued=1, running=1)}
    w = window("talker", before, after)
    assert w == StageWindow("talker", 2, 2.0, 150.0, 1.25, 3.0, 4, 3, 0)


def test_a_restarted_replica_counts_from_zero_and_one_not_read_before_counts_nothing():
    """r2 was not read at the window's start (new, or its scrape failed): its totals may span its whole life,
    so they must not count as one window's work."""
    before = {"r1": C(0, units=1000, busy=10, finished=100, queued=1)}
    after = {"r1": C(2, units=40, busy=0.5, finished=2, queued=1),
             "r2": C(2, units=36000, busy=300, finished=1000, queued=5)}
    w = window("a", before, after)
    assert (w.replicas, w.units_per_s, w.busy, w.requests_per_s) == (2, 20.0, 0.25, 1.0)
    assert (w.queued, w.queued_before) == (6, 6)  # r2's queue is not growth either


def test_a_replica_gone_by_the_second_snapshot_counts_nothing():
    w = window("a", {"r1": C(0, units=10), "r2": C(0, units=10)}, {"r1": C(1, units=30)})
    assert (w.replicas, w.units_per_s) == (1, 20.0)


def test_no_span_gives_zero_rates():
    w = window("a", {"r1": C(5, units=1)}, {"r1": C(5, units=1)})
    assert (w.units_per_s, w.busy, w.requests_per_s) == (0.0, 0.0, 0.0)


def W(units_per_s, busy, requests_per_s=1.0, queued=0, replicas=1, queued_before=None, seconds=1.0):
    return StageWindow("a", replicas, seconds, units_per_s, busy, requests_per_s, queued, 0,
                       queued if queued_before is None else queued_before)


def test_capacity_is_units_per_busy_second_and_remembers_the_best():
    e = estimate(StageEstimate("a"), W(50, 0.5), queue_seconds=1)
    assert (e.capacity, e.load, e.utilization) == (100.0, 50.0, 0.5)
    # at low load a replica batches less: the best seen fades slowly instead of dropping
    e2 = estimate(e, W(10, 0.2), queue_seconds=1)
    assert e2.capacity == pytest.approx(100.0 * CAPACITY_MEMORY)
    # too little busy time says nothing about capacity: it stays as it was, however long that lasts
    e3 = StageEstimate("a", capacity=80)
    for _ in range(300):
        e3 = estimate(e3, W(1, 0.001), queue_seconds=1)
    assert e3.capacity == 80


def test_a_growing_queue_is_load_that_arrives_and_is_not_served():
    # 4 requests/s of 25 units each served; the queue went from 0 to 8 in 2 s: 100 units/s more arrive
    e = estimate(StageEstimate("a"), W(100, 1.0, requests_per_s=4, queued=8, queued_before=0, seconds=2), 1)
    assert e.units_per_request == 25.0
    assert e.load == pytest.approx(100 + 100 + 8 * 25 / MIN_DRAIN_S)
    assert e.utilization == pytest.approx(e.load / 100)


def test_a_standing_queue_is_drained_over_the_longer_of_the_target_and_min_drain():
    standing = W(100, 1.0, requests_per_s=4, queued=8)
    assert estimate(StageEstimate("a"), standing, queue_seconds=1).load == pytest.approx(100 + 200 / MIN_DRAIN_S)
    assert estimate(StageEstimate("a"), standing, queue_seconds=100).load == pytest.approx(100 + 200 / 100)
    # a shrinking queue: less arrives than is served
    shrinking = W(100, 1.0, requests_per_s=4, queued=0, queued_before=4, seconds=2)
    assert estimate(StageEstimate("a"), shrinking, 1).load == pytest.approx(50.0)


def test_the_recent_window_brings_its_queue_the_long_one_its_throughput():
    long, recent = W(100, 1.0, requests_per_s=4), W(160, 1.0, requests_per_s=4, queued=6, queued_before=0, seconds=3)
    e = estimate(StageEstimate("a"), long, 1, recent)
    assert e.load == pytest.approx(100 + 6 * 25 / 3 + 6 * 25 / MIN_DRAIN_S)
    assert recent_load(e, recent, 1) == pytest.approx(160 + 6 * 25 / 3 + 6 * 25 / MIN_DRAIN_S)


def test_work_per_request_is_smoothed_and_kept_when_nothing_finished():
    e = estimate(StageEstimate("a", capacity=10, units_per_request=25), W(0, 0, requests_per_s=0, queued=2), 1)
    assert e.units_per_request == 25.0
    e2 = estimate(e, W(100, 1.0, requests_per_s=2), 1)   # this window says 50
    assert e2.units_per_request == pytest.approx(PER_REQUEST_MEMORY * 25 + (1 - PER_REQUEST_MEMORY) * 50)


def test_need_stands_in_a_capacity_until_one_is_measured():
    n = need(StageEstimate("a", load=5), 1, 4, gpus=1, unit="frames/s", default_capacity=20)
    assert (n.capacity, n.load, n.min_replicas, n.max_replicas, n.gpus, n.unit) == (20, 5, 1, 4, 1, "frames/s")
    assert need(StageEstimate("a", capacity=7), 1, 4).capacity == 7


def test_load_is_never_negative_when_the_queue_empties_faster_than_the_long_window_served():
    long, recent = W(10, 0.1, requests_per_s=1), W(300, 1.0, requests_per_s=4, queued=0, queued_before=30, seconds=3)
    e = estimate(StageEstimate("a", units_per_request=25), long, 1, recent)
    assert e.load == 0.0 and recent_load(e, recent, 1) >= 0.0
