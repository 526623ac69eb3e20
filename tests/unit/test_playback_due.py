"""When an audio decoder's chunks are due (engines/omni/audio.PlaybackDue, the scheduler's Deadlines): the
first at once, each later one when the audio decoded before it has played from the first chunk on."""

from __future__ import annotations

import time

from stage_service.engines.omni.audio import PlaybackDue


def test_the_first_chunk_is_due_when_asked_and_later_ones_when_the_audio_before_runs_out():
    clock = PlaybackDue()
    before = time.perf_counter()
    assert before <= clock.due() <= time.perf_counter()   # nothing plays yet: due now
    clock.played(0, 24000)                                 # an empty chunk starts nothing
    assert clock.started is None
    clock.played(12000, 24000)                             # 0.5 s out: the listener starts playing
    started = clock.started
    assert started is not None and clock.due() == started + 0.5
    clock.played(48000, 24000)                             # 2 s more
    assert clock.due() == started + 2.5 and clock.started == started
