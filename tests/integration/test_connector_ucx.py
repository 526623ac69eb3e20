"""UCX backend specifics on 127.0.0.1: a get that outlives its timeout drops the endpoint (its posted
receives cancelled) and the next get reconnects; the UCX context goes with the last store and comes
back with the next; many gets in flight on one endpoint each get their own bytes."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch

os.environ.setdefault("UCX_TLS", "tcp")  # before ucxx loads; peer processes inherit it
os.environ.setdefault("UCX_NET_DEVICES", "lo")

from omnistage.connector import PeerUnreachable, TensorKey, make_connector

from ..connector_peer import PeerProcess, decode, digest

MIB = 1 << 20


async def test_a_get_past_its_timeout_drops_the_endpoint_and_the_next_get_reconnects():
    producer = PeerProcess("thinker", "ucx", host_id="host-a")
    await producer.start()
    consumer = await make_connector("talker", ("ucx",), host_id="host-a", get_timeout_s=1)
    try:
        puts = [await producer.call(op="put", key=["r1", "thinker", i, "x"], dtype="uint8", shape=[MIB], seed=i,
                                    transport="ucx") for i in range(2)]
        refs = [decode(p["tensor"]) for p in puts]
        await consumer.get(refs[0])  # the endpoint is now cached
        os.kill(producer.proc.pid, signal.SIGSTOP)  # the producer answers nothing
        try:
            with pytest.raises(PeerUnreachable, match="took over 1 s"):
                await consumer.get(refs[1])
            assert consumer.endpoints == 0
        finally:
            os.kill(producer.proc.pid, signal.SIGCONT)
        assert digest(await consumer.get(refs[1])) == puts[1]["sha256"]  # still held: fetched over a new endpoint
        assert consumer.endpoints == 1
    finally:
        await consumer.close()
        assert await producer.close() == 0


async def test_the_context_goes_with_the_last_store_and_comes_back_with_the_next():
    for round_ in range(2):
        producer = await make_connector("thinker", ("ucx",), host_id="h")
        consumer = await make_connector("talker", ("ucx",), host_id="h")
        try:
            t = torch.arange(1000, dtype=torch.int32) + round_
            msg = await producer.put(TensorKey("r", "thinker", round_, "x"), t, transport="ucx")
            assert torch.equal(await consumer.get(msg), t)
        finally:
            await consumer.close()
            await producer.close()


@pytest.mark.parametrize("fragment_bytes", [0, 256 << 10])
async def test_concurrent_gets_on_one_endpoint_each_land_their_own_bytes(fragment_bytes):
    producer = await make_connector("thinker", ("ucx",), host_id="h", fragment_bytes=fragment_bytes)
    consumer = await make_connector("talker", ("ucx",), host_id="h", fragment_bytes=fragment_bytes)
    try:
        tensors = [torch.full((MIB // 4 + i,), i, dtype=torch.float32) for i in range(8)]
        msgs = [await producer.put(TensorKey("r", "thinker", i, "x"), t, transport="ucx")
                for i, t in enumerate(tensors)]
        got = await asyncio.gather(*(consumer.get(m) for m in msgs))
        assert all(torch.equal(g, t) for g, t in zip(got, tensors))
        assert consumer.endpoints + producer.endpoints == 2  # one endpoint, seen from both ends
    finally:
        await consumer.close()
        await producer.close()
