"""A small client for the orchestrator's API, sync and async, and the content parts a request carries.

    from omnistage.client import OmniClient, image_part
    with OmniClient("127.0.0.1:50051") as c:
        r = c.generate("Hello", max_tokens=16)
        print(r.text); r.save_audio("out.wav")
        r = c.generate(parts=[image_part("cat.png"), "What is in this picture?"])

An orchestrator serving TLS on its client port: `OmniClient(endpoint, tls_ca="ca.crt")` (the CA that signed
its certificate, a file or PEM bytes).

Several orchestrator replicas: `OmniClient(["10.0.0.5:50051", "10.0.0.6:50051"])` (or "10.0.0.5:50051,10.0.0.6:50051")
spreads requests over them, round robin per request, skipping a replica that is down; so does one DNS name
that resolves to every replica (`dns:///omni-orchestrator-headless:50051`, a headless Service). See
docs/orchestrator.md "Several orchestrator replicas".
"""

from __future__ import annotations

import io
import ipaddress
import json
import os
import time
import wave
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Iterator, Sequence

import grpc
import numpy as np

from omnistage.api import MAX_MESSAGE_BYTES
from omnistage.contract.request import build_request
from omnistage.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc

ORCHESTRATOR_SERVICE = orchestrator_pb2.DESCRIPTOR.services_by_name["Orchestrator"].full_name
# round_robin, not gRPC's default pick_first: every address the target names or resolves to gets a connection
# and requests take turns, so several orchestrator replicas share the load (one address: no difference).
# The health check (grpc.health.v1 Watch on the Orchestrator service) leaves out a replica that says it is
# not serving, which a draining one says first: a rolling update then refuses no request. A server without
# the health service counts as serving.
BALANCING = json.dumps({"loadBalancingConfig": [{"round_robin": {}}],
                        "healthCheckConfig": {"serviceName": ORCHESTRATOR_SERVICE}})
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
BALANCED = [("grpc.service_config", BALANCING)]  # a target naming (or resolving to) several replicas
TARGET_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:", "xds:")
Endpoints = str | Sequence[str]  # "HOST:PORT", any gRPC target, or several IP:PORT (a list, or joined by commas)


@dataclass
class Image:
    png: bytes
    width: int
    height: int


@dataclass
class GenerateResult:
    request_id: str = ""          # the server's id for the request
    client_request_id: str = ""   # the label the client gave it (request_id=...), echoed
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    pcm: bytearray = field(default_factory=bytearray)  # int16 little-endian mono
    sample_rate: int = 0
    audio_chunks: int = 0
    images: list[Image] = field(default_factory=list)
    final: orchestrator_pb2.Final | None = None
    first_event_s: float | None = None      # seconds from the call to the first event
    first_audio_s: float | None = None      # seconds from the call to the first audio chunk
    events: list[str] = field(default_factory=list)  # event kinds in arrival order

    def add(self, ev: orchestrator_pb2.GenerateResponse, elapsed: float) -> None:
        kind = ev.WhichOneof("event")
        self.request_id = ev.request_id or self.request_id
        self.client_request_id = ev.client_request_id or self.client_request_id
        self.events.append(kind)
        if self.first_event_s is None:
            self.first_event_s = elapsed
        if kind == "text":
            self.text += ev.text.text
            self.token_ids.extend(ev.text.token_ids)
        elif kind == "audio":
            if self.first_audio_s is None:
                self.first_audio_s = elapsed
            self.pcm.extend(ev.audio.pcm)
            self.sample_rate = ev.audio.sample_rate
            self.audio_chunks += 1
        elif kind == "image":
            self.images.append(Image(ev.image.png, ev.image.width, ev.image.height))
        elif kind == "final":
            self.final = ev.final

    @property
    def audio_seconds(self) -> float:
        return len(self.pcm) / 2 / self.sample_rate if self.sample_rate else 0.0

    def wav_bytes(self) -> bytes:
        buf = io.BytesIO()
        with wave.open(buf, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(self.sample_rate or 24000)
            w.writeframes(bytes(self.pcm))
        return buf.getvalue()

    def save_audio(self, path: str) -> None:
        with open(path, "wb") as f:
            f.write(self.wav_bytes())

    def save_image(self, path: str, index: int = 0) -> None:
        with open(path, "wb") as f:
            f.write(self.images[index].png)


# ------------------------------------------------------------------- content parts

Media = str | os.PathLike | bytes  # a file to read, or its bytes


def _read(media: Media) -> bytes:
    return bytes(media) if isinstance(media, (bytes, bytearray, memoryview)) else Path(media).read_bytes()


def text_part(text: str) -> common_pb2.ContentPart:
    return common_pb2.ContentPart(text=text)


def image_part(image: Media) -> common_pb2.ContentPart:
    """An encoded image (PNG, JPEG or WebP): a file, or its bytes."""
    return common_pb2.ContentPart(image=_encoded_image(image))


def raw_image_part(pixels: np.ndarray) -> common_pb2.ContentPart:
    """Pixels as they are: [H, W, 3] uint8 RGB."""
    return common_pb2.ContentPart(image=_raw_image(pixels))


def audio_part(audio: Media) -> common_pb2.ContentPart:
    """An encoded audio file (WAV, FLAC, MP3 or OGG): a file, or its bytes."""
    return common_pb2.ContentPart(audio=common_pb2.AudioPart(data=_read(audio)))


def pcm_part(samples: np.ndarray | bytes, sample_rate: int, channels: int = 1) -> common_pb2.ContentPart:
    """Raw audio: 16-bit little-endian PCM bytes (`channels` interleaved), or an array of samples ([n], or
    [n, channels]; floats in [-1, 1] or int16)."""
    if isinstance(samples, np.ndarray):
        if samples.ndim == 2:
            channels = samples.shape[1]
        elif samples.ndim != 1:
            raise ValueError(f"samples must be [n] or [n, channels], got shape {samples.shape}")
        if samples.dtype != np.int16:
            samples = np.round(np.clip(samples.astype(np.float64), -1.0, 1.0) * 32767).astype(np.int16)
        samples = samples.astype("<i2").tobytes()
    return common_pb2.ContentPart(audio=common_pb2.AudioPart(data=bytes(samples), sample_rate=sample_rate,
                                                             channels=channels))


def video_part(frames: Sequence[np.ndarray | Media], timestamps: Sequence[float]) -> common_pb2.ContentPart:
    """A video as frames, each [H, W, 3] uint8 RGB pixels or an encoded image (a file, or its bytes), with
    each frame's time in seconds (increasing)."""
    if len(frames) != len(timestamps):
        raise ValueError(f"{len(frames)} frames and {len(timestamps)} timestamps: each frame needs one")
    images = [_raw_image(f) if isinstance(f, np.ndarray) else _encoded_image(f) for f in frames]
    return common_pb2.ContentPart(video=common_pb2.VideoPart(frames=images, timestamps=list(timestamps)))


def video_file_part(video: Media) -> common_pb2.ContentPart:
    """An encoded video file (a file, or its bytes), for a server with a video decoder installed."""
    return common_pb2.ContentPart(video=common_pb2.VideoPart(data=_read(video)))


def _encoded_image(image: Media) -> common_pb2.ImagePart:
    return common_pb2.ImagePart(data=_read(image))


def _raw_image(pixels: np.ndarray) -> common_pb2.ImagePart:
    if pixels.ndim != 3 or pixels.shape[2] != 3 or pixels.dtype != np.uint8:
        raise ValueError(f"pixels must be [H, W, 3] uint8 RGB, got shape {pixels.shape} of {pixels.dtype}")
    h, w, _ = pixels.shape
    return common_pb2.ImagePart(data=np.ascontiguousarray(pixels).tobytes(), width=w, height=h)


# ------------------------------------------------------------------------ channels

def channel_target(endpoints: Endpoints) -> tuple[str, list[tuple[str, str]]]:
    """The gRPC target for one or several orchestrator addresses, and the channel options it needs beyond
    CHANNEL_OPTIONS. One address, or a gRPC target URI (`dns:///NAME:PORT`, `ipv4:A:P,B:Q`), is used as it
    is. Several must be IP:PORT ([IPv6]:PORT) each: they become one `ipv4:`/`ipv6:` target that round_robin
    spreads requests over; the channel's authority (the name TLS checks) is the first one's host, as if it
    alone had been dialed. Host names are refused rather than resolved once here: one DNS name resolving to
    every replica keeps following them. A target URI or several addresses get round_robin with the health
    check (BALANCING); one plain address is dialed as before."""
    if isinstance(endpoints, str) and endpoints.startswith(TARGET_SCHEMES):
        return endpoints, BALANCED  # a gRPC target URI already (its own address list, if any, included)
    addresses = [a.strip() for a in (endpoints.split(",") if isinstance(endpoints, str) else endpoints)]
    addresses = [a for a in addresses if a]
    if not addresses:
        raise ValueError("no orchestrator endpoint given")
    if len(addresses) == 1:
        return addresses[0], []
    families = {_ip_family(a) for a in addresses}
    if len(families) > 1:
        raise ValueError(f"orchestrator endpoints {addresses} mix IPv4 and IPv6: give one family")
    host = addresses[0].rsplit(":", 1)[0]
    return f"{families.pop()}:{','.join(addresses)}", [*BALANCED, ("grpc.default_authority", host)]


def _ip_family(address: str) -> str:
    host, sep, port = address.rpartition(":")
    try:
        if not sep or not port.isdigit():
            raise ValueError
        ip = ipaddress.ip_address(host[1:-1] if host.startswith("[") and host.endswith("]") else host)
    except ValueError:
        raise ValueError(f"orchestrator endpoint {address!r}: several endpoints must each be IP:PORT "
                         "([IPv6]:PORT); for host names give one DNS name that resolves to every replica") from None
    return f"ipv{ip.version}"


def _tls_credentials(tls_ca: str | os.PathLike | bytes | None) -> grpc.ChannelCredentials | None:
    from omnistage.tls_grpc import client_credentials

    return None if tls_ca is None else client_credentials(tls_ca)


def _auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata carrying an API key (the orchestrator's keys are one set for gRPC and HTTP)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


class OmniClient:
    """Blocking client. `generate` collects a whole result; `stream` yields events as they arrive. `tls_ca`
    (a PEM file or its bytes): the orchestrator serves TLS with a certificate this CA signed. `api_key`: sent
    on every call when the orchestrator requires keys. `endpoint`: one orchestrator, or several replicas that
    requests are spread over (see `channel_target`)."""

    def __init__(self, endpoint: Endpoints, tls_ca: str | os.PathLike | bytes | None = None,
                 api_key: str | None = None):
        target, extra = channel_target(endpoint)
        creds, options = _tls_credentials(tls_ca), CHANNEL_OPTIONS + extra
        self.channel = (grpc.secure_channel(target, creds, options=options) if creds
                        else grpc.insecure_channel(target, options=options))
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)
        self.metadata = _auth_metadata(api_key)

    def stream(self, prompt: str = "", *, timeout: float | None = None,
               **kw) -> Iterator[orchestrator_pb2.GenerateResponse]:
        return self.stub.Generate(build_request(prompt, **kw), timeout=timeout, metadata=self.metadata)

    def generate(self, prompt: str = "", *, timeout: float | None = None, **kw) -> GenerateResult:
        result, t0 = GenerateResult(), time.perf_counter()
        for ev in self.stream(prompt, timeout=timeout, **kw):
            result.add(ev, time.perf_counter() - t0)
        return result

    def describe(self) -> orchestrator_pb2.PipelineInfo:
        return self.stub.DescribePipeline(orchestrator_pb2.DescribePipelineRequest(), metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "OmniClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncOmniClient:
    """OmniClient for asyncio."""

    def __init__(self, endpoint: Endpoints, tls_ca: str | os.PathLike | bytes | None = None,
                 api_key: str | None = None):
        target, extra = channel_target(endpoint)
        creds, options = _tls_credentials(tls_ca), CHANNEL_OPTIONS + extra
        self.channel = (grpc.aio.secure_channel(target, creds, options=options) if creds
                        else grpc.aio.insecure_channel(target, options=options))
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)
        self.metadata = _auth_metadata(api_key)

    def stream(self, prompt: str = "", *, timeout: float | None = None,
               **kw) -> AsyncIterator[orchestrator_pb2.GenerateResponse]:
        return self.stub.Generate(build_request(prompt, **kw), timeout=timeout, metadata=self.metadata)

    async def generate(self, prompt: str = "", *, timeout: float | None = None, **kw) -> GenerateResult:
        result, t0 = GenerateResult(), time.perf_counter()
        async for ev in self.stream(prompt, timeout=timeout, **kw):
            result.add(ev, time.perf_counter() - t0)
        return result

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncOmniClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
