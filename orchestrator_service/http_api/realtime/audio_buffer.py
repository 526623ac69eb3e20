"""The input audio buffer: pcm16 mono 24 kHz appended by the client, not yet committed. Bounded in seconds:
an append past the bound is refused whole (an `error` event) and the buffer keeps what it had, so a client
sending faster than real time cannot grow it. Its position in the session's audio (`start_ms`) is kept, for
the VAD's `audio_start_ms` / `audio_end_ms`, across what server VAD drops before speech begins."""

from __future__ import annotations

from .events import RealtimeError
from .limits import BYTES_PER_SECOND

MS_PER_SECOND = 1000


def ms_of(nbytes: int) -> int:
    return nbytes * MS_PER_SECOND // BYTES_PER_SECOND


def bytes_of(ms: int) -> int:
    return ms * BYTES_PER_SECOND // MS_PER_SECOND // 2 * 2


class AudioBuffer:
    def __init__(self, max_seconds: float):
        self.max_bytes = int(max_seconds * BYTES_PER_SECOND) // 2 * 2
        self._pcm = bytearray()
        self.start_ms = 0  # where the buffer's first sample sits in the session's audio
        self.appended_ms = 0  # all audio appended this session

    def __len__(self) -> int:
        return len(self._pcm)

    @property
    def end_ms(self) -> int:
        return self.start_ms + ms_of(len(self._pcm))

    def append(self, pcm: bytes) -> None:
        if len(self._pcm) + len(pcm) > self.max_bytes:
            raise RealtimeError("input_audio_buffer_full",
                                f"the input audio buffer holds at most {self.max_bytes / BYTES_PER_SECOND:g} s; it "
                                f"has {len(self._pcm) / BYTES_PER_SECOND:.2f} s and this append "
                                f"{len(pcm) / BYTES_PER_SECOND:.2f} s (commit it, or send audio at real time with "
                                f"server VAD); the append was dropped", "audio")
        self._pcm += pcm

    def take(self) -> bytes:
        """The whole buffer, emptied."""
        pcm = bytes(self._pcm)
        self.start_ms = self.end_ms
        self._pcm.clear()
        return pcm

    def clear(self) -> None:
        self.take()

    def keep_from(self, ms: int) -> None:
        """Drop the audio before `ms` of the session's audio (silence before speech and its padding)."""
        extra = min(len(self._pcm), bytes_of(ms - self.start_ms))
        if extra > 0:
            del self._pcm[:extra]
            self.start_ms += ms_of(extra)

    def keep_last(self, ms: int) -> None:
        """Drop all but the last `ms` of audio (silence before speech, beyond the prefix padding)."""
        extra = len(self._pcm) - bytes_of(ms)
        if extra > 0:
            del self._pcm[:extra]
            self.start_ms += ms_of(extra)
