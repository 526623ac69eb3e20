"""The orchestrator's call on one stage (orchestrator_service/stage_call.py) against scripted stage
replicas served in-process over real gRPC (no model): a failed replica is replaced and the new one
sees every input once and in order, inputs forwarded during a retry included; a call whose inputs
are no longer held, or whose output reached the client, is not retried; cancel leaves nothing open."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from omnistage.v1 import stage_pb2, stage_pb2_grpc, tensor_pb2
from orchestrator_service.retry_budget import RetryBudget
from orchestrator_service.routing import Router
from orchestrator_service.stage_call import StageCall, StageFailed

from ..harness import example
from ..polling import wait_until

STAGE, SOURCE = "llm", "up"


class ScriptedStage(stage_pb2_grpc.StageServiceServicer):
    """Answers each input chunk with an output chunk of the same id and text; with no input edge, one
    end-of-stream chunk once the input half-closes. The first call of the script (on whichever replica
    gets it) aborts with `fail_code` (UNAVAILABLE: the replica went down) after `fail_first_after` input
    chunks."""

    def __init__(self, fail_first_after: int | None = None, fail_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
                 reported: stage_pb2.StageFailure | None = None):
        """`reported`: a StageFailure message sent before the abort (a stage says its status in it first)."""
        self.fail_first_after = fail_first_after
        self.fail_code = fail_code
        self.reported = reported
        self.calls: list[list[stage_pb2.StageInput]] = []  # every call's input messages, as received
        self.open = 0

    async def Process(self, request_iterator, context):
        got: list[stage_pb2.StageInput] = []
        first = not self.calls
        self.calls.append(got)
        self.open += 1
        try:
            async for msg in request_iterator:
                got.append(msg)
                if msg.WhichOneof("kind") != "chunk":
                    continue
                if first and self.fail_first_after is not None and len(got) - 1 >= self.fail_first_after:
                    if self.reported is not None:
                        yield stage_pb2.StageOutput(failure=self.reported)
                    await context.abort(self.fail_code, "replica went down" if self.fail_code ==
                                        grpc.StatusCode.UNAVAILABLE else "engine failed")
                c = msg.chunk
                yield stage_pb2.StageOutput(chunk=stage_pb2.Chunk(stage=STAGE, chunk_id=c.chunk_id, text=c.text,
                                                                  end_of_stream=c.end_of_stream))
            if len(got) == 1:
                yield stage_pb2.StageOutput(chunk=stage_pb2.Chunk(stage=STAGE, chunk_id=0, end_of_stream=True))
        finally:
            self.open -= 1


class Replicas:
    """Two replicas of the stage running one script, and a router over them."""

    def __init__(self, script: ScriptedStage, retry_budget: RetryBudget | None = None):
        self.script = script
        self.servers: list[grpc.aio.Server] = []
        self.router = Router(example("llm-tiny"), poll_interval=0, retry_budget=retry_budget)

    async def __aenter__(self) -> Replicas:
        addresses = []
        for _ in range(2):
            server = grpc.aio.server()
            stage_pb2_grpc.add_StageServiceServicer_to_server(self.script, server)
            addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
            await server.start()
            self.servers.append(server)
        self.router.set_endpoints(STAGE, addresses)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.router.close()
        for server in self.servers:
            await server.stop(0)

    @property
    def pool(self):
        return self.router.pools[STAGE]

    def other_than(self, addresses: set[str]):
        return next(r for a, r in self.pool.replicas.items() if a not in addresses)


class Run:
    """A StageCall and what it handed on."""

    def __init__(self, replicas: Replicas, sources=frozenset({SOURCE}), client_sees: bool = False,
                 max_replay_bytes: int = 1 << 20):
        self.delivered: list[stage_pb2.Chunk] = []
        self.ended: asyncio.Future = asyncio.get_running_loop().create_future()

        async def deliver(chunk):
            self.delivered.append(chunk)
            return client_sees

        async def ended(error):
            self.ended.set_result(error)

        header = stage_pb2.StageRequestHeader(request_id="r1")
        self.call = StageCall(STAGE, sources, header, router=replicas.router, deadline=None, deliver=deliver,
                              ended=ended, max_attempts=3, max_replay_bytes=max_replay_bytes)

    async def error(self) -> StageFailed | None:
        return await asyncio.wait_for(asyncio.shield(self.ended), 30)


def chunk(i: int, last: bool = False, ref: bool = False, size: int = 0) -> stage_pb2.Chunk:
    tensors = [tensor_pb2.Tensor(name="t", ref=tensor_pb2.TensorRef(backend="shm", key=f"r1/up/{i}/t"))] if ref else \
        [tensor_pb2.Tensor(name="t", data=bytes(size))] if size else []
    return stage_pb2.Chunk(stage=SOURCE, chunk_id=i, text=f"c{i}", end_of_stream=last, tensors=tensors)


def inputs_of(call: list[stage_pb2.StageInput]) -> list[str]:
    return [m.WhichOneof("kind") if m.WhichOneof("kind") == "header" else m.chunk.text for m in call]


async def test_the_status_a_stage_reports_before_ending_the_call_is_its_answer():
    """A stage's StageFailure message is what failed, whatever status the gRPC library reports after it: the
    asyncio client still writing inputs is told INTERNAL "Internal error from Core" instead of the stage's
    status (grpc/grpc#36066), which read as the replica's fault (retried elsewhere, 503) where the stage
    refused the request (400)."""
    script = ScriptedStage(fail_first_after=0, fail_code=grpc.StatusCode.INTERNAL, reported=stage_pb2.StageFailure(
        code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message='stage llm: bad input: unknown speaker "nobody"'))
    async with Replicas(script) as replicas:
        run = Run(replicas)
        await run.call.open()
        await run.call.forward(SOURCE, chunk(0, last=True))
        error = await run.error()
    assert isinstance(error, StageFailed) and error.code == grpc.StatusCode.INVALID_ARGUMENT, error
    assert 'unknown speaker "nobody"' in str(error)
    assert len(script.calls) == 1  # the stage's refusal: not retried on another replica


async def test_a_failed_replica_is_replaced_and_the_new_one_sees_every_input_once_in_order():
    script = ScriptedStage(fail_first_after=3)
    async with Replicas(script) as replicas:
        run = Run(replicas)
        assert await run.call.open() and not await run.call.open()  # a second open finds it open
        first = set(run.call.tried)
        second = replicas.other_than(first)
        second.capacity = 0  # full: the retry waits for room, and inputs keep coming meanwhile
        for i in range(3):
            await run.call.forward(SOURCE, chunk(i))
        await wait_until(lambda: replicas.pool.waiting == 1, what="the retry waiting for room")
        for i in range(3, 5):
            await run.call.forward(SOURCE, chunk(i))
        second.capacity = None
        replicas.pool.room.set()
        await wait_until(lambda: run.call.timing.attempts == 2, what="the second attempt")
        await run.call.forward(SOURCE, chunk(5))
        await run.call.forward(SOURCE, chunk(6, last=True))
        assert await run.error() is None
        assert len(script.calls) == 2 and run.call.tried == {*first, second.address}
        assert inputs_of(script.calls[1]) == ["header", *(f"c{i}" for i in range(7))]
        # The chunks the first replica answered before it went down reached nobody twice.
        assert [c.chunk_id for c in run.delivered] == list(range(7)) and run.delivered[-1].end_of_stream
        assert run.call.finished and run.call.held_bytes == 0 and not run.call.unfetched
        assert all(r.outstanding == 0 for r in replicas.pool.replicas.values())
        await run.call.forward(SOURCE, chunk(7))  # a chunk for a stage that has finished
        assert run.call.unfetched
        run.call.cancel()
        await run.call.stopped()


async def test_inputs_dropped_while_a_retry_waits_end_the_call_instead_of_a_partial_replay():
    script = ScriptedStage(fail_first_after=2)
    async with Replicas(script) as replicas:
        run = Run(replicas, max_replay_bytes=4096)
        await run.call.open()
        second = replicas.other_than(set(run.call.tried))
        second.capacity = 0
        for i in range(2):
            await run.call.forward(SOURCE, chunk(i))
        await wait_until(lambda: replicas.pool.waiting == 1, what="the retry waiting for room")
        await run.call.forward(SOURCE, chunk(2, size=8192))  # past the replay budget
        assert run.call.held_bytes == 0
        second.capacity = None
        replicas.pool.room.set()
        error = await run.error()
        assert isinstance(error, StageFailed) and error.code == grpc.StatusCode.UNAVAILABLE
        assert "not retried: its inputs are no longer held" in str(error) and error.stage == STAGE
        assert len(script.calls) == 1  # the second replica was never called
        assert all(r.outstanding == 0 for r in replicas.pool.replicas.values())  # its slot handed back
        run.call.cancel()
        await run.call.stopped()


@pytest.mark.parametrize("code, slot_taken, retried", [
    (grpc.StatusCode.INTERNAL, True, False), (grpc.StatusCode.INTERNAL, False, True),
    (grpc.StatusCode.UNAVAILABLE, True, True)],
    ids=["engine error, budget spent", "engine error, budget left", "replica gone, budget spent"])
async def test_a_retry_of_an_engine_error_is_made_only_within_the_orchestrators_retry_budget(code, slot_taken,
                                                                                              retried):
    """The budget bounds retries of what a stage returned (INTERNAL: its engine failed on the request); a
    replica that went away is re-homed whatever the budget says."""
    budget = RetryBudget(budget_percent=0.0, min_retry_concurrency=1)  # one retry at a time, whatever the load
    script = ScriptedStage(fail_first_after=0, fail_code=code)
    async with Replicas(script, budget) as replicas:
        with budget.call() as other:
            if slot_taken:
                assert other.try_retry()  # another request's stage call is on its retry
            run = Run(replicas)
            await run.call.open()
            await run.call.forward(SOURCE, chunk(0, last=True))
            error = await run.error()
        if retried:
            assert error is None and len(script.calls) == 2 and run.call.timing.attempts == 2
        else:
            assert isinstance(error, StageFailed) and error.code == grpc.StatusCode.UNAVAILABLE
            assert f"stage {STAGE} failed: engine failed" in str(error)
            assert "not retried: retry budget exhausted" in str(error)
            assert len(script.calls) == 1 and run.call.timing.attempts == 1
        assert (budget.active, budget.retrying) == (0, 0)  # nothing stays counted once the calls ended
        assert all(r.outstanding == 0 for r in replicas.pool.replicas.values())
        run.call.cancel()
        await run.call.stopped()


async def test_a_stage_whose_output_reached_the_client_is_not_retried():
    script = ScriptedStage(fail_first_after=2)
    async with Replicas(script) as replicas:
        run = Run(replicas, client_sees=True)
        await run.call.open()
        for i in range(3):
            await run.call.forward(SOURCE, chunk(i))
        error = await run.error()
        assert error.code == grpc.StatusCode.UNAVAILABLE and "its output already reached the client" in str(error)
        # which replica failed is for the log and error.replica, not the client's message (its address)
        assert error.replica == next(iter(run.call.tried)) and error.replica not in str(error)
        assert len(script.calls) == 1
        run.call.cancel()
        await run.call.stopped()


async def test_an_entry_stage_gets_its_header_and_a_half_close():
    script = ScriptedStage()
    async with Replicas(script) as replicas:
        run = Run(replicas, sources=frozenset())
        await run.call.open()
        assert await run.error() is None
        assert inputs_of(script.calls[0]) == ["header"]
        assert script.calls[0][0].header.request_id == "r1"
        assert [c.chunk_id for c in run.delivered] == [0] and run.call.timing.chunks == 1
        run.call.cancel()
        await run.call.stopped()


async def test_cancel_ends_the_call_on_the_replica_and_frees_its_slot():
    script = ScriptedStage()
    async with Replicas(script) as replicas:
        run = Run(replicas)
        await run.call.open()
        await run.call.forward(SOURCE, chunk(0))
        await wait_until(lambda: len(run.delivered) == 1, what="the first output")
        assert script.open == 1
        run.call.cancel()
        await asyncio.wait_for(run.call.stopped(), 10)
        await wait_until(lambda: script.open == 0, what="the replica seeing the cancel")
        assert all(r.outstanding == 0 for r in replicas.pool.replicas.values())
        assert not run.ended.done()  # a cancelled call reports nothing: the request cancelled it


async def test_equally_idle_replicas_take_calls_in_turn():
    """One call at a time (a light load) still spreads: of equally loaded replicas the one that got a call
    longest ago is next, so a replica just added takes its share at once."""
    async with Replicas(ScriptedStage()) as replicas:
        got = []
        for _ in range(4):
            r = await replicas.router.acquire(STAGE, set(), timeout=5)
            got.append(r.address)
            replicas.router.release(r)
        assert got[0] != got[1] and got[:2] == got[2:]
