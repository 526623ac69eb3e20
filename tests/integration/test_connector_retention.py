"""What a stage's store keeps after its consumer fetched a tensor (omnistage/connector/store.py
`retain_fetched`), on the real shared-memory and UCX backends: a second reader (a retried consumer) fetches
it again; release and the TTL free it; a put that needs the room frees kept tensors, oldest first, instead
of waiting; and only tensors nobody fetched count as unfetched (what a draining stage waits for)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("UCX_TLS", "tcp")  # before ucxx loads
os.environ.setdefault("UCX_NET_DEVICES", "lo")

from omnistage.connector import ChunkSender, TensorKey, make_connector

from ..polling import wait_until

TRANSPORTS = ("shm", "ucx")


@pytest.fixture
async def pair():
    producer = await make_connector("thinker", TRANSPORTS, host_id="host-a", retain_fetched=True)
    consumer = await make_connector("talker", TRANSPORTS, host_id="host-a")
    yield producer, consumer
    await consumer.close()
    await producer.close()


def tensor(seed: int, n: int = 4096) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + seed


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_fetched_tensor_is_kept_for_a_second_fetch_until_its_request_is_released(pair, transport):
    producer, consumer = pair
    msg = await producer.put(TensorKey("r1", "thinker", 0, "hidden"), tensor(1), transport=transport)
    assert producer.unfetched_bytes == producer.held_bytes > 0
    assert torch.equal(await consumer.get(msg), tensor(1))
    await wait_until(lambda: producer.unfetched_bytes == 0, what="the fetch counted")
    assert producer.held_bytes > 0                          # kept for a retried consumer
    assert torch.equal(await consumer.get(msg), tensor(1))  # the retry fetches it again
    assert producer.release_request("r1") > 0
    assert producer.held_bytes == 0 and producer.held_tensors == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_the_ttl_frees_kept_tensors(pair, transport):
    producer, consumer = pair
    msg = await producer.put(TensorKey("r2", "thinker", 0, "hidden"), tensor(2), transport=transport)
    await consumer.get(msg)
    await wait_until(lambda: producer.unfetched_bytes == 0, what="the fetch counted")
    assert producer.expire(0.0) > 0 and producer.held_bytes == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_put_over_budget_frees_kept_tensors_oldest_first_instead_of_waiting(pair, transport):
    producer, consumer = pair
    one = tensor(0).numel() * 4
    sender = ChunkSender(producer, budget_bytes=2 * one, ttl_s=60)
    first = await sender.put_chunk("r3", 0, {"hidden": tensor(0)}, transport=transport)
    second = await sender.put_chunk("r3", 1, {"hidden": tensor(1)}, transport=transport)
    for msgs in (first, second):
        await consumer.get(msgs[0])
    await wait_until(lambda: producer.unfetched_bytes == 0, what="the fetches counted")
    # The budget is full of kept tensors: the next put frees the oldest one and goes on at once.
    await sender.put_chunk("r3", 2, {"hidden": tensor(2)}, transport=transport, timeout=30)
    assert producer.held_tensors == 2
    assert torch.equal(await consumer.get(second[0]), tensor(1))  # the newer kept one is still there
    with pytest.raises(Exception, match="r3/thinker/0/hidden"):
        await consumer.get(first[0])                               # the oldest made the room
    producer.release_request("r3")
    await sender.close()


async def test_an_unfetched_tensor_is_never_freed_for_room(pair):
    producer, _ = pair
    one = tensor(0).numel() * 4
    sender = ChunkSender(producer, budget_bytes=one, ttl_s=60)
    await sender.put_chunk("r4", 0, {"hidden": tensor(0)}, transport="ucx")
    assert producer.evict_fetched(one) == 0 and producer.unfetched_bytes == one
    producer.release_request("r4")
    await sender.close()
