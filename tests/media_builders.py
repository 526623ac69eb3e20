"""Media files built in memory for tests: an image as PNG bytes, audio samples as WAV bytes."""

from __future__ import annotations

import io

import numpy as np
import soundfile
from PIL import Image


def png(pixels: np.ndarray) -> bytes:
    """`pixels` (uint8, [height, width, 3]) as a PNG file."""
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def wav(samples: np.ndarray, rate: int = 16000, subtype: str | None = None) -> bytes:
    """`samples` (float32, mono) as a WAV file at `rate` Hz, in `subtype` (soundfile's default for WAV,
    16-bit PCM, when None; "FLOAT" keeps the samples exactly)."""
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format="WAV", subtype=subtype)
    return buf.getvalue()


def audio_file(fmt: str, seconds: float = 0.1, rate: int = 8000, **kw) -> bytes:
    """`seconds` of silence at `rate` Hz in the container `fmt` (any libsndfile writes: "AIFF", "VOC", ...)."""
    buf = io.BytesIO()
    soundfile.write(buf, np.zeros(int(rate * seconds), np.float32), rate, format=fmt, **kw)
    return buf.getvalue()


def video_file(fmt: str, codec: str = "mpeg4", frames: int = 3) -> bytes:
    """`frames` 32x16 frames at 4 fps, encoded with `codec` in the container `fmt` (any FFmpeg muxes: "mp4",
    "webm", "avi", ...). Needs PyAV (a dev dependency, the `video` extra)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as out:
        stream = out.add_stream(codec, rate=4)
        stream.width, stream.height, stream.pix_fmt = 32, 16, "yuv420p"
        for j in range(frames):
            out.mux(stream.encode(av.VideoFrame.from_ndarray(np.full((16, 32, 3), 30 * j, np.uint8), "rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()


def speech_like(seconds: float, rate: int = 24000, f0: float = 140.0, level: float = 8000) -> bytes:
    """Speech-like pcm16 mono: a voice's harmonics through three vowel formants, at a syllable rate (voice
    activity detectors call it speech)."""
    t = np.arange(int(seconds * rate)) / rate
    sig = np.zeros_like(t)
    for k in range(1, int(rate / 2 / f0)):
        f = k * f0
        gain = sum(np.exp(-((f - formant) / width) ** 2) for formant, width in ((700, 150), (1200, 200), (2600, 300)))
        sig += (gain + 0.05) / np.sqrt(k) * np.sin(2 * np.pi * f * t + k)
    sig *= 0.6 + 0.4 * np.sin(2 * np.pi * 3 * t)
    return (sig / np.abs(sig).max() * level).astype("<i2").tobytes()
