"""The planner's measurements: per-stage windows from replica counters, and the estimates built on them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omnistage.planner.load import (
    CAPACITY_MEMORY,
    MIN_BUSY,
    MIN_DISPERSION,
    MIN_DRAIN_S,
    PER_REQUEST_MEMORY,
    ReplicaCounters,
    StageEstimate,
    StageWindow,
    capacity_seen,
    dispersion,
    estimate,
    load_floor,
    need,
    offered,
    window,
    window_since,
)


def C(at, units=0.0, busy=0.0, finished=0.0, queued=0, running=0, steps=0.0):
    return ReplicaCounters(at, units, busy, finished, queued, running, steps)


def test_window_sums_replicas_over_the_span():
    before = {"r1": C(10, units=100, busy=1, finished=10), "r2": C(10, units=50, busy=2, finished=5)}
    after = {"r1": C(12, units=300, busy=2.5, finished=14, queued=3, running=2),
             "r2": C(12, units=150, busy=3, finished=7, queued=1, running=1)}
    w = window("talker", before, after)
    assert w == StageWindow("talker", 2, 2.0, 150.0, 1.25, 3.0, 4, 3, 0)
    assert w.units_per_step == 0.0  # steps not counted: how full they ran is not known


def test_window_counts_steps_and_how_full_they_ran():
    before = {"r1": C(0, units=100, busy=1, steps=50), "r2": C(0, units=0, busy=0, steps=0)}
    after = {"r1": C(2, units=300, busy=2, steps=100), "r2": C(2, units=100, busy=1, steps=100)}
    w = window("talker", before, after)
    assert (w.steps_per_s, w.units_per_step) == (75.0, 2.0)
    # a replica whose step count went down restarted: it counts from zero
    w = window("talker", {"r1": C(0, units=10, busy=1, steps=500)}, {"r1": C(1, units=40, busy=2, steps=10)})
    assert (w.units_per_s, w.steps_per_s) == (40.0, 10.0)


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


def W(units_per_s, busy, requests_per_s=1.0, queued=0, replicas=1, queued_before=None, seconds=1.0, batch=0.0):
    """`batch`: units per step (0: steps not counted)."""
    return StageWindow("a", replicas, seconds, units_per_s, busy, requests_per_s, queued, 0,
                       queued if queued_before is None else queued_before, units_per_s / batch if batch else 0.0)


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


@pytest.mark.parametrize("name, best, best_fill, w, expected", [
    ("first reading", 0.0, 0.0, W(60, 0.8, batch=1), (75.0, 1.0)),
    ("a faster one is the new best, at its fill", 75.0, 1.0, W(250, 0.9, batch=5), (250 / 0.9, 5.0)),
    # the real run's Talker: 270 frames per busy second at batch 5 (18.5 ms a step); one client: batch 1,
    # 70 per busy second (14 ms a step). At batch 5 that step would make 350: the replica is not slower
    ("light steps, each no slower: kept", 270.0, 5.0, W(60, 0.857, batch=1), (270.0, 5.0)),
    ("light steps, each as slow: kept", 270.0, 5.0, W(54, 1.0, batch=1), (270.0, 5.0)),
    ("light steps, each slower: it fades", 270.0, 5.0, W(40, 1.0, batch=1), (270.0 * CAPACITY_MEMORY, 5.0)),
    ("... no lower than the light steps say", 270.0, 5.0, W(53, 1.0, batch=1), (265.0, 5.0)),
    # an early reading at batch 5.9 made 554 per busy second; the heavy load then runs batch 4.4 at 183
    ("an outlier fades under the real load", 554.0, 5.88, W(183, 1.0, batch=4.44), (554.0 * CAPACITY_MEMORY, 5.88)),
    ("as full and slower: it fades", 270.0, 5.0, W(200, 1.0, batch=5), (270.0 * CAPACITY_MEMORY, 5.0)),
    ("fuller and slower: it fades", 270.0, 5.0, W(200, 1.0, batch=6), (270.0 * CAPACITY_MEMORY, 5.0)),
    ("fades no lower than what it just served", 270.0, 5.0, W(260, 1.0, batch=6), (260.0, 5.0)),
    ("steps not counted now: the rate as it is", 270.0, 5.0, W(60, 0.85), (270.0 * CAPACITY_MEMORY, 5.0)),
    ("steps not counted then: the rate as it is", 270.0, 0.0, W(60, 0.85, batch=1), (270.0 * CAPACITY_MEMORY, 0.0)),
    ("too idle to measure", 270.0, 5.0, W(5, MIN_BUSY / 2, batch=6), (270.0, 5.0)),
    ("nothing made", 270.0, 5.0, W(0, 0.5, batch=6), (270.0, 5.0)),
])
def test_capacity_table(name, best, best_fill, w, expected):
    assert capacity_seen(best, best_fill, w) == pytest.approx(expected), name


def test_one_light_client_does_not_make_a_batched_stage_look_full():
    """The real run's Talker: ~270 frames per busy second at batch ~5 under six clients; then one client keeps
    it stepping 85% of the time at batch 1 (~70 frames per busy second). Its utilisation stays what the load
    asks of a replica that batches, not 0.85."""
    e = estimate(StageEstimate("talker"), W(250, 0.92, requests_per_s=2.5, batch=5), 1)
    for _ in range(300):
        e = estimate(e, W(60, 0.85, requests_per_s=0.6, batch=1), 1)
    assert e.capacity == pytest.approx(250 / 0.92)
    assert e.utilization == pytest.approx(60 / (250 / 0.92)) and e.utilization < 0.25


@given(st.floats(1.0, 1e4), st.floats(1.0, 32.0), st.floats(0.01, 1e4), st.floats(MIN_BUSY, 2.0),
       st.floats(0.01, 1.0), st.floats(1.0, 10.0))
def test_steps_no_slower_than_the_best_never_lower_the_capacity(best, best_fill, units, busy, share, step_time):
    """Emptier steps (`share` of the best's fill) that each took no longer than the best's (`step_time` x
    shorter) leave the capacity as it was, or raise it; any reading lowers it by CAPACITY_MEMORY at most."""
    fill = best_fill * share
    rate = best / best_fill * fill * step_time   # units per busy second: fill units per step, steps this fast
    capacity, kept_fill = capacity_seen(best, best_fill, W(rate * busy, busy, batch=fill))
    assert capacity >= best * (1 - 1e-9) and kept_fill in (best_fill, pytest.approx(fill))
    slower, _ = capacity_seen(best, best_fill, W(units, busy, batch=fill))
    assert slower >= best * CAPACITY_MEMORY * (1 - 1e-9)


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


def test_offered_load_counts_the_requests_that_arrived():
    # 4 requests/s ended, 25 units each; the stage held 6 more at the end of the 3 s (queued 0 -> 4, running 2 -> 4)
    w = StageWindow("a", 2, 3.0, 160.0, 1.0, 4.0, queued=4, running=4, queued_before=0, running_before=2)
    backlog = 4 * 25 / MIN_DRAIN_S
    assert offered(25, w, 1) == (pytest.approx((4 + 6 / 3) * 25 + backlog), pytest.approx(backlog))
    # before any request ended nothing says what one is: the throughput and no queue terms
    assert offered(0, w, 1) == (160.0, 0.0)


def test_a_replica_that_joined_counts_from_its_first_reading():
    """r2 joined at 5 s and took 4 requests from r1's queue into its batch: that is no drop in what arrives.
    Read from its totals it would not count at all, and the queue it emptied would read as load gone; read
    as holding at the start what it holds at its first reading, the 4 would count twice there."""
    readings = [{"r1": C(0, units=0, finished=0, queued=6, running=8)},
                {"r1": C(5, units=500, finished=20, queued=6, running=8)},
                {"r1": C(5.0, units=500, finished=20, queued=2, running=8), "r2": C(5.0, queued=0, running=4)},
                {"r1": C(10, units=1000, finished=40, queued=2, running=8),
                 "r2": C(10, units=250, finished=6, queued=0, running=8)}]
    w = window_since("a", readings, 10.0)
    assert (w.units_per_s, w.requests_per_s, w.queued_before + w.running_before, w.queued + w.running) == \
        pytest.approx((125.0, 4.6, 14, 18))
    assert offered(25, w, 1)[0] == pytest.approx((4.6 + 0.4) * 25 + 2 * 25 / MIN_DRAIN_S)   # 50 arrived in 10 s
    # the last 3 s: from the newest reading at least that old (5 s), r2 from there too
    assert window_since("a", readings, 3.0).seconds == 5.0
    # a window longer than the readings: from the oldest
    assert window_since("a", readings, 60.0) == w


def test_a_filling_stage_reads_its_requests_at_their_size():
    """A stage that starts: 8 requests of 100 units entered service, 2 ended; 400 units made. Units over the
    requests that ended would read 200 a request; the 6 still running count as half done."""
    w = StageWindow("a", 1, 10.0, 40.0, 0.4, 0.2, queued=0, running=6, queued_before=0, running_before=0)
    assert estimate(StageEstimate("a"), w, 1).units_per_request == pytest.approx(40.0 / (0.2 + 0.3))


@pytest.mark.parametrize("name, load, backlog, per_request, seconds, errors, expected", [
    ("10000 requests: about one standard error (10 a second) below", 1000.0, 0.0, 1.0, 10.0, 1.0,
     0.1 * (10000.25 ** 0.5 - 0.5) ** 2),
    ("10 requests in 3 s at 2.5 errors: 4.6 surely", 400.0, 0.0, 120.0, 3.0, 2.5,
     40.0 * ((10 + 2.5 ** 2 / 4) ** 0.5 - 1.25) ** 2),
    ("the backlog is counted, not sampled", 430.0, 30.0, 120.0, 3.0, 2.5,
     40.0 * ((10 + 2.5 ** 2 / 4) ** 0.5 - 1.25) ** 2 + 30.0),
    ("nothing arrived: the backlog alone", 30.0, 30.0, 120.0, 3.0, 2.5, 30.0),
    ("work per request not known yet: as read", 400.0, 0.0, 0.0, 3.0, 2.5, 400.0),
    ("no errors asked: as read", 400.0, 0.0, 120.0, 3.0, 0.0, 400.0),
])
def test_load_floor_table(name, load, backlog, per_request, seconds, errors, expected):
    assert load_floor(load, backlog, per_request, seconds, errors) == pytest.approx(expected), name


@given(st.floats(0, 1e5), st.floats(0, 1.0), st.floats(0.01, 1e3), st.floats(0.5, 60), st.floats(0, 4),
       st.floats(1.0, 10.0))
def test_the_floor_is_below_the_reading_and_rises_with_it_and_with_a_longer_window(load, backlog_share, per_request,
                                                                                    seconds, errors, more):
    backlog = load * backlog_share
    floor = load_floor(load, backlog, per_request, seconds, errors)
    assert backlog - 1e-6 <= floor <= load + 1e-6
    assert load_floor(load * more, backlog, per_request, seconds, errors) >= floor - 1e-6       # monotone in load
    assert load_floor(load, backlog, per_request, seconds * more, errors) >= floor - 1e-6      # surer over longer
    assert load_floor(load, backlog, per_request, seconds, errors * more) <= floor + 1e-6      # lower when stricter


def test_work_per_request_is_smoothed_and_kept_when_nothing_finished():
    e = estimate(StageEstimate("a", capacity=10, units_per_request=25), W(0, 0, requests_per_s=0, queued=2), 1)
    assert e.units_per_request == 25.0
    e2 = estimate(e, W(100, 1.0, requests_per_s=2), 1)   # this window says 50
    assert e2.units_per_request == pytest.approx(PER_REQUEST_MEMORY * 25 + (1 - PER_REQUEST_MEMORY) * 50)


def test_need_stands_in_a_capacity_until_one_is_measured():
    n = need(StageEstimate("a", load=5), 1, 4, gpus=1, unit="frames/s", default_capacity=20)
    assert (n.capacity, n.load, n.min_replicas, n.max_replicas, n.gpus, n.unit) == (20, 5, 1, 4, 1, "frames/s")
    assert need(StageEstimate("a", capacity=7), 1, 4).capacity == 7


def test_load_is_never_negative_when_the_queue_empties_faster_than_requests_end():
    shrinking = W(300, 1.0, requests_per_s=4, queued=0, queued_before=30, seconds=3)
    e = estimate(StageEstimate("a", units_per_request=25), shrinking, 1)
    assert e.load == 0.0 and offered(25, shrinking, 1)[0] == 0.0


@pytest.mark.parametrize("name, counts, expected", [
    ("too few intervals: Poisson", [2, 3] * 4, 1.0),
    ("nothing arrived: Poisson", [0] * 20, 1.0),
    ("alternating 2 and 3 (closed-loop clients): 0.2, at its upper end 0.2 x (1 + 4/sqrt(19))",
     [2, 3] * 10, 0.2 * (1 + 4 / 19 ** 0.5)),
    ("the same count every interval: as steady as it may count", [3] * 20, MIN_DISPERSION),
    ("a level change moves one difference: 1 -> 4 after 10 intervals", [1] * 10 + [4] * 10,
     min(9 / (2 * 19) / 2.5 * (1 + 4 / 19 ** 0.5), 1.0)),
    ("burstier than Poisson: kept at 1", [0, 8] * 10, 1.0),
])
def test_dispersion_table(name, counts, expected):
    assert dispersion(counts) == pytest.approx(expected), name


def test_steadier_arrivals_are_sure_sooner():
    # 25 requests in 10 s of 120 units: at 1.5 errors Poisson says 17.8 surely; a count a fifth as variable 22.5
    poisson = load_floor(300.0, 0.0, 120.0, 10.0, 1.5)
    steady = load_floor(300.0, 0.0, 120.0, 10.0, 1.5, spread=0.2)
    assert poisson == pytest.approx(12.0 * ((25 + 1.5 ** 2 / 4) ** 0.5 - 0.75) ** 2)
    assert steady == pytest.approx(12.0 * 0.2 * ((125 + 1.5 ** 2 / 4) ** 0.5 - 0.75) ** 2)
    assert poisson < steady < 300.0


@given(st.floats(0, 1e5), st.floats(0.01, 1e3), st.floats(0.5, 60), st.floats(0, 4), st.floats(MIN_DISPERSION, 1.0),
       st.floats(0.0, 1.0))
def test_a_steadier_count_never_lowers_the_floor_nor_lifts_it_above_the_reading(load, per_request, seconds, errors,
                                                                                d, steadier):
    floor = load_floor(load, 0.0, per_request, seconds, errors, d)
    assert floor <= load + 1e-6
    assert load_floor(load, 0.0, per_request, seconds, errors, d * steadier + MIN_DISPERSION * (1 - steadier)) >= \
        floor - 1e-6
    assert floor >= load_floor(load, 0.0, per_request, seconds, errors) - 1e-6   # Poisson's is the lowest
