"""Where a listener playing an answer's audio as it arrives would hear a gap (orchestrator_service/playback.py):
the count behind omnistage_audio_underruns_total."""

from __future__ import annotations

from orchestrator_service.playback import Playback


def underruns(chunks: list[tuple[float, float]]) -> list[bool]:
    p = Playback()
    return [p.arrived(at, seconds) for at, seconds in chunks]


def test_audio_that_keeps_ahead_of_playback_never_underruns():
    # 2 s chunks every 1.5 s: each arrives while the one before still plays
    assert underruns([(0.0, 2.0), (1.5, 2.0), (3.0, 2.0), (4.0, 2.0)]) == [False] * 4


def test_a_chunk_after_the_audio_ran_out_is_one_underrun_and_playback_resumes_from_it():
    # the second chunk comes 0.5 s after the first finished; from then on it keeps up again
    assert underruns([(0.0, 1.0), (1.5, 1.0), (2.4, 1.0), (3.3, 1.0)]) == [False, True, False, False]


def test_a_chunk_arriving_exactly_as_the_audio_ends_is_in_time():
    assert underruns([(0.0, 1.0), (1.0, 1.0), (2.0, 1.0)]) == [False, False, False]


def test_every_late_chunk_counts_once():
    p = Playback()
    for at in (0.0, 2.0, 4.0, 6.0):   # 1 s chunks every 2 s: a gap before each after the first
        p.arrived(at, 1.0)
    assert p.underruns == 3
