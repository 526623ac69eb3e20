"""Orchestrator.Generate: validate -> admit -> walk the stage graph -> stream events -> final.
Thin: the request walk lives in request_run, admission in admission."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
import uuid
from typing import Any, AsyncIterator, Iterable

import grpc

from omnistage.api import Pipeline, clones_voices, reads_instructions, reads_language
from omnistage.contract.modalities import MODALITY_CODES, MODALITY_NAMES
from omnistage.contract.params import InvalidRequest, RequestParams, fill_resolved, has_media, resolve
from omnistage.v1 import orchestrator_pb2, orchestrator_pb2_grpc

from . import access_log, client_cap, consumer_pace, otel
from .admission import Admission, Overloaded
from .api_keys import ApiKeys
from .media_check import MediaCheck, check_needed_parts
from .metrics import OrchestratorMetrics
from .playback import Playback
from .request_class import request_class
from .request_run import RequestRun, StageFailed, needed_stages
from .routing import Router
from .stage_call import remaining
from .voices import Voices

log = logging.getLogger("omnistage.orchestrator")
MAX_REQUEST_ID = 128
# A draining replica's refusal: another replica (or this one, restarted) takes the retry within about this.
DRAIN_RETRY_AFTER_S = 1.0
REFUSED_KEY = {"unauthenticated": grpc.StatusCode.UNAUTHENTICATED, "priority": grpc.StatusCode.PERMISSION_DENIED}


class Refused(Exception):
    """A request the orchestrator will not serve, or can no longer finish: the status a client gets,
    whichever front door it came through. `param` names the request field at fault (bad input);
    `retry_after_s` comes with overload; `stage` names the stage that failed."""

    def __init__(self, code: grpc.StatusCode, message: str, *, param: str | None = None,
                 retry_after_s: float | None = None, stage: str | None = None):
        self.code, self.message = code, message
        self.param, self.retry_after_s, self.stage = param, retry_after_s, stage
        super().__init__(message)

    @classmethod
    def overloaded(cls, e: Overloaded) -> "Refused":
        return cls(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{e}; retry after {e.retry_after_s}s",
                   retry_after_s=e.retry_after_s)


def effective_deadline(caller: float | None, now: float, request_timeout_s: float) -> float | None:
    """The earlier of the caller's deadline and the pipeline's default (requestTimeoutSeconds from arrival;
    0: none), both time.time() seconds: no request is held without a bound unless the pipeline says so."""
    default = now + request_timeout_s if request_timeout_s > 0 else None
    if caller is None or default is None:
        return caller if default is None else default
    return min(caller, default)


def checked_label(label: str) -> str:
    """The client's request_id: its own label for the request (the server's id is what stages key on), bounded
    in length and to visible ASCII so it is safe in logs, traces and headers."""
    if len(label) > MAX_REQUEST_ID:
        raise InvalidRequest("request_id", f"is longer than {MAX_REQUEST_ID} characters")
    if any(not ("!" <= c <= "~") for c in label):
        raise InvalidRequest("request_id", "may hold only visible ASCII characters (no spaces or control characters)")
    return label


def requested_outputs(pipeline: Pipeline, request: orchestrator_pb2.GenerateRequest) -> dict[str, str]:
    """stage -> modality for the outputs asked for (all of the pipeline's when none are named)."""
    by_modality = {o.modality: o.stage for o in pipeline.outputs}
    if not request.outputs:
        return {stage: m for m, stage in by_modality.items()}
    chosen: dict[str, str] = {}
    for i, code in enumerate(request.outputs):
        name = MODALITY_NAMES.get(code)
        if name is None:
            raise InvalidRequest(f"outputs[{i}]", f"unknown modality {code}")
        if name not in by_modality:
            raise InvalidRequest(f"outputs[{i}]", f'pipeline "{pipeline.name}" has no {name} output '
                                               f"(it has: {', '.join(by_modality)})")
        chosen[by_modality[name]] = name
    return chosen


def unready_stage(router: Router, stages) -> tuple[str, str] | None:
    """(stage, why) for the first needed stage no replica of which can take work now: none at all, or
    every one unreachable or draining (a crashed process at a fixed address). Admission would hold the
    request until the stage came back; the client is better told, and can retry."""
    for s in sorted(stages):
        pool = router.pools[s]
        if not pool.replicas:
            return s, "has no replicas"
        if not pool.candidates():
            return s, f"has no ready replica ({len(pool.replicas)} unreachable or draining)"
    return None


def estimated_cost(params: RequestParams, outputs: Iterable[str]) -> float:
    """Relative work of a request, for ShortestFirst ordering (pure; units do not matter, order does): its text
    tokens, its codec frames when it asks for audio, and its denoise steps (weighted 4) when it asks for an
    image. From the resolved parameters, so a number the request leaves out counts as the pipeline's default:
    the number its stages will make."""
    outputs = set(outputs)
    return float(params.max_tokens + (params.max_codec_frames if "audio" in outputs else 0) +
                 4 * (params.num_inference_steps if outputs & {"image", "video"} else 0))


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServicer):
    def __init__(self, pipeline: Pipeline, router: Router, metrics: OrchestratorMetrics, media: MediaCheck,
                 api_keys: ApiKeys | None = None, voices: Voices | None = None):
        self.pipeline = pipeline
        # The audio output's voices (voices.py; None: no audio output, or not read): checked before admission.
        self.voices = voices
        self.router = router
        self.metrics = metrics
        self.media = media
        orc = pipeline.deployment.orchestrator
        self.max_attempts = 1 + orc.max_retries
        self.admission = Admission(orc.max_inflight, orc.max_queued, capacity=router.capacity,
                                   backlog=router.backlog, fairness=orc.fairness)
        # A replica's readiness changed: admission may go on, and the per-stage gauges say so at once (not at
        # the next request's end: a stage that lost its last replica reads capacity 0 with no traffic).
        router.on_change = self._replicas_changed
        self.draining = False
        self.runs: dict[str, RequestRun] = {}       # server id -> the request's walk
        self.labels: dict[str, str] = {}            # client label -> server id, while in flight
        self.api_keys = api_keys if api_keys is not None else ApiKeys(max_priority=orc.max_priority)
        self.client_cap = client_cap.ClientCap(client_cap.default_cap(orc.max_inflight, orc.max_queued),
                                               trusted=client_cap.trusted_proxies(os.environ))
        # The job API both doors share (/v1/videos, gRPC Jobs), set by the server (jobs/replica.py): the job API
        # builds on this module. None: no job API here (the HTTP door then refuses creating a job).
        self.jobs: Any = None  # a jobs.api.JobApi

    async def Generate(self, request: orchestrator_pb2.GenerateRequest, context):
        """The gRPC front door: the request path below, a refusal as the call's status."""
        remaining = context.time_remaining()
        deadline = time.time() + remaining if remaining is not None else None
        # The server's ClientDoor (grpc_door) refused a missing key before the message was read; the priority the
        # message asks for is checked against the key here.
        refused = self.api_keys.refusal(dict(context.invocation_metadata()).get("authorization"), request.priority)
        if refused is not None:   # a key refused (or its priority): not the admission queue's doing
            self.metrics.requests.labels("unauthenticated").inc()
            await context.abort(REFUSED_KEY[refused[0]], refused[1])
        client = client_cap.client_of(
            client_cap.key_index(self.api_keys, dict(context.invocation_metadata()).get("authorization")),
            client_cap.peer_host(context.peer()), self.client_cap.trusted)
        # Each event is written with a bound on how long it may wait on the client (consumer_pace.py), so a
        # client that stops reading or reads a trickle gives its request up instead of holding it.
        pace, too_slow = consumer_pace.ConsumerPace(consumer_pace.GRACE_S, consumer_pace.MIN_READ_BPS), None
        try:
            rid = uuid.uuid4().hex  # here, not in generate: the access line names it however the request ends
            async with contextlib.aclosing(access_log.observed(self.generate(
                    request, deadline, rid, client=client, incoming=otel.Incoming.of(
                        "grpc", context.invocation_metadata() or ())), rid)) as events:
                async for ev in events:
                    nbytes, t0 = ev.ByteSize(), time.monotonic()
                    allowed = pace.allowed_wait(nbytes)
                    try:
                        async with asyncio.timeout(allowed):
                            await context.write(ev)
                    except TimeoutError:
                        too_slow = pace.too_slow(nbytes, allowed)
                        break  # leaving the block cancels the request in every stage and frees its slot
                    pace.sent(nbytes, time.monotonic() - t0)
        except Refused as e:
            if e.retry_after_s is not None:
                context.set_trailing_metadata((("retry-after", f"{e.retry_after_s}"),))
            await context.abort(e.code, e.message)
        if too_slow is not None:
            log.warning("gRPC: %s", too_slow)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, too_slow)
        return
        yield  # Generate stays an async generator (the door's interceptors iterate it); events go by write()

    async def generate(self, request: orchestrator_pb2.GenerateRequest, deadline: float | None = None,
                       request_id: str | None = None,
                       client: str | None = None,
                       incoming: otel.Incoming | None = None,
                       media_checked: bool = False) -> AsyncIterator[orchestrator_pb2.GenerateResponse]:
        """The one request path both front doors (gRPC and HTTP) take: validate -> admit -> walk the
        stage graph -> events -> final. `deadline` is time.time() seconds, the caller's; the pipeline's
        requestTimeoutSeconds bounds it. `request_id` is the server's id for it (a new one when None; the
        HTTP layer makes its own to name the response); `request.request_id` is only the client's label.
        `client` names who sent it for the per-client cap (client_cap.py; None: not capped). `incoming`: its door
        and trace context, for its span (otel.py). `media_checked`: its media parts were decoded and checked when
        it was accepted (a job, at submission), so a run is not failed by a decoder busy or slow now.
        Raises Refused; a caller that stops iterating (client gone) cancels the request in every stage."""
        deadline = effective_deadline(deadline, time.time(), self.pipeline.limits.request_timeout_seconds)
        m = self.metrics
        if self.draining:
            m.requests.labels("rejected").inc()
            raise Refused(grpc.StatusCode.UNAVAILABLE, "orchestrator is draining; retry on another replica",
                          retry_after_s=DRAIN_RETRY_AFTER_S)
        try:
            label = checked_label(request.request_id)
            params = resolve(request.params, self.pipeline.limits)
            check_needed_parts(self.pipeline, params.parts)
            if params.language and not reads_language(self.pipeline):
                raise InvalidRequest("params.audio.language", f'"{self.pipeline.name}" has no stage that reads it '
                                                              "(a speech recognition or text-to-speech model does)")
            if params.instructions and not reads_instructions(self.pipeline):
                raise InvalidRequest("params.audio.instructions", f'"{self.pipeline.name}" has no stage that reads '
                                                                  "them (a text-to-speech model does)")
            if params.ref_text and not clones_voices(self.pipeline):
                raise InvalidRequest("params.audio.ref_text", f'"{self.pipeline.name}" has no stage that reads it (a '
                                                              "voice-cloning text-to-speech model does)")
            outputs = requested_outputs(self.pipeline, request)
            if self.voices is not None and "audio" in outputs.values():  # resolve's own default is not the model's
                params = dataclasses.replace(params, speaker=self.voices.choose(request.params.audio.speaker))
            req_class = request_class(params, outputs.values())
            media_decode_ms = 0.0
            if has_media(params.parts) and not media_checked:
                self.client_cap.check(client)  # a client over its cap gets no media decoded first
                media_decode_ms = await self.media.check(params.parts)
                m.media_decode_seconds.observe(media_decode_ms / 1e3)
        except InvalidRequest as e:
            m.requests.labels("invalid").inc()
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e), param=e.field) from None
        except Overloaded as e:  # the media decoders stayed busy
            m.requests.labels("rejected").inc()
            raise Refused.overloaded(e) from None
        stages = needed_stages(self.pipeline, set(outputs))
        down = unready_stage(self.router, stages)
        if down:  # nothing to wait for: say so now rather than hold the request
            m.requests.labels("failed").inc()
            raise Refused(grpc.StatusCode.UNAVAILABLE, f"stage {down[0]} {down[1]}", stage=down[0])
        if label in self.labels:
            m.requests.labels("invalid").inc()
            raise Refused(grpc.StatusCode.ALREADY_EXISTS,
                          f"request_id {label!r}: a request with this id is already in flight", param="request_id")
        rid = request_id or uuid.uuid4().hex
        if label:
            self.labels[label] = rid
        t0 = time.perf_counter()
        outcome = "failed"
        ticket = None
        span = otel.RequestSpan(incoming, self.pipeline.name, rid, label, params.max_tokens)
        capped = contextlib.ExitStack()
        try:
            capped.enter_context(self.client_cap.holding(client))  # Overloaded: refused before it queues
            m.waiting.set(self.admission.queued + 1)
            try:
                async with asyncio.timeout(remaining(deadline)):
                    ticket = await self.admission.admit(stages, request.priority,
                                                        estimated_cost(params, outputs.values()))
            except TimeoutError:
                outcome = "timeout"
                raise Refused(grpc.StatusCode.DEADLINE_EXCEEDED,
                              "the request's deadline passed while it waited for admission") from None
            finally:
                m.waiting.set(self.admission.queued)
            m.admitted.inc()
            m.class_requests.labels(req_class).inc()
            m.admission_wait_seconds.observe(ticket.wait_ms / 1e3)
            m.inflight.set(self.admission.inflight)
            span.admitted(ticket.wait_ms / 1e3)
            # The stages are sent the values resolved here, so they apply no defaults of their own.
            sent = fill_resolved(request.params, params)
            run = RequestRun(self.pipeline, self.router, rid, sent, outputs, deadline,
                             max_attempts=self.max_attempts, on_dispatched=lambda: self.admission.arrived(ticket),
                             trace_metadata=span.metadata)
            self.runs[rid] = run
            first, last_audio, playback = True, t0, Playback()
            async with contextlib.aclosing(run.events()) as events:  # closed now, not at GC, if we stop early
                async for ev in events:
                    if first and not ev.HasField("progress"):  # a progress report is no output yet
                        m.first_output_seconds.observe(time.perf_counter() - t0)
                        first = False
                    if ev.HasField("audio"):
                        last_audio = time.perf_counter()
                        if ev.audio.sample_rate:
                            m.observe_audio_chunk(playback.arrived(
                                last_audio, len(ev.audio.pcm) / 2 / max(1, ev.audio.channels) / ev.audio.sample_rate))
                    ev.client_request_id = label
                    yield ev
            m.observe_audio(last_audio - t0, run.assembler.usage.audio_seconds)
            final = orchestrator_pb2.Final(finish_reason=run.finish_reason or "stop", usage=run.assembler.usage)
            trace = run.trace(ticket.wait_ms, media_decode_ms)
            for st in trace.stages:
                for part in ("queue_ms", "compute_ms", "transfer_ms", "encode_ms", "first_chunk_ms", "total_ms"):
                    m.stage_seconds.labels(st.stage, part[:-3]).observe(getattr(st, part) / 1e3)
                if st.attempts > 1:
                    m.retries.labels(st.stage).inc(st.attempts - 1)
            if request.return_trace:
                final.trace.CopyFrom(trace)
            span.answered(final)
            yield orchestrator_pb2.GenerateResponse(request_id=rid, client_request_id=label, final=final)
            outcome = "finished"
        except Overloaded as e:
            outcome = "rejected"
            raise Refused.overloaded(e) from None
        except StageFailed as e:
            outcome = "cancelled" if e.code == grpc.StatusCode.CANCELLED else \
                "timeout" if e.code == grpc.StatusCode.DEADLINE_EXCEEDED else "failed"
            m.stage_errors.labels(e.stage, e.code.name).inc()
            if e.replica:  # which replica is the operator's to know, not the client's (nor its address)
                log.warning("request %s: stage %s replica %s: %s", rid, e.stage, e.replica, e)
            raise Refused(e.code, str(e), stage=e.stage) from None
        except (asyncio.CancelledError, GeneratorExit):  # the client went away
            outcome = "cancelled"
            raise
        finally:
            span.end(outcome)
            capped.close()
            self.runs.pop(rid, None)
            if label:
                self.labels.pop(label, None)
            if ticket is not None:
                self.admission.release(ticket)
            m.inflight.set(self.admission.inflight)
            m.requests.labels(outcome).inc()
            if ticket is not None:  # admitted (counted in class_requests): its class's ended count
                m.observe_ended(req_class, trace if outcome == "finished" else None)
            m.latency_seconds.observe(time.perf_counter() - t0)
            m.observe_admission(self.router)

    def _replicas_changed(self) -> None:
        self.admission.poke()
        self.metrics.observe_admission(self.router)

    async def DescribePipeline(self, request, context) -> orchestrator_pb2.PipelineInfo:
        refused = self.api_keys.refusal(dict(context.invocation_metadata()).get("authorization"), 0)
        if refused is not None:  # the same keys as Generate (and as the HTTP API's /v1/models)
            await context.abort(REFUSED_KEY[refused[0]], refused[1])
        voices = self.voices or Voices()
        return orchestrator_pb2.PipelineInfo(
            name=self.pipeline.name, stages=[s.name for s in self.pipeline.stages],
            outputs=[MODALITY_CODES[o.modality] for o in self.pipeline.outputs],
            voices=voices.names, default_voice=voices.default)
