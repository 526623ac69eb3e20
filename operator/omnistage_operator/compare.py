"""Pure comparison of a desired child with the live object: does the live one already hold every
field we set? The apiserver adds defaults and rewrites quantities ("0.5" -> "500m"), so equality is
"desired is a subset of live", with quantities compared by value. A field edited by hand breaks the
subset and the child is put back; fields we never set (defaults, other controllers' annotations)
are left alone."""

from __future__ import annotations

from typing import Any

from kubernetes.utils import parse_quantity

# Keys whose values are resource quantities.
_QUANTITY_PARENTS = ("requests", "limits")


def matches(desired: Any, live: Any, *, quantities: bool = False) -> bool:
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return live is None and not desired
        for key, want in desired.items():
            have = live.get(key)
            if have is None and _empty(want):
                continue   # the apiserver drops empty maps and lists, and false booleans
            if not matches(want, have, quantities=quantities or key in _QUANTITY_PARENTS):
                return False
        return True
    if isinstance(desired, list):
        if not isinstance(live, list):
            return live is None and not desired
        return len(desired) == len(live) and all(matches(d, l_) for d, l_ in zip(desired, live))
    if quantities and desired is not None and live is not None:
        return _same_quantity(desired, live)
    return desired == live


def _same_quantity(a: Any, b: Any) -> bool:
    try:
        return parse_quantity(a) == parse_quantity(b)
    except ValueError:
        return a == b


def _empty(value: Any) -> bool:
    return value is False or value is None or value in ({}, [], "")
