"""Fault injection for tests and chaos drills: a real engine whose steps start failing.

Not a mock: the engine loads its model and runs its real steps; from the chosen
step on, the step raises instead, as a broken device or a corrupted model would.

In process: `fail_steps(engine, after=N)`. In a stage process (`python -m stage_service`), the environment
variable ENV_INJECT_STEP_FAILURE=N: a test's switch, kept out of the command line, which is the production
contract (`omnistage/contract/launch.py`).
"""

from __future__ import annotations

import os
import threading
from typing import Mapping

from stage_service.runtime.base import Engine, SteppedEngine

# N: every engine step after the N-th raises (unset: none does).
ENV_INJECT_STEP_FAILURE = "OMNISTAGE_TEST_INJECT_STEP_FAILURE"


class InjectedFault(RuntimeError):
    """Raised by an engine step that was told to fail."""


def fail_steps(engine: SteppedEngine, after: int, count: int | None = None) -> None:
    """Make the engine's steps after the first `after` raise: `count` of them, or every one from then on."""
    if not isinstance(engine, SteppedEngine):
        raise TypeError(f"{type(engine).__name__} does not run on the step scheduler: no steps to fail")
    real = engine.scheduler.step_fn
    lock = threading.Lock()
    taken = 0

    def step(states):
        nonlocal taken
        with lock:
            taken += 1
            n = taken
        if n > after and (count is None or n <= after + count):
            raise InjectedFault(f"injected failure at step {n}")
        return real(states)

    engine.scheduler.step_fn = step


def injected_step_failure(env: Mapping[str, str] = os.environ) -> int | None:
    """The N of ENV_INJECT_STEP_FAILURE (unset or empty: None); ValueError naming the variable otherwise."""
    value = env.get(ENV_INJECT_STEP_FAILURE, "")
    if not value:
        return None
    try:
        after = int(value)
    except ValueError:
        raise ValueError(f"{ENV_INJECT_STEP_FAILURE}={value!r}: must be a whole number of steps") from None
    if after < 0:
        raise ValueError(f"{ENV_INJECT_STEP_FAILURE}={value!r}: must be >= 0")
    return after


def fail_steps_from_env(engine: Engine, env: Mapping[str, str] = os.environ) -> None:
    """fail_steps(engine, after=N) when the environment asks for it (ENV_INJECT_STEP_FAILURE=N)."""
    after = injected_step_failure(env)
    if after is not None:
        fail_steps(engine, after=after)
