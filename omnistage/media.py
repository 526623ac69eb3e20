"""A request's content parts (text, image, audio, video): decoded and checked against the pipeline's limits.

Shared by the orchestrator, which decodes every part once at admission so that no stage is sent what it
cannot read, and by the stages whose engine reads media, which decode again to feed the checkpoint's
processor. Pure: no gRPC, no model.

Memory is bounded by checks that run before the allocation they guard: an image's size is read from
its header before its pixels are decoded, a video's frame count and sizes before any frame, an audio
file's length from its header and again while it is read in blocks. Time is the caller's to bound (the
orchestrator decodes off its event loop with a timeout). Whatever the bytes, `decode_parts` raises only
InvalidRequest, naming the part.
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
    out: list[Part] = []
    for i, part in enumerate(parts):
        kind = part.WhichOneof("part")
        path = f"params.parts[{i}].{kind}"
        if kind not in accepts:
            raise InvalidRequest(path, f"this pipeline reads no {kind} (it reads {', '.join(sorted(accepts))})")
        decoded = _DECODERS[kind](getattr(part, kind), path, limits)
        if keep:
            out.append(decoded)
    return out


# ------------------------------------------------------------------------- decoders

def _guarded(hint: str):
    """Turn anything but InvalidRequest that a decoder raises into InvalidRequest naming the part: the
    decoders (Pillow, libsndfile, FFmpeg) raise many kinds of error on hostile bytes."""
    def wrap(decode):
        def guarded(msg, path: str, limits: Limits):
            try:
                return decode(msg, path, limits)
            except InvalidRequest:
                raise
            except Exception as e:  # noqa: BLE001 - see above; the type says what the decoder found
                raise InvalidRequest(path, f"cannot decode ({hint}: {type(e).__name__})") from None
        return guarded
    return wrap


def _text(text: str, path: str, limits: Limits) -> Text:
    return Text(text)  # emptiness is checked with the structure (check_parts)


@_guarded("not PNG, JPEG or WebP, or corrupt")
def _image(msg: common_pb2.ImagePart, path: str, limits: Limits) -> Image:
    _, _, load = _open_image(msg, path, limits)
    return Image(load())


@_guarded("not WAV, FLAC, MP3 or OGG, or corrupt")
def _audio(msg: common_pb2.AudioPart, path: str, limits: Limits) -> Audio:
    if not msg.data:
        raise InvalidRequest(path, "is empty")
    if msg.sample_rate:
        return _raw_pcm(msg, path, limits)
    if msg.channels:
        raise InvalidRequest(path, "channels is for raw PCM: set sample_rate too")
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
        blocks, n = [], 0
        while True:  # in blocks, mixed down as read: the header's length is not trusted
            block = f.read(_AUDIO_BLOCK_FRAMES, dtype="float32", always_2d=True)
            if not len(block):
                break
            n += len(block)
            if n > most:
                raise InvalidRequest(path, _too_long(n / rate, limits, "at least "))
            blocks.append(block.mean(axis=1, dtype=np.float32))
    if not n:
        raise InvalidRequest(path, "has no samples")
    samples = np.concatenate(blocks)
    np.nan_to_num(samples, copy=False, nan=0.0, posinf=1.0, neginf=-1.0)  # float WAVs may hold anything
    np.clip(samples, -1.0, 1.0, out=samples)
    return Audio(samples, rate)


def _raw_pcm(msg: common_pb2.AudioPart, path: str, limits: Limits) -> Audio:
    channels = msg.channels or 1
    rate = _check_rate_and_channels(msg.sample_rate, channels, path)
    frame_bytes = 2 * channels
    if len(msg.data) % frame_bytes:
        raise InvalidRequest(path, f"raw PCM is {len(msg.data)} bytes, not a whole number of {channels}-channel "
                                   f"16-bit frames ({frame_bytes} bytes each)")
    frames = len(msg.data) // frame_bytes
    if frames > limits.max_audio_seconds * rate:
        raise InvalidRequest(path, _too_long(frames / rate, limits))
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
def _video(msg: common_pb2.VideoPart, path: str, limits: Limits) -> Video:
    if msg.data:
        if msg.frames or msg.timestamps:
            raise InvalidRequest(path, "set either frames with timestamps, or data (an encoded file), not both")
        return _video_file(msg.data, path, limits)
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


def _check_video_pixels(frames: int, width: int, height: int, path: str, limits: Limits) -> None:
    total = frames * width * height
    if total > limits.max_video_pixels:
        raise InvalidRequest(path, f"has {frames} frames of {width}x{height}, {total} pixels in all; the limit is "
                                   f"{limits.max_video_pixels}")


def _video_file(data: bytes, path: str, limits: Limits) -> Video:
    """An encoded video, through PyAV where it is installed (an optional dependency: FFmpeg is large)."""
    try:
        import av
    except ImportError:
        raise InvalidRequest(path, _NO_VIDEO_DECODER) from None
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except av.FFmpegError:
        raise InvalidRequest(path, "cannot decode (not a video file FFmpeg reads)") from None
    with container:
        if not container.streams.video:
            raise InvalidRequest(path, "has no video stream")
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        _check_pixels(width, height, path, limits)
        frames: list[np.ndarray] = []
        timestamps: list[float] = []
        for frame in container.decode(stream):
            if len(frames) == limits.max_video_frames:
                raise InvalidRequest(path, f"has more than {limits.max_video_frames} frames; the limit is "
                                           f"{limits.max_video_frames} (send fewer, as frames with timestamps)")
            if (frame.width, frame.height) != (width, height):
                raise InvalidRequest(path, f"frame {len(frames)} is {frame.width}x{frame.height}; the stream is "
                                           f"{width}x{height} (frames of one video must have one size)")
            _check_video_pixels(len(frames) + 1, width, height, path, limits)
            if frame.time is None:
                raise InvalidRequest(path, f"frame {len(frames)} has no timestamp")
            frames.append(frame.to_ndarray(format="rgb24"))
            timestamps.append(float(frame.time))
    if not frames:
        raise InvalidRequest(path, "has no frames")
    _check_timestamps(timestamps, path)
    return Video(np.stack(frames), tuple(timestamps))


_DECODERS: dict[str, Callable] = {"text": _text, "image": _image, "audio": _audio, "video": _video}


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


def _rgb(im: PILImage.Image, path: str) -> np.ndarray:
    try:
        im.load()
    except (OSError, SyntaxError, ValueError):  # what Pillow's decoders raise on truncated or corrupt data
        raise InvalidRequest(path, f"cannot decode ({im.format} data is corrupt or truncated)") from None
    im = ImageOps.exif_transpose(im)  # as a viewer shows it, as transformers' load_image does
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
