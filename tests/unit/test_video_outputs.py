"""A video stage's chunks as client events (orchestrator_service/outputs.py): each `video` chunk one
VideoFrames event (frames counted from the first, the request's fps), the usage counting frames; a stage's
progress report one Progress event."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistage.contract import tensors
from omnistage.v1 import stage_pb2
from orchestrator_service.outputs import OutputAssembler


def video_chunk(frames: np.ndarray, chunk_id: int = 0) -> stage_pb2.Chunk:
    return stage_pb2.Chunk(stage="vae-decode", chunk_id=chunk_id,
                           tensors=[tensors.to_proto("video", torch.from_numpy(frames))])


def test_video_chunks_become_frame_events_indexed_from_the_first_frame():
    rng = np.random.default_rng(0)
    first, rest = (rng.integers(0, 256, (n, 16, 24, 3), dtype=np.uint8) for n in (1, 4))
    out = OutputAssembler("r1", fps=16)
    events = out.events("video", video_chunk(first)) + out.events("video", video_chunk(rest, 1))
    assert [ev.WhichOneof("event") for ev in events] == ["video", "video"]
    got = [ev.video for ev in events]
    assert [(v.index, v.count, v.width, v.height, v.fps) for v in got] == [(0, 1, 24, 16, 16), (1, 4, 24, 16, 16)]
    assert got[0].rgb == first.tobytes() and got[1].rgb == rest.tobytes()
    assert out.usage.video_frames == 5


def test_a_chunk_without_frames_makes_no_event():
    out = OutputAssembler("r1", fps=16)
    assert out.events("video", stage_pb2.Chunk(stage="vae-decode", end_of_stream=True)) == []
    assert out.usage.video_frames == 0


@pytest.mark.parametrize("frames", [np.zeros((2, 4, 4), np.uint8), np.zeros((2, 4, 4, 3), np.float32)],
                         ids=["not-rgb", "not-uint8"])
def test_a_video_tensor_of_another_shape_is_refused_naming_it(frames):
    with pytest.raises(ValueError, match='tensor "video" must be uint8 \\[frames, height, width, 3\\]'):
        OutputAssembler("r1").events("video", video_chunk(frames))


def test_a_progress_report_is_a_progress_event_naming_its_stage():
    ev = OutputAssembler("r1").progress("denoise", stage_pb2.StageProgress(done=3, total=8, unit="steps"))
    assert ev.request_id == "r1"
    assert (ev.progress.stage, ev.progress.done, ev.progress.total, ev.progress.unit) == ("denoise", 3, 8, "steps")
