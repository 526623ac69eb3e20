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
