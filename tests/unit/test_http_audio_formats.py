"""Audio in the asked format (orchestrator_service/http_api/audio_formats.py): each encoder's output
decodes back, lossless ones to the same samples; formats without an encoder are refused by name."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile

from omnistage.contract.params import InvalidRequest
from orchestrator_service.http_api import audio_formats

RATE = 24000
PCM = (np.sin(np.arange(RATE // 2) / 9) * 12000).astype("<i2")


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_lossless_formats_decode_to_the_same_samples(fmt):
    data, rate = soundfile.read(io.BytesIO(audio_formats.encode(PCM.tobytes(), RATE, fmt, "f")), dtype="int16")
    assert rate == RATE and np.array_equal(data, PCM)


@pytest.mark.parametrize("fmt", ["mp3", "opus"])
def test_lossy_formats_decode_to_about_the_same_length(fmt):
    data, rate = soundfile.read(io.BytesIO(audio_formats.encode(PCM.tobytes(), RATE, fmt, "f")), dtype="int16")
    assert rate in (RATE, 48000) and abs(len(data) * RATE / rate - len(PCM)) < 0.1 * len(PCM)


def test_raw_pcm_is_the_samples_and_no_audio_is_an_empty_file():
    assert audio_formats.encode(PCM.tobytes(), RATE, "pcm16", "f") == PCM.tobytes()
    data, _ = soundfile.read(io.BytesIO(audio_formats.encode(b"", 0, "wav", "f")))
    assert len(data) == 0


def test_formats_without_an_encoder_are_refused_naming_the_field():
    with pytest.raises(InvalidRequest) as e:
        audio_formats.check("aac", "response_format", audio_formats.SPEECH_FORMATS)
    assert e.value.field == "response_format" and "no encoder" in str(e.value)
    with pytest.raises(InvalidRequest) as e:
        audio_formats.check("pcm", "audio.format", audio_formats.CHAT_FORMATS)  # chat spells it pcm16
    assert e.value.field == "audio.format" and "pcm16" in str(e.value)
    with pytest.raises(InvalidRequest) as e:
        audio_formats.encode(PCM.tobytes(), 22050, "opus", "audio.format")
    assert e.value.field == "audio.format"


def test_content_types():
    assert [audio_formats.content_type(f) for f in ("wav", "flac", "mp3", "opus", "pcm")] == \
        ["audio/wav", "audio/flac", "audio/mpeg", "audio/ogg", "audio/pcm"]
