"""The Qwen3-ASR stage's transcript as it streams: the model's language header never sent, only what follows
its marker (or the whole answer where none comes), and every delta an extension of what was sent."""

from __future__ import annotations

import pytest

from stage_service.engines.qwen3_asr.engine import MARKER, Transcript


def streamed(pieces: list[str], forced: bool) -> list[str]:
    """The deltas sent as the decoded answer grows by `pieces` (one piece a token), the last one final."""
    deltas = Transcript(lambda tokens: "".join(pieces[:len(tokens)]), forced)
    return [deltas.delta(list(range(i + 1)), final=i == len(pieces) - 1) for i in range(len(pieces))]


@pytest.mark.parametrize("pieces, forced, sent", [
    # detected language: the header is held back, the transcript after the marker streams
    (["language", " English", MARKER, " Hello", " there"], False, ["", "", "", "Hello", " there"]),
    # no marker by the end: the whole answer is the transcript, as the processor parses it
    (["Hello", " there"], False, ["", "Hello there"]),
    # a forced language: the prompt holds the header, everything decoded is transcript
    ([" Hello", " there"], True, ["Hello", " there"]),
])
def test_the_header_is_never_sent(pieces, forced, sent):
    assert streamed(pieces, forced) == sent
