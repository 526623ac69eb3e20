"""Final-stage chunks -> client events (pure). The orchestrator forwards bytes as the stages
produced them: int16 PCM audio, PNG images, text deltas."""

from __future__ import annotations

import struct

from omnistage.v1 import orchestrator_pb2, stage_pb2, tensor_pb2


def _tensor(chunk: stage_pb2.Chunk, name: str) -> tensor_pb2.Tensor | None:
    for t in chunk.tensors:
        if t.name == name:
            return t
    return None


def token_ids(chunk: stage_pb2.Chunk) -> list[int]:
    t = _tensor(chunk, "token_ids")
    if t is None or not t.data:
        return []
    n = len(t.data) // 8
    return list(struct.unpack(f"<{n}q", t.data[: n * 8]))


def png_size(png: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    if len(png) < 24 or png[:8] != b"\x89PNG\r\n\x1a\n":
        return 0, 0
    return struct.unpack(">II", png[16:24])


class OutputAssembler:
    """Turns one request's output-stage chunks into GenerateResponse events and counts usage."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.audio_index = 0
        self.image_index = 0
        self.usage = orchestrator_pb2.Usage()

    def events(self, modality: str, chunk: stage_pb2.Chunk) -> list[orchestrator_pb2.GenerateResponse]:
        rid = self.request_id
        if modality == "text":
            ids = token_ids(chunk)
            self.usage.completion_tokens += len(ids)
            if not chunk.text and not ids:
                return []
            return [orchestrator_pb2.GenerateResponse(request_id=rid, text=orchestrator_pb2.TextDelta(
                text=chunk.text, token_ids=ids, stage=chunk.stage))]
        if modality == "audio":
            t = _tensor(chunk, "audio")
            if t is None or not t.data:
                return []
            samples = len(t.data) // 2
            self.usage.audio_samples += samples
            if chunk.sample_rate:
                self.usage.audio_seconds += samples / chunk.sample_rate
            ev = orchestrator_pb2.GenerateResponse(request_id=rid, audio=orchestrator_pb2.AudioChunk(
                pcm=t.data, sample_rate=chunk.sample_rate, channels=1, index=self.audio_index))
            self.audio_index += 1
            return [ev]
        if modality == "image":
            t = _tensor(chunk, "image")
            if t is None or not t.data:
                return []
            w, h = png_size(t.data)
            self.usage.images += 1
            ev = orchestrator_pb2.GenerateResponse(request_id=rid, image=orchestrator_pb2.ImageOutput(
                png=t.data, width=w, height=h, index=self.image_index))
            self.image_index += 1
            return [ev]
        return []

    def count_prompt(self, chunk: stage_pb2.Chunk) -> None:
        t = _tensor(chunk, "prompt_token_ids")
        if t is not None and t.shape:
            self.usage.prompt_tokens = max(self.usage.prompt_tokens, int(t.shape[0]))
