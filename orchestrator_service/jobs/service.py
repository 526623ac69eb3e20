"""The gRPC Jobs service (jobs.proto): thin over the door-neutral job operations (api.py). Keys as for Generate:
with keys configured a call needs one, and a job is seen only with the key that submitted it; a refusal is the
call's status (with `retry-after` when it says one)."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import grpc

from omnistage.v1 import jobs_pb2, jobs_pb2_grpc

from ..api_keys import ApiKeys
from ..servicer import REFUSED_KEY, Refused
from .api import JobApi, owner_of
from .store import Job, JobStatus

FETCH_CHUNK_BYTES = 1 << 20  # a Fetch message: well within gRPC's default 4 MiB receive limit of any client
STATUS = {JobStatus.QUEUED: jobs_pb2.JOB_QUEUED, JobStatus.IN_PROGRESS: jobs_pb2.JOB_IN_PROGRESS,
          JobStatus.COMPLETED: jobs_pb2.JOB_COMPLETED, JobStatus.FAILED: jobs_pb2.JOB_FAILED}


def to_proto(job: Job) -> jobs_pb2.Job:
    m = job.meta
    out = jobs_pb2.Job(id=job.id, status=STATUS[job.status],
                       progress=100 if job.status == JobStatus.COMPLETED else job.progress,
                       model=m.get("model", ""), width=m.get("width", 0), height=m.get("height", 0),
                       num_frames=m.get("num_frames", 0), fps=m.get("fps", 0), seconds=m.get("seconds", 0.0),
                       created_at=job.created_at, started_at=job.started_at or 0.0,
                       completed_at=job.completed_at or 0.0, expires_at=job.expires_at or 0.0,
                       attempts=job.attempts, restarted_reason=job.restarted_reason,
                       variants=sorted(job.content) if job.status == JobStatus.COMPLETED else [])
    if job.status == JobStatus.FAILED:
        out.error.code, out.error.message = job.error_code, job.error_message
    return out


class JobsServicer(jobs_pb2_grpc.JobsServicer):
    def __init__(self, jobs: JobApi, keys: ApiKeys):
        self.jobs, self.keys = jobs, keys

    async def _owner(self, context: grpc.aio.ServicerContext, priority: int = 0) -> str:
        """The caller's owner name; a call without a valid key, or asking for a priority above its key's, is
        aborted (as Generate is)."""
        header = dict(context.invocation_metadata() or ()).get("authorization")
        refused = self.keys.refusal(header, priority)
        if refused is not None:
            await context.abort(REFUSED_KEY[refused[0]], refused[1])
        return owner_of(self.keys, header)

    async def Submit(self, request: jobs_pb2.SubmitJobRequest, context) -> jobs_pb2.Job:
        # The job runs later at the priority it asks for: checked against the key now, as Generate checks it.
        owner = await self._owner(context, request.request.priority)
        return to_proto(await _answered(context, self.jobs.create(request.request, owner)))

    async def Get(self, request: jobs_pb2.JobRef, context) -> jobs_pb2.Job:
        owner = await self._owner(context)
        return to_proto(await _answered(context, self.jobs.get(request.id, owner)))

    async def Cancel(self, request: jobs_pb2.JobRef, context) -> jobs_pb2.Job:
        owner = await self._owner(context)
        return to_proto(await _answered(context, self.jobs.cancel(request.id, owner)))

    async def Delete(self, request: jobs_pb2.JobRef, context) -> jobs_pb2.DeleteJobResponse:
        owner = await self._owner(context)
        job = await _answered(context, self.jobs.delete(request.id, owner))
        return jobs_pb2.DeleteJobResponse(id=job.id, deleted=True)

    async def List(self, request: jobs_pb2.ListJobsRequest, context) -> jobs_pb2.JobList:
        owner = await self._owner(context)
        jobs, has_more = await _answered(context, self.jobs.list(owner, request.after or None, request.limit or None,
                                                                 request.order or None))
        return jobs_pb2.JobList(jobs=[to_proto(j) for j in jobs], has_more=has_more)

    async def Watch(self, request: jobs_pb2.JobRef, context) -> AsyncIterator[jobs_pb2.Job]:
        owner = await self._owner(context)
        watch = self.jobs.watch(request.id, owner)
        try:
            while True:
                job = await _answered(context, anext(watch, None))
                if job is None:
                    return
                yield to_proto(job)
        finally:
            await watch.aclose()

    async def Fetch(self, request: jobs_pb2.FetchRequest, context) -> AsyncIterator[jobs_pb2.ContentChunk]:
        owner = await self._owner(context)
        path, media_type = await _answered(context, self.jobs.content_of(request.id, owner, request.variant or None))
        try:
            f = await asyncio.to_thread(path.open, "rb")
        except FileNotFoundError:  # swept since it was found
            await context.abort(grpc.StatusCode.NOT_FOUND, f"video {request.id!r}: its content expired")
        with f:
            total = await asyncio.to_thread(lambda: f.seek(0, 2))
            f.seek(0)
            first = True
            while True:
                data = await asyncio.to_thread(f.read, FETCH_CHUNK_BYTES)
                if not data and not first:
                    return
                chunk = jobs_pb2.ContentChunk(data=data)
                if first:
                    chunk.media_type, chunk.total_bytes = media_type, total
                    first = False
                yield chunk
                if not data:
                    return


async def _answered(context, operation):
    """The operation's result; a refusal aborts the call with its status."""
    try:
        return await operation
    except Refused as e:
        if e.retry_after_s is not None:
            context.set_trailing_metadata((("retry-after", f"{e.retry_after_s}"),))
        await context.abort(e.code, e.message)
