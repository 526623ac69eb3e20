"""Content parts: every decoder path on real files made here, every refusal naming its part, resampling
accuracy, and fuzzed bytes that never raise anything but InvalidRequest."""

from __future__ import annotations

import io
import math
import struct
import sys
import zlib

import numpy as np
import pytest
import soundfile
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image as PILImage

from omnistage import media
from omnistage.api import Limits
from omnistage.contract.params import InvalidRequest
from omnistage.v1 import common_pb2

LIMITS = Limits()
rng = np.random.default_rng(3)
PIXELS = rng.integers(0, 256, (12, 20, 3), dtype=np.uint8)


def encode_image(pixels: np.ndarray, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    PILImage.fromarray(pixels).save(buf, format=fmt, **kw)
    return buf.getvalue()


def encode_audio(samples: np.ndarray, rate: int, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=fmt, **kw)
    return buf.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height, with almost no pixel data behind it."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 10)) + chunk(b"IEND", b""))


def frame(data: bytes = b"", **kw) -> common_pb2.ImagePart:
    return common_pb2.ImagePart(data=data, **kw)


def image(data: bytes = b"", **kw) -> common_pb2.ContentPart:
    return common_pb2.ContentPart(image=frame(data, **kw))


def audio(data: bytes, **kw) -> common_pb2.ContentPart:
    return common_pb2.ContentPart(audio=common_pb2.AudioPart(data=data, **kw))


def video(frames=(), timestamps=(), data: bytes = b"") -> common_pb2.ContentPart:
    return common_pb2.ContentPart(video=common_pb2.VideoPart(frames=list(frames), timestamps=list(timestamps),
                                                             data=data))


def text(s: str) -> common_pb2.ContentPart:
    return common_pb2.ContentPart(text=s)


def sine(freq: float, rate: int, seconds: float, amplitude: float = 0.5) -> np.ndarray:
    return (amplitude * np.sin(2 * np.pi * freq * np.arange(int(rate * seconds)) / rate)).astype(np.float32)


def one(part, limits=LIMITS, accepts=media.ALL):
    [decoded] = media.decode_parts([part], limits, accepts)
    return decoded


def refused(parts, limits=LIMITS, accepts=media.ALL) -> str:
    with pytest.raises(InvalidRequest) as e:
        media.decode_parts(parts if isinstance(parts, list) else [parts], limits, accepts)
    return str(e.value)


# ----------------------------------------------------------------------- decoded

@pytest.mark.parametrize("fmt,kw,exact", [("PNG", {}, True), ("WEBP", {"lossless": True}, True),
                                          ("JPEG", {"quality": 95, "subsampling": 0}, False)])
def test_encoded_images_decode_to_rgb_pixels(fmt, kw, exact):
    got = one(image(encode_image(PIXELS, fmt, **kw)))
    assert isinstance(got, media.Image) and got.modality == media.MODALITY[media.Image] == "image"
    assert got.pixels.shape == (12, 20, 3) and got.pixels.dtype == np.uint8
    if exact:
        assert np.array_equal(got.pixels, PIXELS)
    else:
        assert np.abs(got.pixels.astype(int) - PIXELS).mean() < 10


def test_raw_rgb_is_taken_as_is():
    got = one(image(PIXELS.tobytes(), width=20, height=12))
    assert np.array_equal(got.pixels, PIXELS)


def test_alpha_and_grey_become_rgb():
    rgba = np.dstack([PIXELS, np.full((12, 20), 128, np.uint8)])
    assert np.array_equal(one(image(encode_image(rgba, "PNG"))).pixels, PIXELS)
    grey16 = (np.arange(12 * 20, dtype=np.uint16).reshape(12, 20) * 256)
    got = one(image(encode_image(grey16, "PNG"))).pixels
    assert np.array_equal(got[..., 0], (grey16 >> 8).astype(np.uint8)) and np.array_equal(got[..., 0], got[..., 2])


def test_jpeg_exif_orientation_is_applied():
    im = PILImage.fromarray(PIXELS)
    exif = im.getexif()
    exif[0x0112] = 6  # rotated 90 degrees: shown as 12 wide, 20 high
    buf = io.BytesIO()
    im.save(buf, format="JPEG", exif=exif)
    assert one(image(buf.getvalue())).pixels.shape == (20, 12, 3)


@pytest.mark.parametrize("fmt,kw,tolerance", [("WAV", {}, 1e-4), ("FLAC", {}, 1e-4), ("OGG", {}, 0.1),
                                              ("MP3", {}, 0.1)])
def test_encoded_audio_decodes_to_mono_float(fmt, kw, tolerance):
    rate = 16000
    left, right = sine(440, rate, 1.0, 0.6), sine(440, rate, 1.0, 0.2)
    got = one(audio(encode_audio(np.stack([left, right], axis=1), rate, fmt, **kw)))
    assert isinstance(got, media.Audio) and got.sample_rate == rate and got.samples.dtype == np.float32
    assert got.samples.ndim == 1 and abs(len(got.samples) - rate) < 0.1 * rate  # MP3 pads its frames
    assert np.abs(got.samples).max() <= 1.0
    rms = np.sqrt(np.mean(got.samples[2000:12000] ** 2))
    assert abs(rms - 0.4 / math.sqrt(2)) < tolerance  # the channels' mean


def test_float_wav_out_of_range_is_clipped_and_nan_zeroed():
    samples = np.array([0.5, 3.0, -7.0, np.nan, np.inf], np.float32)
    got = one(audio(encode_audio(samples, 8000, "WAV", subtype="FLOAT"))).samples
    assert got.tolist() == [0.5, 1.0, -1.0, 0.0, 1.0]


@pytest.mark.parametrize("channels", [1, 2])
def test_raw_pcm_is_s16le_mixed_to_mono(channels):
    pcm = np.array([[1000, 3000], [-32768, -32768], [32767, 32767]], np.int16)[:, :channels]
    got = one(audio(pcm.astype("<i2").tobytes(), sample_rate=24000, channels=channels))
    assert got.sample_rate == 24000
    assert np.allclose(got.samples, pcm.mean(axis=1) / 32768)


def test_video_frames_decode_with_their_timestamps():
    frames = [frame(encode_image(PIXELS, "PNG")), frame(PIXELS[::-1].tobytes(), width=20, height=12)]
    got = one(video(frames, [0.0, 0.5]))
    assert isinstance(got, media.Video) and got.timestamps == (0.0, 0.5)
    assert got.frames.shape == (2, 12, 20, 3) and got.frames.dtype == np.uint8
    assert np.array_equal(got.frames[0], PIXELS) and np.array_equal(got.frames[1], PIXELS[::-1])


def test_encoded_video_decodes_where_pyav_is_installed():
    import av  # a dev dependency (the `video` extra)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 32, 16, "yuv420p"
        for j in range(6):
            frame = av.VideoFrame.from_ndarray(np.full((16, 32, 3), 40 * j, np.uint8), format="rgb24")
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    got = one(video(data=buf.getvalue()))
    assert got.frames.shape == (6, 16, 32, 3)
    assert np.allclose(got.timestamps, [j / 4 for j in range(6)])
    assert "has more than 3 frames" in refused(video(data=buf.getvalue()), Limits(max_video_frames=3))
    assert "cannot decode" in refused(video(data=b"not a video at all" * 10))


def test_parts_keep_their_order_and_kinds():
    got = media.decode_parts([text("Look:"), image(encode_image(PIXELS, "PNG")), text("and listen:"),
                              audio(encode_audio(sine(440, 8000, 0.1), 8000, "WAV"))], LIMITS)
    assert [media.MODALITY[type(p)] for p in got] == ["text", "image", "text", "audio"]
    assert got[0] == media.Text("Look:") and got[2].text == "and listen:"


# ------------------------------------------------------------------------ refused

def test_images_that_are_not_png_jpeg_or_webp_are_refused():
    for fmt in ("GIF", "BMP", "TIFF"):
        assert refused(image(encode_image(PIXELS, fmt))) == \
            "params.parts[0].image: cannot decode (not PNG, JPEG or WebP)"
    assert refused(image(b"\x00garbage" * 50)) == "params.parts[0].image: cannot decode (not PNG, JPEG or WebP)"


def test_truncated_image_is_refused():
    data = encode_image(PIXELS, "PNG")
    assert refused(image(data[: len(data) // 2])) == \
        "params.parts[0].image: cannot decode (PNG data is corrupt or truncated)"


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_image_size_is_checked_from_the_header_before_decoding():
    # 10000 x 10000 claimed by a file of a few bytes: refused on its header, no pixel decoded.
    assert refused(image(png_header(10000, 10000))) == \
        f"params.parts[0].image: is 10000x10000 = 100000000 pixels; the limit is {LIMITS.max_image_pixels}"
    assert refused(image(png_header(30000, 30000))) == \
        f"params.parts[0].image: has more than {LIMITS.max_image_pixels} pixels"  # Pillow's bomb guard
    assert refused(image(encode_image(PIXELS, "PNG")), Limits(max_image_pixels=100)) == \
        "params.parts[0].image: is 20x12 = 240 pixels; the limit is 100"


@pytest.mark.parametrize("part,message", [
    (image(b""), "params.parts[0].image: is empty"),
    (image(b"", width=0, height=4), "params.parts[0].image: raw RGB needs both width and height"),
    (image(png_header(0, 10)), "params.parts[0].image: cannot decode (not PNG, JPEG or WebP)"),
    (image(b"\x01" * 10, width=2, height=2), "params.parts[0].image: raw RGB of 2x2 is 12 bytes (width * height "
                                             "* 3), got 10"),
    (image(b"", width=5000, height=5000), "params.parts[0].image: is 5000x5000 = 25000000 pixels; the limit is "
                                          "12845056"),
    (image(b"\x00" * 3 * 500, width=500, height=1), "params.parts[0].image: is 500x1: one side more than 200 "
                                                     "times the other (the limit on the aspect ratio)"),
    (image(encode_image(np.zeros((1, 300, 3), np.uint8), "PNG")), "params.parts[0].image: is 300x1: one side more "
                                                                 "than 200 times the other (the limit on the aspect "
                                                                 "ratio)"),
])
def test_bad_images(part, message):
    assert refused(part) == message


@pytest.mark.parametrize("part,message", [
    (audio(b""), "params.parts[0].audio: is empty"),
    (audio(b"\x00\x01" * 300), "params.parts[0].audio: cannot decode (not WAV, FLAC, MP3 or OGG)"),
    (audio(encode_audio(sine(440, 8000, 0.1), 8000, "AIFF")),
     "params.parts[0].audio: cannot decode (not WAV, FLAC, MP3 or OGG: AIFF)"),
    (audio(encode_audio(np.zeros(0, np.float32), 8000, "WAV")), "params.parts[0].audio: has no samples"),
    (audio(b"\x00" * 7, sample_rate=16000), "params.parts[0].audio: raw PCM is 7 bytes, not a whole number of "
                                            "1-channel 16-bit frames (2 bytes each)"),
    (audio(b"\x00" * 6, sample_rate=16000, channels=2), "params.parts[0].audio: raw PCM is 6 bytes, not a whole "
                                                        "number of 2-channel 16-bit frames (4 bytes each)"),
    (audio(b"\x00" * 4, sample_rate=10_000_000), "params.parts[0].audio: sample rate must be between 1 and 192000 "
                                                 "Hz, got 10000000"),
    (audio(b"\x00" * 128, sample_rate=8000, channels=64), "params.parts[0].audio: must have between 1 and 32 "
                                                          "channels, got 64"),
    (audio(b"RIFF", channels=2), "params.parts[0].audio: channels is for raw PCM: set sample_rate too"),
])
def test_bad_audio(part, message):
    assert refused(part) == message


def test_audio_longer_than_the_limit_is_refused():
    short = Limits(max_audio_seconds=1)
    assert refused(audio(encode_audio(sine(440, 8000, 2.0), 8000, "FLAC")), short) == \
        "params.parts[0].audio: is 2.0 s long; the limit is 1 s"
    assert refused(audio(b"\x00" * 2 * 8000 * 3, sample_rate=8000), short) == \
        "params.parts[0].audio: is 3.0 s long; the limit is 1 s"
    assert one(audio(encode_audio(sine(440, 8000, 1.0), 8000, "WAV")), short).samples.shape == (8000,)


FRAME = frame(encode_image(PIXELS, "PNG"))


@pytest.mark.parametrize("part,limits,message", [
    (video(), LIMITS, "params.parts[0].video: has no frames: send frames with timestamps (or an encoded file in "
                      "data)"),
    (video([FRAME, FRAME]), LIMITS, "params.parts[0].video: has 2 frames and 0 timestamps; each frame needs one"),
    (video([FRAME, FRAME], [0.0]), LIMITS, "params.parts[0].video: has 2 frames and 1 timestamps; each frame needs "
                                           "one"),
    (video([FRAME, FRAME], [0.5, 0.5]), LIMITS, "params.parts[0].video: timestamps must increase: timestamp 1 is "
                                                "0.5 s, after 0.5 s"),
    (video([FRAME, FRAME], [1.0, 0.5]), LIMITS, "params.parts[0].video: timestamps must increase: timestamp 1 is "
                                                "0.5 s, after 1 s"),
    (video([FRAME], [math.nan]), LIMITS, "params.parts[0].video: timestamp 0 must be a finite number of seconds "
                                         ">= 0, got nan"),
    (video([FRAME] * 3, [0, 1, 2]), Limits(max_video_frames=2), "params.parts[0].video: has 3 frames; the limit "
                                                                "is 2"),
    (video([FRAME] * 3, [0, 1, 2]), Limits(max_video_pixels=500), "params.parts[0].video: has 3 frames of 20x12, "
                                                                  "720 pixels in all; the limit is 500"),
    (video([FRAME, frame(encode_image(PIXELS[:6], "PNG"))], [0, 1]), LIMITS,
     "params.parts[0].video.frames[1]: is 20x6; frame 0 is 20x12 (frames of one video must have one size)"),
    (video([FRAME, frame(b"junk")], [0, 1]), LIMITS,
     "params.parts[0].video.frames[1]: cannot decode (not PNG, JPEG or WebP)"),
    (video([FRAME], [0], data=b"\x00" * 10), LIMITS, "params.parts[0].video: set either frames with timestamps, or "
                                                     "data (an encoded file), not both"),
])
def test_bad_videos(part, limits, message):
    assert refused(part, limits) == message


def test_encoded_video_without_a_decoder_says_to_send_frames(monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)  # as on a server without PyAV: `import av` fails
    assert refused(video(data=b"\x00\x00\x00\x18ftypmp42" * 4)) == \
        "params.parts[0].video: no video decoder installed on the server; send frames with timestamps"


@pytest.mark.parametrize("parts,limits,message", [
    ([image(b"\x00")] * 3, Limits(max_parts=2), "params.parts: has 3 media parts; the limit is 2"),
    ([text("a")] * 4097, Limits(max_parts=2), "params.parts: has 4097 parts; the limit is 4096"),
    ([text("a"), common_pb2.ContentPart()], LIMITS, "params.parts[1]: empty part (set text, image, audio or "
                                                     "video)"),
    ([text("")], LIMITS, "params.parts[0].text: is empty"),
    ([text("a"), image(b"\x00" * 200)], Limits(max_part_bytes=100), "params.parts[1].image: is 206 bytes; the "
                                                                     "limit is 100"),
])
def test_structure_is_checked_first(parts, limits, message):
    assert refused(parts, limits) == message


def test_a_modality_the_pipeline_does_not_read_is_refused():
    assert refused([text("hi"), image(FRAME.data)], accepts=frozenset({"text"})) == \
        "params.parts[1].image: this pipeline reads no image (it reads text)"
    assert refused(audio(b"\x00\x00", sample_rate=8000), accepts=frozenset({"text", "image"})) == \
        "params.parts[0].audio: this pipeline reads no audio (it reads image, text)"


# ---------------------------------------------------------------------- resample

def test_resample_keeps_a_sines_frequency_and_amplitude():
    x = sine(1000, 44100, 2.0, amplitude=0.8)
    y = media.resample(x, 44100, 16000)
    assert y.dtype == np.float32 and len(y) == 32000
    inner = y[1000:-1000]
    spectrum = np.abs(np.fft.rfft(inner * np.hanning(len(inner))))
    assert np.argmax(spectrum) * 16000 / len(inner) == pytest.approx(1000, abs=1)
    assert np.sqrt(2 * np.mean(inner ** 2)) == pytest.approx(0.8, rel=0.005)
    ideal = sine(1000, 16000, 2.0, amplitude=0.8)
    assert np.abs(y - ideal)[100:-100].max() < 2e-3  # aligned: no delay


def test_resample_removes_what_the_lower_rate_cannot_hold():
    y = media.resample(sine(12000, 44100, 1.0), 44100, 16000)  # above 8 kHz: would alias to 4 kHz
    assert np.sqrt(np.mean(y[500:-500] ** 2)) < 0.01


@pytest.mark.parametrize("rate_from,rate_to", [(8000, 16000), (16000, 24000), (48000, 16000), (22050, 16000),
                                               (44101, 16000)])
def test_resample_between_rates(rate_from, rate_to):
    y = media.resample(sine(440, rate_from, 1.0), rate_from, rate_to)
    assert len(y) == math.ceil(rate_from * rate_to / rate_from)
    assert np.abs(y - sine(440, rate_to, 1.0))[200:-200].max() < 2e-3


def test_resample_edges():
    x = sine(440, 16000, 0.01)
    assert np.array_equal(media.resample(x, 16000, 16000), x)
    assert media.resample(np.zeros(0, np.float32), 16000, 24000).shape == (0,)
    with pytest.raises(ValueError):
        media.resample(x, 0, 16000)


# -------------------------------------------------------------------------- fuzz

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
SMALL = Limits(max_image_pixels=1 << 16, max_audio_seconds=5, max_video_frames=4, max_video_pixels=1 << 18)


def only_invalid_request(parts) -> None:
    try:
        media.decode_parts(parts, SMALL)
    except InvalidRequest as e:
        assert e.field.startswith("params.parts")


@FUZZ
@given(st.binary(max_size=2048), st.sampled_from(["image", "audio", "video", "frame"]))
def test_random_bytes_only_ever_raise_invalid_request(data, kind):
    part = {"image": lambda: image(data), "audio": lambda: audio(data), "video": lambda: video(data=data),
            "frame": lambda: video([frame(data)], [0.0])}[kind]()
    only_invalid_request([part])


HEADERS = [encode_image(PIXELS, "PNG"), encode_image(PIXELS, "JPEG"), encode_image(PIXELS, "WEBP"),
           encode_audio(sine(440, 8000, 0.2), 8000, "WAV"), encode_audio(sine(440, 8000, 0.2), 8000, "FLAC"),
           encode_audio(sine(440, 8000, 0.2), 8000, "OGG"), encode_audio(sine(440, 8000, 0.2), 8000, "MP3")]


@FUZZ
@given(st.sampled_from(HEADERS), st.integers(0, 4096), st.binary(min_size=1, max_size=64), st.booleans())
def test_corrupted_real_files_only_ever_raise_invalid_request(data, at, junk, as_image):
    """Real files with bytes overwritten or cut: past the magic numbers, into the decoders proper."""
    at = at % len(data)
    bad = data[:at] + junk + data[at + len(junk):] if at % 2 else data[:at]
    only_invalid_request([image(bad) if as_image else audio(bad)])


@FUZZ
@given(st.integers(0, 300), st.integers(0, 300), st.integers(0, 1 << 16), st.integers(0, 2 ** 32 - 1),
       st.integers(0, 2 ** 32 - 1), st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=5))
def test_random_raw_shapes_only_ever_raise_invalid_request(width, height, size, rate, channels, timestamps):
    data = bytes(size)
    only_invalid_request([image(data, width=width, height=height)])
    only_invalid_request([audio(data, sample_rate=rate, channels=channels)])
    frames = [frame(data, width=width, height=height)] * len(timestamps)
    only_invalid_request([video(frames, timestamps)])
