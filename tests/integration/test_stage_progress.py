"""A stage's progress reports (StageOutput.progress) as the orchestrator's stage call takes them, against
scripted replicas over real gRPC: each report is handed to the request once, between the stage's chunks
and never as one; a replica that took over after a failure reports its steps again from the start, and
only those past what the client was told go on."""

from __future__ import annotations

import grpc

from omnistage.v1 import stage_pb2, stage_pb2_grpc
from orchestrator_service.stage_call import StageCall

from .test_stage_call import SOURCE, STAGE, Replicas, Run, chunk


class SteppingStage(stage_pb2_grpc.StageServiceServicer):
    """Reports `steps` steps done, then answers its input with one end-of-stream chunk; its first call (on
    whichever replica gets it) fails UNAVAILABLE after `fail_after` reports (the replica went down)."""

    def __init__(self, steps: int, fail_after: int | None = None):
        self.steps, self.fail_after, self.calls = steps, fail_after, 0

    async def Process(self, request_iterator, context):
        self.calls += 1
        first = self.calls == 1
        async for msg in request_iterator:
            if msg.WhichOneof("kind") == "chunk" and msg.chunk.end_of_stream:
                break
        for done in range(1, self.steps + 1):
            if first and done - 1 == self.fail_after:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "replica went down")
            yield stage_pb2.StageOutput(progress=stage_pb2.StageProgress(done=done, total=self.steps, unit="steps"))
        yield stage_pb2.StageOutput(chunk=stage_pb2.Chunk(stage=STAGE, chunk_id=0, end_of_stream=True))


def with_progress(run: Run, reports: list[tuple[int, int, str]]) -> Run:
    async def progress(p: stage_pb2.StageProgress) -> None:
        reports.append((p.done, p.total, p.unit))
    c = run.call
    run.call = StageCall(STAGE, c.sources, c.header, router=c.router, deadline=None, deliver=c._deliver,
                         ended=c._ended, max_attempts=3, max_replay_bytes=1 << 20, progress=progress)
    return run


async def test_progress_reports_go_to_the_request_between_chunks_not_as_chunks():
    reports: list[tuple[int, int, str]] = []
    async with Replicas(SteppingStage(steps=3)) as replicas:
        run = with_progress(Run(replicas), reports)
        await run.call.open()
        await run.call.forward(SOURCE, chunk(0, last=True))
        assert await run.error() is None
    assert reports == [(1, 3, "steps"), (2, 3, "steps"), (3, 3, "steps")]
    assert [c.chunk_id for c in run.delivered] == [0]


async def test_a_replica_taking_over_reports_only_the_steps_past_those_already_reported():
    reports: list[tuple[int, int, str]] = []
    script = SteppingStage(steps=4, fail_after=2)
    async with Replicas(script) as replicas:
        run = with_progress(Run(replicas), reports)
        await run.call.open()
        await run.call.forward(SOURCE, chunk(0, last=True))
        assert await run.error() is None
    assert script.calls == 2
    assert [done for done, _, _ in reports] == [1, 2, 3, 4]
