"""Videos (`/v1/videos`, OpenAI's video API shape): a video is a durable job (jobs/api.py), created here and run
by whichever orchestrator replica claims it; polled, listed, watched (server-sent events), fetched once completed
(`/content?variant=video|thumbnail|spritesheet|preview`) and deleted. The request is translated here (pure), the job
operations are the door-neutral ones the gRPC Jobs service calls too.

The body is JSON or multipart/form-data (as the OpenAI SDKs send it): `prompt`, `model`, `seconds` (OpenAI's
"4"/"8"/"12", or any number: seconds x fps frames, to the nearest count the video VAE makes), `size` "WxH",
`seed`, `input_reference` (an image-to-video pipeline's reference image: a file in a multipart body, or in JSON a
data: URL or `{"image_url": "data:..."}`; the first frame's picture, resized to the video's size as the pipeline
does); omnistage's own: `num_frames`, `fps`, `negative_prompt`, `num_inference_steps`, `guidance_scale`.
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
from typing import Annotated, Any, AsyncGenerator, AsyncIterator, Awaitable, BinaryIO, Callable

import grpc
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from omnistage.api import Pipeline, accepted_inputs
from omnistage.contract.params import FRAME_STEP, InvalidRequest
from omnistage.contract.request import build_request
from omnistage.v1 import common_pb2, orchestrator_pb2

from ..jobs.api import NO_STORE, JobApi, QuotaRefused, content_gone, owner_of
from ..jobs.store import Job, JobStatus
from ..servicer import Refused
from . import multipart_form
from .errors import ApiError, from_refused, retry_after_header
from .responses import SSE_DONE, SSE_HEADERS, SSE_MEDIA_TYPE, sse_event
from .schemas import MAX_NAME_CHARS, UINT32, UINT64
from .translate import check_model, image_size, inline_image

Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
# Fields of OpenAI's video API this server cannot honour, and why.
INPUT_REFERENCE_REFUSED = ("image-to-video is not served: {model} is a text-to-video pipeline (its first stage "
                           "takes the prompt only); send the prompt without input_reference")
REMIX_REFUSED = ("remix is not supported: {model} generates each video from its prompt alone; create a new video "
                 "with a changed prompt instead")


class VideoRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    prompt: str
    model: Name | None = None
    seconds: Annotated[str, Field(max_length=16)] | float | None = None
    size: Name | None = None
    seed: int | None = Field(None, ge=0, le=UINT64)
    input_reference: Any = None
    # omnistage's
    num_frames: int | None = Field(None, ge=1, le=UINT32)
    fps: int | None = Field(None, ge=1, le=UINT32)
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(None, ge=1, le=UINT32)
    guidance_scale: float | None = None


CONTENT_CHUNK_BYTES = 1 << 20  # a video's content is sent in reads of this size (memory per download stays bounded)
# Frame counts past this are refused without being rounded to a count: far beyond any maxFrames (a uint32).
MOST_COUNTED_FRAMES = float(UINT32)


def frames_for(seconds: str | float, fps: int, most: int) -> int:
    """`seconds` of video at `fps` as a frame count the video VAE makes (1 + FRAME_STEP x k, the nearest; pure);
    more than `most` frames is refused, naming the longest clip there is."""
    try:
        value = float(seconds)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise InvalidRequest("seconds", f"must be a number of seconds above 0 (such as \"4\"), got {seconds!r}")
    wanted = value * fps  # checked before rounding: a huge product is inf, which round() cannot take
    if not (math.isfinite(wanted) and wanted <= MOST_COUNTED_FRAMES):
        raise InvalidRequest("seconds", f"{value:g} s at {fps} fps is {wanted:.3g} frames; this pipeline makes at "
                                        f"most {most} frames ({most / fps:.2f} s at {fps} fps)")
    frames = 1 + FRAME_STEP * max(0, round((wanted - 1) / FRAME_STEP))
    if frames > most:
        raise InvalidRequest("seconds", f"{value:g} s at {fps} fps is {frames} frames; this pipeline makes at most "
                                        f"{most} frames ({most / fps:.2f} s at {fps} fps)")
    return frames


def reference_parts(value: Any, pipeline: Pipeline) -> list[common_pb2.ContentPart]:
    """`input_reference` as the request's image part (none without one); the media check decodes it later."""
    if value in (None, ""):
        return []
    if "image" not in accepted_inputs(pipeline):
        raise InvalidRequest("input_reference", INPUT_REFERENCE_REFUSED.format(model=f'"{pipeline.name}"'))
    return [common_pb2.ContentPart(image=common_pb2.ImagePart(data=inline_image(value, "input_reference")))]


def translate(body: VideoRequest, pipeline: Pipeline) -> orchestrator_pb2.GenerateRequest:
    """The body as the job's GenerateRequest (outputs [VIDEO]); the job API validates it against the limits."""
    check_model(body.model, pipeline)
    parts = reference_parts(body.input_reference, pipeline)
    width, height = image_size(body.size)
    limits = pipeline.limits
    fps = body.fps or 0
    if fps > limits.max_fps:  # before seconds x fps: a rate too high is the rate's fault, not the length's
        raise InvalidRequest("fps", f"must be between 1 and {limits.max_fps}, got {fps}")
    frames = body.num_frames or 0
    if body.seconds is not None and body.num_frames is None:
        frames = frames_for(body.seconds, fps or limits.default_fps, limits.max_frames)
    request = build_request(body.prompt, width=width, height=height, num_inference_steps=body.num_inference_steps or 0,
                            guidance_scale=body.guidance_scale, negative_prompt=body.negative_prompt or "",
                            seed=body.seed, outputs=["video"], parts=parts)
    request.params.video.num_frames, request.params.video.fps = frames, fps
    return request


def from_form(form: multipart_form.Form) -> VideoRequest:
    """A multipart body's fields as the JSON body's (its numbers as text, read as numbers)."""
    fields: dict[str, Any] = {name: form.text(name) for name in form.fields}
    files = form.files.get("input_reference", [])
    if len(files) > 1:
        raise InvalidRequest("input_reference", f"takes one image, got {len(files)} files")
    if files:
        fields["input_reference"] = files[0].data
    return VideoRequest.model_validate(fields)


# Request-path fields -> the body's, for a refusal of the resolved parameters (the reference image is the one part).
FIELDS = {"params.prompt": "prompt", "params.parts": "input_reference", "params.parts[0].image": "input_reference",
          "params.image.width": "size", "params.image.height": "size",
          "params.image.num_inference_steps": "num_inference_steps", "params.image.guidance_scale": "guidance_scale",
          "params.image.negative_prompt": "negative_prompt", "params.seed": "seed",
          "params.video.num_frames": "seconds", "params.video.fps": "fps"}


def video_object(job: Job) -> dict:
    """A job as OpenAI's Video object (with omnistage's frame count, rate and restarts beside it)."""
    m = job.meta
    seconds = m.get("seconds", 0.0)
    body = {"id": job.id, "object": "video", "model": m.get("model", ""), "status": job.status.value,
            "progress": 100 if job.status == JobStatus.COMPLETED else job.progress,
            "created_at": int(job.created_at), "completed_at": _ts(job.completed_at),
            "expires_at": _ts(job.expires_at), "size": f"{m.get('width', 0)}x{m.get('height', 0)}",
            "seconds": f"{seconds:g}", "remixed_from_video_id": None,
            "error": {"code": job.error_code, "message": job.error_message} if job.status == JobStatus.FAILED else None,
            "num_frames": m.get("num_frames", 0), "fps": m.get("fps", 0), "attempts": job.attempts}
    if job.restarted_reason:
        body["restarted_reason"] = job.restarted_reason
    return body


def _ts(t: float | None) -> int | None:
    return None if t is None else int(t)


def job_error(e: Refused, fields: dict[str, str] = FIELDS) -> ApiError:
    """A job operation's refusal as the OpenAI error shape (a job's kinds beside the request path's)."""
    if e.code == grpc.StatusCode.NOT_FOUND:
        return ApiError(404, e.message, "invalid_request_error", e.param, "video_not_found")
    if e.code == grpc.StatusCode.FAILED_PRECONDITION:
        return ApiError(409, e.message, "invalid_request_error", None, "video_not_ready")
    if e.code == grpc.StatusCode.UNAVAILABLE and e.message == NO_STORE:
        return ApiError(503, e.message, "service_unavailable_error", None, "jobs_not_configured")
    if isinstance(e, QuotaRefused):
        return ApiError(429, e.message, "rate_limit_error", None, "too_many_queued_videos",
                        {"Retry-After": retry_after_header(e.retry_after_s or 1)})
    return from_refused(e, fields)


def _answers_job_errors(handler: Callable[..., Awaitable[Response]]):
    """A job refusal as its answer (the API's wrapper answers the rest: `routes.answering`)."""
    @functools.wraps(handler)
    async def wrapped(self, request: Request) -> Response:
        try:
            return await handler(self, request)
        except Refused as e:
            raise job_error(e) from None
    return wrapped


class VideoEndpoints:
    """The /v1/videos handlers; `endpoints` (routes.Endpoints) reads bodies under the API's bounds and answers
    errors in the one shape."""

    def __init__(self, endpoints, jobs: JobApi | None, pipeline: Pipeline, keys):
        self.endpoints, self.pipeline, self.keys = endpoints, pipeline, keys
        self.jobs = jobs if jobs is not None else JobApi(pipeline, None, None)  # none: creating is refused (503)

    def owner(self, request: Request) -> str:
        return owner_of(self.keys, request.headers.get("authorization"))

    @_answers_job_errors
    async def create(self, request: Request) -> Response:
        content_type = request.headers.get("content-type", "")
        form = multipart_form.is_form(content_type)
        # JSON: text only, or with a base64 reference image where the pipeline takes one (bounded as chat's parts)
        limit = (self.endpoints.upload_limit if form else self.endpoints.chat_limit.size
                 if "image" in accepted_inputs(self.pipeline) else self.endpoints.text_limit.size)
        async with self.endpoints._body(request, limit) as (body, _):
            raw = body.getvalue()
        body = (from_form(multipart_form.parse(raw, content_type)) if form else
                VideoRequest.model_validate_json(raw, strict=True))
        try:
            job = await self.jobs.create(translate(body, self.pipeline), self.owner(request))
        except Refused as e:  # the frame count is refused as the field that gave it
            raise job_error(e, FIELDS | {"params.video.num_frames": "num_frames" if body.num_frames else "seconds"}) \
                from None
        return JSONResponse(video_object(job))

    @_answers_job_errors
    async def retrieve(self, request: Request) -> Response:
        return JSONResponse(video_object(await self.jobs.get(request.path_params["video_id"], self.owner(request))))

    @_answers_job_errors
    async def list(self, request: Request) -> Response:
        q = request.query_params
        limit = q.get("limit")
        if limit is not None and not limit.isdigit():
            raise InvalidRequest("limit", f"must be a whole number, got {limit!r}")
        jobs, has_more = await self.jobs.list(self.owner(request), q.get("after"), int(limit) if limit else None,
                                              q.get("order"))
        data = [video_object(j) for j in jobs]
        return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None, "has_more": has_more})

    @_answers_job_errors
    async def delete(self, request: Request) -> Response:
        job = await self.jobs.delete(request.path_params["video_id"], self.owner(request))
        return JSONResponse({"id": job.id, "object": "video.deleted", "deleted": True})

    @_answers_job_errors
    async def cancel(self, request: Request) -> Response:
        return JSONResponse(video_object(await self.jobs.cancel(request.path_params["video_id"],
                                                                self.owner(request))))

    @_answers_job_errors
    async def content(self, request: Request) -> Response:
        video_id, variant = request.path_params["video_id"], request.query_params.get("variant")
        path, media_type = await self.jobs.content_of(video_id, self.owner(request), variant)
        try:  # opened before the answer starts: a file swept after this is still read whole from its handle
            f = await asyncio.to_thread(path.open, "rb")
        except FileNotFoundError:  # swept since it was found: as content that expired
            raise content_gone(video_id, variant or "video") from None
        size = os.fstat(f.fileno()).st_size
        return StreamingResponse(_file_chunks(f), media_type=media_type, headers={"Content-Length": str(size)})

    @_answers_job_errors
    async def remix(self, request: Request) -> Response:
        raise ApiError(400, REMIX_REFUSED.format(model=f'"{self.pipeline.name}"'), "invalid_request_error", None,
                       "unsupported")

    @_answers_job_errors
    async def events(self, request: Request) -> Response:
        """Server-sent events: the video object now and at each change (`type` video.queued, video.in_progress,
        video.progress, video.completed, video.failed), then `[DONE]`."""
        watch = self.jobs.watch(request.path_params["video_id"], self.owner(request))
        try:
            first = await anext(watch)  # an unknown id is a 404, before the stream starts
        except Refused as e:
            if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            raise ApiError(429, e.message, "rate_limit_error", None, "too_many_watches",
                           {"Retry-After": retry_after_header(e.retry_after_s or 1)}) from None
        return StreamingResponse(_sse(first, watch), media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)


async def _sse(first: Job, watch: AsyncGenerator[Job, None]) -> AsyncIterator[bytes]:
    """The events of `watch`; one that ends it early (the video deleted, the store unreachable) is sent as an
    `error` event (the API's error shape) before the stream ends."""
    last_status = None
    job: Job | None = first
    try:
        while job is not None:
            kind = "progress" if job.status == last_status else job.status.value
            last_status = job.status
            yield sse_event({"type": f"video.{kind}", "video": video_object(job)})
            try:
                job = await anext(watch, None)
            except Refused as e:
                yield sse_event({"type": "error", "error": job_error(e).body()["error"]})
                return
        yield SSE_DONE
    finally:
        await watch.aclose()


async def _file_chunks(f: BinaryIO) -> AsyncIterator[bytes]:
    with f:
        while data := await asyncio.to_thread(f.read, CONTENT_CHUNK_BYTES):
            yield data


def routes(videos: VideoEndpoints, wrap: Callable) -> list[Route]:
    """The /v1/videos routes, each handler wrapped by `wrap` (the API's error answer)."""
    def route(path: str, handler, method: str) -> Route:
        return Route(path, wrap(handler), methods=[method])
    return [
        route("/v1/videos", videos.create, "POST"),
        route("/v1/videos", videos.list, "GET"),
        route("/v1/videos/{video_id}", videos.retrieve, "GET"),
        route("/v1/videos/{video_id}", videos.delete, "DELETE"),
        route("/v1/videos/{video_id}/content", videos.content, "GET"),
        route("/v1/videos/{video_id}/events", videos.events, "GET"),
        route("/v1/videos/{video_id}/cancel", videos.cancel, "POST"),
        route("/v1/videos/{video_id}/remix", videos.remix, "POST"),
    ]
