"""Replicas of each stage, what each can hold, and the choice among them.

Each replica's capacity and the load other orchestrators put on it come from
its own `GetLoad` answers, polled in the background; the load this
orchestrator puts on it is counted exactly as calls open and close. A replica
that is draining, unreachable or just failed gets no new work; one that refused
a connection is ejected (outliers.py) until a probe answers. The choice is the
ready replica with the least outstanding work relative to what it holds (of
equals, the one that got a call longest ago), and a replica is never sent more
than it holds: dispatch waits for room.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omnistage.api import MAX_MESSAGE_BYTES, Pipeline
from omnistage.serving import KEEPALIVE_CHANNEL_OPTIONS
from omnistage.tls_grpc import ChannelTls
from omnistage.v1 import stage_pb2, stage_pb2_grpc

from .outliers import Outlier, nothing_sent, unreachable
from .retry_budget import RetryBudget

log = logging.getLogger("omnistage.orchestrator")

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.enable_retries", 0), *KEEPALIVE_CHANNEL_OPTIONS]


# A channel being closed (replica removed, certificate rotated) lets its calls finish for the pipeline's
# request timeout plus this; a pipeline without one (0) gets NO_TIMEOUT_CLOSE_GRACE_S.
CLOSE_GRACE_MARGIN_S = 60.0
NO_TIMEOUT_CLOSE_GRACE_S = 3600.0


class NoReplica(RuntimeError):
    def __init__(self, stage: str, why: str = "no ready replica"):
        self.stage = stage
        super().__init__(f"stage {stage}: {why}")


@dataclass(eq=False)
class Replica:
    stage: str
    address: str
    channel: grpc.aio.Channel
    stub: stage_pb2_grpc.StageServiceStub
    default_capacity: int
    outstanding: int = 0            # calls this orchestrator has open on it
    others: int = 0                 # load from other orchestrators: reported load minus ours at that time
    capacity: int | None = None     # max_running + max_queued, as the replica last said
    draining: bool = False
    reachable: bool = True
    failures: int = 0
    outlier: Outlier = field(default_factory=Outlier)
    picked: int = 0                 # the pool's pick count when this replica last got a call (0: never)

    @property
    def ready(self) -> bool:
        return self.reachable and not self.draining and not self.outlier.ejected

    @property
    def holds(self) -> int:
        return self.capacity if self.capacity is not None else self.default_capacity

    @property
    def load(self) -> int:
        return self.outstanding + self.others

    @property
    def has_room(self) -> bool:
        return self.load < self.holds


@dataclass
class StagePool:
    stage: str
    replicas: dict[str, Replica] = field(default_factory=dict)
    waiting: int = 0            # dispatches of in-flight requests waiting for room
    picks: int = 0              # calls placed so far

    def __post_init__(self):
        self.room = asyncio.Event()

    def candidates(self, exclude: frozenset[str] | set[str] = frozenset()) -> list[Replica]:
        return [r for r in self.replicas.values() if r.ready and r.address not in exclude]

    def choose(self, exclude: frozenset[str] | set[str] = frozenset()) -> Replica | None:
        """The ready replica with room and the least load for what it holds, of equals the one that got a
        call longest ago (so a light load still spreads, and a replica just added takes its turn); None
        when all are full; NoReplica when there is no ready replica at all."""
        ready = self.candidates(exclude)
        if not ready:
            raise NoReplica(self.stage)
        roomy = [r for r in ready if r.has_room]
        if not roomy:
            return None
        return min(roomy, key=lambda r: (r.load / max(1, r.holds), r.failures, r.picked, r.address))

    def capacity(self) -> int:
        return sum(r.holds for r in self.replicas.values() if r.ready)

    def backlog(self) -> int:
        return sum(r.load for r in self.replicas.values() if r.ready) + self.waiting


class Router:
    """Channels to every stage replica, kept in step with the endpoints discovery reports."""

    tls: ChannelTls | None = None  # set before the first endpoints: replicas are dialed over mutual TLS

    def __init__(self, pipeline: Pipeline, poll_interval: float = 0.25,
                 on_change: Callable[[], None] | None = None, retry_budget: RetryBudget | None = None):
        self.pipeline = pipeline
        self.poll_interval = poll_interval
        self.on_change = on_change or (lambda: None)
        self.retry_budget = retry_budget or RetryBudget()  # shared by every stage call routed here
        self.pools: dict[str, StagePool] = {s.name: StagePool(s.name) for s in pipeline.stages}
        self._pollers: dict[Replica, asyncio.Task] = {}
        self._probes: dict[Replica, asyncio.Task] = {}  # of ejected replicas

    def _default_capacity(self, stage: str) -> int:
        sch = self.pipeline.deployment.stages[stage].scheduler
        return sch.max_batch + sch.max_queued

    # ------------------------------------------------------------ membership
    def set_endpoints(self, stage: str, addresses: list[str]) -> None:
        pool = self.pools[stage]
        for addr in set(pool.replicas) - set(addresses):
            r = pool.replicas.pop(addr)
            for tasks in (self._pollers, self._probes):
                task = tasks.pop(r, None)
                if task:
                    task.cancel()
            asyncio.ensure_future(r.channel.close(grace=self._close_grace_s()))  # lets its in-flight calls finish
            log.info("stage %s: replica %s removed", stage, addr)
        for addr in addresses:
            if addr not in pool.replicas:
                ch = self._channel(stage, addr)
                r = Replica(stage, addr, ch, stage_pb2_grpc.StageServiceStub(ch), self._default_capacity(stage))
                pool.replicas[addr] = r
                self._start_poller(r)
                log.info("stage %s: replica %s added", stage, addr)
        self._changed()

    def _channel(self, stage: str, addr: str) -> grpc.aio.Channel:
        if self.tls is None:
            return grpc.aio.insecure_channel(addr, options=CHANNEL_OPTIONS)
        return grpc.aio.secure_channel(addr, self.tls.credentials, options=[*CHANNEL_OPTIONS, *self.tls.options(stage)])

    def renew_channels(self) -> None:
        """After the certificate files were rotated (self.tls refreshed): a new channel for every replica, so
        new calls present the new leaf; each old channel closes with a grace that lets its calls finish."""
        for pool in self.pools.values():
            for r in pool.replicas.values():
                old, r.channel = r.channel, self._channel(r.stage, r.address)
                r.stub = stage_pb2_grpc.StageServiceStub(r.channel)
                asyncio.ensure_future(old.close(grace=self._close_grace_s()))
        log.info("stage channels renewed with the rotated certificate")

    def _close_grace_s(self) -> float:
        """How long calls on a channel being closed may still run: as long as a request may
        (requestTimeoutSeconds), and a margin; closing cancels whatever is left (CANCELLED, not retried)."""
        timeout = self.pipeline.limits.request_timeout_seconds
        return (timeout if timeout > 0 else NO_TIMEOUT_CLOSE_GRACE_S) + CLOSE_GRACE_MARGIN_S

    def _start_poller(self, r: Replica) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop yet: start() begins polling
        if self.poll_interval > 0 and r not in self._pollers:
            self._pollers[r] = asyncio.create_task(self._poll(r), name=f"poll-{r.stage}-{r.address}")

    def start(self) -> None:
        for pool in self.pools.values():
            for r in pool.replicas.values():
                self._start_poller(r)

    async def _poll(self, r: Replica) -> None:
        misses = 0
        while True:
            try:
                load = await r.stub.GetLoad(stage_pb2.GetLoadRequest(), timeout=max(1.0, 4 * self.poll_interval))
                changed = (not r.reachable or r.draining != load.draining or
                           r.capacity != load.max_running + load.max_queued)
                r.others = max(0, load.running + load.queued - r.outstanding)
                r.capacity = load.max_running + load.max_queued
                r.draining = load.draining
                r.reachable = True
                misses = 0
                if changed or r.others:
                    self._changed()
            except grpc.aio.AioRpcError as e:
                if nothing_sent(e.code(), e.details() or ""):
                    self.eject(r)  # refused: out at once, not after a second miss
                misses += 1
                if r.reachable and unreachable(e.code(), misses):
                    r.reachable = False
                    log.warning("stage %s: replica %s unreachable", r.stage, r.address)
                    self._changed()
            except asyncio.CancelledError:
                raise
            await asyncio.sleep(self.poll_interval)

    # ----------------------------------------------------------------- use
    def pool(self, stage: str) -> StagePool:
        try:
            return self.pools[stage]
        except KeyError:
            raise NoReplica(stage, "no such stage") from None

    def capacity(self, stage: str) -> int:
        return self.pools[stage].capacity()

    def backlog(self, stage: str) -> int:
        return self.pools[stage].backlog()

    async def acquire(self, stage: str, exclude: set[str], timeout: float | None) -> Replica:
        """A replica of `stage` with room, its outstanding count taken; waits while all are full."""
        pool = self.pool(stage)
        loop = asyncio.get_running_loop()
        end = None if timeout is None else loop.time() + timeout
        counted = False
        try:
            while True:
                r = pool.choose(exclude)
                if r is not None:
                    r.outstanding += 1
                    pool.picks += 1
                    r.picked = pool.picks
                    if counted:
                        pool.waiting -= 1
                        counted = False
                    return r
                if not counted:
                    pool.waiting += 1
                    counted = True
                pool.room.clear()
                left = None if end is None else end - loop.time()
                if left is not None and left <= 0:
                    raise TimeoutError(f"stage {stage}: no replica had room before the deadline")
                try:
                    await asyncio.wait_for(pool.room.wait(), left)
                except asyncio.TimeoutError:
                    pass
        finally:
            if counted:
                pool.waiting -= 1

    def release(self, r: Replica) -> None:
        """A call on `r` ended: its slot is free for the next dispatch or admission."""
        r.outstanding -= 1
        pool = self.pools.get(r.stage)
        if pool is not None:
            pool.room.set()
        self.on_change()

    def report_failure(self, r: Replica) -> None:
        """A call to `r` failed: no new work until its next successful poll says it is fine."""
        r.failures += 1
        r.reachable = False
        self.on_change()

    def eject(self, r: Replica) -> None:
        """`r` refused a connection: no new work until a probe after its ejection time answers."""
        if r.outlier.ejected:
            return
        loop = asyncio.get_running_loop()
        until = r.outlier.eject(loop.time())
        log.warning("stage %s: replica %s refused a connection: ejected for %.1fs", r.stage, r.address,
                    until - loop.time())
        if r not in self._probes and r.address in self.pools[r.stage].replicas:
            self._probes[r] = asyncio.create_task(self._probe(r), name=f"probe-{r.stage}-{r.address}")
        self._changed()

    async def _probe(self, r: Replica) -> None:
        """Bring an ejected replica back once it answers a GetLoad after its ejection time."""
        loop = asyncio.get_running_loop()
        try:
            while r.outlier.ejected:
                await asyncio.sleep(max(0.0, r.outlier.until - loop.time()))
                try:
                    load = await r.stub.GetLoad(stage_pb2.GetLoadRequest(), timeout=max(1.0, 4 * self.poll_interval))
                except grpc.aio.AioRpcError:
                    r.outlier.eject(loop.time())  # still down: out again, for longer
                    continue
                r.outlier.probe_answered()
                r.reachable, r.draining = True, load.draining
                r.capacity = load.max_running + load.max_queued
                log.info("stage %s: replica %s answered its probe: back in routing", r.stage, r.address)
                self._changed()
        finally:
            self._probes.pop(r, None)

    def served(self, r: Replica) -> None:
        """A call on `r` ended well: its next ejection starts from the base time."""
        r.outlier.served()

    def _changed(self) -> None:
        for pool in self.pools.values():
            pool.room.set()
        self.on_change()

    async def wait_ready(self, timeout: float) -> None:
        """Block until every known replica answers health SERVING (used at start-up)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        for pool in self.pools.values():
            for r in list(pool.replicas.values()):
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
        for t in [*self._pollers.values(), *self._probes.values()]:
            t.cancel()
        for pool in self.pools.values():
            for r in pool.replicas.values():
                await r.channel.close()
