"""A job's video content, made as its frames arrive: the H.264 MP4 (PyAV), the thumbnail (the first frame, PNG),
the spritesheet (a grid of frames spread over the video, JPEG) and the preview (an animated, looping WebP of
frames spread over the video, small: for a page or a chat to show in place of a player).

Frames are encoded as they come and then dropped: what is held is the encoder's own look-ahead, the first frame
(for the thumbnail), the spritesheet's few tiles and the preview's few small frames, never the whole video.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import av
import numpy as np
from PIL import Image

CODEC = "libx264"
PIXEL_FORMAT = "yuv420p"  # what every player decodes; it needs an even width and height (padded when odd)
# Quality of the H.264 stream: x264's default constant rate factor, visually near lossless for generated clips.
CRF = "23"
# The spritesheet: at most this many frames, spread evenly over the video, each scaled to at most this width.
SPRITE_TILES = 16
SPRITE_COLUMNS = 4
SPRITE_TILE_WIDTH = 160
SPRITE_QUALITY = 85  # JPEG quality of the spritesheet: small files, tiles still legible
# The preview: at most this many frames, spread evenly over the video (its length kept: each shows longer), each
# scaled to at most this width.
PREVIEW_FRAMES = 48
PREVIEW_WIDTH = 320
PREVIEW_QUALITY = 70  # WebP quality: a preview, not the video
MEDIA_TYPES = {"video": "video/mp4", "thumbnail": "image/png", "spritesheet": "image/jpeg", "preview": "image/webp"}
VARIANTS = tuple(MEDIA_TYPES)


def sprite_indices(total_frames: int, tiles: int = SPRITE_TILES) -> list[int]:
    """The frames (of `total_frames`) a spritesheet (or the preview) shows: at most `tiles`, the first and the last
    among them, spread evenly (pure)."""
    if total_frames <= 0:
        return []
    if total_frames <= tiles:
        return list(range(total_frames))
    return sorted({round(i * (total_frames - 1) / (tiles - 1)) for i in range(tiles)})


class VideoMux:
    """`add(frames)` as they come ([n, H, W, 3] uint8 RGB, display order), `close()` once: the MP4 is at `path`,
    `thumbnail()`, `spritesheet()` and `preview()` give the other variants. `total_frames` (the request's frame
    count) places the spritesheet's tiles and the preview's frames; frames past it are encoded but never shown
    there."""

    def __init__(self, path: Path, fps: int, total_frames: int):
        self.path, self.fps, self.total_frames = path, fps, total_frames
        self.frames = 0
        self._container: av.container.OutputContainer | None = None
        self._stream: av.video.stream.VideoStream | None = None
        self._first: np.ndarray | None = None
        self._wanted = set(sprite_indices(total_frames))
        self._tiles: list[np.ndarray] = []
        self._previewed = set(sprite_indices(total_frames, PREVIEW_FRAMES))
        self._preview: list[np.ndarray] = []

    def add(self, frames: np.ndarray) -> None:
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise ValueError(f"frames must be uint8 [n, height, width, 3], got {frames.dtype} {list(frames.shape)}")
        if self._container is None:
            self._open(frames.shape[2], frames.shape[1])
        elif frames.shape[1:3] != self._size:
            raise ValueError(f"frames of {frames.shape[2]}x{frames.shape[1]} after frames of "
                             f"{self._size[1]}x{self._size[0]}")
        for frame in frames:
            if self._first is None:
                self._first = frame.copy()
            if self.frames in self._wanted:
                self._tiles.append(_tile(frame))
            if self.frames in self._previewed:
                self._preview.append(_tile(frame, PREVIEW_WIDTH))
            self._encode(frame)
            self.frames += 1

    def close(self) -> None:
        """Flush the encoder and finish the file (an MP4 without frames is refused: there is nothing to play)."""
        if self._container is None or self._stream is None:
            raise ValueError("no frames: nothing to mux")
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        self._container = None

    def abort(self) -> None:
        """Give up: the encoder closed, the partial file removed."""
        if self._container is not None:
            self._container.close()
            self._container = None
        self.path.unlink(missing_ok=True)

    def thumbnail(self) -> bytes:
        if self._first is None:
            raise ValueError("no frames: no thumbnail")
        out = io.BytesIO()
        Image.fromarray(self._first).save(out, format="PNG")
        return out.getvalue()

    def spritesheet(self) -> bytes:
        if not self._tiles:
            raise ValueError("no frames: no spritesheet")
        columns = min(SPRITE_COLUMNS, len(self._tiles))
        rows = math.ceil(len(self._tiles) / columns)
        th, tw = self._tiles[0].shape[:2]
        sheet = np.zeros((rows * th, columns * tw, 3), np.uint8)
        for i, tile in enumerate(self._tiles):
            r, c = divmod(i, columns)
            sheet[r * th:(r + 1) * th, c * tw:(c + 1) * tw] = tile
        out = io.BytesIO()
        Image.fromarray(sheet).save(out, format="JPEG", quality=SPRITE_QUALITY)
        return out.getvalue()

    def preview(self) -> bytes:
        """The animated WebP, looping; it lasts as long as the video (each frame shown for its share)."""
        if not self._preview:
            raise ValueError("no frames: no preview")
        seconds = max(self.frames, 1) / self.fps
        duration_ms = max(1, round(seconds * 1000 / len(self._preview)))
        first, *rest = [Image.fromarray(f) for f in self._preview]
        out = io.BytesIO()
        first.save(out, format="WEBP", save_all=True, append_images=rest, duration=duration_ms, loop=0,
                   quality=PREVIEW_QUALITY)
        return out.getvalue()

    # ------------------------------------------------------------------ encoder
    def _open(self, width: int, height: int) -> None:
        self._size = (height, width)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._container = av.open(str(self.path), mode="w", format="mp4")
        stream = self._container.add_stream(CODEC, rate=self.fps, options={"crf": CRF})
        assert isinstance(stream, av.video.stream.VideoStream)  # H.264: a video stream
        stream.width, stream.height = width + width % 2, height + height % 2
        stream.pix_fmt = PIXEL_FORMAT
        self._stream = stream

    def _encode(self, frame: np.ndarray) -> None:
        h, w = frame.shape[:2]
        if h % 2 or w % 2:  # yuv420p halves both: repeat the last row / column to make them even
            frame = np.pad(frame, ((0, h % 2), (0, w % 2), (0, 0)), mode="edge")
        picture = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
        assert self._container is not None and self._stream is not None  # opened by add() before the first frame
        for packet in self._stream.encode(picture):
            self._container.mux(packet)


def _tile(frame: np.ndarray, width: int = SPRITE_TILE_WIDTH) -> np.ndarray:
    """A frame scaled to at most `width` wide (its aspect kept)."""
    h, w = frame.shape[:2]
    if w <= width:
        return frame.copy()
    size = (width, max(1, round(h * width / w)))
    return np.asarray(Image.fromarray(frame).resize(size, Image.Resampling.BILINEAR))

