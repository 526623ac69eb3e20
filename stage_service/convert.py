"""Pure converters between stage protobuf messages and the engine types."""

from __future__ import annotations

import time

from omnistage import tensors
from omnistage.v1 import stage_pb2

from .engines.base import InputChunk, OutputChunk


def input_from_proto(msg: stage_pb2.Chunk) -> InputChunk:
    t0 = time.perf_counter()
    decoded = {}
    for t in msg.tensors:
        if t.name in decoded:
            raise tensors.TensorFormatError(f'chunk {msg.chunk_id} from "{msg.stage}" has two tensors named "{t.name}"')
        decoded[t.name] = tensors.from_proto(t)
    return InputChunk(stage=msg.stage, chunk_id=msg.chunk_id, tensors=decoded, text=msg.text,
                      end_of_stream=msg.end_of_stream, sample_rate=msg.sample_rate,
                      transfer_ms=(time.perf_counter() - t0) * 1e3)


def output_to_proto(out: OutputChunk, stage: str, chunk_id: int, end_of_stream: bool) -> stage_pb2.Chunk:
    return stage_pb2.Chunk(
        stage=stage, chunk_id=chunk_id, text=out.text, end_of_stream=end_of_stream,
        sample_rate=out.sample_rate, finish_reason=out.finish_reason,
        tensors=[tensors.to_proto(name, t) for name, t in out.tensors.items()],
        timing=stage_pb2.ChunkTiming(queue_ms=out.queue_ms, compute_ms=out.compute_ms, transfer_ms=out.transfer_ms))
