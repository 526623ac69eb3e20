"""Hostile media at the parsers' door: only the allowed containers reach libsndfile or FFmpeg (read from
their first bytes, refused by name otherwise), video timestamps whose span or rate would overflow the
model's positions are refused naming the field, and a check that keeps nothing allocates one part's
frame or block at a time, not the whole part."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import soundfile

from omnistage import media
from omnistage.api import Limits
from omnistage.contract.params import InvalidRequest
from omnistage.v1 import common_pb2

from ..media_builders import audio_file, png, video_file

LIMITS = Limits()


def audio(data: bytes) -> common_pb2.ContentPart:
    return common_pb2.ContentPart(audio=common_pb2.AudioPart(data=data))


def video(data: bytes = b"", frames=(), timestamps=()) -> common_pb2.ContentPart:
    return common_pb2.ContentPart(video=common_pb2.VideoPart(data=data, frames=list(frames),
                                                             timestamps=list(timestamps)))


def refused(part, limits=LIMITS) -> str:
    with pytest.raises(InvalidRequest) as e:
        media.decode_parts([part], limits)
    return str(e.value)


@pytest.fixture
def parsers(monkeypatch):
    """Every file libsndfile or FFmpeg is asked to open, by parser."""
    import av
    opened: dict[str, list] = {"libsndfile": [], "ffmpeg": []}
    real_sf, real_av = soundfile.SoundFile, av.open

    def sf_open(file, *a, **kw):
        if not a or a[0] == "r":  # reading, not the test's own writing of a file
            opened["libsndfile"].append(kw)
        return real_sf(file, *a, **kw)

    def av_open(file, *a, **kw):
        if kw.get("mode", "r") == "r":
            opened["ffmpeg"].append(kw)
        return real_av(file, *a, **kw)
    monkeypatch.setattr(media.soundfile, "SoundFile", sf_open)
    monkeypatch.setattr(av, "open", av_open)
    return opened


@pytest.mark.parametrize("fmt,named", [("AIFF", "AIFF"), ("VOC", "VOC"), ("AU", "AU"), ("CAF", "CAF"),
                                       ("W64", None), ("IRCAM", None)])
def test_audio_containers_libsndfile_reads_but_we_do_not_are_refused_before_it_parses(parsers, fmt, named):
    assert refused(audio(audio_file(fmt))) == \
        "params.parts[0].audio: cannot decode (not WAV, FLAC, MP3 or OGG" + (f": {named})" if named else ")")
    assert parsers["libsndfile"] == []


@pytest.mark.parametrize("fmt,kw", [("WAV", {}), ("FLAC", {}), ("OGG", {"subtype": "VORBIS"}),
                                    ("WAV", {"subtype": "FLOAT"}), ("RF64", {})])
def test_allowed_audio_containers_still_decode(parsers, fmt, kw):
    [got] = media.decode_parts([audio(audio_file(fmt, **kw))], LIMITS)
    assert isinstance(got, media.Audio) and got.samples.shape == (800,)
    assert len(parsers["libsndfile"]) == 1


@pytest.mark.parametrize("data,named", [
    (b"ffconcat version 1.0\nfile 'clip.mp4'\n", "an FFmpeg concat script"),
    (b"#EXTM3U\n#EXTINF:1,\nclip.ts\n", "an HLS playlist"),
    (b"FLV\x01\x05" + b"\x00" * 64, "FLV"),
    (b"\x00" * 64, None),
])
def test_video_containers_ffmpeg_reads_but_we_do_not_are_refused_before_it_probes(parsers, data, named):
    assert refused(video(data)) == \
        "params.parts[0].video: cannot decode (not MP4, Matroska or WebM" + (f": {named})" if named else ")")
    assert parsers["ffmpeg"] == []


def test_an_avi_file_ffmpeg_would_decode_is_refused_by_name(parsers):
    assert refused(video(video_file("avi"))) == "params.parts[0].video: cannot decode (not MP4, Matroska or WebM: AVI)"
    assert parsers["ffmpeg"] == []


@pytest.mark.parametrize("fmt,codec", [("mp4", "mpeg4"), ("webm", "libvpx"), ("matroska", "mpeg4")])
def test_mp4_and_matroska_open_with_one_demuxer_bounded_probing_and_no_protocol(parsers, fmt, codec):
    [got] = media.decode_parts([video(video_file(fmt, codec))], LIMITS)
    assert got.frames.shape == (3, 16, 32, 3)
    [kw] = parsers["ffmpeg"]
    assert kw["format"] in media.VIDEO_FORMATS
    assert kw["options"] == {"probesize": "1048576", "analyzeduration": "1000000", "protocol_whitelist": "none"}


def test_a_video_codec_outside_the_list_is_refused_by_name():
    assert refused(video(video_file("matroska", "mpeg2video"))) == \
        "params.parts[0].video: has mpeg2video video; the codecs read are av1, h264, hevc, mpeg4, vp8, vp9"


FRAME = common_pb2.ImagePart(data=png(np.zeros((8, 8, 3), np.uint8)))


@pytest.mark.parametrize("timestamps,message", [
    ([0, 1, 2, 1e20], "params.parts[0].video.timestamps: span 1e+20 s (from 0 to 1e+20 s); the limit is 3600 s"),
    ([5.0, 3606.0], "params.parts[0].video.timestamps: span 3601 s (from 5 to 3606 s); the limit is 3600 s"),
    ([0, 1e-6, 2e-6], "params.parts[0].video.timestamps: say 1e+06 frames per second; the limit is 1000"),
])
def test_timestamps_that_would_overflow_the_models_positions_are_refused_naming_the_field(timestamps, message):
    assert refused(video(frames=[FRAME] * len(timestamps), timestamps=timestamps)) == message


def test_timestamps_within_the_span_and_rate_decode():
    [got] = media.decode_parts([video(frames=[FRAME] * 3, timestamps=[1e6, 1e6 + 1, 1e6 + 3600])], LIMITS)
    assert got.timestamps == (1e6, 1e6 + 1, 1e6 + 3600)


def peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_check_that_keeps_nothing_holds_one_frame_of_a_video_not_the_stack():
    side, n = 256, 16  # frames of one colour: their PNGs are small beside their pixels
    frames = [common_pb2.ImagePart(data=png(np.full((side, side, 3), j, np.uint8))) for j in range(n)]
    part = video(frames=frames, timestamps=list(range(n)))
    stack = n * side * side * 3
    assert peak_bytes(lambda: media.decode_parts([part], LIMITS, keep=False)) < stack / 4
    assert peak_bytes(lambda: media.decode_parts([part], LIMITS, keep=True)) >= stack  # what keeping costs


def test_a_check_that_keeps_nothing_holds_one_block_of_audio_not_the_samples():
    part = audio(audio_file("FLAC", seconds=30, rate=48000))  # silence: tiny as FLAC, 5.8 MB as float32
    samples = 30 * 48000 * 4
    assert peak_bytes(lambda: media.decode_parts([part], LIMITS, keep=False)) < samples / 4
    assert peak_bytes(lambda: media.decode_parts([part], LIMITS, keep=True)) >= samples
