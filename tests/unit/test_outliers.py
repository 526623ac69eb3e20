"""Outlier ejection of stage replicas (orchestrator_service/outliers.py): which failures mean nothing was
sent, how long each ejection in a row lasts, and when a replica is probed and back."""

from __future__ import annotations

import grpc
import pytest

from orchestrator_service.outliers import (
    BASE_EJECTION_S,
    MAX_EJECTION_S,
    UNREACHABLE_AFTER_FAILED_POLLS,
    UNREACHABLE_AFTER_SLOW_POLLS,
    Outlier,
    ejection_seconds,
    nothing_sent,
    unreachable,
)

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
REFUSED = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: "
           "Failed to connect to remote host: Connection refused")


@pytest.mark.parametrize("code, details, sent", [
    (UNAVAILABLE, REFUSED, False),                                            # the replica's port is closed
    (UNAVAILABLE, "failed to connect to all addresses; last error: UNAVAILABLE: No route to host", False),
    (UNAVAILABLE, "DNS resolution failed for stage-llm-0:50051", False),      # its pod name is gone
    (UNAVAILABLE, "Socket closed", True),                                      # it died mid-call: some was sent
    (UNAVAILABLE, "Connection reset by peer", True),
    (UNAVAILABLE, "stage llm is draining", True),                             # it answered, refusing work
    (UNAVAILABLE, "", True),
    (grpc.StatusCode.INTERNAL, REFUSED, True),                                 # only UNAVAILABLE means not connected
    (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", True),
])
def test_nothing_sent_only_when_no_connection_was_made(code, details, sent):
    assert nothing_sent(code, details) is not sent


@pytest.mark.parametrize("consecutive, seconds", [
    (1, BASE_EJECTION_S), (2, 2 * BASE_EJECTION_S), (5, 5 * BASE_EJECTION_S), (30, MAX_EJECTION_S),
    (1000, MAX_EJECTION_S),
])
def test_each_ejection_in_a_row_lasts_longer_up_to_the_cap(consecutive, seconds):
    assert ejection_seconds(consecutive) == seconds


def test_ejection_count_must_be_positive():
    with pytest.raises(ValueError, match="consecutive ejections must be >= 1"):
        ejection_seconds(0)


def test_an_ejected_replica_is_out_until_a_probe_after_its_time_answers():
    o = Outlier(base_s=1.0, max_s=10.0)
    assert not o.ejected and not o.probe_due(0.0)
    assert o.eject(100.0) == 101.0
    assert o.ejected
    assert not o.probe_due(100.5)           # not probed before its time
    assert o.probe_due(101.0)
    assert o.ejected                        # its time passed, but it is out until a probe answers
    o.probe_answered()
    assert not o.ejected and not o.probe_due(200.0)


def test_a_failed_probe_ejects_for_longer_and_a_served_call_resets_the_growth():
    o = Outlier(base_s=1.0, max_s=10.0)
    o.eject(0.0)
    assert o.eject(1.0) == 3.0              # the probe at 1.0 failed: out for 2 s
    assert o.eject(3.0) == 6.0              # and again: 3 s
    o.probe_answered()
    o.served()
    assert o.consecutive == 0
    assert o.eject(10.0) == 11.0            # a new outage starts from the base time


def test_back_by_probe_without_a_served_call_keeps_the_growth():
    o = Outlier(base_s=1.0, max_s=10.0)
    o.eject(0.0)
    o.probe_answered()
    assert o.eject(5.0) == 7.0              # refused again before serving anything: 2 s


def test_served_while_ejected_does_not_clear_the_ejection():
    o = Outlier()
    o.eject(0.0)
    o.served()                              # a call opened before the ejection ended well
    assert o.ejected and o.consecutive == 1


def test_slow_polls_do_not_take_a_replica_out_as_soon_as_failed_ones():
    """A replica that answers no load poll within its bound is slow (starved of CPU, a long step), not gone:
    only about 10 s of timed-out polls mark it unreachable, where two polls that could not connect do."""
    slow, gone = grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE
    assert not unreachable(gone, 1) and unreachable(gone, 2)
    assert not any(unreachable(slow, n) for n in range(1, UNREACHABLE_AFTER_SLOW_POLLS))
    assert unreachable(slow, UNREACHABLE_AFTER_SLOW_POLLS)
    assert UNREACHABLE_AFTER_SLOW_POLLS > UNREACHABLE_AFTER_FAILED_POLLS
