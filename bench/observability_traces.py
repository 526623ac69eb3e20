"""What tracing costs: spans per request of the omni pipeline (qwen3-omni-tiny: thinker, talker, code2wav),
and requests per second with tracing on (every span made and handed to the SDK's in-memory exporter) over
tracing off, in the same run on the same servers, in alternating rounds so that drift on a busy machine
falls on both sides alike.

The stages and the orchestrator run in this process (real gRPC servers on 127.0.0.1, the tiny models), so
spans from both sides reach the one exporter.

    .venv/bin/python bench/observability_traces.py [--quick]
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from common import figure, on_off_figures, run_measure
from observability_logs import CONCURRENCY, rps_round

from omnistage import tracing
from omnistage.api import load_pipeline
from omnistage.client import AsyncOmniClient
from omnistage.contract import launch
from orchestrator_service.server import OrchestratorServer
from stage_service.server import StageServer

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "qwen3-omni-tiny.yaml"
STAGES = ("thinker", "talker", "code2wav")
SPANS = 1 + 3 * len(STAGES)  # per request: the root, and queue, compute and transfer at each stage
SPANS_BOUND_S = 10.0  # a safety bound on waiting for the last stage spans of a round to end


async def _measure(quick: bool) -> list[dict]:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    pipeline = load_pipeline(EXAMPLE)
    stages = {}
    for name in STAGES:
        stages[name] = StageServer(pipeline, name, "127.0.0.1", 0, model_root=str(launch.model_root()))
        await stages[name].start()
    orc = OrchestratorServer(pipeline, {n: [f"127.0.0.1:{s.port}"] for n, s in stages.items()})
    await orc.start(wait_for_stages=30)
    rounds, per_round = (3, 9) if quick else (6, 30)
    off: list[float] = []
    on: list[float] = []
    traced = 0
    spans: list = []
    try:
        async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
            await rps_round(client, CONCURRENCY)  # warm-up: first-call costs on every stage
            for _ in range(rounds):
                tracing.shutdown()
                off.append(await rps_round(client, per_round))
                exporter = InMemorySpanExporter()  # one per round: shutting the tracer down stops its exporter
                tracing.configure(exporter, "omnistage-bench")
                on.append(await rps_round(client, per_round))
                traced += per_round
                # a stage ends its transfer span as its stream closes, which may be just after the answer came
                end = time.monotonic() + SPANS_BOUND_S
                while len(exporter.get_finished_spans()) < per_round * SPANS and time.monotonic() < end:
                    await asyncio.sleep(0.01)
                tracing.shutdown()
                spans += exporter.get_finished_spans()
    finally:
        tracing.shutdown()
        await orc.drain()
        for s in stages.values():
            await s.drain()
    traces = {s.context.trace_id for s in spans}
    assert len(traces) == traced, (len(traces), traced)
    return [figure("traces.spans_per_request", len(spans) / traced, "spans"),
            *on_off_figures("traces", on, off)]


def measure(quick: bool) -> list[dict]:
    return asyncio.run(_measure(quick))


def main() -> None:
    run_measure("observability_traces", "Traces (qwen3-omni-tiny, in-memory exporter)", measure,
                {"concurrency": CONCURRENCY})


if __name__ == "__main__":
    main()
