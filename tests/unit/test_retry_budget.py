"""The orchestrator's retry budget (orchestrator_service/retry_budget.py): retries in progress stay under
max(min_retry_concurrency, budget_percent of the active stage calls), and leave nothing counted."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator_service.retry_budget import BUDGET_PERCENT, MIN_RETRY_CONCURRENCY, RetryBudget


def test_the_defaults_are_envoys():
    b = RetryBudget()
    assert (b.budget_percent, b.min_retry_concurrency) == (BUDGET_PERCENT, MIN_RETRY_CONCURRENCY) == (20.0, 3)


@pytest.mark.parametrize("active, percent, floor, allowed", [
    (1, 20.0, 3, 1),      # one call: it may retry (the floor)
    (10, 20.0, 3, 3),     # 20% of 10 is 2: the floor of 3 rules
    (15, 20.0, 3, 3),     # 20% of 15 is exactly 3
    (20, 20.0, 3, 4),     # 20% of 20
    (100, 20.0, 3, 20),
    (101, 20.0, 3, 21),   # 20.2: a 21st retry starts while 20 < 20.2
    (50, 0.0, 0, 0),      # a budget of nothing: no retry at all
    (4, 100.0, 0, 4),     # every active call may be retrying
])
def test_retries_allowed_at_once(active, percent, floor, allowed):
    b = RetryBudget(percent, floor)
    with contextlib.ExitStack() as calls:
        shares = [calls.enter_context(b.call()) for _ in range(active)]
        granted = [s.try_retry() for s in shares]
        assert sum(granted) == allowed and granted == sorted(granted, reverse=True)  # first come, first served
        assert b.retrying == allowed
    assert (b.active, b.retrying) == (0, 0)


def test_a_call_retrying_again_gives_back_its_slot_first():
    b = RetryBudget(0.0, 1)
    with b.call() as a, b.call() as other:
        assert a.try_retry() and a.try_retry()  # its second retry takes the slot its first one held
        assert not other.try_retry()
        assert b.retrying == 1
    assert (b.active, b.retrying) == (0, 0)


def test_a_slot_frees_when_its_call_ends():
    b = RetryBudget(0.0, 1)
    with b.call() as waiting:
        with b.call() as first:
            assert first.try_retry() and not waiting.try_retry()
        assert waiting.try_retry()
    assert (b.active, b.retrying) == (0, 0)


def test_a_call_that_fails_still_gives_back_what_it_counted():
    b = RetryBudget()
    with pytest.raises(RuntimeError), b.call() as share:
        assert share.try_retry()
        raise RuntimeError("the call failed")
    assert (b.active, b.retrying) == (0, 0)


def test_negative_settings_are_refused():
    with pytest.raises(ValueError):
        RetryBudget(-1.0, 3)
    with pytest.raises(ValueError):
        RetryBudget(20.0, -1)


@given(percent=st.floats(0, 100), floor=st.integers(0, 5),
       ops=st.lists(st.tuples(st.sampled_from(["open", "retry", "end"]), st.integers(0, 30)), max_size=80))
def test_retries_never_exceed_the_budget_when_they_start(percent, floor, ops):
    b = RetryBudget(percent, floor)
    open_calls: list[tuple[contextlib.ExitStack, object]] = []
    for op, i in ops:
        if op == "open":
            stack = contextlib.ExitStack()
            open_calls.append((stack, stack.enter_context(b.call())))
        elif open_calls:
            stack, share = open_calls[i % len(open_calls)]
            if op == "retry":
                before = b.retrying - share.retrying  # the others' retries
                if share.try_retry():
                    assert before < b.limit  # it started under the budget
            else:
                open_calls.remove((stack, share))
                stack.close()
        assert 0 <= b.retrying <= b.active == len(open_calls)
    for stack, _ in open_calls:
        stack.close()
    assert (b.active, b.retrying) == (0, 0)
