"""Waiting in tests: poll a condition with a timeout, never a fixed sleep. `wait_until` for coroutines,
`wait_until_sync` for plain test code; both take the same arguments and fail the same way."""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Callable


async def wait_until(condition: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02,
                     what: str = "condition", detail: Callable[[], Any] | None = None) -> Any:
    """Poll `condition()` (plain or async) until it returns something truthy, and return that.

    After `timeout` seconds fail naming `what`, with `detail()` (plain or async: the state that kept
    the condition false) when given.
    """
    end = time.monotonic() + timeout
    while True:
        value = await _resolved(condition())
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(_failure(what, timeout, None if detail is None else await _resolved(detail())))
        await asyncio.sleep(interval)


def wait_until_sync(condition: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02,
                    what: str = "condition", detail: Callable[[], Any] | None = None) -> Any:
    """`wait_until` for code outside an event loop (blocks the thread between polls)."""
    end = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(_failure(what, timeout, None if detail is None else detail()))
        time.sleep(interval)


async def _resolved(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _failure(what: str, timeout: float, detail: Any) -> str:
    return f"{what} not reached within {timeout}s" + ("" if detail is None else f": {detail}")
