"""targets.underruns end to end on the orchestrator's side: real stage services for Qwen3-Omni tiny (in-process,
port 0), an orchestrator delivering real audio, and its /metrics text read as the planner reads it: every audio
chunk a client received is counted, the late ones among them, and the planner's window counts them both."""

from __future__ import annotations

import asyncio
import urllib.request

from omnistage.client import AsyncOmniClient
from omnistage.contract import launch
from omnistage.planner.latency import counted_since
from omnistage.planner.scrape import AUDIO_CHUNKS, AUDIO_UNDERRUNS, orchestrator_counters
from orchestrator_service.server import OrchestratorServer

from ..harness import example, start_stage

PIPELINE = example("qwen3-omni-tiny")
REQUESTS = 2


def scrape(port: int) -> str:
    with urllib.request.urlopen(launch.http_url("127.0.0.1", port, launch.METRICS_PATH), timeout=10) as r:
        return r.read().decode()


async def test_every_audio_chunk_delivered_and_the_late_ones_reach_the_planner_from_the_metrics_text(model_dir):
    stages = {n: await start_stage(PIPELINE, n, model_dir) for n in ("thinker", "talker", "code2wav")}
    orc = OrchestratorServer(PIPELINE, {n: [f"127.0.0.1:{s.port}"] for n, s in stages.items()}, http_port=0)
    try:
        await orc.start(wait_for_stages=30)
        async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
            before = orchestrator_counters(await asyncio.to_thread(scrape, orc.http.port))
            answers = [await client.generate("Hello there", max_tokens=6, ignore_eos=True, max_codec_frames=45,
                                             timeout=120) for _ in range(REQUESTS)]
            # a text-only request delivers no audio chunk: it counts in neither
            await client.generate("Hello there", max_tokens=4, ignore_eos=True, outputs=["text"],
                                  timeout=120)
            after = orchestrator_counters(await asyncio.to_thread(scrape, orc.http.port))
    finally:
        await orc.drain()
        for s in stages.values():
            await s.drain()
    delivered = sum(r.audio_chunks for r in answers)
    assert all(r.audio_chunks >= 2 for r in answers)        # 45 frames: a first chunk of 15, then more
    window = counted_since([{"orch-0": before}, {"orch-0": after}])
    assert window[AUDIO_CHUNKS] == delivered
    # a request's first chunk starts its playback and is never late; any other may be, on a loaded machine
    assert 0 <= window[AUDIO_UNDERRUNS] <= delivered - REQUESTS
    assert after[AUDIO_UNDERRUNS] == orc.metrics.registry.get_sample_value(f"{AUDIO_UNDERRUNS}_total")
