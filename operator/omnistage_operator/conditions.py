"""Pure condition bookkeeping: upsert a condition by type; `lastTransitionTime` moves only when the
status flips, so an unchanged world gives an unchanged status (and no write)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any


def condition(type_: str, status: bool | str, reason: str, message: str, generation: int | None = None) -> dict:
    value = status if isinstance(status, str) else ("True" if status else "False")
    cond: dict[str, Any] = {"type": type_, "status": value, "reason": reason, "message": message}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def set_condition(conditions: list[dict], cond: dict, now: str) -> bool:
    """Put `cond` into `conditions` (in place); True when anything changed."""
    for i, old in enumerate(conditions):
        if old.get("type") != cond["type"]:
            continue
        new = dict(cond)
        flipped = old.get("status") != cond["status"]
        new["lastTransitionTime"] = now if flipped or not old.get("lastTransitionTime") else old["lastTransitionTime"]
        if new == old:
            return False
        conditions[i] = new
        return True
    conditions.append({**cond, "lastTransitionTime": now})
    return True


def get_condition(conditions: list[dict] | None, type_: str) -> dict | None:
    return next((c for c in conditions or () if c.get("type") == type_), None)


def is_true(conditions: list[dict] | None, type_: str) -> bool:
    c = get_condition(conditions, type_)
    return c is not None and c.get("status") == "True"


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
