"""Replicas of each stage and the choice among them: least outstanding work among ready replicas."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omnistage.v1 import stage_pb2_grpc

log = logging.getLogger("omnistage.orchestrator")

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 512 << 20), ("grpc.max_send_message_length", 512 << 20),
                   ("grpc.enable_retries", 0)]


class NoReplica(RuntimeError):
    def __init__(self, stage: str, why: str = "no ready replica"):
        self.stage = stage
        super().__init__(f"stage {stage}: {why}")


@dataclass
class Replica:
    stage: str
    address: str
    channel: grpc.aio.Channel
    stub: stage_pb2_grpc.StageServiceStub
    outstanding: int = 0
    ready: bool = True
    failures: int = 0


@dataclass
class StagePool:
    stage: str
    replicas: dict[str, Replica] = field(default_factory=dict)

    def choose(self, exclude: set[str] = frozenset()) -> Replica:
        ready = [r for r in self.replicas.values() if r.ready and r.address not in exclude]
        if not ready:
            raise NoReplica(self.stage)
        return min(ready, key=lambda r: (r.outstanding, r.failures))


class Router:
    """Channels to every stage replica, kept in step with the endpoints discovery reports."""

    def __init__(self):
        self.pools: dict[str, StagePool] = {}

    def set_endpoints(self, stage: str, addresses: list[str]) -> None:
        pool = self.pools.setdefault(stage, StagePool(stage))
        for addr in set(pool.replicas) - set(addresses):
            r = pool.replicas.pop(addr)
            asyncio.ensure_future(r.channel.close(grace=30))
            log.info("stage %s: replica %s removed", stage, addr)
        for addr in addresses:
            if addr not in pool.replicas:
                ch = grpc.aio.insecure_channel(addr, options=CHANNEL_OPTIONS)
                pool.replicas[addr] = Replica(stage, addr, ch, stage_pb2_grpc.StageServiceStub(ch))
                log.info("stage %s: replica %s added", stage, addr)

    def pool(self, stage: str) -> StagePool:
        try:
            return self.pools[stage]
        except KeyError:
            raise NoReplica(stage, "no replicas known") from None

    async def wait_ready(self, timeout: float) -> None:
        """Block until every replica answers health SERVING (used at start-up)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        for pool in self.pools.values():
            for r in pool.replicas.values():
                stub = health_pb2_grpc.HealthStub(r.channel)
                while True:
                    try:
                        resp = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                        if resp.status == health_pb2.HealthCheckResponse.SERVING:
                            break
                    except grpc.aio.AioRpcError:
                        pass
                    if loop.time() > end:
                        raise NoReplica(r.stage, f"replica {r.address} not serving after {timeout:.0f}s")
                    await asyncio.sleep(0.2)

    async def close(self) -> None:
        for pool in self.pools.values():
            for r in pool.replicas.values():
                await r.channel.close()
