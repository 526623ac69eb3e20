"""Fixtures the unit tests share."""

from __future__ import annotations

import pytest

from omnistage.connector import make_connector


@pytest.fixture
async def shm_pair():
    """A producer and a consumer connector on one host, shared memory only; no segment is left after."""
    producer = await make_connector("thinker", ("shm",), host_id="host-a")
    consumer = await make_connector("talker", ("shm",), host_id="host-a")
    yield producer, consumer
    await consumer.close()
    await producer.close()
    assert producer.stores["shm"].segments() == []
