"""The job content muxer: frames fed a chunk at a time come back out of the MP4 (as H.264 decodes them), the
thumbnail is the first frame, the spritesheet tiles frames spread over the video."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
from PIL import Image

from orchestrator_service.jobs.mux import SPRITE_COLUMNS, SPRITE_TILES, VideoMux, sprite_indices

# H.264 at its default quality on smooth frames: a decoded pixel within this many levels of the original on average
MEAN_ERROR_LEVELS = 4.0


def _frames(n: int, h: int, w: int) -> np.ndarray:
    """Smooth, distinct frames (a gradient that moves): what an encoder keeps close."""
    y, x = np.mgrid[0:h, 0:w]
    out = np.empty((n, h, w, 3), np.uint8)
    for i in range(n):
        out[i, ..., 0] = (x * 4 + i * 8) % 256
        out[i, ..., 1] = (y * 4) % 256
        out[i, ..., 2] = 128
    return out


def _decode(path) -> tuple[list[np.ndarray], float]:
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        return [f.to_ndarray(format="rgb24") for f in container.decode(stream)], float(stream.average_rate)


@pytest.mark.parametrize(("h", "w"), [(32, 48), (17, 31)])  # even, and odd (padded for yuv420p)
def test_frames_fed_in_chunks_come_back_from_the_mp4(tmp_path, h, w):
    frames = _frames(9, h, w)
    mux = VideoMux(tmp_path / "v.mp4", fps=16, total_frames=9)
    for chunk in (frames[:1], frames[1:5], frames[5:]):  # as Wan's VAE hands them on: 1, then 4 at a time
        mux.add(chunk)
    mux.close()
    decoded, fps = _decode(tmp_path / "v.mp4")
    assert fps == 16 and len(decoded) == 9
    for got, want in zip(decoded, frames):
        got = got[:h, :w]
        assert np.abs(got.astype(int) - want.astype(int)).mean() < MEAN_ERROR_LEVELS
    thumb = np.asarray(Image.open(io.BytesIO(mux.thumbnail())))
    assert thumb.shape == (h, w, 3) and np.array_equal(thumb, frames[0])


def test_spritesheet_tiles_frames_spread_over_the_video(tmp_path):
    mux = VideoMux(tmp_path / "v.mp4", fps=8, total_frames=81)
    for start in range(0, 81, 4):
        mux.add(_frames(81, 16, 16)[start:start + 4])
    mux.close()
    sheet = Image.open(io.BytesIO(mux.spritesheet()))
    assert sheet.format == "JPEG"
    assert sheet.size == (SPRITE_COLUMNS * 16, SPRITE_TILES // SPRITE_COLUMNS * 16)
    assert len(mux._tiles) == SPRITE_TILES  # only the tiles are kept, not the 81 frames


@pytest.mark.parametrize(("total", "want"), [(0, []), (3, [0, 1, 2]), (16, list(range(16)))])
def test_sprite_indices_small(total, want):
    assert sprite_indices(total) == want


def test_sprite_indices_spread_first_to_last():
    got = sprite_indices(81)
    assert got[0] == 0 and got[-1] == 80 and len(got) == SPRITE_TILES and got == sorted(set(got))


def test_wrong_frames_are_refused_naming_the_shape(tmp_path):
    mux = VideoMux(tmp_path / "v.mp4", fps=8, total_frames=4)
    with pytest.raises(ValueError, match=r"uint8 \[n, height, width, 3\]"):
        mux.add(np.zeros((2, 8, 8), np.uint8))
    mux.add(np.zeros((1, 8, 8, 3), np.uint8))
    with pytest.raises(ValueError, match="16x8 after frames of 8x8"):
        mux.add(np.zeros((1, 8, 16, 3), np.uint8))
    mux.abort()
    assert not (tmp_path / "v.mp4").exists()


def test_the_preview_is_a_looping_animated_webp_as_long_as_the_video_from_a_few_small_frames(tmp_path):
    from orchestrator_service.jobs.mux import PREVIEW_FRAMES, PREVIEW_WIDTH

    frames = _frames(81, 200, 400)
    mux = VideoMux(tmp_path / "v.mp4", fps=16, total_frames=81)
    for start in range(0, 81, 4):
        mux.add(frames[start:start + 4])
    mux.close()
    preview = Image.open(io.BytesIO(mux.preview()))
    assert preview.format == "WEBP" and preview.is_animated and preview.n_frames == PREVIEW_FRAMES
    assert preview.size == (PREVIEW_WIDTH, 160) and preview.info.get("loop") == 0
    shown = 0
    for i in range(preview.n_frames):
        preview.seek(i)
        preview.load()
        shown += preview.info["duration"]
    assert abs(shown - 81 / 16 * 1000) <= PREVIEW_FRAMES  # the video's length, within a millisecond a frame
    assert len(mux._preview) == PREVIEW_FRAMES and all(f.shape == (160, PREVIEW_WIDTH, 3) for f in mux._preview)
