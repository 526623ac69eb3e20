"""The byte budget requests take from while held: a take past the capacity is refused and takes nothing, and
whatever a holder took comes back when it ends, refused or not."""

from __future__ import annotations

import pytest

from orchestrator_service.byte_budget import BudgetFull, ByteBudget


def test_takes_up_to_the_capacity_and_gives_back_on_exit():
    budget = ByteBudget(10)
    with budget.holding() as a, budget.holding() as b:
        a(6)
        b(4)
        assert budget.held == 10
        with budget.holding() as c, pytest.raises(BudgetFull) as e:
            c(1)
        assert (e.value.capacity, e.value.wanted, budget.held) == (10, 1, 10)
    assert budget.held == 0


def test_a_holder_that_fails_gives_back_what_it_took():
    budget = ByteBudget(10)
    with pytest.raises(RuntimeError), budget.holding() as take:
        take(7)
        raise RuntimeError("the request failed")
    assert budget.held == 0


def test_a_clients_share_bounds_what_one_client_holds_while_others_still_take():
    budget = ByteBudget(10, per_client=6)
    with budget.holding("10.0.0.1") as slow, budget.holding("10.0.0.2") as other:
        slow(6)
        with pytest.raises(BudgetFull, match=r"this client \(10.0.0.1\) holds 6 bytes .* at most 6"):
            slow(1)
        other(4)  # the rest of the budget is still the others'
        assert budget.by_client == {"10.0.0.1": 6, "10.0.0.2": 4}
    assert budget.held == 0 and budget.by_client == {}
