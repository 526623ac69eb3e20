"""The KV budget: its policy (kv_budget.py) table by table, its invariants, the scheduler admitting and
preempting by it, and `engineArgs.kvCacheBytes` refused when it is not a positive integer. The scheduler
tests step plain-Python states that count tokens and size their cache as a paged one is sized, so they
run without a model; tests/integration/test_kv_budget_stage.py runs the same on the tiny LM."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from omnistage.api import SchedulerSettings, validate
from stage_service.runtime.base import EngineOptions
from stage_service.runtime.errors import EngineConfigError, EngineOverloaded
from stage_service.runtime.kv_budget import KvPages, admits, never_fits, resolve_budget, to_preempt
from stage_service.runtime.scheduler import StepScheduler, StepState

from ..conftest import EXAMPLES

PAGES = KvPages(per_token=100, page=4)  # a page of 4 tokens is 400 bytes


@pytest.mark.parametrize("tokens, expected", [(0, 0), (1, 400), (4, 400), (5, 800), (12, 1200), (13, 1600)])
def test_a_cache_holds_whole_pages(tokens, expected):
    assert PAGES.bytes_for(tokens) == expected


@pytest.mark.parametrize("kv_cache_bytes, fraction, gpu, weights, expected", [
    (5000, 0.0, None, 10, 5000),            # given: on any device
    (5000, 0.5, 100_000, 10, 5000),         # given wins over the fraction
    (None, 0.5, 100_000, 10_000, 40_000),   # on a GPU: its share less the weights
    (None, 0.0, 100_000, 10_000, None),     # no fraction: unbounded, as before
    (None, 0.5, None, 10_000, None),        # off a GPU: unbounded
])
def test_the_budget_is_kv_cache_bytes_or_the_gpu_share_left_after_the_weights(kv_cache_bytes, fraction, gpu, weights,
                                                                               expected):
    assert resolve_budget("lm", kv_cache_bytes, fraction, gpu, weights) == expected


def test_on_a_gpu_the_activations_of_the_largest_step_are_left_out_of_the_budget_too():
    assert resolve_budget("lm", None, 0.5, 100_000, 10_000, 15_000) == 25_000
    assert resolve_budget("lm", 5000, 0.5, 100_000, 10_000, 15_000) == 5000  # given: as given
    with pytest.raises(ValueError, match=r"activations of its largest step \(45000 bytes\); raise it, bound a "
                                         r"step's tokens \(engineArgs\.max_num_batched_tokens\)"):
        resolve_budget("lm", None, 0.5, 100_000, 10_000, 45_000)


def test_a_gpu_share_the_weights_fill_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"spec\.deployment\.stages\.lm\.gpuMemoryFraction: 0\.1 .* weights "
                                         r"\(20000 bytes\)"):
        resolve_budget("lm", None, 0.1, 100_000, 20_000)


@pytest.mark.parametrize("running, candidate, budget, expected", [
    ([], 10_000, 100, True),               # nothing running: it joins (a never-fitting one is refused earlier)
    ([400, 400], 400, 1200, True),         # exactly fits
    ([400, 400], 800, 1200, False),
    ([1200], 1, 1200, False),
])
def test_a_queued_state_joins_only_if_it_fits_beside_the_running_states_next_step(running, candidate, budget,
                                                                                 expected):
    assert admits(running, candidate, budget) is expected


@pytest.mark.parametrize("running, preemptible, budget, expected", [
    ([400, 400, 400], [True] * 3, 1200, []),             # fits: nobody
    ([400, 400, 800], [True] * 3, 1200, [2]),            # the newest goes
    ([800, 400, 400], [True] * 3, 1000, [2, 1]),         # as many as needed, newest first
    ([400, 400, 800], [True, True, False], 1200, [1]),   # one that cannot be recomputed stays
    ([2000, 400], [True, True], 1000, [1]),              # never the oldest, even if the rest cannot fit
    ([400, 800], [True, False], 1000, [0]),              # the oldest too, beside one that cannot be recomputed
    ([400, 800], [False, True], 1000, [1]),
    ([400, 800], [False, False], 1000, []),              # nothing left to preempt
])
def test_preemption_takes_the_most_recently_admitted_that_can_be_recomputed(running, preemptible, budget, expected):
    assert to_preempt(running, preemptible, budget) == expected


@given(st.lists(st.tuples(st.integers(0, 5000), st.booleans()), min_size=1, max_size=20), st.integers(1, 20_000))
def test_preemption_leaves_the_rest_in_the_budget_or_nothing_more_to_take(running, budget):
    sizes, can = [s for s, _ in running], [c for _, c in running]
    out = to_preempt(sizes, can, budget)
    assert all(can[i] for i in out) and out == sorted(out, reverse=True)
    assert 0 not in out or not all(can)  # the oldest only beside one that cannot be recomputed
    kept = sum(s for i, s in enumerate(sizes) if i not in out)
    first = 1 if all(can) else 0
    left = [i for i in range(first, len(sizes)) if can[i] and i not in out]
    # Fits, or every preemptible one (but the oldest, if all are) is taken; never one more than needed.
    assert kept <= budget or not left
    if out:
        assert kept + sizes[out[-1]] > budget


def test_a_sequence_that_can_never_fit_is_told_the_numbers():
    assert never_fits("lm", 12, PAGES, 1200) is None
    why = never_fits("lm", 13, PAGES, 1200)
    assert why is not None and "needs 1600 bytes" in why and "13 tokens x 100 bytes per token" in why
    assert "stage lm's whole KV budget of 1200 bytes" in why


@pytest.mark.parametrize("value", [1, 1 << 40])
def test_kv_cache_bytes_is_an_engine_arg(value):
    assert EngineOptions.parse("lm", {"kvCacheBytes": value}).kv_cache_bytes == value
    assert EngineOptions.parse("lm", {}).kv_cache_bytes is None


@pytest.mark.parametrize("value", [0, -5, "1Gi", 1.5, True, None])
def test_kv_cache_bytes_must_be_a_positive_integer(value):
    with pytest.raises(EngineConfigError, match=r"spec\.deployment\.stages\.lm\.engineArgs\.kvCacheBytes: expected "
                                                r"a positive integer, got"):
        EngineOptions.parse("lm", {"kvCacheBytes": value})


def spec_errors(engine: str, value) -> list[str]:
    """Validation of llm-tiny with its stage on `engine` and `engineArgs.kvCacheBytes: value`."""
    doc = yaml.safe_load((EXAMPLES / "llm-tiny.yaml").read_text())
    doc["spec"]["topology"]["stages"][0]["engine"] = engine
    doc["spec"]["deployment"]["stages"]["llm"]["engineArgs"] = {"kvCacheBytes": value}
    return [str(e) for e in validate(doc)]


@pytest.mark.parametrize("engine, value, expected", [
    ("transformers", 1 << 30, None),
    ("transformers", 0, "expected a positive integer (bytes), got 0"),
    ("transformers", "1Gi", "expected a positive integer (bytes), got '1Gi'"),
    ("transformers", True, "expected a positive integer (bytes), got True"),
    ("vllm", 1 << 30, "bounds the KV cache of transformers AR stages; the vllm engine takes no KV budget"),
])
def test_the_spec_refuses_a_kv_cache_bytes_that_is_not_a_positive_integer_naming_it(engine, value, expected):
    found = [e for e in spec_errors(engine, value) if "kvCacheBytes" in e]
    assert found == ([] if expected is None else [f"spec.deployment.stages.llm.engineArgs.kvCacheBytes: {expected}"])


def test_the_spec_refuses_a_kv_cache_bytes_on_a_transformers_stage_that_keeps_no_kv():
    doc = yaml.safe_load((EXAMPLES / "qwen3-omni-tiny.yaml").read_text())
    doc["spec"]["deployment"]["stages"]["code2wav"]["engineArgs"] = {"kvCacheBytes": 1 << 20}
    assert [str(e) for e in validate(doc)] == [
        "spec.deployment.stages.code2wav.engineArgs.kvCacheBytes: bounds the KV cache of transformers AR stages; "
        "a generation stage keeps none"]


# ---------------------------------------------------------------- the scheduler under a budget


@dataclass(eq=False)
class Tokens(StepState):
    """A sequence of `prompt` tokens that makes `length` more, one per step; its cache is sized as a paged one
    (every token fed), dropped when preempted and refilled by its next step."""

    name: str
    prompt: int
    length: int
    made: list[int] = field(default_factory=list)
    cached: int = 0  # tokens in its cache
    refills: int = 0
    preemptible: bool = True
    finished: bool = False

    def kv_bytes(self) -> int:
        return PAGES.bytes_for(self.cached)

    def kv_bytes_next(self) -> int:
        return PAGES.bytes_for(self.prompt + (len(self.made) if self.preemptible else self.length - 1))

    def preempt(self) -> None:
        self.cached = 0

    def release(self) -> None:
        self.cached = 0


def step(states: list[Tokens]) -> list[int]:
    for s in states:
        if s.cached == 0 and s.made:
            s.refills += 1
        s.cached = s.prompt + len(s.made)  # everything fed so far, the last token included
        s.made.append(len(s.made))
        s.finished = len(s.made) >= s.length
    return [s.made[-1] for s in states]


async def run_all(states: list[Tokens], budget: int | None, max_batch: int = 16) -> tuple[StepScheduler, list]:
    sched = StepScheduler("kv", SchedulerSettings(max_batch, 64, 0.0), step)
    sched.kv_budget = budget
    measured: list[int] = []
    inner = sched.step_fn
    sched.step_fn = lambda batch: (inner(batch), measured.append(sched.kv_held()))[0]  # after every step
    sched.start()

    async def one(s: Tokens) -> list[int]:
        async with sched.submit(s.name, s) as stream:
            return [r async for r in stream]

    outs = await asyncio.gather(*(one(s) for s in states))
    await sched.shutdown()
    return sched, [outs, measured]


async def test_many_long_sequences_all_finish_inside_a_budget_that_fits_a_few():
    budget = 3 * PAGES.bytes_for(6 + 20)
    states = [Tokens(f"s{i}", prompt=6, length=20) for i in range(10)]
    sched, (outs, measured) = await run_all(states, budget)
    assert outs == [list(range(20))] * 10  # no token repeated or lost across preemptions
    assert sched.preemptions > 0 and sum(s.refills for s in states) == sched.preemptions
    assert 0 < max(measured) <= budget and sched.kv_peak == max(measured)
    _, (unbounded, held) = await run_all([Tokens(f"s{i}", prompt=6, length=20) for i in range(10)], None)
    assert unbounded == outs and max(held) > budget  # the budget is what kept them in


async def test_a_state_that_cannot_be_recomputed_reserves_its_most_and_is_never_preempted():
    budget = PAGES.bytes_for(4 + 15) + PAGES.bytes_for(4 + 10)
    pinned = Tokens("pinned", prompt=4, length=16, preemptible=False)
    others = [Tokens(f"s{i}", prompt=4, length=11) for i in range(4)]
    sched, (outs, measured) = await run_all([pinned, *others], budget)
    assert outs == [list(range(16))] + [list(range(11))] * 4
    assert pinned.refills == 0 and max(measured) <= budget


async def test_the_oldest_is_preempted_too_when_one_that_cannot_be_recomputed_was_admitted_beside_it():
    """A long recomputable sequence admitted first, then one that reserves its most while the first is small:
    the first outgrows the budget, and only preempting it (the pinned one always makes progress) keeps it in."""
    budget = 2000  # each alone fits: first at its longest 19 tokens (5 pages), pinned 13 (4)
    first = Tokens("first", prompt=4, length=16)
    pinned = Tokens("pinned", prompt=4, length=10, preemptible=False)
    sched, (outs, measured) = await run_all([first, pinned], budget)
    assert outs == [list(range(16)), list(range(10))]
    assert max(measured) <= budget and first.refills >= 1 and pinned.refills == 0


async def test_preempted_states_wait_at_the_front_of_the_queue_in_admission_order():
    """The scheduler's loop is not started: the test moves it one admission at a time."""
    sched = StepScheduler("kv", SchedulerSettings(8, 64, 0.0), step)
    sched.kv_budget = PAGES.bytes_for(8) + PAGES.bytes_for(4)  # after their next step: room for one and a page
    a, b, c, late = (Tokens(n, prompt=3, length=12) for n in ("a", "b", "c", "late"))
    async with contextlib.AsyncExitStack() as stack:
        for s in (a, b, c):
            await stack.enter_async_context(sched.submit(s.name, s))
        sched._admit()
        assert [j.state.name for j in sched._running] == ["a", "b", "c"]
        for s in (a, b, c):  # grown: after their next step only one fits
            s.cached, s.made = 7, list(range(5))
        await stack.enter_async_context(sched.submit("late", late))
        sched._admit()
        assert [j.state.name for j in sched._running] == ["a"] and sched.preemptions == 2
        assert [j.state.name for j in sched._queue] == ["b", "c", "late"] and b.cached == c.cached == 0
        assert sched.kv_held() == PAGES.bytes_for(7)
    await sched.shutdown()


async def test_under_a_budget_every_queued_state_counts_against_max_queued():
    """A free batch slot is no room under a budget: maxQueued bounds the states waiting for the budget."""
    for budget, accepted in ((PAGES.bytes_for(8), 2), (None, 10)):  # unbounded: maxBatch 8 + maxQueued 2
        sched = StepScheduler("kv", SchedulerSettings(8, 2, 0.0), step)  # the loop is not started: all queue
        sched.kv_budget = budget
        async with contextlib.AsyncExitStack() as stack:
            for i in range(accepted):
                await stack.enter_async_context(sched.submit(f"s{i}", Tokens(f"s{i}", prompt=4, length=4)))
            with pytest.raises(EngineOverloaded, match=f"stage kv: {accepted} requests queued"):
                await stack.enter_async_context(sched.submit("late", Tokens("late", prompt=4, length=4)))
        await sched.shutdown()
