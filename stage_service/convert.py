"""Pure converters between stage protobuf messages and the engine types. Tensors are carried as
descriptors (inline or by reference): the data plane (`data_plane.py`) makes and resolves them."""

from __future__ import annotations

from typing import Mapping

import torch

from omnistage.contract import tensors as tensor_codec
from omnistage.v1 import stage_pb2, tensor_pb2
from stage_service.runtime.base import InputChunk, OutputChunk


def input_from_proto(msg: stage_pb2.Chunk, tensors: Mapping[str, torch.Tensor], transfer_ms: float = 0.0) -> InputChunk:
    """The engine's view of an input chunk whose tensors have been fetched."""
    return InputChunk(stage=msg.stage, chunk_id=msg.chunk_id, tensors=dict(tensors), text=msg.text,
                      end_of_stream=msg.end_of_stream, sample_rate=msg.sample_rate, transfer_ms=transfer_ms)


def output_to_proto(out: OutputChunk, stage: str, chunk_id: int, end_of_stream: bool,
                    descriptors: list[tensor_pb2.Tensor] | None = None, *, units: int = 0,
                    unit: str = "") -> stage_pb2.Chunk:
    """An output chunk; its tensors as the given descriptors, or inline when none are given. `units` of
    `unit`: the stage's work for the request, on its last chunk only."""
    if descriptors is None:
        descriptors = [tensor_codec.to_proto(name, t) for name, t in out.tensors.items()]
    return stage_pb2.Chunk(
        stage=stage, chunk_id=chunk_id, text=out.text, end_of_stream=end_of_stream,
        sample_rate=out.sample_rate, finish_reason=out.finish_reason, tensors=descriptors,
        timing=stage_pb2.ChunkTiming(queue_ms=out.queue_ms, compute_ms=out.compute_ms, transfer_ms=out.transfer_ms,
                                   encode_ms=out.encode_ms, units=units, unit=unit))
