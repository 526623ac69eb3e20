"""The work units a stage replica did for each request it is serving, until the request's call hands them on.

The stage's `omnistage_stage_units_total` counts work in aggregate; the planner also needs it per request
(per request class, the demand on each stage), so the same units are tallied per request id as they are
counted, and the call's last chunk carries its request's total (`ChunkTiming.units`) into the trace.
An engine owns one: the step scheduler adds one per request per step it delivers, vLLM the tokens each
output brings. The call scope takes a request's tally when its last call here ends, however it ends, so
nothing is kept for requests that are gone.

Used on the event loop only (the scheduler adds when it delivers a step, not on its worker thread). Two
calls of one request on the same replica at once (a retry that came back here while the old call ends)
share its tally: the old call leaving takes nothing while the new one serves, so the new call's last chunk
carries both calls' units (the work the replica did for the request).
"""

from __future__ import annotations


class WorkTally:
    """request id -> work units done for it so far."""

    def __init__(self) -> None:
        self._units: dict[str, int] = {}

    def add(self, request_id: str, n: int = 1) -> None:
        if n:
            self._units[request_id] = self._units.get(request_id, 0) + n

    def peek(self, request_id: str) -> int:
        """The request's units so far (0 when none), kept."""
        return self._units.get(request_id, 0)

    def take(self, request_id: str) -> int:
        """The request's units so far (0 when none), forgotten here."""
        return self._units.pop(request_id, 0)

    def __len__(self) -> int:
        """Requests with units held (a leak check: 0 once every call has ended)."""
        return len(self._units)
