"""A stage's access log: one `omnistage.access` line per Process call, written as the call ends
(call_scope.StageCalls): the stage, the request id, its outcome and status, the seconds it waited in the
engine's queue and computed, its wall seconds, and the work units it made (tokens, codec frames, steps).
Levels as the orchestrator's lines (`logs.level_for`): a bad input or a cancel is INFO, load and deadlines
WARNING, a fault of this stage ERROR.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc

from omnistage.logs import ACCESS_LOGGER, level_for

log = logging.getLogger(ACCESS_LOGGER)
# The status of a call that ended without an error status (call_scope: outcome finished or cancelled).
_NO_STATUS = {"finished": grpc.StatusCode.OK, "cancelled": grpc.StatusCode.CANCELLED}


def write(stage: str, request_id: str, outcome: str, status: grpc.StatusCode | None, queue_s: float,
          compute_s: float, total_s: float, units: int, unit: str) -> None:
    """The line of one call; nothing built when the access log is off."""
    status = status or _NO_STATUS.get(outcome, grpc.StatusCode.UNKNOWN)
    level = level_for(status)
    if not log.isEnabledFor(level):
        return
    fields: dict[str, Any] = {"stage": stage, "request_id": request_id, "outcome": outcome, "status": status.name,
                              "queue_s": round(queue_s, 6), "compute_s": round(compute_s, 6),
                              "total_s": round(total_s, 6), "units": units, "unit": unit}
    log.log(level, " ".join(f"{k}={v}" for k, v in fields.items() if v not in (None, "")), extra=fields)
