"""Memory held across fuzz runs: a fuzz pass must leave nothing behind that grows with the inputs."""

from __future__ import annotations

import asyncio
import gc
from typing import Callable

import psutil


async def second_pass_growth(run: Callable[[], None]) -> int:
    """The process's RSS growth over a second pass of `run` (a blocking fuzz pass, run on a thread), after a
    first pass that warms caches and lazily built objects."""
    proc = psutil.Process()
    await asyncio.to_thread(run)
    gc.collect()
    rss = proc.memory_info().rss
    await asyncio.to_thread(run)
    gc.collect()
    return proc.memory_info().rss - rss
