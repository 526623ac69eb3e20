"""Audio in the format a client asked for: the audio stage's PCM (signed 16-bit little-endian, mono) as
it is (`pcm`, `pcm16`) or encoded with libsndfile (`soundfile`): WAV, FLAC, MP3 (libsndfile >= 1.1),
Opus in Ogg. A format whose encoder this libsndfile lacks, and AAC (libsndfile has none), is refused
naming the field that asked for it."""

from __future__ import annotations

import io

import numpy as np
import soundfile

from omnistage.contract.params import InvalidRequest

# name -> (libsndfile container, subtype, content type)
ENCODERS = {
    "wav": ("WAV", "PCM_16", "audio/wav"),
    "flac": ("FLAC", "PCM_16", "audio/flac"),
    "mp3": ("MP3", "MPEG_LAYER_III", "audio/mpeg"),
    "opus": ("OGG", "OPUS", "audio/ogg"),
}
RAW = {"pcm": "audio/pcm", "pcm16": "audio/pcm"}  # the samples as they are
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
NO_AUDIO_RATE = 24000  # the header's rate for an answer with no audio at all (so no rate of its own)
# What each endpoint's field names the formats, as the OpenAI reference spells them.
CHAT_FORMATS = ("wav", "mp3", "flac", "opus", "pcm16")
SPEECH_FORMATS = ("mp3", "opus", "flac", "wav", "pcm")


def available(fmt: str) -> bool:
    if fmt in RAW:
        return True
    enc = ENCODERS.get(fmt)
    return enc is not None and soundfile.check_format(enc[0], enc[1])


def check(fmt: str, param: str, names: tuple[str, ...]) -> str:
    """`fmt` when this server can produce it; else InvalidRequest naming `param`."""
    served = [n for n in names if available(n)]
    if fmt not in served:
        why = "is not one of" if fmt not in names and fmt != "aac" else "has no encoder on this server; use one of"
        raise InvalidRequest(param, f'"{fmt}" {why}: {", ".join(served)}')
    return fmt


def content_type(fmt: str) -> str:
    return RAW.get(fmt) or ENCODERS[fmt][2]


def encode(pcm: bytes, sample_rate: int, fmt: str, param: str) -> bytes:
    """The whole of a response's audio in `fmt` (checked with `check` before the request ran)."""
    if fmt in RAW:
        return bytes(pcm)
    container, subtype, _ = ENCODERS[fmt]
    sample_rate = sample_rate or NO_AUDIO_RATE
    if fmt == "opus" and sample_rate not in OPUS_RATES:
        raise InvalidRequest(param, f"opus needs a sample rate of {', '.join(map(str, OPUS_RATES))} Hz; this "
                                    f"pipeline's audio is {sample_rate} Hz (ask for another format)")
    buf = io.BytesIO()
    samples = np.frombuffer(pcm, dtype="<i2")
    with soundfile.SoundFile(buf, "w", samplerate=sample_rate, channels=1, format=container, subtype=subtype) as f:
        if samples.size:
            f.write(samples)
    return buf.getvalue()
