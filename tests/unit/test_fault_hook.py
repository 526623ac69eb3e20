"""The test fault hook's switch (stage_service/runtime/faults.py): an environment variable, read once where
the stage process starts; anything but a count of steps is refused naming the variable."""

from __future__ import annotations

import pytest

from stage_service.runtime.faults import ENV_INJECT_STEP_FAILURE, fail_steps_from_env, injected_step_failure


@pytest.mark.parametrize("env, after", [
    ({}, None),                              # unset: no fault
    ({ENV_INJECT_STEP_FAILURE: ""}, None),
    ({ENV_INJECT_STEP_FAILURE: "0"}, 0),     # every step fails
    ({ENV_INJECT_STEP_FAILURE: "3"}, 3),
])
def test_the_environment_says_after_which_step_the_engine_fails(env, after):
    assert injected_step_failure(env) == after


@pytest.mark.parametrize("value", ["x", "2.5", "-1"])
def test_a_bad_value_is_refused_naming_the_variable(value):
    with pytest.raises(ValueError, match=f"^{ENV_INJECT_STEP_FAILURE}="):
        injected_step_failure({ENV_INJECT_STEP_FAILURE: value})


def test_without_the_variable_the_engine_is_left_alone():
    engine = object()  # not even a stepped engine: nothing is asked of it
    fail_steps_from_env(engine, {})
