"""Stop sequences (the chat API's `stop`), watched in the text as it streams.

The request path has no stop strings of its own, so the HTTP layer finds the first one completed in the
answer's text, ends the answer just before it and cancels the rest of the request (however the text is
split into deltas, the same answer). Text that could still be the
beginning of a stop string is held back until the next delta decides it: at most len(longest) - 1
characters, so a stop string split across deltas is still found and never half sent.
"""

from __future__ import annotations

from typing import Sequence

MAX_STOPS = 4  # as the OpenAI reference


class StopWatch:
    def __init__(self, stops: Sequence[str] = ()):
        self.stops = tuple(stops)
        self.hold = max(map(len, self.stops), default=1) - 1
        self.stopped = False
        self._held = ""

    def feed(self, text: str) -> str:
        """The text that may be sent now; after a stop string is found, nothing more."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        text = self._held + text
        # The stop completed first wins (ties: the one starting first), as if the text came a character at
        # a time: a later, longer stop that starts earlier was never finished when the first one was.
        found = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in self.stops) if i >= 0]
        if found:
            self.stopped, self._held = True, ""
            return text[:min(found)[1]]
        keep = min(self.hold, len(text))
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep]

    def flush(self) -> str:
        """At the end of the answer: what was held back (it began no stop string after all)."""
        out, self._held = self._held, ""
        return out
