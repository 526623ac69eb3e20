"""What access lines cost: requests per second of the omni pipeline (qwen3-omni-tiny: thinker, talker,
code2wav) with `omnistage.access` lines on (one per request at the orchestrator, one per stage call, written as
JSON lines to a file, as a pod's log) over off (`--access-log off`), in the same run on the same servers, in
alternating rounds so that drift on a busy machine falls on both sides alike; and the lines per request.

The stages and the orchestrator run in this process (real gRPC servers on 127.0.0.1, the tiny models), so
both sides' lines reach the one log file.

    .venv/bin/python bench/observability_logs.py [--quick]
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import time
from pathlib import Path
from typing import Iterator

from common import figure, on_off_figures, run_measure

from omnistage import logs
from omnistage.api import load_pipeline
from omnistage.client import AsyncOmniClient
from omnistage.contract import launch
from orchestrator_service.server import OrchestratorServer
from stage_service.server import StageServer

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "qwen3-omni-tiny.yaml"
STAGES = ("thinker", "talker", "code2wav")
CONCURRENCY = 3  # requests in flight: a steady stream through all three stages at once
LINES = 1 + len(STAGES)  # per request: the orchestrator's, and one per stage call
LINES_BOUND_S = 10.0  # a safety bound on waiting for a round's last stage lines (written as each call ends)
REQUEST = dict(max_tokens=6, ignore_eos=True, max_codec_frames=10, timeout=120)


async def rps_round(client: AsyncOmniClient, n: int) -> float:
    """Requests per second over `n` requests, CONCURRENCY at a time."""
    todo = iter(range(n))

    async def worker():
        for _ in todo:
            await client.generate("Hello there", **REQUEST)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return n / (time.perf_counter() - t0)


def _access_lines(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if f'"logger": "{logs.ACCESS_LOGGER}"' in line)


async def wait_for_access_lines(path: Path, lines: int) -> None:
    """Until `path` holds `lines` access lines (a stage writes its line as its call ends, which may be just
    after the answer came), at most LINES_BOUND_S."""
    end = time.monotonic() + LINES_BOUND_S
    while _access_lines(path) < lines and time.monotonic() < end:
        await asyncio.sleep(0.01)


@contextlib.contextmanager
def access_log_file() -> Iterator[Path]:
    """This process's log lines, access lines included, written as JSON lines to a file (as a pod's log), at
    INFO; the access logger enabled again on exit. Yields the file's path."""
    root, access = logging.getLogger(), logging.getLogger(logs.ACCESS_LOGGER)
    with tempfile.TemporaryDirectory(prefix="omnistage-bench-logs-") as folder:
        path = Path(folder) / "process.log"
        handler = logging.FileHandler(path)
        handler.setFormatter(logs.formatter("json"))
        saved = root.level
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        try:
            yield path
        finally:
            access.disabled = False
            root.removeHandler(handler)
            root.setLevel(saved)
            handler.close()


async def _measure(quick: bool) -> list[dict]:
    with access_log_file() as path:
        return await _measure_into(path, quick)


async def _measure_into(path: Path, quick: bool) -> list[dict]:
    access = logging.getLogger(logs.ACCESS_LOGGER)
    pipeline = load_pipeline(EXAMPLE)
    stages = {}
    rounds, per_round = (3, 9) if quick else (6, 30)
    off, on, logged = [], [], 0
    try:
        for name in STAGES:
            stages[name] = StageServer(pipeline, name, "127.0.0.1", 0, model_root=str(launch.model_root()))
            await stages[name].start()
        orc = OrchestratorServer(pipeline, {n: [f"127.0.0.1:{s.port}"] for n, s in stages.items()})
        await orc.start(wait_for_stages=30)
        try:
            async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
                access.disabled = True
                await rps_round(client, CONCURRENCY)  # warm-up: first-call costs on every stage
                for _ in range(rounds):
                    access.disabled = True
                    off.append(await rps_round(client, per_round))
                    access.disabled = False
                    on.append(await rps_round(client, per_round))
                    logged += per_round
                    await wait_for_access_lines(path, logged * LINES)
                    access.disabled = True   # before the next "off" round: none of its lines
        finally:
            await orc.drain()
    finally:
        for s in stages.values():
            await s.drain()
    lines = _access_lines(path)
    return [figure("logs.access_lines_per_request", lines / logged, "lines"),
            *on_off_figures("logs", on, off)]


def measure(quick: bool) -> list[dict]:
    return asyncio.run(_measure(quick))


def main() -> None:
    run_measure("observability_logs", "Access logs (qwen3-omni-tiny, JSON lines to a file)", measure,
                {"concurrency": CONCURRENCY})


if __name__ == "__main__":
    main()
