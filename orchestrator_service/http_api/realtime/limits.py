"""The bounds on one Realtime connection. Those that follow the pipeline (audio seconds, content parts)
are read from its limits; the rest are constants, each with its reason."""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.api import Limits

# Input and output audio: pcm16 mono at 24 kHz, the only format the Realtime reference's `audio/pcm` names.
SAMPLE_RATE = 24000
BYTES_PER_SAMPLE = 2
BYTES_PER_SECOND = SAMPLE_RATE * BYTES_PER_SAMPLE
# A client event's size as sent (JSON text). An append of 10 s of audio is 640 KB of base64: 1 MiB leaves room
# for any one event a client sends, and bounds what one event makes the server decode.
MAX_EVENT_BYTES = 1 << 20
# A WebSocket message past this is not read at all (the protocol closes with 1009): twice the event bound,
# so that an event somewhat over it is read and answered with an `error` event instead.
MAX_FRAME_BYTES = 2 * MAX_EVENT_BYTES
# Input audio not yet committed: at most this many seconds (and at most the pipeline's maxAudioSeconds, as it
# becomes one audio part). A client appending faster than real time past it gets `error` events and its
# appends are dropped; the buffer never grows past the bound.
MAX_BUFFERED_AUDIO_S = 60.0
# Items the conversation keeps; beyond it (or beyond the pipeline's maxParts / audio seconds per request) the
# oldest are dropped (`conversation.item.deleted`), as the reference's truncation drops the oldest turns.
MAX_ITEMS = 64
# The text of one item (instructions, a message, a function call's arguments or output): the pipeline's
# prompt bound applies to the whole conversation; this bounds what one event makes the session hold.
MAX_TEXT_CHARS = 64 << 10
# Keepalive: a client that answers no ping within this is gone (its responses are cancelled).
PING_INTERVAL_S = 20.0


@dataclass(frozen=True)
class SessionLimits:
    buffered_audio_s: float
    items: int
    parts: int  # content parts of one request (every item with content is at least one)
    audio_s: float  # audio seconds of one request, all parts together
    chars: int  # text of one request: its parts', its tools' and its calls' characters together

    @classmethod
    def of(cls, limits: Limits) -> SessionLimits:
        request_audio = limits.max_request_audio_seconds or limits.max_audio_seconds
        return cls(buffered_audio_s=min(MAX_BUFFERED_AUDIO_S, limits.max_audio_seconds), items=MAX_ITEMS,
                   parts=limits.max_parts, audio_s=request_audio, chars=limits.max_prompt_chars)
