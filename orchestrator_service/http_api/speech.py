"""Speech (`/v1/audio/speech`): a call's audio as one body in the asked format, as raw pcm streamed as
it is produced, or as `speech.audio.delta` / `speech.audio.done` server-sent events."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from . import audio_formats
from .call import Call, ClientGone
from .errors import ApiError
from .responses import b64encode_str, sse_event, with_trace

SAMPLE_RATE_HEADER = "X-Sample-Rate"  # with pcm: the samples' rate (mono, signed 16-bit little-endian)


async def whole(call: Call, fmt: str) -> tuple[bytes, int]:
    """Every audio chunk, then encoded: (body, sample rate)."""
    pcm, rate = bytearray(), 0
    async for ev in call:
        if ev.WhichOneof("event") == "audio":
            pcm += ev.audio.pcm
            rate = ev.audio.sample_rate
    # Encoding takes seconds for minutes of audio (opus most): off the event loop every request shares.
    return await asyncio.to_thread(audio_formats.encode, pcm, rate, fmt, "response_format"), rate


async def pcm_stream(call: Call) -> AsyncIterator[bytes]:
    """The samples as each audio chunk arrives. A failure after the first can only cut the body short:
    it is raised, and the connection closes before the body's end (the client sees it incomplete)."""
    try:
        async for ev in call:
            if ev.WhichOneof("event") == "audio":
                yield ev.audio.pcm
    except ClientGone:
        return


async def sse_stream(call: Call) -> AsyncIterator[bytes]:
    """`speech.audio.delta` events (base64 pcm) as the audio is produced, then `speech.audio.done` with
    the usage; a failure after the first event is one error event, and the stream ends."""
    final = None
    try:
        async for ev in call:
            kind = ev.WhichOneof("event")
            if kind == "audio":
                yield sse_event({"type": "speech.audio.delta", "audio": b64encode_str(ev.audio.pcm)})
            elif kind == "final":
                final = ev.final
        used_in = final.usage.prompt_tokens if final else 0
        used_out = final.usage.completion_tokens if final else 0
        yield sse_event(with_trace({"type": "speech.audio.done", "usage": {
            "input_tokens": used_in, "output_tokens": used_out, "total_tokens": used_in + used_out}}, final))
    except ApiError as e:
        yield sse_event(e.body())
    except ClientGone:
        return


def first_rate(event) -> int:
    """The sample rate of a first event that is audio (0 when it is not)."""
    return event.audio.sample_rate if event is not None and event.WhichOneof("event") == "audio" else 0
