"""Server turn detection (`server_vad`): speech and silence in the input audio, as it arrives.

Each 30 ms frame is speech when it is louder than a floor (digital silence and hiss are never speech) and
WebRTC's voice activity detector (webrtcvad: a GMM over band energies, compiled into the package; no model
file) calls it speech at the aggressiveness the session's `threshold` maps to. Speech starts after
START_MS of speech frames in a row and stops after `silence_duration_ms` of non-speech frames in a row; the
times are those of the session's audio (ms from its first appended sample)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .limits import SAMPLE_RATE

FRAME_MS = 30  # one of webrtcvad's frame lengths (10, 20, 30 ms): the longest is the steadiest
FRAME_SAMPLES = SAMPLE_RATE * FRAME_MS // 1000
FRAME_BYTES = FRAME_SAMPLES * 2
VAD_RATE = 48000  # webrtcvad takes 8, 16, 32 or 48 kHz: 24 kHz doubled is exact (it filters down to 8 kHz itself)
START_MS = 90  # speech frames in a row before speech starts: a click or a cough's onset is not a turn
# RMS below this (about -50 dBFS) is silence whatever the detector says: it adapts to its input's level, and
# on near-silence calls a hum speech.
MIN_SPEECH_RMS = 100.0
MODES = 4  # webrtcvad's aggressiveness 0..3


def mode_of(threshold: float) -> int:
    """The reference's threshold (0..1: higher needs louder speech) as webrtcvad's aggressiveness."""
    return min(MODES - 1, int(threshold * MODES))


def webrtc_classifier(threshold: float) -> Callable[[bytes], bool]:
    import webrtcvad  # the orchestrator's server_vad only

    vad = webrtcvad.Vad(mode_of(threshold))

    def is_speech(frame: bytes) -> bool:
        x = np.frombuffer(frame, dtype="<i2").astype(np.float32)
        if float(np.sqrt(np.mean(x * x))) < MIN_SPEECH_RMS:
            return False
        up = np.empty(2 * len(x), np.float32)  # 24 -> 48 kHz, linear interpolation
        up[0::2] = x
        up[1::2] = np.concatenate([(x[:-1] + x[1:]) / 2, x[-1:]])
        return vad.is_speech(up.astype("<i2").tobytes(), VAD_RATE)

    return is_speech


@dataclass(frozen=True)
class SpeechStarted:
    audio_start_ms: int


@dataclass(frozen=True)
class SpeechStopped:
    audio_end_ms: int


class Segmenter:
    """Speech turns in a stream of pcm16 24 kHz audio: `feed(pcm)` -> SpeechStarted / SpeechStopped events."""

    def __init__(self, silence_ms: int, is_speech: Callable[[bytes], bool], start_ms: int = START_MS):
        self.is_speech = is_speech
        self.start_frames = max(1, -(-start_ms // FRAME_MS))
        self.stop_frames = max(1, -(-silence_ms // FRAME_MS))
        self.in_speech = False
        self._run = 0  # frames in a row of the kind that would change the state
        self._frames = 0  # frames classified so far
        self._rest = bytearray()  # less than a frame, waiting for more

    def feed(self, pcm: bytes) -> list[SpeechStarted | SpeechStopped]:
        events: list[SpeechStarted | SpeechStopped] = []
        self._rest += pcm
        whole = len(self._rest) // FRAME_BYTES * FRAME_BYTES
        for at in range(0, whole, FRAME_BYTES):
            speech = self.is_speech(bytes(self._rest[at:at + FRAME_BYTES]))
            self._frames += 1
            if speech != self.in_speech:
                self._run += 1
            else:
                self._run = 0
            if not self.in_speech and self._run >= self.start_frames:
                self.in_speech, self._run = True, 0
                events.append(SpeechStarted((self._frames - self.start_frames) * FRAME_MS))
            elif self.in_speech and self._run >= self.stop_frames:
                self.in_speech, self._run = False, 0
                events.append(SpeechStopped((self._frames - self.stop_frames) * FRAME_MS))
        del self._rest[:whole]
        return events

    def reset(self) -> None:
        """After the buffer is cleared or committed by the client: no speech in progress."""
        self.in_speech, self._run = False, 0
