"""Hostile traffic on the UCX data plane: forged replies injected into other requests' gets.

`ucx_injection.requests_corrupted` / `ucx_injection.requests_failed`: of `ucx_injection.requests` gets
of distinct 4 KiB tensors from a producer store, how many landed other bytes than the producer held /
failed, while a hostile peer connected to the consumer's own listener floods forged NOT_FOUND and OK
reply headers (OK ones followed by a payload of the right size) at every tag a get could use
(sequential from 1), FLOOD_ROUNDS times, the first before the gets start, and at random 64-bit tags
(`ucx_injection.flood_messages`, `.flood_mib`).
Beside them, `ucx_injection.baseline_requests_corrupted` / `_failed`: the same gets with no flood.
`ucx_injection.flood_discarded`: flood messages the consumer's listener received and dropped (nothing
legitimate sends it a tagged message), so the flood does not pile up in UCX's queue.
All in this process, over tcp on 127.0.0.1.

    .venv/bin/python bench/abuse_ucx.py
"""

from __future__ import annotations

import asyncio
import os
import random

os.environ.setdefault("UCX_TLS", "tcp")  # before ucxx loads
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import torch
from common import figure, print_table

from omnistage.connector import TensorKey, make_connector
from omnistage.connector.wire import NOT_FOUND, OK
from tests.ucx_hostile_peer import HostilePeer, forged_header

TENSOR_BYTES = 4 << 10  # small: eager messages, which a forger's pre-seeded ones match first
RANDOM_TAGS_PER_ROUND = 64
FLOOD_ROUNDS = 4  # each round forges a reply for every tag the gets will use: more than any get consumes


async def _run(requests: int, flood: bool) -> dict:
    producer = await make_connector("thinker", ("ucx",), host_id="bench")
    consumer = await make_connector("talker", ("ucx",), host_id="bench")
    hostile = HostilePeer()
    try:
        tensors = [torch.randint(0, 256, (TENSOR_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
                   for i in range(requests)]
        refs = [await producer.put(TensorKey("bench", "thinker", i, "x"), t, transport="ucx")
                for i, t in enumerate(tensors)]
        flooding = None
        if flood:
            assert await hostile.connect(consumer.ucx_address)

            async def flood_rounds() -> None:
                payload = bytes([0xAB]) * TENSOR_BYTES
                for _ in range(FLOOD_ROUNDS):
                    sends = []
                    for i in range(requests + 2):
                        header = forged_header(OK, TENSOR_BYTES) if i % 2 else forged_header(NOT_FOUND)
                        sends += [hostile.send(header, 2 * i + 1), hostile.send(payload, 2 * i + 2)]
                    sends += [hostile.send(forged_header(NOT_FOUND), random.getrandbits(64))
                              for _ in range(RANDOM_TAGS_PER_ROUND)]
                    await asyncio.gather(*sends, return_exceptions=True)
                    await asyncio.sleep(0)  # the gets run between rounds

            flooding = asyncio.create_task(flood_rounds())
            await asyncio.sleep(0)  # the first round is posted before the first get
        corrupted = failed = 0
        for ref, tensor in zip(refs, tensors):
            try:
                got = await consumer.get(ref)
            except Exception:  # noqa: BLE001 - counted
                failed += 1
            else:
                corrupted += not torch.equal(got, tensor)
        if flooding is not None:
            await flooding
        store = consumer.stores["ucx"]
        discarded = getattr(store, "discarded_messages", 0)
        for _ in range(500):  # let the last round reach the listener (bounded)
            if discarded >= hostile.messages:
                break
            await asyncio.sleep(0.01)
            discarded = getattr(store, "discarded_messages", 0)
        return {"corrupted": corrupted, "failed": failed, "messages": hostile.messages, "bytes": hostile.bytes,
                "discarded": discarded}
    finally:
        await hostile.close()
        await consumer.close()
        await producer.close()


def measure(quick: bool) -> list[dict]:
    requests = 200 if quick else 2000
    clean = asyncio.run(_run(requests, flood=False))
    flooded = asyncio.run(_run(requests, flood=True))
    return [
        figure("ucx_injection.requests", requests, "gets"),
        figure("ucx_injection.requests_corrupted", flooded["corrupted"], "gets"),
        figure("ucx_injection.requests_failed", flooded["failed"], "gets"),
        figure("ucx_injection.baseline_requests_corrupted", clean["corrupted"], "gets"),
        figure("ucx_injection.baseline_requests_failed", clean["failed"], "gets"),
        figure("ucx_injection.flood_messages", flooded["messages"], "messages"),
        figure("ucx_injection.flood_mib", flooded["bytes"] / (1 << 20), "MiB"),
        figure("ucx_injection.flood_discarded", flooded["discarded"], "messages"),
    ]


if __name__ == "__main__":
    print_table("UCX data plane under a forged-reply flood", measure(quick=False))
