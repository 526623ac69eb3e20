"""Prometheus conventions on a real orchestrator over a real stage (the tiny LM on the transformers engine):
latencies in seconds, and each client request counted once among the ended outcomes, apart from the
admitted count. Read from the /metrics text the status port serves, as Prometheus reads it."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from omnistage.client import AsyncOmniClient
from omnistage.contract import launch
from orchestrator_service.server import OrchestratorServer

from ..harness import small_lm, start_stage

LM_LIMITS = {"defaultMaxTokens": 2, "maxTokens": 4}   # answers of a few tokens: the requests are cheap
ADMITTED = "omnistage_requests_admitted_total"
ENDED = "omnistage_requests_ended_total"


@pytest.fixture(scope="module")
async def served(model_dir):
    pipeline = small_lm(LM_LIMITS)
    stage = await start_stage(pipeline, "llm", model_dir, http_port=0)
    orc = OrchestratorServer(pipeline, {"llm": [f"127.0.0.1:{stage.port}"]}, http_port=0)
    await orc.start(wait_for_stages=30)
    client = AsyncOmniClient(f"127.0.0.1:{orc.port}")
    yield client, orc, stage
    await client.close()
    await orc.drain()
    await stage.drain()


def scrape(port: int) -> dict[str, float]:
    """Every sample of a /metrics page, keyed `name{label=value,...}` (labels sorted)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{launch.METRICS_PATH}", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def ended(samples: dict[str, float]) -> dict[str, float]:
    return {k.split("outcome=")[1].rstrip("}"): v for k, v in samples.items() if k.startswith(ENDED + "{")}


async def test_an_admitted_request_that_finishes_is_counted_once_among_the_ended(served):
    client, orc, _ = served
    before = scrape(orc.http.port)
    await client.generate("Hello", timeout=120)
    after = scrape(orc.http.port)
    assert after[ADMITTED + "{}"] - before.get(ADMITTED + "{}", 0.0) == 1
    moved = {k: v - ended(before).get(k, 0.0) for k, v in ended(after).items()}
    assert moved.get("finished") == 1 and sum(moved.values()) == 1   # no "admitted" among the end states
    assert "admitted" not in ended(after)


async def test_a_request_refused_before_admission_is_ended_and_never_admitted(served):
    client, orc, _ = served
    before = scrape(orc.http.port)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await client.generate("Hello", max_tokens=LM_LIMITS["maxTokens"] + 1, timeout=120)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = scrape(orc.http.port)
    assert after.get(ADMITTED + "{}", 0.0) == before.get(ADMITTED + "{}", 0.0)
    moved = {k: v - ended(before).get(k, 0.0) for k, v in ended(after).items()}
    assert moved.get("invalid") == 1 and sum(moved.values()) == 1


async def test_latencies_are_in_seconds(served):
    """A request's latency is read within the wall time the caller saw (in ms it would be a thousand times
    that), on the orchestrator and, for the engine's steps, on the stage."""
    client, orc, stage = served
    before, stage_before = scrape(orc.http.port), scrape(stage.http.port)
    started = time.monotonic()
    await client.generate("Hello", timeout=120)
    wall = time.monotonic() - started
    after, stage_after = scrape(orc.http.port), scrape(stage.http.port)
    for name in ("omnistage_request_latency_seconds", "omnistage_request_first_output_seconds"):
        took = after[f"{name}_sum{{}}"] - before.get(f"{name}_sum{{}}", 0.0)
        assert 0 < took <= wall, name
    step = "omnistage_stage_step_seconds_sum{stage=llm}"
    assert 0 < stage_after[step] - stage_before.get(step, 0.0) <= wall
    for samples in (after, stage_after):
        assert not [k for k in samples if "_ms_" in k or k.split("{")[0].endswith("_ms")]
