"""Pure converters: tensors <-> proto bit for bit, engine chunks <-> stage protos, client events."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omnistage.contract import tensors
from omnistage.v1 import stage_pb2, tensor_pb2
from orchestrator_service.outputs import OutputAssembler, png_size, token_ids
from stage_service.convert import input_from_proto, output_to_proto
from stage_service.runtime.base import OutputChunk

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool]


def sample(dtype: torch.dtype, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (3, 5), (2, 0, 4), (2, 3, 4, 5)])
def test_tensor_round_trip_is_bit_exact(dtype, shape):
    t = sample(dtype, shape)
    msg = tensors.to_proto("x", t)
    back = tensors.from_proto(tensor_pb2.Tensor.FromString(msg.SerializeToString()))
    assert back.dtype == dtype and tuple(back.shape) == tuple(shape)
    assert tensors.tensor_bytes(back) == tensors.tensor_bytes(t)


def test_non_contiguous_tensors_are_sent_in_logical_order():
    t = torch.arange(12, dtype=torch.int32).reshape(3, 4).T
    assert torch.equal(tensors.from_proto(tensors.to_proto("x", t)), t)


@given(st.lists(st.integers(0, 4), max_size=4), st.binary(max_size=64), st.sampled_from(list(range(0, 12))))
@settings(max_examples=200, deadline=None)
def test_malformed_tensors_raise_a_clear_error(shape, data, code):
    msg = tensor_pb2.Tensor(name="x", dtype=code, shape=shape, data=data)
    try:
        t = tensors.from_proto(msg)
    except tensors.TensorFormatError as e:
        assert "tensor" in str(e)
    else:
        assert list(t.shape) == shape


def test_reference_tensor_is_not_decoded_inline():
    msg = tensor_pb2.Tensor(name="h", dtype=tensor_pb2.FLOAT32, shape=[4],
                            ref=tensor_pb2.TensorRef(backend="ucx", address="127.0.0.1:1", key="k", nbytes=16))
    with pytest.raises(tensors.TensorFormatError, match="not inline"):
        tensors.from_proto(msg)


def test_stage_chunk_round_trip():
    out = OutputChunk(tensors={"codes": torch.arange(8).view(2, 4)}, text="hi", finish_reason="length",
                      sample_rate=24000, queue_ms=1.5, compute_ms=2.5)
    msg = output_to_proto(out, "talker", 3, True, units=30, unit="frames")
    assert msg.stage == "talker" and msg.chunk_id == 3 and msg.end_of_stream and msg.timing.compute_ms == 2.5
    assert (msg.timing.units, msg.timing.unit) == (30, "frames")
    earlier = output_to_proto(out, "talker", 2, False).timing
    assert (earlier.units, earlier.unit) == (0, "")  # the last chunk alone carries the request's units
    wire = stage_pb2.Chunk.FromString(msg.SerializeToString())
    back = input_from_proto(wire, {t.name: tensors.from_proto(t) for t in wire.tensors})
    assert back.stage == "talker" and back.chunk_id == 3 and back.end_of_stream and back.text == "hi"
    assert torch.equal(back.tensors["codes"], out.tensors["codes"])


def test_output_assembler_turns_chunks_into_events():
    a = OutputAssembler("r1")
    text = output_to_proto(OutputChunk(tensors={"token_ids": torch.tensor([5, 6, 7])}, text="abc"), "thinker", 0, False)
    [ev] = a.events("text", text)
    assert ev.text.text == "abc" and list(ev.text.token_ids) == [5, 6, 7] and ev.request_id == "r1"
    pcm = torch.arange(-100, 100, dtype=torch.int16)
    audio = output_to_proto(OutputChunk(tensors={"audio": pcm}, sample_rate=8000), "code2wav", 0, False)
    [ev] = a.events("audio", audio)
    assert ev.audio.pcm == pcm.numpy().tobytes() and ev.audio.sample_rate == 8000 and ev.audio.index == 0
    [ev] = a.events("audio", audio)
    assert ev.audio.index == 1
    assert a.usage.completion_tokens == 3 and a.usage.audio_samples == 400
    assert a.usage.audio_seconds == pytest.approx(400 / 8000)
    empty = output_to_proto(OutputChunk(tensors={"audio": torch.empty(0, dtype=torch.int16)}), "code2wav", 2, True)
    assert a.events("audio", empty) == []


def test_png_size_and_token_ids():
    header = b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\rIHDR" + struct.pack(">II", 64, 32)
    assert png_size(header) == (64, 32)
    assert png_size(b"not a png") == (0, 0)
    chunk = stage_pb2.Chunk(tensors=[tensors.to_proto("token_ids", torch.tensor([1, 2 ** 40]))])
    assert token_ids(chunk) == [1, 2 ** 40]
