"""The denoise loop's step cache without a model: its engineArgs (refused by name when bad), its reuse decision per
request (step_cache.py's `StepCachePolicy`), and its per-request state's bytes."""

from __future__ import annotations

import pytest
import torch

from stage_service.engines.diffusers.step_cache import StepCachePolicy, StepCacheState, relative_change
from stage_service.runtime.base import EngineOptions
from stage_service.runtime.errors import EngineConfigError

ARGS = "spec.deployment.stages.denoise.engineArgs"


@pytest.mark.parametrize("args, threshold, warmup", [
    ({}, None, 1),
    ({"step_cache_threshold": 0.08}, 0.08, 1),
    ({"step_cache_threshold": 1}, 1.0, 1),  # YAML's 1 is an int
    ({"step-cache-threshold": 0.2, "step_cache_warmup": 3}, 0.2, 3),
])
def test_the_step_cache_is_off_by_default_and_takes_a_threshold_and_a_warmup(args, threshold, warmup):
    options = EngineOptions.parse("denoise", args)
    assert options.step_cache_threshold == threshold and options.step_cache_warmup == warmup
    assert threshold is None or type(options.step_cache_threshold) is float


@pytest.mark.parametrize("args, message", [
    ({"step_cache_threshold": 0}, "step_cache_threshold: expected a number above 0 and at most 1, got 0"),
    ({"step_cache_threshold": -0.1}, "step_cache_threshold: expected a number above 0 and at most 1, got -0.1"),
    ({"step_cache_threshold": 1.5}, "step_cache_threshold: expected a number above 0 and at most 1, got 1.5"),
    ({"step_cache_threshold": "0.1"}, "step_cache_threshold: expected a number above 0 and at most 1, got '0.1'"),
    ({"step_cache_threshold": True}, "step_cache_threshold: expected a number above 0 and at most 1, got True"),
    ({"step_cache_threshold": float("nan")}, "step_cache_threshold: expected a number above 0 and at most 1"),
    ({"step_cache_threshold": 0.1, "step_cache_warmup": 0}, "step_cache_warmup: expected a positive integer"),
    ({"step_cache_threshold": 0.1, "step_cache_warmup": 1.5}, "step_cache_warmup: expected a positive integer"),
    ({"step_cache_warmup": 2}, "step_cache_warmup: applies with step_cache_threshold"),
    ({"step_cache": {"threshold": 0.1}}, "unknown key(s) step_cache"),
])
def test_a_bad_step_cache_setting_is_refused_naming_it(args, message):
    with pytest.raises(EngineConfigError) as e:
        EngineOptions.parse("denoise", args)
    assert str(e.value).startswith(ARGS) and message in str(e.value)


def cache_at(signal: torch.Tensor) -> StepCacheState:
    return StepCacheState(signal=signal, residual=torch.zeros_like(signal))


BEFORE = torch.full((2, 4, 8), 2.0)


@pytest.mark.parametrize("cache, step, want", [
    (StepCacheState(), 5, False),      # nothing computed yet
    (cache_at(BEFORE), 0, False),      # the warmup step
    (cache_at(BEFORE), 9, False),      # the last step
    (cache_at(BEFORE), 5, True),
])
def test_a_request_may_reuse_only_between_warmup_and_its_last_step_once_it_has_a_cache(cache, step, want):
    assert StepCachePolicy(threshold=0.1, warmup=1).may_reuse(cache, step, steps=10) is want


@pytest.mark.parametrize("now, below", [(BEFORE, True), (BEFORE * 1.09, True), (BEFORE * 1.11, False)])
def test_the_change_of_the_first_blocks_residual_decides_against_the_threshold(now, below):
    assert (float(relative_change(now, BEFORE)) < 0.1) is below
    assert float(relative_change(now, torch.zeros(2, 4, 8))) == float("inf")  # nothing to compare against


def test_the_change_is_the_requests_own_rows_relative_l1():
    before = torch.tensor([[1.0, -1.0], [2.0, -2.0]])
    now = before + torch.tensor([[0.3, 0.0], [0.0, -0.3]])
    assert float(relative_change(now, before)) == pytest.approx(0.6 / 6)
    assert float(relative_change(now.half(), before.half())) == pytest.approx(0.1, rel=1e-2)  # in float32


def test_a_longer_warmup_computes_its_first_steps():
    cache = cache_at(BEFORE)
    policy = StepCachePolicy(threshold=0.5, warmup=3)
    assert [policy.may_reuse(cache, step, 10) for step in range(10)] == [False] * 3 + [True] * 6 + [False]


def test_its_tensors_count_in_the_requests_bytes_and_go_with_it():
    cache = StepCacheState(signal=torch.zeros(2, 16, 8), residual=torch.zeros(2, 16, 8))
    assert cache.held_bytes() == 2 * 2 * 16 * 8 * 4
    cache.release()
    assert cache.held_bytes() == 0 and cache.signal is None and cache.residual is None


def test_a_denoise_states_bytes_count_its_cache_and_its_release_frees_it():
    from stage_service.engines.diffusers.engines import DenoiseState

    latents, text = torch.zeros(1, 4, 2, 2), {"encoder_hidden_states": torch.zeros(2, 3, 4)}
    plain = DenoiseState(scheduler=None, latents=latents, text=dict(text), guidance=5.0, generator=torch.Generator())
    cache = StepCacheState(signal=torch.zeros(2, 16, 8), residual=torch.zeros(2, 16, 8))
    cached = DenoiseState(scheduler=None, latents=latents, text=dict(text), guidance=5.0,
                          generator=torch.Generator(), cache=cache)
    assert cached.held_bytes() == plain.held_bytes() + cache.held_bytes() > plain.held_bytes()
    cached.release()
    assert cached.held_bytes() == 0 and cache.signal is None
