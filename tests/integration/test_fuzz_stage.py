"""Fuzz a real stage's Process and Release with what a caller could send: streams without a header or with a
second one, chunks from the wrong stage, with wrong or repeated ids, tensors of the wrong dtype, shape or
size, references to segments that are missing, foreign, truncated or lie about their size, keys of other
requests, huge declared sizes, deadlines in the past or absurdly far, and Release of any id, at any time.

The stage is the VAE decoder of the tiny text-to-image pipeline: it reads one edge (latents from denoise)
over shared memory as well as inline, and its model is small. Every call ends, within a bound, with OK or a
clean client status naming the problem (never UNKNOWN or INTERNAL); afterwards the stage serves a good
request and holds nothing."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from pathlib import Path

import grpc
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from omnistage.connector import TensorKey
from omnistage.connector.shm import SEGMENT_PREFIX
from omnistage.connector.wire import HEADER_BYTES, TensorHeader
from omnistage.contract import tensors
from omnistage.v1 import stage_pb2, stage_pb2_grpc, tensor_pb2

from ..harness import example as pipeline_example
from ..harness import header, start_stage
from .test_stage_support import assert_nothing_held

PIPELINE = pipeline_example("text-to-image-tiny")
STAGE, SOURCE = "vae-decode", "denoise"
CALL_TIMEOUT_S = 60  # far above any call here: reaching it is a hang, and fails the test
SHM = Path("/dev/shm")
RUN = secrets.token_hex(3)  # this run's segment names, apart from any other run's

# The statuses a caller's bad input may get, each with what its message must say.
CLEAN = {grpc.StatusCode.INVALID_ARGUMENT: "",
         grpc.StatusCode.DEADLINE_EXCEEDED: f"stage {STAGE}: deadline passed",
         grpc.StatusCode.UNAVAILABLE: f"stage {STAGE}: input not fetched",  # a segment that is gone
         grpc.StatusCode.CANCELLED: "was released"}


def latents(h: int = 4, w: int = 4) -> torch.Tensor:
    return torch.zeros(1, 4, h, w)


# ---- one step of a Process stream ------------------------------------------------------------------------

@st.composite
def segment_ref(draw, request_id: str, chunk_id: int, name: str):
    """A reference to a segment this test writes (what it holds drawn too): (descriptor, segment bytes)."""
    t = latents()
    good = TensorHeader.of(t, readers=1).pack() + tensors.tensor_bytes(t)
    content = draw(st.one_of(
        st.just(good),
        st.just(good[:HEADER_BYTES + 10]),  # truncated body
        st.just(TensorHeader(torch.float32, (1, 4, 4, 4), 1 << 40, 1).pack()[:HEADER_BYTES]),  # lies about size
        st.binary(max_size=300),
        st.builds(lambda at, b: good[:at] + bytes([b]) + good[at + 1:], st.integers(0, HEADER_BYTES - 1),
                  st.integers(0, 255))))
    seg = f"{SEGMENT_PREFIX}fuzz-{RUN}-{draw(st.integers(0, 10**9))}"
    key = draw(st.sampled_from([TensorKey(request_id or "r", SOURCE, chunk_id, name or "latents").wire,
                                TensorKey("another-request", SOURCE, chunk_id, name or "latents").wire, "x"]))
    ref = tensor_pb2.TensorRef(
        backend=draw(st.sampled_from(["shm", "shm", "ucx", "nope"])),
        address=draw(st.sampled_from([seg, seg, f"{seg}-missing", "../../etc/passwd", ""])),
        key=key, nbytes=draw(st.sampled_from([t.numel() * 4, 0, 1 << 40, 2**64 - 1])),
        host_id=draw(st.sampled_from(["self", "self", "elsewhere"])))
    shape = draw(st.sampled_from([list(t.shape), [1 << 38], [-1, 4]]))
    return tensor_pb2.Tensor(name=name, dtype=draw(st.sampled_from([1, 1, 2, 0, 99])), shape=shape, ref=ref), \
        (seg, content)


@st.composite
def input_tensor(draw, request_id: str, chunk_id: int):
    name = draw(st.sampled_from(["latents", "latents", "other", ""]))
    kind = draw(st.sampled_from(["good", "inline", "ref"]))
    if kind == "good":
        return tensors.to_proto(name, latents(*draw(st.sampled_from([(4, 4), (8, 4)])))), None
    if kind == "inline":
        msg = tensor_pb2.Tensor(name=name, dtype=draw(st.integers(0, 11)),
                                shape=draw(st.lists(st.integers(-1, 5) | st.just(1 << 40), max_size=5)),
                                data=draw(st.binary(max_size=300)))
        return msg, None
    return draw(segment_ref(request_id, chunk_id, name))


@st.composite
def good_streams(draw):
    """A stream the stage serves: its latents inline or in a shared-memory segment."""
    t = latents()
    segments = []
    if draw(st.booleans()):
        msg = tensors.to_proto("latents", t)
    else:
        seg = f"{SEGMENT_PREFIX}fuzz-{RUN}-{draw(st.integers(0, 10**9))}"
        segments.append((seg, TensorHeader.of(t, readers=1).pack() + tensors.tensor_bytes(t)))
        msg = tensor_pb2.Tensor(name="latents", dtype=tensors.proto_dtype(t.dtype), shape=list(t.shape),
                                ref=tensor_pb2.TensorRef(backend="shm", address=seg, nbytes=t.numel() * 4,
                                                         key=TensorKey("fz", SOURCE, 0, "latents").wire,
                                                         host_id="self"))
    chunk = stage_pb2.Chunk(stage=SOURCE, chunk_id=0, end_of_stream=True, tensors=[msg])
    return [header("fz"), stage_pb2.StageInput(chunk=chunk)], segments, draw(st.booleans())


@st.composite
def streams(draw):
    """(messages, segments to write first, release mid-call)."""
    if draw(st.integers(0, 3)) == 0:
        return draw(good_streams())
    request_id = draw(st.sampled_from(["fz", "fz", ""]) | st.text(max_size=12))
    messages, segments = [], []
    opening = draw(st.sampled_from(["header", "header", "header", "none", "chunk"]))
    now_ms = int(time.time() * 1e3)
    if opening == "header":
        deadline = draw(st.sampled_from([0, 0, now_ms - 1000, -5, 2**63 - 1, now_ms + 30_000]))
        first = header(request_id, deadline_unix_ms=deadline)
        if draw(st.booleans()):
            first.header.params.image.guidance_scale = draw(st.floats(allow_nan=True, allow_infinity=True))
        messages.append(first)
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.integers(0, 9)) == 0:
            messages.append(header(request_id))  # a second header
            continue
        chunk_id = draw(st.sampled_from([0, 0, 1, 2, 2**32 - 1]))
        ts = draw(st.lists(input_tensor(request_id, chunk_id), max_size=2))
        segments += [s for _, s in ts if s is not None]
        messages.append(stage_pb2.StageInput(chunk=stage_pb2.Chunk(
            stage=draw(st.sampled_from([SOURCE, SOURCE, SOURCE, "text-encoder", STAGE, ""])), chunk_id=chunk_id,
            end_of_stream=draw(st.booleans()), tensors=[t for t, _ in ts])))
    return messages, segments, draw(st.booleans())


@pytest.fixture(scope="module")
async def stage(model_dir):
    srv = await start_stage(PIPELINE, STAGE, model_dir)
    yield srv
    await srv.drain()


def process(channel: grpc.Channel, messages, release: str | None = None
            ) -> tuple[grpc.StatusCode, str, list[stage_pb2.Chunk]]:
    """One Process call on the blocking API, which reports the status the server sent. (The asyncio client
    reports INTERNAL "Internal error from Core" instead when the server ends the call while it still has
    messages to write: grpc/grpc#36066.) With `release`, a Release of that id follows the call's start."""
    stub = stage_pb2_grpc.StageServiceStub(channel)
    call = stub.Process(iter(messages), timeout=CALL_TIMEOUT_S)
    if release is not None:
        stub.Release(stage_pb2.ReleaseRequest(request_id=release), timeout=CALL_TIMEOUT_S)
    chunks, failures = [], []
    try:
        for out in call:
            if out.HasField("failure"):
                failures.append(out.failure)
            else:
                chunks.append(out.chunk)
    except grpc.RpcError:
        pass
    code, details = call.code(), call.details() or ""
    # A status the stage ended the call with came first as a message saying the same (stage.proto StageFailure);
    # one gRPC itself set (a message over its size bound) comes alone.
    assert len(failures) <= 1 and all((f.code, f.message) == (code.value[0], details) for f in failures), \
        (failures, code, details)
    assert not failures or not chunks or not chunks[-1].end_of_stream, "a failure after the last chunk"
    return code, details, chunks


def check_outcome(code: grpc.StatusCode, details: str, chunks, messages) -> None:
    assert code == grpc.StatusCode.OK or code in CLEAN, (code, details, messages)
    if code == grpc.StatusCode.OK:
        assert chunks and chunks[-1].end_of_stream, messages
        return
    assert details and CLEAN[code] in details, (code, details, messages)
    assert "Traceback" not in details and "Exception" not in details, details


def good_request(channel: grpc.Channel) -> None:
    code, details, chunks = process(channel, [header("good"), stage_pb2.StageInput(chunk=stage_pb2.Chunk(
        stage=SOURCE, chunk_id=0, end_of_stream=True, tensors=[tensors.to_proto("latents", latents())]))])
    assert code == grpc.StatusCode.OK, details
    assert any(t.name == "image" for t in chunks[0].tensors)


_HOLE_SEGMENT = f"{SEGMENT_PREFIX}fuzz-{RUN}-huge"
_HOLE = [header("fz"), stage_pb2.StageInput(chunk=stage_pb2.Chunk(stage=SOURCE, end_of_stream=True, tensors=[
    tensor_pb2.Tensor(name="latents", dtype=1, shape=[1 << 38], ref=tensor_pb2.TensorRef(
        backend="shm", address=_HOLE_SEGMENT, key=TensorKey("fz", SOURCE, 0, "latents").wire,
        nbytes=1 << 40, host_id="self"))]))]
_FOREIGN_BACKEND = [header("fz"), stage_pb2.StageInput(chunk=stage_pb2.Chunk(stage=SOURCE, end_of_stream=True, tensors=[
    tensor_pb2.Tensor(name="latents", dtype=1, shape=[1, 4, 4, 4], ref=tensor_pb2.TensorRef(
        backend="ucx", address="127.0.0.1:1", key=TensorKey("fz", SOURCE, 0, "latents").wire, nbytes=256))]))]
_BAD_NAME = [header("fz"), stage_pb2.StageInput(chunk=stage_pb2.Chunk(stage=SOURCE, end_of_stream=True, tensors=[
    tensor_pb2.Tensor(name="latents", dtype=1, shape=[1, 4, 4, 4], ref=tensor_pb2.TensorRef(
        backend="shm", address="omnistage-\0", key=TensorKey("fz", SOURCE, 0, "latents").wire, nbytes=256,
        host_id="self"))]))]


async def test_any_process_stream_ends_cleanly_and_leaves_nothing(stage):
    host = stage.data_plane.host_id
    seen: dict[grpc.StatusCode, int] = {}

    def one(channel, messages, segments, release_mid_call):
        for m in messages:  # "self" stands for the stage's own host id, known only once it runs
            if m.WhichOneof("kind") == "header":
                m.header.failure_message = True  # as the orchestrator asks: process() checks what it says
            if m.WhichOneof("kind") == "chunk":
                for t in m.chunk.tensors:
                    if t.WhichOneof("payload") == "ref" and t.ref.host_id == "self":
                        t.ref.host_id = host
        for name, content in segments:
            (SHM / name).write_bytes(content)
        rid = next((m.header.request_id for m in messages if m.WhichOneof("kind") == "header"), "") or "fz"
        try:
            code, details, chunks = process(channel, messages, rid if release_mid_call else None)
        finally:
            for name, _ in segments:
                (SHM / name).unlink(missing_ok=True)
        seen[code] = seen.get(code, 0) + 1
        check_outcome(code, details, chunks, messages)

    def run_all():
        with grpc.insecure_channel(f"127.0.0.1:{stage.port}") as channel:
            @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
            @given(streams())
            @example(([], [], False)).via("no message at all")
            @example((_HOLE, [(_HOLE_SEGMENT, TensorHeader(torch.float32, (1 << 38,), 1 << 40, 1).pack())], False)).via(
                "a header-only segment declaring 1 TiB: allocated before reading (ENOMEM: INTERNAL)")
            @example((_FOREIGN_BACKEND, [], False)).via("a backend the stage does not read: INTERNAL")
            @example((_BAD_NAME, [], False)).via("a NUL in a segment name: ValueError, INTERNAL")
            def run(case):
                one(channel, *case)

            run()
            assert seen.get(grpc.StatusCode.OK) and seen.get(grpc.StatusCode.INVALID_ARGUMENT), seen
            good_request(channel)

    await asyncio.to_thread(run_all)
    await assert_nothing_held(stage)
    assert stage.data_plane.held_bytes == 0
    assert not list(SHM.glob(f"{SEGMENT_PREFIX}fuzz-{RUN}-*"))


async def test_the_status_comes_first_as_a_message_only_when_the_header_asks(stage):
    """A client that asks (failure_message) reads a StageFailure saying the status before it; one that does
    not (built before the message existed) gets the status alone, as it always did."""
    def call(ask: bool):
        messages = [stage_pb2.StageInput(), *_FOREIGN_BACKEND[1:]]
        messages[0].CopyFrom(_FOREIGN_BACKEND[0])
        messages[0].header.failure_message = ask
        with grpc.insecure_channel(f"127.0.0.1:{stage.port}") as channel:
            call = stage_pb2_grpc.StageServiceStub(channel).Process(iter(messages), timeout=CALL_TIMEOUT_S)
            outputs = []
            with contextlib.suppress(grpc.RpcError):
                outputs.extend(call)
            return call.code(), call.details(), outputs

    code, details, outputs = await asyncio.to_thread(call, True)
    assert code != grpc.StatusCode.OK and [o.WhichOneof("kind") for o in outputs] == ["failure"], outputs
    assert (outputs[0].failure.code, outputs[0].failure.message) == (code.value[0], details)
    code_alone, details_alone, outputs = await asyncio.to_thread(call, False)
    assert outputs == [] and (code_alone, details_alone) == (code, details)
    await assert_nothing_held(stage)


async def test_release_of_any_id_is_answered_and_frees_nothing_of_others(stage):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stage.port}") as channel:
        stub = stage_pb2_grpc.StageServiceStub(channel)
        loop = asyncio.get_running_loop()

        async def release(request_id: str) -> None:
            try:
                resp = await stub.Release(stage_pb2.ReleaseRequest(request_id=request_id), timeout=CALL_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                assert (e.code(), e.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "request_id: is required")
                assert request_id == ""
                return
            assert resp.bytes_freed == 0  # this stage holds nothing for anyone

        @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.text(max_size=300) | st.sampled_from(["", "fz", "good", "/", "\0"]))
        def run(request_id):
            asyncio.run_coroutine_threadsafe(release(request_id), loop).result(2 * CALL_TIMEOUT_S)

        await asyncio.to_thread(run)
    with grpc.insecure_channel(f"127.0.0.1:{stage.port}") as channel:
        await asyncio.to_thread(good_request, channel)
    await assert_nothing_held(stage)
