"""One client over several orchestrator replicas (docs/orchestrator.md "Several orchestrator replicas"): two
real orchestrators in-process on port 0 over the same real stage; each must serve requests (over TLS too), a
replica that says it is not serving gets none, and one that went away costs no request."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from omnistage import tls
from omnistage.client import AsyncOmniClient, OmniClient
from omnistage.serving import set_serving
from orchestrator_service.server import SERVICE, OrchestratorServer

from ..harness import small_lm, start_stage
from ..polling import wait_until

REQUESTS = 8


LM_LIMITS = {"defaultMaxTokens": 2, "maxTokens": 4}  # answers of a few tokens: the requests are cheap


def finished(orc: OrchestratorServer) -> float:
    return orc.metrics.registry.get_sample_value("omnistage_requests_ended_total", {"outcome": "finished"}) or 0.0


@contextlib.asynccontextmanager
async def two_replicas(model_dir, **orchestrator_kw):
    """Two orchestrator replicas over one stage replica; all drained on the way out."""
    pipeline = small_lm(LM_LIMITS)
    stage = await start_stage(pipeline, "llm", model_dir)
    orcs: list[OrchestratorServer] = []
    try:
        for _ in range(2):
            orcs.append(OrchestratorServer(pipeline, {"llm": [f"127.0.0.1:{stage.port}"]}, **orchestrator_kw))
            await orcs[-1].start(wait_for_stages=30)
        yield orcs
    finally:
        for orc in orcs:
            await orc.drain()
        await stage.drain()


@pytest.fixture
async def replicas(model_dir):
    async with two_replicas(model_dir) as orcs:
        yield orcs


async def test_one_async_client_spreads_requests_over_both_replicas(replicas):
    a, b = replicas
    async with AsyncOmniClient([f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"]) as client:
        results = [await client.generate("hi", timeout=60) for _ in range(REQUESTS)]
    assert all(r.final is not None for r in results)
    assert finished(a) + finished(b) == REQUESTS
    assert finished(a) >= 1 and finished(b) >= 1, (finished(a), finished(b))


async def test_the_blocking_client_takes_the_addresses_joined_by_commas(replicas):
    """As `omnistage generate --endpoint A,B` passes them."""
    a, b = replicas

    def run() -> list:
        with OmniClient(f"127.0.0.1:{a.port},127.0.0.1:{b.port}") as client:
            return [client.generate("hi", timeout=60) for _ in range(REQUESTS)]

    results = await asyncio.to_thread(run)
    assert all(r.final is not None for r in results)
    assert finished(a) >= 1 and finished(b) >= 1, (finished(a), finished(b))


async def test_a_replica_reporting_not_serving_gets_no_requests(replicas):
    """What a draining orchestrator says first (grpc.health.v1): the client's health check takes it out of
    the rotation, so a rolling update refuses no request."""
    a, b = replicas
    async with AsyncOmniClient([f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"]) as client:
        for _ in range(2):
            await client.generate("hi", timeout=60)
        await set_serving(b.health, [SERVICE], False)  # b itself would still serve: only health says no

        async def four_in_a_row_on_a() -> bool:
            before = finished(b)
            for _ in range(4):
                await client.generate("hi", timeout=60)
            return finished(b) == before

        await wait_until(four_in_a_row_on_a, 30, what="the client leaving out the replica not serving")
        before_a, before_b = finished(a), finished(b)
        for _ in range(REQUESTS):
            assert (await client.generate("hi", timeout=60)).final is not None
        assert (finished(a) - before_a, finished(b) - before_b) == (REQUESTS, 0)


async def test_a_replica_that_went_away_costs_no_request(replicas):
    a, b = replicas
    async with AsyncOmniClient([f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"]) as client:
        for _ in range(2):
            await client.generate("hi", timeout=60)
        await b.drain()
        before_a = finished(a)
        results = [await client.generate("hi", timeout=60) for _ in range(REQUESTS)]
    assert all(r.final is not None for r in results)
    assert finished(a) - before_a == REQUESTS


async def test_both_replicas_serve_over_tls_checked_against_the_first_address(model_dir, tmp_path):
    """Client-facing TLS: every replica's certificate names its IP (here all 127.0.0.1); the channel checks
    each against the host of the first address given."""
    ca = tls.new_ca()
    cert, key = tls.issue(*ca, tls.identity("test", "llm-tiny", tls.ORCHESTRATOR_ROLE), ip_addresses=["127.0.0.1"])
    files = tls.write_dir(tmp_path / "client", ca[0], cert, key)
    async with two_replicas(model_dir, client_tls_dir=str(files.folder)) as (a, b):
        async with AsyncOmniClient([f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"], tls_ca=ca[0]) as client:
            results = [await client.generate("hi", timeout=60) for _ in range(REQUESTS)]
    assert all(r.final is not None for r in results)
    assert finished(a) >= 1 and finished(b) >= 1, (finished(a), finished(b))
