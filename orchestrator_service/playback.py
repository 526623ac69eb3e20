"""A listener playing a request's audio as it arrives (pure): where the audio would have gone silent.

Playback starts with the first audio chunk and plays the chunks in order, each for its length. A chunk that
arrives after everything before it has finished playing is an underrun: the listener heard a gap. Playback
then resumes with that chunk, so one late chunk is one underrun, not one for every chunk after it.
"""

from __future__ import annotations


class Playback:
    def __init__(self) -> None:
        self.ends_at: float | None = None  # when the audio arrived so far finishes playing
        self.underruns = 0

    def arrived(self, at: float, seconds: float) -> bool:
        """A chunk of `seconds` of audio arrived at `at`; whether it came after the audio before it ran out."""
        late = self.ends_at is not None and at > self.ends_at
        if late:
            self.underruns += 1
        self.ends_at = (at if self.ends_at is None or late else self.ends_at) + seconds
        return late
