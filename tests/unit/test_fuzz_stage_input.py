"""Fuzz the pure parsers of a stage's Process stream, for volume (tests/integration/test_fuzz_stage.py sends
the same kind of input to a real stage): the header, the request it resolves to, each input chunk's
descriptors, inline tensors, and the per-edge chunk order. Each either accepts its input or raises the
error the servicer maps to INVALID_ARGUMENT, never anything else."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from omnistage.api import load_pipeline
from omnistage.connector import TensorKey
from omnistage.contract import tensors
from omnistage.contract.chunks import ChunkOrderError, EdgeReorderBuffer
from omnistage.contract.params import InvalidRequest
from omnistage.v1 import common_pb2, stage_pb2, tensor_pb2
from stage_service.runtime.errors import InputError
from stage_service.servicer import check_input_chunk, header_from_proto, request_from_proto

from ..conftest import EXAMPLES

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PIPELINE = load_pipeline(EXAMPLES / "text-to-image-tiny.yaml")
STAGE = "vae-decode"  # reads one edge, from denoise
SOURCES = ("denoise",)
BUDGET = PIPELINE.deployment.stages["denoise"].transfer.max_buffered_bytes
CLEAN_ERRORS = (InvalidRequest, InputError, tensors.TensorFormatError, ChunkOrderError)

i64 = st.integers(-2**63, 2**63 - 1)
u32 = st.integers(0, 8) | st.integers(0, 2**32 - 1)
u64 = st.integers(0, 4096) | st.integers(0, 2**64 - 1)
dims = st.integers(0, 4) | st.integers(-2, 2**40) | i64
names = st.sampled_from(["latents", "x", ""]) | st.text(max_size=8)
stage_names = st.sampled_from(["denoise", "text-encoder", "vae-decode", ""]) | st.text(max_size=8)


@st.composite
def refs(draw, name: str, stage: str, chunk_id: int):
    key = draw(st.one_of(st.just(TensorKey("r1", stage or "s", chunk_id, name or "t").wire),
                         st.builds(lambda *a: TensorKey(*a).wire, st.sampled_from(["r1", "r2"]),
                                   st.sampled_from(["denoise", "x"]), st.integers(0, 3),
                                   st.sampled_from(["latents", "x"])),
                         st.text(max_size=30)))
    return tensor_pb2.TensorRef(backend=draw(st.sampled_from(["shm", "ucx", "", "gpu"])),
                                address=draw(st.sampled_from(["omnistage-1-2-ab-0", "127.0.0.1:1", "", "../x"])),
                                key=key, nbytes=draw(u64), host_id=draw(st.sampled_from(["h", ""])))


@st.composite
def descriptors(draw, stage: str = "denoise", chunk_id: int = 0):
    name = draw(names)
    dtype = draw(st.integers(0, 11) | st.integers(0, 2**31 - 1))
    shape = draw(st.lists(dims, max_size=5))
    msg = tensor_pb2.Tensor(name=name, dtype=dtype, shape=shape)
    payload = draw(st.sampled_from(["data", "exact", "ref", "none"]))
    if payload == "data":
        msg.data = draw(st.binary(max_size=64))
    elif payload == "exact" and tensors.DTYPE_NAMES.get(dtype) and all(0 <= d <= 4 for d in shape):
        itemsize = tensors.torch_dtype(dtype).itemsize
        n = 1
        for d in shape:
            n *= d
        msg.data = draw(st.binary(min_size=n * itemsize, max_size=n * itemsize))
    elif payload == "ref":
        msg.ref.CopyFrom(draw(refs(name, stage, chunk_id)))
    return msg


@st.composite
def chunks(draw):
    stage = draw(stage_names)
    chunk_id = draw(u32)
    return stage_pb2.Chunk(stage=stage, chunk_id=chunk_id, end_of_stream=draw(st.booleans()),
                           tensors=draw(st.lists(descriptors(stage, chunk_id), max_size=3)),
                           text=draw(st.text(max_size=10)), sample_rate=draw(u32))


@FUZZ
@given(chunks(), st.sampled_from([set(), {"shm"}, {"shm", "ucx"}]))
@example(stage_pb2.Chunk(stage="other"), {"shm"}).via("a chunk from a stage that is not an input")
@example(stage_pb2.Chunk(stage="denoise", tensors=[tensor_pb2.Tensor(name="latents", dtype=1, shape=[1 << 40], ref=(
    tensor_pb2.TensorRef(backend="shm", key=TensorKey("r1", "denoise", 0, "latents").wire, nbytes=4 << 40)))]),
    {"shm"}).via("a declared size far over the producer's budget: allocated before the fetch failed")
@example(stage_pb2.Chunk(stage="denoise", tensors=[tensor_pb2.Tensor(name="latents", dtype=1, shape=[2], ref=(
    tensor_pb2.TensorRef(backend="shm", key=TensorKey("other-request", "denoise", 0, "latents").wire, nbytes=8)))]),
    {"shm"}).via("a reference to another request's tensor")
@example(stage_pb2.Chunk(stage="denoise", tensors=[tensor_pb2.Tensor(name="latents", dtype=1, shape=[2], ref=(
    tensor_pb2.TensorRef(backend="gpu", key=TensorKey("r1", "denoise", 0, "latents").wire, nbytes=8)))]),
    {"shm"}).via("a backend the stage does not read: ConnectorError, INTERNAL")
def test_an_input_chunk_is_accepted_only_as_its_producer_could_send_it(chunk, backends):
    try:
        check_input_chunk(chunk, "r1", PIPELINE, SOURCES, backends)
    except CLEAN_ERRORS as e:
        assert str(e)
        return
    assert chunk.stage in SOURCES
    for t in chunk.tensors:
        if t.WhichOneof("payload") == "data":
            got = tensors.from_proto(t)  # accepted inline bytes always convert
            assert list(got.shape) == list(t.shape)
        else:
            assert t.ref.backend in backends and t.ref.nbytes <= BUDGET
            assert TensorKey.parse(t.ref.key) == TensorKey("r1", chunk.stage, chunk.chunk_id, t.name)


@FUZZ
@given(descriptors())
@example(tensor_pb2.Tensor(name="b", dtype=tensor_pb2.BOOL, shape=[2], data=b"\x05\x01")).via("bool bytes not 0/1")
@example(tensor_pb2.Tensor(name="z", dtype=1, shape=[0, 2**63 - 1], data=b""))
def test_an_inline_tensor_converts_or_is_a_format_error(msg):
    try:
        t = tensors.from_proto(msg)
    except tensors.TensorFormatError as e:
        assert str(e)
        return
    assert list(t.shape) == list(msg.shape) and tensors.proto_dtype(t.dtype) == msg.dtype
    assert tensors.descriptor_bytes(msg) == len(msg.data)
    if t.dtype == torch.bool:
        assert set(t.view(torch.uint8).reshape(-1).tolist()) <= {0, 1}


floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
params = st.builds(
    lambda prompt, ids, max_tokens, temp, w, steps, guide: common_pb2.GenerationParams(
        prompt=prompt, prompt_token_ids=ids,
        text=common_pb2.TextParams(max_tokens=max_tokens, **({"temperature": temp} if temp is not None else {})),
        image=common_pb2.ImageParams(width=w, height=w, num_inference_steps=steps,
                                     **({"guidance_scale": guide} if guide is not None else {}))),
    st.text(max_size=20), st.lists(st.integers(-2**31, 2**31 - 1), max_size=4), u32, st.none() | floats, u32, u32,
    st.none() | floats)
first_messages = st.one_of(
    st.none(), st.just(stage_pb2.StageInput()), chunks().map(lambda c: stage_pb2.StageInput(chunk=c)),
    st.builds(lambda rid, p, deadline, consumers: stage_pb2.StageInput(header=stage_pb2.StageRequestHeader(
        request_id=rid, params=p, deadline_unix_ms=deadline, consumers=consumers)),
        st.sampled_from(["", "r1"]) | st.text(max_size=10), params, st.just(0) | i64,
        st.lists(stage_names, max_size=3)))


@FUZZ
@given(first_messages)
def test_a_stream_opens_with_a_header_and_a_request_or_an_invalid_request(first):
    try:
        h = header_from_proto(first)
        req = request_from_proto(h, PIPELINE.limits)
    except InvalidRequest as e:
        assert e.field and str(e).startswith(e.field)
        return
    assert req.request_id == first.header.request_id != ""


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 12), st.booleans()), max_size=30), st.integers(1, 8))
def test_chunks_come_out_in_order_once_or_the_edge_refuses_them(pushes, max_pending):
    buf = EdgeReorderBuffer[int]("denoise", max_pending=max_pending)
    out: list[int] = []
    for chunk_id, eos in pushes:
        try:
            out += buf.push(chunk_id, chunk_id, eos)
        except ChunkOrderError as e:
            assert "denoise" in str(e)
    assert out == list(range(len(out)))
    assert buf.pending <= max_pending
    if buf.finished:
        assert out[-1] == buf.end_id


def test_the_chunk_check_names_the_reference_at_fault():
    bad = stage_pb2.Chunk(stage="denoise", chunk_id=3, tensors=[tensor_pb2.Tensor(
        name="latents", dtype=1, shape=[2], ref=tensor_pb2.TensorRef(backend="shm", key="r2/denoise/3/latents",
                                                                     nbytes=8))])
    with pytest.raises(tensors.TensorFormatError, match='chunk 3 from "denoise": tensor "latents" references '
                                                        '"r2/denoise/3/latents", not a tensor of this chunk'):
        check_input_chunk(bad, "r1", PIPELINE, SOURCES, {"shm"})
