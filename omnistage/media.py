"""A request's content parts (text, image, audio, video): decoded and checked against the pipeline's limits.

Shared by the orchestrator, which decodes every part once at admission so that no stage is sent what it
cannot read, and by the stages whose engine reads media, which decode again to feed the checkpoint's
processor. Pure: no gRPC, no model.

Memory is bounded by checks that run before the allocation they guard: an image's size is read from
its header before its pixels are decoded, a video's frame count and sizes before any frame, an audio
file's length from its header and again while it is read in blocks; the same checks keep a request's parts
together within its totals (`RequestTotals`). Only the containers named below reach a parser: each part's
format is read from its first bytes before libsndfile or FFmpeg sees it, and FFmpeg is held to that one
demuxer with bounded probing and no protocol. Time and native crashes are the caller's to bound (the
orchestrator decodes in worker processes, `orchestrator_service/media_pool.py`). Whatever the bytes,
`decode_parts` raises only InvalidRequest, naming the part.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from math import gcd
from typing import Callable, ClassVar, Sequence

import numpy as np
import soundfile
from PIL import Image as PILImage
from PIL import ImageOps

from omnistage.api import Limits
from omnistage.api.fields import camel
from omnistage.contract.params import InvalidRequest, check_parts
from omnistage.v1 import common_pb2

ALL = frozenset({"text", "image", "audio", "video"})
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
AUDIO_FORMATS = frozenset({"WAV", "WAVEX", "RF64", "FLAC", "MP3", "OGG"})  # as soundfile names them
# Bounds that keep an audio part's decoded size proportional to max_audio_seconds.
MAX_SAMPLE_RATE = 192_000
MAX_CHANNELS = 32
_AUDIO_BLOCK_FRAMES = 1 << 16
_NO_VIDEO_DECODER = "no video decoder installed on the server; send frames with timestamps"
# Video containers FFmpeg may open, by the demuxer each is held to, and the codecs it may decode in them: the
# ones cameras and browsers write. Every other FFmpeg demuxer (concat scripts, playlists, AVI, ...) and
# decoder stays out of reach of request bytes.
VIDEO_FORMATS = ("mp4", "matroska")  # matroska covers WebM
VIDEO_CODECS = frozenset({"h264", "hevc", "vp8", "vp9", "av1", "mpeg4"})
# FFmpeg's probing of an input: 1 MiB and 1 s of stream (defaults 5 MB, 5 s); MP4 and Matroska say their
# streams in their headers, so probing finds them well within this.
_PROBE_BYTES = 1 << 20
_ANALYZE_MICROSECONDS = 1_000_000
# The span video timestamps may cover, and their mean rate: the model turns seconds into rotary positions,
# so a span of 1e20 s (finite, increasing) would make positions that overflow. An hour is far beyond what a
# prompt's frames (maxVideoFrames, 128 by default) sample usefully; 1000 fps is beyond any camera's
# frame rate a prompt would carry.
MAX_VIDEO_SECONDS = 3600.0
MAX_VIDEO_FPS = 1000.0


@dataclass(frozen=True)
class Text:
    text: str
    modality: ClassVar[str] = "text"


@dataclass(frozen=True, eq=False)
class Image:
    pixels: np.ndarray  # [H, W, 3] uint8 RGB
    modality: ClassVar[str] = "image"


@dataclass(frozen=True, eq=False)
class Audio:
    samples: np.ndarray  # [n] float32 mono in [-1, 1], at the part's own rate
    sample_rate: int
    modality: ClassVar[str] = "audio"


@dataclass(frozen=True, eq=False)
class Video:
    frames: np.ndarray  # [T, H, W, 3] uint8 RGB
    timestamps: tuple[float, ...]  # seconds, one per frame, increasing
    modality: ClassVar[str] = "video"


Part = Text | Image | Audio | Video
MODALITY = {cls: cls.modality for cls in (Text, Image, Audio, Video)}


def decode_parts(parts: Sequence[common_pb2.ContentPart], limits: Limits, accepts: frozenset[str] = ALL,
                 keep: bool = True) -> list[Part]:
    """Every part decoded, in order; InvalidRequest names the first part that is refused and why.
    `accepts`: the modalities the pipeline reads (`omnistage.api.accepted_inputs`). `keep=False` checks
    only: each part is dropped once decoded (one part's pixels at a time in memory), and none is returned."""
    check_parts(parts, limits)
    totals = RequestTotals(limits)
    out: list[Part] = []
    for i, part in enumerate(parts):
        kind = part.WhichOneof("part")
        path = f"params.parts[{i}].{kind}"
        if kind not in accepts:
            raise InvalidRequest(path, f"this pipeline reads no {kind} (it reads {', '.join(sorted(accepts))})")
        decoded = _DECODERS[kind](getattr(part, kind), path, limits, totals, keep)
        if keep:
            out.append(decoded)
    return out


class RequestTotals:
    """A request's running media totals (limits.maxRequest*), each checked as it grows: from a part's header,
    before that part's samples or pixels are decoded, and again as decoding counts what a header only claimed.
    So a request is refused at the first part that passes a total, and the decoding it cost before that is
    within the totals themselves, whatever the number of parts."""

    # total -> (the Limits property that bounds it, the field that sets it, what the message calls it, unit)
    BOUNDS = {
        "audio seconds": ("request_audio_seconds", "max_request_audio_seconds", "audio", " s"),
        "image pixels": ("request_image_pixels", "max_request_image_pixels", "images", " pixels"),
        "video frames": ("request_video_frames", "max_request_video_frames", "video", " frames"),
        "video pixels": ("request_video_pixels", "max_request_video_pixels", "video", " pixels"),
    }

    def __init__(self, limits: Limits):
        self.limits = limits
        self.sums: dict[str, float] = dict.fromkeys(self.BOUNDS, 0)

    def check(self, total: str, amount: float, path: str, qualifier: str = "") -> None:
        """InvalidRequest naming `path` and the total when `amount` more would pass it."""
        bound, field, noun, unit = self.BOUNDS[total]
        most, reached = getattr(self.limits, bound), self.sums[total] + amount
        if reached > most:
            raise InvalidRequest(path, f"brings the request's {noun} to {qualifier}{_amount(reached)}{unit}; the "
                                       f"limit per request is {_amount(most)}{unit if unit == ' s' else ''} "
                                       f"({camel(field)})")

    def add(self, total: str, amount: float, path: str) -> None:
        self.check(total, amount, path)
        self.sums[total] += amount


def _amount(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{round(x, 3):g}"


# ------------------------------------------------------------------------- decoders

def _guarded(hint: str):
    """Turn anything but InvalidRequest that a decoder raises into InvalidRequest naming the part: the
    decoders (Pillow, libsndfile, FFmpeg) raise many kinds of error on hostile bytes."""
    def wrap(decode):
        def guarded(msg, path: str, limits: Limits, totals: RequestTotals, keep: bool = True):
            try:
                return decode(msg, path, limits, totals, keep)
            except InvalidRequest:
                raise
            except Exception as e:  # noqa: BLE001 - see above; the type says what the decoder found
                raise InvalidRequest(path, f"cannot decode ({hint}: {type(e).__name__})") from None
        return guarded
    return wrap


def _text(text: str, path: str, limits: Limits, totals: RequestTotals, keep: bool = True) -> Text:
    return Text(text)  # emptiness is checked with the structure (check_parts)


@_guarded("not PNG, JPEG or WebP, or corrupt")
def _image(msg: common_pb2.ImagePart, path: str, limits: Limits, totals: RequestTotals, keep: bool = True) -> Image:
    w, h, load = _open_image(msg, path, limits)
    totals.add("image pixels", w * h, path)  # from the header: before a pixel is decoded
    return Image(load())


@_guarded("not WAV, FLAC, MP3 or OGG, or corrupt")
def _audio(msg: common_pb2.AudioPart, path: str, limits: Limits, totals: RequestTotals, keep: bool = True) -> Audio:
    """`keep=False` checks only: the samples are read and counted, not gathered."""
    if not msg.data:
        raise InvalidRequest(path, "is empty")
    if msg.sample_rate:
        return _raw_pcm(msg, path, limits, totals)
    if msg.channels:
        raise InvalidRequest(path, "channels is for raw PCM: set sample_rate too")
    if audio_container(msg.data) is None:  # before libsndfile, which would open any format it knows
        named = _named_container(msg.data)
        raise InvalidRequest(path, "cannot decode (not WAV, FLAC, MP3 or OGG" + (f": {named})" if named else ")"))
    try:
        f = soundfile.SoundFile(io.BytesIO(msg.data))
    except soundfile.LibsndfileError:
        raise InvalidRequest(path, "cannot decode (not WAV, FLAC, MP3 or OGG)") from None
    with f:
        if f.format not in AUDIO_FORMATS:
            raise InvalidRequest(path, f"cannot decode (not WAV, FLAC, MP3 or OGG: {f.format})")
        rate = _check_rate_and_channels(f.samplerate, f.channels, path)
        most = int(limits.max_audio_seconds * rate)
        if f.frames > most:
            raise InvalidRequest(path, _too_long(f.frames / rate, limits))
        totals.check("audio seconds", f.frames / rate, path)  # from the header, before a sample is read
        blocks, n = [], 0
        while True:  # in blocks, mixed down as read: the header's length is not trusted
            block = f.read(_AUDIO_BLOCK_FRAMES, dtype="float32", always_2d=True)
            if not len(block):
                break
            n += len(block)
            if n > most:
                raise InvalidRequest(path, _too_long(n / rate, limits, "at least "))
            totals.check("audio seconds", n / rate, path, "at least ")
            if keep:
                blocks.append(block.mean(axis=1, dtype=np.float32))
    if not n:
        raise InvalidRequest(path, "has no samples")
    totals.add("audio seconds", n / rate, path)
    if not keep:
        return Audio(np.zeros(0, np.float32), rate)
    samples = np.concatenate(blocks)
    np.nan_to_num(samples, copy=False, nan=0.0, posinf=1.0, neginf=-1.0)  # float WAVs may hold anything
    np.clip(samples, -1.0, 1.0, out=samples)
    return Audio(samples, rate)


def _raw_pcm(msg: common_pb2.AudioPart, path: str, limits: Limits, totals: RequestTotals) -> Audio:
    channels = msg.channels or 1
    rate = _check_rate_and_channels(msg.sample_rate, channels, path)
    frame_bytes = 2 * channels
    if len(msg.data) % frame_bytes:
        raise InvalidRequest(path, f"raw PCM is {len(msg.data)} bytes, not a whole number of {channels}-channel "
                                   f"16-bit frames ({frame_bytes} bytes each)")
    frames = len(msg.data) // frame_bytes
    if frames > limits.max_audio_seconds * rate:
        raise InvalidRequest(path, _too_long(frames / rate, limits))
    totals.add("audio seconds", frames / rate, path)
    pcm = np.frombuffer(msg.data, dtype="<i2").reshape(frames, channels)
    return Audio(pcm.mean(axis=1, dtype=np.float32) / np.float32(32768.0), rate)


def _check_rate_and_channels(rate: int, channels: int, path: str) -> int:
    if not 1 <= rate <= MAX_SAMPLE_RATE:
        raise InvalidRequest(path, f"sample rate must be between 1 and {MAX_SAMPLE_RATE} Hz, got {rate}")
    if not 1 <= channels <= MAX_CHANNELS:
        raise InvalidRequest(path, f"must have between 1 and {MAX_CHANNELS} channels, got {channels}")
    return rate


def _too_long(seconds: float, limits: Limits, qualifier: str = "") -> str:
    return f"is {qualifier}{seconds:.1f} s long; the limit is {limits.max_audio_seconds:g} s"


@_guarded("corrupt")
def _video(msg: common_pb2.VideoPart, path: str, limits: Limits, totals: RequestTotals, keep: bool = True) -> Video:
    """`keep=False` checks only: one frame's pixels at a time, none gathered."""
    if msg.data:
        if msg.frames or msg.timestamps:
            raise InvalidRequest(path, "set either frames with timestamps, or data (an encoded file), not both")
        return _video_file(msg.data, path, limits, totals, keep)
    n = len(msg.frames)
    if not n:
        raise InvalidRequest(path, "has no frames: send frames with timestamps (or an encoded file in data)")
    if n > limits.max_video_frames:
        raise InvalidRequest(path, f"has {n} frames; the limit is {limits.max_video_frames}")
    if len(msg.timestamps) != n:
        raise InvalidRequest(path, f"has {n} frames and {len(msg.timestamps)} timestamps; each frame needs one")
    timestamps = tuple(msg.timestamps)
    _check_timestamps(timestamps, path)
    # Every frame's header first: the whole video is known to fit before any pixel is decoded.
    opened = [_open_image(frame, f"{path}.frames[{j}]", limits) for j, frame in enumerate(msg.frames)]
    width, height, _ = opened[0]
    for j, (w, h, _) in enumerate(opened):
        if (w, h) != (width, height):
            raise InvalidRequest(f"{path}.frames[{j}]", f"is {w}x{h}; frame 0 is {width}x{height} (frames of one "
                                                        "video must have one size)")
    _check_video_pixels(n, width, height, path, limits)
    totals.add("video frames", n, path)
    totals.add("video pixels", n * width * height, path)
    if not keep:
        for _, _, load in opened:
            load()
        return Video(np.zeros((0, height, width, 3), np.uint8), timestamps)
    frames = np.empty((n, height, width, 3), dtype=np.uint8)
    for j, (_, _, load) in enumerate(opened):
        frames[j] = load()
    return Video(frames, timestamps)


def _check_timestamps(timestamps: Sequence[float], path: str) -> None:
    for j, t in enumerate(timestamps):
        if not (math.isfinite(t) and t >= 0):
            raise InvalidRequest(path, f"timestamp {j} must be a finite number of seconds >= 0, got {t}")
        if j and t <= timestamps[j - 1]:
            raise InvalidRequest(path, f"timestamps must increase: timestamp {j} is {t:g} s, after "
                                       f"{timestamps[j - 1]:g} s")
    span = timestamps[-1] - timestamps[0] if timestamps else 0.0
    if span > MAX_VIDEO_SECONDS:
        raise InvalidRequest(f"{path}.timestamps", f"span {span:g} s (from {timestamps[0]:g} to "
                                                   f"{timestamps[-1]:g} s); the limit is {MAX_VIDEO_SECONDS:g} s")
    if len(timestamps) > 1 and len(timestamps) - 1 > MAX_VIDEO_FPS * span:
        raise InvalidRequest(f"{path}.timestamps", f"say {(len(timestamps) - 1) / span:g} frames per second; the "
                                                   f"limit is {MAX_VIDEO_FPS:g}")


def _check_video_pixels(frames: int, width: int, height: int, path: str, limits: Limits) -> None:
    total = frames * width * height
    if total > limits.max_video_pixels:
        raise InvalidRequest(path, f"has {frames} frames of {width}x{height}, {total} pixels in all; the limit is "
                                   f"{limits.max_video_pixels}")


def _video_file(data: bytes, path: str, limits: Limits, totals: RequestTotals, keep: bool) -> Video:
    """An encoded video, through PyAV where it is installed (an optional dependency: FFmpeg is large)."""
    fmt = video_container(data)
    if fmt is None:  # before FFmpeg, whose probing would try every demuxer it has
        named = _named_container(data)
        raise InvalidRequest(path, "cannot decode (not MP4, Matroska or WebM" + (f": {named})" if named else ")"))
    try:
        import av
    except ImportError:
        raise InvalidRequest(path, _NO_VIDEO_DECODER) from None
    try:
        # protocol_whitelist "none" names no protocol: the bytes come through PyAV's own reader, and a
        # reference inside the file can open nothing.
        container = av.open(io.BytesIO(data), mode="r", format=fmt,
                            options={"probesize": str(_PROBE_BYTES), "analyzeduration": str(_ANALYZE_MICROSECONDS),
                                     "protocol_whitelist": "none"})
    except av.FFmpegError:
        raise InvalidRequest(path, f"cannot decode (not a {fmt} file FFmpeg reads)") from None
    with container:
        if not container.streams.video:
            raise InvalidRequest(path, "has no video stream")
        stream = container.streams.video[0]
        codec = stream.codec_context.name
        if codec not in VIDEO_CODECS:
            raise InvalidRequest(path, f"has {codec} video; the codecs read are {', '.join(sorted(VIDEO_CODECS))}")
        width, height = stream.codec_context.width, stream.codec_context.height
        _check_pixels(width, height, path, limits)
        frames: list[np.ndarray] = []
        timestamps: list[float] = []
        for frame in container.decode(stream):
            if len(timestamps) == limits.max_video_frames:
                raise InvalidRequest(path, f"has more than {limits.max_video_frames} frames; the limit is "
                                           f"{limits.max_video_frames} (send fewer, as frames with timestamps)")
            if (frame.width, frame.height) != (width, height):
                raise InvalidRequest(path, f"frame {len(timestamps)} is {frame.width}x{frame.height}; the stream is "
                                           f"{width}x{height} (frames of one video must have one size)")
            _check_video_pixels(len(timestamps) + 1, width, height, path, limits)
            totals.add("video frames", 1, path)  # counted as decoded: a file's header does not bind its frames
            totals.add("video pixels", width * height, path)
            if frame.time is None:
                raise InvalidRequest(path, f"frame {len(timestamps)} has no timestamp")
            pixels = frame.to_ndarray(format="rgb24")
            if keep:
                frames.append(pixels)
            timestamps.append(float(frame.time))
    if not timestamps:
        raise InvalidRequest(path, "has no frames")
    _check_timestamps(timestamps, path)
    if not keep:
        return Video(np.zeros((0, height, width, 3), np.uint8), tuple(timestamps))
    return Video(np.stack(frames), tuple(timestamps))


_DECODERS: dict[str, Callable] = {"text": _text, "image": _image, "audio": _audio, "video": _video}


# ----------------------------------------------------------------------- containers

def audio_container(data: bytes) -> str | None:
    """The audio container `data`'s first bytes say, among those read (AUDIO_FORMATS); None for any other."""
    if data[:4] in (b"RIFF", b"RF64") and data[8:12] == b"WAVE":
        return "WAV"
    if data[:4] in (b"fLaC", b"OggS"):
        return {b"fLaC": "FLAC", b"OggS": "OGG"}[data[:4]]
    if data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):  # tag or frame sync
        return "MP3"
    return None


def video_container(data: bytes) -> str | None:
    """The FFmpeg demuxer (VIDEO_FORMATS) for the container `data`'s first bytes say; None for any other."""
    if data[4:8] == b"ftyp":
        return "mp4"
    if data[:4] == b"\x1a\x45\xdf\xa3":  # EBML: Matroska and WebM
        return "matroska"
    return None


# A few containers that are refused, named in the refusal so that the sender knows what was seen.
_NAMED_CONTAINERS = ((0, b"FORM", "AIFF"), (0, b"Creative Voice File", "VOC"), (0, b".snd", "AU"),
                     (0, b"caff", "CAF"), (8, b"AVI ", "AVI"), (0, b"ffconcat", "an FFmpeg concat script"),
                     (0, b"#EXTM3U", "an HLS playlist"), (0, b"\x30\x26\xb2\x75", "ASF"), (0, b"FLV", "FLV"))


def _named_container(data: bytes) -> str | None:
    return next((name for at, magic, name in _NAMED_CONTAINERS if data[at:at + len(magic)] == magic), None)


# --------------------------------------------------------------------------- images

def _open_image(msg: common_pb2.ImagePart, path: str, limits: Limits) -> tuple[int, int, Callable[[], np.ndarray]]:
    """(width, height, load): everything the header says is checked; `load()` decodes the pixels
    ([H, W, 3] uint8 RGB)."""
    data = msg.data
    if msg.width or msg.height:
        w, h = msg.width, msg.height
        if not (w and h):
            raise InvalidRequest(path, "raw RGB needs both width and height")
        _check_pixels(w, h, path, limits)
        if len(data) != w * h * 3:
            raise InvalidRequest(path, f"raw RGB of {w}x{h} is {w * h * 3} bytes (width * height * 3), got "
                                       f"{len(data)}")
        return w, h, lambda: np.frombuffer(data, dtype=np.uint8).reshape(h, w, 3)
    if not data:
        raise InvalidRequest(path, "is empty")
    try:
        im = PILImage.open(io.BytesIO(data), formats=IMAGE_FORMATS)  # lazy: reads the header only
    except (PILImage.DecompressionBombError, PILImage.DecompressionBombWarning):
        raise InvalidRequest(path, f"has more than {limits.max_image_pixels} pixels") from None
    except OSError:  # UnidentifiedImageError, or a header cut short
        raise InvalidRequest(path, "cannot decode (not PNG, JPEG or WebP)") from None
    w, h = im.size
    _check_pixels(w, h, path, limits)
    return w, h, lambda: _rgb(im, path)


def _check_pixels(w: int, h: int, path: str, limits: Limits) -> None:
    if not (w and h):
        raise InvalidRequest(path, f"is {w}x{h}: an image needs at least one pixel")
    if w * h > limits.max_image_pixels:
        raise InvalidRequest(path, f"is {w}x{h} = {w * h} pixels; the limit is {limits.max_image_pixels}")
    if max(w, h) > limits.max_image_aspect_ratio * min(w, h):
        raise InvalidRequest(path, f"is {w}x{h}: one side more than {limits.max_image_aspect_ratio:g} times the "
                                   "other (the limit on the aspect ratio)")


def _rgb(opened: PILImage.Image, path: str) -> np.ndarray:
    """The pixels, copied out; the image is closed (its decoded pixels freed: a video's frames are loaded
    one after another)."""
    with opened:
        try:
            opened.load()
        except (OSError, SyntaxError, ValueError):  # what Pillow's decoders raise on truncated or corrupt data
            raise InvalidRequest(path, f"cannot decode ({opened.format} data is corrupt or truncated)") from None
        im = ImageOps.exif_transpose(opened)  # as a viewer shows it, as transformers' load_image does
        if im.mode.startswith("I;16"):  # 16-bit grey: Pillow's RGB conversion would clip, not scale
            grey = (np.asarray(im, dtype=np.uint16) >> 8).astype(np.uint8)
            return np.repeat(grey[..., None], 3, axis=2)
        return np.asarray(im.convert("RGB"))


# --------------------------------------------------------------------------- audio

# A Kaiser-windowed sinc low-pass with this many zero crossings each side at the lower of the two rates,
# like scipy.signal.resample_poly's default filter.
_ZERO_CROSSINGS = 10
_KAISER_BETA = 5.0


def resample(samples: np.ndarray, rate_from: int, rate_to: int) -> np.ndarray:
    """`samples` ([n] mono) from `rate_from` to `rate_to` Hz, float32: polyphase filtering with a
    windowed-sinc low-pass at the lower rate's Nyquist frequency; the output has ceil(n * to / from)
    samples, aligned with the input (no delay)."""
    if rate_from <= 0 or rate_to <= 0:
        raise ValueError(f"sample rates must be positive, got {rate_from} and {rate_to}")
    x = np.asarray(samples, dtype=np.float32).reshape(-1)
    if rate_from == rate_to or not len(x):
        return x.copy()
    g = gcd(rate_from, rate_to)
    up, down = rate_to // g, rate_from // g
    # The filter runs at the up-sampled rate (x with up-1 zeros between samples), cut off at 1/max(up,down)
    # of that rate's Nyquist; `up` restores the gain the inserted zeros take away.
    widest = max(up, down)
    half = _ZERO_CROSSINGS * widest
    t = np.arange(-half, half + 1)
    h = np.sinc(t / widest) / widest * np.kaiser(2 * half + 1, _KAISER_BETA) * up
    # Polyphase: output k sits at up-sampled position p = k*down + half and takes the taps h[p%up + m*up]
    # against x[p//up - m]; phases[r] holds those taps for p%up == r, reversed to meet a rising window of x.
    per_phase = -(-len(h) // up)
    phases = np.zeros(per_phase * up)
    phases[:len(h)] = h
    phases = phases.reshape(per_phase, up).T[:, ::-1].astype(np.float32)
    n_out = -(-len(x) * up // down)
    padded = np.concatenate([np.zeros(per_phase - 1, np.float32), x,
                             np.zeros(per_phase + half // up + down + 1, np.float32)])
    windows = np.lib.stride_tricks.sliding_window_view(padded, per_phase)  # windows[s] ends at x[s]
    y = np.empty(n_out, np.float32)
    # Outputs k = r, r+up, r+2*up, ... share one phase and step `down` windows apart.
    for r in range(min(up, n_out)):
        p = r * down + half
        count = len(range(r, n_out, up))
        y[r::up] = windows[p // up: p // up + count * down: down] @ phases[p % up]
    return y
