"""Failures across real processes on 127.0.0.1: a consumer killed mid-stream leaves the producer's
buffers to the TTL; a cancelled request frees every buffer at once; a producer that dies makes
fetches fail with a clear error instead of hanging."""

from __future__ import annotations

import json
import os

import pytest
from prometheus_client import CollectorRegistry

os.environ.setdefault("UCX_TLS", "tcp")  # before ucxx loads; peer processes inherit it
os.environ.setdefault("UCX_NET_DEVICES", "lo")

from omnistage.connector import ChunkSender, PeerUnreachable, TensorNotFound, TransferMetrics, make_connector

from ..connector_peer import PeerProcess, decode, digest, encode, make_tensor
from ..polling import wait_until
from .test_connector_backends import peer_reaches, peer_segments

CHUNK_SHAPE = [8 << 20]  # float32: 32 MiB per chunk


@pytest.mark.parametrize("transport", ["ucx", "shm"])
async def test_consumer_killed_mid_stream_leaves_buffers_to_the_ttl(transport):
    producer = await make_connector("thinker", ("shm", "ucx"), host_id="host-a")
    registry = CollectorRegistry()
    sender = ChunkSender(producer, budget_bytes=1 << 30, ttl_s=5.0, metrics=TransferMetrics(registry),
                         sweep_interval_s=0.1)
    consumer = PeerProcess("talker", "shm,ucx", host_id="host-a")
    await consumer.start()
    chunks = [make_tensor("float32", CHUNK_SHAPE, i) for i in range(4)]  # made before the TTL clock starts
    try:
        msgs = [await sender.put_chunk("r1", i, {"hidden": t}, consumer="talker", transport=transport)
                for i, t in enumerate(chunks)]
        sender.start()
        got = await consumer.call(op="get", tensor=encode(msgs[0][0]))
        assert got["sha256"] == digest(chunks[0])
        # ask for chunk 1 and kill the consumer without waiting: it dies during or right after the fetch
        consumer.proc.stdin.write((json.dumps({"op": "get", "tensor": encode(msgs[1][0])}) + "\n").encode())
        await consumer.proc.stdin.drain()
        consumer.kill()
        assert await consumer.proc.wait() == -9
        await wait_until(lambda: producer.held_bytes == 0, timeout=30, what="TTL freeing the buffers")
        ttl = registry.get_sample_value("omnistage_transfer_released_bytes_total",
                                        {"stage": "thinker", "reason": "ttl"})
        assert ttl >= 2 * (32 << 20)  # chunks 2 and 3 were never asked for: only the TTL could free them
        assert producer.stores["shm"].segments() == []
        # the dead consumer's UCX endpoint is gone too
        await wait_until(lambda: producer.endpoints == 0, timeout=20, what="dead endpoint closed")
    finally:
        await sender.close()
        await producer.close()


async def test_cancel_frees_every_buffer_of_the_request_at_once():
    producer = PeerProcess("thinker", "shm,ucx", host_id="host-a")
    await producer.start()
    consumer = await make_connector("talker", ("shm", "ucx"), host_id="host-a")
    try:
        msgs = []
        for i, transport in enumerate(["ucx", "shm", "ucx", "shm"]):
            r = await producer.call(op="put", key=["r1", "thinker", i, "x"], dtype="float16", shape=[1 << 20],
                                    seed=i, transport=transport)
            msgs.append((decode(r["tensor"]), r["sha256"]))
        other = await producer.call(op="put", key=["r2", "thinker", 0, "x"], dtype="int8", shape=[1 << 20], seed=9,
                                    transport="shm")
        assert digest(await consumer.get(msgs[0][0])) == msgs[0][1]
        await peer_reaches(producer, {"held_bytes": 3 * (2 << 20) + (1 << 20)})
        assert (await producer.call(op="release_request", request_id="r1"))["freed"] == 3 * (2 << 20)
        held = await producer.call(op="held")
        assert (held["held_bytes"], held["held_tensors"]) == (1 << 20, 1)
        assert len(peer_segments(producer.proc.pid)) == 1  # r2's segment only
        for msg, _ in msgs[1:]:
            with pytest.raises(TensorNotFound):
                await consumer.get(msg)
        assert digest(await consumer.get(decode(other["tensor"]))) == other["sha256"]
        assert (await producer.call(op="held"))["held_bytes"] == 0
    finally:
        await consumer.close()
        assert await producer.close() == 0


async def test_dead_producer_fails_fetches_clearly():
    producer = PeerProcess("thinker", "ucx", host_id="host-a")
    await producer.start()
    consumer = await make_connector("talker", ("ucx",), host_id="host-a", get_timeout_s=15)
    try:
        refs = [decode((await producer.call(op="put", key=["r1", "thinker", i, "x"], dtype="float32", shape=[1 << 18],
                                            seed=i, transport="ucx", readers=2))["tensor"]) for i in range(2)]
        await consumer.get(refs[0])  # the endpoint is now cached
        address = refs[0].ref.address
        producer.kill()
        await producer.proc.wait()
        with pytest.raises(PeerUnreachable, match=f"from {address}|at {address}"):
            await consumer.get(refs[1])
        with pytest.raises(PeerUnreachable, match=f"at {address}"):
            await consumer.get(refs[1])  # a fresh connection to the dead listener
        assert consumer.endpoints == 0
    finally:
        await consumer.close()


async def test_segments_of_a_killed_producer_are_reaped_by_the_next_store():
    producer = PeerProcess("thinker", "shm", host_id="host-a")
    await producer.start()
    for i in range(3):
        await producer.call(op="put", key=["r1", "thinker", i, "x"], dtype="uint8", shape=[1 << 20], seed=i,
                            transport="shm")
    pid = producer.proc.pid
    assert len(peer_segments(pid)) == 3
    producer.kill()
    assert await producer.proc.wait() == -9
    assert len(peer_segments(pid)) == 3  # nobody unlinked them
    successor = await make_connector("thinker", ("shm",), host_id="host-a")
    try:
        assert peer_segments(pid) == []
    finally:
        await successor.close()
