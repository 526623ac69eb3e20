"""The per-request part of a batched step: where one request's own values can fail it, it fails alone.

A step function runs its batch's shared forward, then each state's own part (sampling with its
settings and generator, its guidance and scheduler step, its image encoding) through `alone`. When
that part raises, the state finishes and a `RequestFailed` is its result in the step's list: the
scheduler ends that request with it (a result that is an exception), its neighbours get their
results, and the step counts as a good one. A shared forward that raises is still the step's failure:
it fails the whole batch, and enough of those in a row the engine.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any, Callable, TypeVar

from stage_service.runtime.errors import RequestFailed
from stage_service.runtime.scheduler import StepState

log = logging.getLogger("omnistage.stage")
T = TypeVar("T")


def alone(state: StepState, part: Callable[..., T], *args: Any) -> T | RequestFailed:
    """`part(*args)`, the work of a step that uses `state`'s own values only; if it raises, `state` is
    finished (nothing steps it again) and the `RequestFailed` returned is its result."""
    try:
        return part(*args)
    except Exception as e:  # noqa: BLE001 - whatever this request's own values made fail is its failure alone
        state.finished = True
        # Kept as text, without the traceback: its frames hold the batch's states and tensors.
        log.warning("a request failed alone in its batch\n%s", "".join(traceback.format_exception(e)).rstrip())
        return RequestFailed(f"{type(e).__name__}: {e}")


def unless_failed(results: list, convert: Callable[[Any], T]) -> list[T | RequestFailed]:
    """Each step result converted, a request's failure passed on as it is."""
    return [r if isinstance(r, RequestFailed) else convert(r) for r in results]
