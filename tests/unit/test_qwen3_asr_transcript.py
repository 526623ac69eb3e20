"""The Qwen3-ASR stage's transcript as it streams, on crafted token streams: the model's language header never
sent, only what follows its marker (or the whole answer where none comes), the marker found as a token however
the answer's text is cut into chunks, and every delta an extension of what was sent."""

from __future__ import annotations

import pytest

from stage_service.engines.qwen3_asr.engine import Transcript, transcript

MARKER = 0  # the marker's token id; its text is never decoded (a special token, skipped)
PIECES = {MARKER: "", 1: "language", 2: " English", 3: " Hello", 4: " there", 5: "Hel", 6: "lo", 7: "  "}


def decode(tokens: list[int]) -> str:
    return "".join(PIECES[t] for t in tokens)


def streamed(tokens: list[int], chunks: list[int], forced: bool) -> list[str]:
    """The deltas sent as the answer grows by `chunks` tokens at a time, the last chunk final."""
    deltas, sent, at = Transcript(decode, MARKER, forced), [], 0
    for n in chunks:
        at += n
        sent.append(deltas.delta(tokens[:at], final=at == len(tokens)))
    assert at == len(tokens)
    return sent


@pytest.mark.parametrize("tokens, chunks, forced, sent", [
    # detected language: the header is held back, the transcript after the marker streams
    ([1, 2, MARKER, 3, 4], [1, 1, 1, 1, 1], False, ["", "", "", "Hello", " there"]),
    # the marker inside a chunk, with the header before it and the transcript after it
    ([1, 2, MARKER, 5, 6], [2, 2, 1], False, ["", "Hel", "lo"]),
    ([1, 2, MARKER, 5, 6], [5], False, ["Hello"]),
    # the marker in the last chunk, nothing after it
    ([1, 2, MARKER], [2, 1], False, ["", ""]),
    # no marker by the end: the whole answer is the transcript, stripped, sent with the last chunk
    ([7, 3, 4, 7], [2, 2], False, ["", "Hello there"]),
    # a forced language: the prompt holds the header, everything decoded is transcript
    ([3, 4], [1, 1], True, ["Hello", " there"]),
    ([7, 5, 6], [1, 2], True, ["", "Hello"]),
])
def test_the_header_is_never_sent(tokens, chunks, forced, sent):
    assert streamed(tokens, chunks, forced) == sent
    # what the stream sends in all is the transcript of the whole answer
    assert "".join(sent) == transcript(tokens, decode, MARKER, forced)
