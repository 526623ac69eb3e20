"""Final-stage chunks -> client events (pure). The orchestrator forwards bytes as the stages
produced them: int16 PCM audio, PNG images, uint8 RGB video frames, text deltas; and a stage's progress
reports as progress events."""

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

    def __init__(self, request_id: str, fps: int = 0):
        self.request_id = request_id
        self.fps = fps  # the request's frame rate (resolved), on every VideoFrames event
        self.audio_index = 0
        self.image_index = 0
        self.frame_index = 0  # frames sent so far: the next VideoFrames event's first frame
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
        if modality == "video":
            return self._video(chunk)
        return []

    def _video(self, chunk: stage_pb2.Chunk) -> list[orchestrator_pb2.GenerateResponse]:
        t = _tensor(chunk, "video")
        if t is None or not t.shape:
            return []
        shape = list(t.shape)
        if (len(shape) != 4 or shape[3] != 3 or t.dtype != tensor_pb2.UINT8
                or len(t.data) != shape[0] * shape[1] * shape[2] * 3):
            raise ValueError(f'stage {chunk.stage}: tensor "video" must be uint8 [frames, height, width, 3] '
                             f"inline, got {tensor_pb2.DType.Name(t.dtype)} {shape} with {len(t.data)} bytes")
        count = shape[0]
        if not count:
            return []
        ev = orchestrator_pb2.GenerateResponse(request_id=self.request_id, video=orchestrator_pb2.VideoFrames(
            rgb=t.data, width=shape[2], height=shape[1], count=count, index=self.frame_index, fps=self.fps))
        self.frame_index += count
        self.usage.video_frames += count
        return [ev]

    def progress(self, stage: str, p: stage_pb2.StageProgress) -> orchestrator_pb2.GenerateResponse:
        """A stage's progress report as the client's event."""
        return orchestrator_pb2.GenerateResponse(request_id=self.request_id, progress=orchestrator_pb2.Progress(
            stage=stage, done=p.done, total=p.total, unit=p.unit))

    def count_prompt(self, chunk: stage_pb2.Chunk) -> None:
        t = _tensor(chunk, "prompt_token_ids")
        if t is not None and t.shape:
            self.usage.prompt_tokens = max(self.usage.prompt_tokens, int(t.shape[0]))
