"""Every backend moves every dtype, 1 byte to 256 MiB, bit for bit: in one process and between real
processes on 127.0.0.1. Many requests leave no shared-memory segment or UCX endpoint behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("UCX_TLS", "tcp")  # before ucxx loads; peer processes inherit it
os.environ.setdefault("UCX_NET_DEVICES", "lo")

from omnistage.connector import ConnectorError, TensorKey, TensorNotFound, make_connector

from ..connector_peer import DTYPES, PeerProcess, decode, digest, encode, make_tensor
from ..connector_support import connector_pair
from ..polling import wait_until

SHM = Path("/dev/shm")
SHAPES = [(), (1,), (3, 5, 7), (0, 4), (257, 1031)]


def peer_segments(pid: int) -> list[str]:
    """A process's shared-memory segments: omnistage-<pid namespace>-<pid>-..."""
    return sorted(p.name for p in SHM.glob(f"omnistage-*-{pid}-*"))


async def peer_reaches(peer: PeerProcess, want: dict, timeout: float = 20.0) -> None:
    """Wait until the peer's counts are `want`."""
    async def reached():
        return {k: v for k, v in (await peer.call(op="held")).items() if k in want} == want

    await wait_until(reached, timeout, what=f"peer counts {want}")


async def nothing_held(conn) -> None:
    """A producer notices a UCX fetch completed a moment after its consumer has the bytes."""
    await wait_until(lambda: conn.held_bytes == 0, what=f"{conn.stage} holding nothing")


@pytest.fixture(scope="module")
async def local():
    async with connector_pair("host-a") as connectors:
        yield connectors


@pytest.fixture(scope="module")
async def peer():
    p = PeerProcess("thinker", "shm,ucx", host_id="host-a")
    await p.start()
    yield p
    assert await p.close() == 0


@pytest.mark.parametrize("dtype", list(DTYPES))
async def test_ucx_every_dtype_in_process(local, dtype):
    producer, consumer = local
    for i, shape in enumerate(SHAPES):
        t = make_tensor(dtype, list(shape), seed=i)
        msg = await producer.put(TensorKey("r1", "thinker", i, dtype), t, transport="ucx")
        assert msg.ref.backend == "ucx" and msg.ref.address == producer.ucx_address
        assert digest(await consumer.get(msg)) == digest(t)
    await nothing_held(producer)


@pytest.mark.parametrize("nbytes", [1, 4096, 65537, 1 << 20, 16 << 20])
async def test_ucx_sizes_in_process(local, nbytes):
    producer, consumer = local
    t = make_tensor("uint8", [nbytes], seed=nbytes)
    msg = await producer.put(TensorKey("r1", "thinker", 0, "x"), t, transport="ucx")
    out = await consumer.get(msg)
    assert digest(out) == digest(t)
    await nothing_held(producer)
    with pytest.raises(TensorNotFound, match="no longer holds r1/thinker/0/x"):
        await consumer.get(msg)  # consumed


@pytest.mark.parametrize("transport", ["shm", "ucx"])
@pytest.mark.parametrize("dtype", list(DTYPES))
async def test_every_dtype_across_processes(local, peer, transport, dtype):
    _, consumer = local
    for i, shape in enumerate([(), (3, 5, 7), (129, 1025)]):
        r = await peer.call(op="put", key=["r1", "thinker", i, dtype], dtype=dtype, shape=list(shape), seed=i,
                            transport=transport)
        out = await consumer.get(decode(r["tensor"]))
        assert digest(out) == r["sha256"] and str(out.dtype) == f"torch.{dtype}" and tuple(out.shape) == shape


async def test_this_process_serves_a_consumer_in_another(local, peer):
    producer, _ = local
    for i, dtype in enumerate(DTYPES):
        t = make_tensor(dtype, [33, 65], seed=i)
        msg = await producer.put(TensorKey("r2", "thinker", i, "x"), t, transport="ucx")
        r = await peer.call(op="get", tensor=encode(msg))
        assert r["sha256"] == digest(t)
    await nothing_held(producer)


@pytest.mark.parametrize("transport", ["inline", "shm", "ucx"])
async def test_256_MiB(local, peer, transport):
    _, consumer = local
    if transport == "inline":
        producer = local[0]
        t = make_tensor("float32", [64 << 20], seed=7)
        out = await consumer.get(await producer.put(TensorKey("big", "thinker", 0, "x"), t, transport="inline"))
        assert digest(out) == digest(t)
        return
    r = await peer.call(op="put", key=["big", "thinker", 0, transport], dtype="bfloat16", shape=[8192, 16384],
                        seed=7, transport=transport)
    out = await consumer.get(decode(r["tensor"]))
    assert digest(out) == r["sha256"] and out.nbytes == 256 << 20


async def test_many_requests_leave_no_segment_or_endpoint_behind():
    peer = PeerProcess("thinker", "shm,ucx", host_id="host-a")  # its own: counts start from nothing
    await peer.start()
    pid = peer.proc.pid
    consumer = await make_connector("talker", ("shm", "ucx"), host_id="host-a")
    try:
        for i in range(300):
            transport = ("shm", "ucx")[i % 2]
            r = await peer.call(op="put", key=[f"req{i}", "thinker", 0, "hidden"], dtype="float16", shape=[64, 512],
                                seed=i, transport=transport)
            assert digest(await consumer.get(decode(r["tensor"]))) == r["sha256"]
        await peer_reaches(peer, {"held_bytes": 0, "held_tensors": 0, "endpoints": 1})
        assert consumer.endpoints == 1 and peer_segments(pid) == []
    finally:
        await consumer.close()
    assert consumer.endpoints == 0
    await peer_reaches(peer, {"endpoints": 0})
    assert await peer.close() == 0


async def test_endpoint_cache_is_bounded():
    producers = [await make_connector(f"p{i}", ("ucx",), host_id="h") for i in range(3)]
    consumer = await make_connector("c", ("ucx",), host_id="h", max_endpoints=2)
    try:
        for round_ in range(2):
            for i, p in enumerate(producers):
                t = make_tensor("int32", [1000], seed=i)
                msg = await p.put(TensorKey("r", f"p{i}", round_, "x"), t, transport="ucx")
                assert digest(await consumer.get(msg)) == digest(t)
                assert consumer.endpoints <= 2
        await wait_until(lambda: sum(p.endpoints for p in producers) == 2, what="evicted endpoints closed")
    finally:
        await consumer.close()
        for p in producers:
            await p.close()


async def test_released_request_is_gone_for_its_consumer(local):
    producer, consumer = local
    msgs = [await producer.put(TensorKey("gone", "thinker", c, "x"), make_tensor("float32", [1 << 16], c),
                               transport=tr) for c, tr in enumerate(["ucx", "shm"])]
    assert producer.release_request("gone") == 2 * (1 << 18) and producer.held_bytes == 0
    for msg in msgs:
        with pytest.raises(TensorNotFound, match="gone/thinker"):
            await consumer.get(msg)


async def test_reference_that_lies_about_its_size_is_refused_and_the_endpoint_survives(local):
    producer, consumer = local
    t = make_tensor("float32", [1 << 16], seed=1)
    msg = await producer.put(TensorKey("lie", "thinker", 0, "x"), t, transport="ucx")
    msg.ref.nbytes -= 4
    with pytest.raises(ConnectorError, match="another size than the reference's 262140 bytes"):
        await consumer.get(msg)
    msg.ref.nbytes += 4
    assert digest(await consumer.get(msg)) == digest(t)  # still held, and the same endpoint still works


async def test_fragmented_fetches_are_exact_and_refusals_leave_no_receive_pending(local):
    producer, _ = local
    consumer = await make_connector("talker", ("ucx",), host_id="host-a", fragment_bytes=1 << 20)
    try:
        t = make_tensor("int16", [(11 << 20) // 4], seed=5)  # 5.5 MiB: five whole fragments and a half
        msg = await producer.put(TensorKey("frag", "thinker", 0, "x"), t, transport="ucx")
        assert digest(await consumer.get(msg)) == digest(t)
        with pytest.raises(TensorNotFound):
            await consumer.get(msg)  # refused: six empty fragments answer the six posted receives
        again = await producer.put(TensorKey("frag", "thinker", 1, "x"), t, transport="ucx")
        assert digest(await consumer.get(again)) == digest(t)  # the same endpoint, nothing left pending
    finally:
        await consumer.close()
    with pytest.raises(ValueError, match="fragment_bytes must be 0"):
        await make_connector("talker", ("ucx",), fragment_bytes=100)
