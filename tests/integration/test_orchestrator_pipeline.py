"""The orchestrator walking real stage services (in-process, port 0) for Qwen3-Omni tiny."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from omnistage.client import AsyncOmniClient
from omnistage.contract import launch
from omnistage.planner.scrape import (
    CLASS_ENDED,
    CLASS_FINISHED,
    CLASS_REQUESTS,
    CLASS_STAGE_REQUESTS,
    CLASS_STAGE_UNITS,
    RTF,
    UNITS,
)
from orchestrator_service.server import OrchestratorServer

from ..harness import example, start_stage

PIPELINE = example("qwen3-omni-tiny")


@pytest.fixture(scope="module")
async def pipeline(model_dir):
    stages = {n: await start_stage(PIPELINE, n, model_dir) for n in ("thinker", "talker", "code2wav")}
    orc = OrchestratorServer(PIPELINE, {n: [f"127.0.0.1:{s.port}"] for n, s in stages.items()}, http_port=0)
    await orc.start(wait_for_stages=30)
    client = AsyncOmniClient(f"127.0.0.1:{orc.port}")
    yield client, orc, stages
    await client.close()
    await orc.drain()
    for s in stages.values():
        await s.drain()


def rtf_observed(orc) -> float:
    """Requests whose real-time factor the orchestrator observed (omnistage_request_rtf, for targets.rtf)."""
    return orc.metrics.registry.get_sample_value(f"{RTF}_count") or 0.0


async def test_text_and_audio_stream_back_with_a_trace(pipeline):
    client, orc, stages = pipeline
    observed = rtf_observed(orc)
    r = await client.generate("Hello there", max_tokens=8, ignore_eos=True, max_codec_frames=30,
                              return_trace=True, timeout=120)
    assert r.text and len(r.token_ids) == 8
    assert r.sample_rate == 24000 and len(r.pcm) > 0 and r.audio_chunks == 2  # 30 frames: a first chunk of 15, then 15
    assert r.final.usage.completion_tokens == 8 and r.final.usage.prompt_tokens > 0
    assert r.final.usage.audio_samples == len(r.pcm) // 2
    assert [s.stage for s in r.final.trace.stages] == ["thinker", "talker", "code2wav"]
    for s in r.final.trace.stages:
        assert s.compute_ms > 0 and s.total_ms >= s.first_chunk_ms > 0 and s.chunks >= 1 and s.attempts == 1
    assert r.events[-1] == "final" and r.events.count("final") == 1
    # its real-time factor: seconds to its last audio chunk over its audio's seconds (above 0, finite)
    assert rtf_observed(orc) == observed + 1
    rtf_sum = orc.metrics.registry.get_sample_value(f"{RTF}_sum")
    assert 0 < rtf_sum < float("inf")


def scraped(port: int) -> dict[tuple[str, tuple], float]:
    """The orchestrator's /metrics as the planner reads them: (sample name, its labels) -> value."""
    with urllib.request.urlopen(launch.http_url("127.0.0.1", port, launch.METRICS_PATH), timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def stage_units(stage) -> float:
    """What a stage's omnistage_stage_units_total counted so far."""
    return stage.metrics.registry.get_sample_value(f"{UNITS}_total", {"stage": stage.stage.name,
                                                                      "unit": stage.engine.unit}) or 0.0


async def test_a_finished_trace_carries_each_stages_work_units_counted_per_request_class(pipeline):
    """Each stage's units in the trace are what its omnistage_stage_units_total counted for the request (one
    per engine step it took part in): the Thinker's generated tokens, the Talker's codec frames and the step
    that prefilled its prompt, Code2Wav's decoded chunks; the orchestrator counts them under the class."""
    client, orc, stages = pipeline
    port = orc.http.port
    before = await asyncio.to_thread(scraped, port)
    counted = {n: stage_units(s) for n, s in stages.items()}
    r = await client.generate("Hello there", max_tokens=6, ignore_eos=True, max_codec_frames=20,
                              return_trace=True, timeout=120)
    units = {s.stage: (s.units, s.unit) for s in r.final.trace.stages}
    assert units == {"thinker": (6, "tokens"), "talker": (1 + 20, "frames"), "code2wav": (2, "chunks")}
    assert len(r.token_ids) == 6 and r.audio_chunks == 2  # 20 frames: a first chunk of 15, then 5
    assert {n: stage_units(s) - counted[n] for n, s in stages.items()} == {n: u for n, (u, _) in units.items()}
    assert all(len(s.engine.tally) == 0 for s in stages.values())  # taken by each stage's last chunk

    after = await asyncio.to_thread(scraped, port)

    def added(name: str, **labels) -> float:
        key = (f"{name}_total", tuple(sorted({"class": "text->text+audio", **labels}.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert added(CLASS_REQUESTS) == added(CLASS_FINISHED) == added(CLASS_ENDED) == 1
    for stage, (n, unit) in units.items():
        assert added(CLASS_STAGE_REQUESTS, stage=stage) == 1
        assert added(CLASS_STAGE_UNITS, stage=stage, unit=unit) == n


async def test_text_only_request_skips_the_speech_stages(pipeline):
    client, orc, stages = pipeline
    before = stages["talker"].metrics.requests.labels("talker", "finished")._value.get()
    observed = rtf_observed(orc)
    r = await client.generate("Hi", max_tokens=4, outputs=["text"], return_trace=True, timeout=60)
    assert r.text and not r.pcm and [s.stage for s in r.final.trace.stages] == ["thinker"]
    assert stages["talker"].metrics.requests.labels("talker", "finished")._value.get() == before
    assert rtf_observed(orc) == observed   # no audio: no real-time factor


async def test_audio_cut_at_its_codec_frame_cap_is_reported_as_length(pipeline):
    """Audio-only answers (as /v1/audio/speech asks) carried no text stage's reason and were always "stop",
    even when the Talker stopped at maxCodecFrames mid-sentence."""
    client, orc, stages = pipeline
    r = await client.generate("Hello there", max_tokens=8, max_codec_frames=4, outputs=["audio"], timeout=120)
    assert r.pcm and r.final.finish_reason == "length"


@pytest.mark.parametrize("kw,field", [
    (dict(prompt=""), "params.prompt"),
    (dict(max_tokens=100_000), "params.text.max_tokens"),
    (dict(outputs=["image"]), "outputs[0]"),
    (dict(request_id="x" * 500), "request_id"),
])
async def test_bad_requests_are_invalid_argument_naming_the_field(pipeline, kw, field):
    client, orc, stages = pipeline
    kw = {"prompt": "hi", **kw}
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.generate(timeout=30, **kw)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(field)


async def test_bad_speaker_from_a_stage_reaches_the_client(pipeline):
    client, orc, stages = pipeline
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.generate("hi", max_tokens=3, speaker="nobody", timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "params.audio.speaker" in e.value.details()
    r = await client.generate("hi", max_tokens=3, max_codec_frames=5, timeout=60)
    assert r.final is not None


async def test_a_stage_that_is_gone_gives_unavailable_naming_it(model_dir):
    stages = {n: await start_stage(PIPELINE, n, model_dir) for n in ("thinker", "code2wav")}
    endpoints = {n: [f"127.0.0.1:{s.port}"] for n, s in stages.items()}
    endpoints["talker"] = ["127.0.0.1:1"]  # nothing listens there
    orc = OrchestratorServer(PIPELINE, endpoints)
    await orc.start()
    try:
        async with AsyncOmniClient(f"127.0.0.1:{orc.port}") as client:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.generate("hi", max_tokens=3, timeout=60)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "stage talker" in e.value.details()
        # The request's other stage calls were cancelled: nothing is left running on them.
        for s in stages.values():
            assert s.servicer.inflight == 0
    finally:
        await orc.drain()
        for s in stages.values():
            await s.drain()


async def test_the_trace_names_each_stage_transfer_path_and_work(pipeline):
    # (its OpenTelemetry spans, made as the request goes: tests/integration/test_traces.py)
    client, orc, stages = pipeline
    r = await client.generate("Hello", max_tokens=4, max_codec_frames=10, return_trace=True, timeout=120)
    traced = {s.stage: s for s in r.final.trace.stages}
    # the memory path its inputs took (connector paths): CPU to CPU here; the thinker reads no stage
    assert traced["talker"].transfer_path == "host"
    assert traced["thinker"].transfer_path == ""
    thinker = traced["thinker"]  # its work: the tokens it generated
    assert thinker.unit == "tokens" and thinker.units == len(r.token_ids)
