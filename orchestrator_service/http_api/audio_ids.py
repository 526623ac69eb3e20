"""The audio answers a client may refer back to: an answer's `message.audio.id`, sent again in a later turn
as an assistant message's `audio: {"id": ...}`, stands for what that answer said.

The model reads an earlier spoken answer as its transcript (the Thinker's text), so the door keeps the
transcript alone (never the audio) under a fresh unguessable id until the id's `expires_at`, in this
process: an id another orchestrator replica gave, or one past its time, is refused by name. Bounded in
entries and characters; past either bound the oldest go first (their ids are then refused as expired).
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from typing import Callable

from omnistage.contract.params import InvalidRequest

KEEP_S = 3600  # an answer's audio can be referred to for an hour, as OpenAI keeps it for multi-turn use
MAX_ENTRIES = 65536
MAX_CHARS = 16 << 20  # of transcripts kept: at most ~64 MiB of text


class AnswerTranscripts:
    def __init__(self, keep_s: float = KEEP_S, max_entries: int = MAX_ENTRIES, max_chars: int = MAX_CHARS,
                 clock: Callable[[], float] = time.time):
        self.keep_s, self.max_entries, self.max_chars, self.clock = keep_s, max_entries, max_chars, clock
        self._kept: OrderedDict[str, tuple[float, str]] = OrderedDict()  # id -> (expires at, transcript)
        self._chars = 0

    @staticmethod
    def new_id() -> str:
        return "audio_" + secrets.token_hex(16)

    def expires_at(self, created: float) -> int:
        return int(created + self.keep_s)

    def keep(self, audio_id: str, transcript: str, created: float) -> None:
        """Keep `transcript` under `audio_id` until `expires_at(created)`."""
        self._drop_expired()
        if len(transcript) > self.max_chars:
            return
        self._kept[audio_id] = (self.expires_at(created), transcript)
        self._chars += len(transcript)
        while len(self._kept) > self.max_entries or self._chars > self.max_chars:
            _, (_, old) = self._kept.popitem(last=False)
            self._chars -= len(old)

    def transcript(self, audio_id: str, field: str) -> str:
        """The transcript kept under `audio_id`; InvalidRequest naming `field` when it is unknown or expired."""
        self._drop_expired()
        kept = self._kept.get(audio_id)
        if kept is None or kept[0] <= self.clock():
            raise InvalidRequest(field, f'"{audio_id}" is not the id of an audio answer this server gave in the last '
                                        f"{self.keep_s // 60:.0f} minutes (unknown or expired): send the answer's "
                                        "text as the assistant message's content")
        return kept[1]

    def __len__(self) -> int:
        return len(self._kept)

    def _drop_expired(self) -> None:
        now = self.clock()
        while self._kept:
            audio_id, (expires, text) = next(iter(self._kept.items()))
            if expires > now:
                break
            del self._kept[audio_id]
            self._chars -= len(text)
