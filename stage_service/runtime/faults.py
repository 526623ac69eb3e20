"""Fault injection for tests and chaos drills: a real engine whose steps start failing.

Not a mock: the engine loads its model and runs its real steps; from the chosen
step on, the step raises instead, as a broken device or a corrupted model would.
"""

from __future__ import annotations

import threading

from stage_service.runtime.base import SteppedEngine


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
