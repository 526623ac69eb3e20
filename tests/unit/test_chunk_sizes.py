"""How many units a stage puts in each chunk it hands on: chunkSize, a smaller first chunk
(initialChunkSize), the rest at the end; the spec rules for initialChunkSize; and the async chunk
benchmark's playback-gap measure (logic only, no model)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from omnistage.api import SpecError, Stage, parse_pipeline, validate

from ..conftest import EXAMPLES

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from omni_load import playback_gaps

BASE = yaml.safe_load((EXAMPLES / "qwen3-omni-tiny.yaml").read_text())
THINKER, TALKER, CODE2WAV = 0, 1, 2


def stage(chunk: int, initial: int = 0) -> Stage:
    return Stage(name="talker", kind="ar", engine="transformers", model="m", emits=("codes",),
                 chunk_size=chunk, initial_chunk_size=initial)


def emitted(s: Stage, units: int) -> list[int]:
    """The chunk sizes a stage hands on producing `units` one step at a time, as the Talker does."""
    sizes, pending = [], 0
    for made in range(1, units + 1):
        pending += 1
        if s.chunk_due(len(sizes), pending, done=made == units):
            sizes.append(pending)
            pending = 0
    return sizes


@pytest.mark.parametrize(("chunk", "initial", "index", "units"), [
    (25, 0, 0, 25),     # unset: the first chunk as the rest
    (25, 0, 3, 25),
    (25, 5, 0, 5),      # the first chunk is the small one
    (25, 5, 1, 25),
    (25, 5, 7, 25),
    (25, 25, 0, 25),    # equal to chunkSize: no change
    (0, 0, 0, 0),       # whole result
    (0, 5, 0, 0),       # whole result wins (validation refuses this spec)
])
def test_chunk_units(chunk, initial, index, units):
    assert stage(chunk, initial).chunk_units(index) == units


@pytest.mark.parametrize(("chunk", "initial", "index", "pending", "done", "due"), [
    (25, 5, 0, 4, False, False),
    (25, 5, 0, 5, False, True),     # the first chunk goes at initialChunkSize
    (25, 5, 1, 5, False, False),    # later ones wait for chunkSize
    (25, 5, 1, 25, False, True),
    (25, 0, 0, 5, False, False),
    (25, 0, 0, 25, False, True),
    (0, 0, 0, 400, False, False),   # whole result: only at the end
    (0, 0, 0, 400, True, True),
    (25, 5, 3, 7, True, True),      # the end hands on what is left
    (25, 5, 3, 0, True, False),     # ... and nothing when nothing is left
    (25, 5, 0, 0, True, True),      # ... except a first (empty) chunk, so the consumer sees the end
])
def test_chunk_due(chunk, initial, index, pending, done, due):
    assert stage(chunk, initial).chunk_due(index, pending, done) is due


@pytest.mark.parametrize(("chunk", "initial", "units", "sizes"), [
    (25, 5, 400, [5] + [25] * 15 + [20]),
    (25, 0, 400, [25] * 16),
    (25, 5, 3, [3]),
    (25, 5, 30, [5, 25]),
    (25, 10, 12, [10, 2]),
    (0, 0, 400, [400]),
])
def test_emitted_chunk_sizes(chunk, initial, units, sizes):
    assert emitted(stage(chunk, initial), units) == sizes


@given(st.integers(1, 64), st.integers(0, 64), st.integers(1, 500))
def test_chunks_cover_the_result_and_none_is_larger_than_its_size(chunk, initial, units):
    initial = min(initial, chunk)
    s = stage(chunk, initial)
    sizes = emitted(s, units)
    assert sum(sizes) == units and all(n > 0 for n in sizes)
    assert all(n <= s.chunk_units(i) for i, n in enumerate(sizes))
    assert all(n == s.chunk_units(i) for i, n in enumerate(sizes[:-1]))  # only the last is short


@pytest.mark.parametrize(("index", "pending", "due"), [(3, 0, True), (3, 2, True), (0, 0, True)])
def test_with_always_end_the_end_hands_on_a_chunk_even_with_nothing_left(index, pending, due):
    assert stage(25, 5).chunk_due(index, pending, True, always_end=True) is due
    s = stage(25, 5)
    for held in (4, 5, 25):  # before the end: as without it
        assert s.chunk_due(index, held, False, always_end=True) is s.chunk_due(index, held, False)


def test_an_engines_chunks_follow_the_rule_and_only_the_first_carries_the_first_chunk_timings():
    from stage_service.runtime.base import Chunking, OutputChunk

    chunks, handed = Chunking(stage(25, 5)), []
    for made in range(1, 41):
        if chunks.due(1, done=made == 40):
            units, first = chunks.pending, chunks.first
            out = chunks.hand_on(OutputChunk(compute_ms=1.0), queue_ms=7.0, encode_ms=2.0, transfer_ms=3.0)
            handed.append((units, first, out.queue_ms, out.encode_ms, out.transfer_ms, out.compute_ms))
    assert [h[0] for h in handed] == emitted(stage(25, 5), 40) == [5, 25, 10]
    assert handed[0][1:] == (True, 7.0, 2.0, 3.0, 1.0)
    assert all(h[1:] == (False, 0.0, 0.0, 0.0, 1.0) for h in handed[1:])
    assert not chunks.first and chunks.pending == 0


# ------------------------------------------------------------------------------------ the spec field

def with_stage(index: int, **fields) -> dict:
    doc = copy.deepcopy(BASE)
    for key, value in fields.items():
        if value is None:
            doc["spec"]["topology"]["stages"][index].pop(key, None)
        else:
            doc["spec"]["topology"]["stages"][index][key] = value
    return doc


@pytest.mark.parametrize(("initial", "chunk"), [(0, 25), (1, 25), (5, 25), (25, 25), (None, 25), (0, 0)])
def test_initial_chunk_size_accepted(initial, chunk):
    p = parse_pipeline(with_stage(TALKER, initialChunkSize=initial, chunkSize=chunk))
    assert p.stage("talker").initial_chunk_size == (initial or 0)
    assert p.stage("talker").chunk_units(0) == (initial or chunk)


@pytest.mark.parametrize(("index", "fields", "message"), [
    (TALKER, {"initialChunkSize": -1}, "spec.topology.stages[1].initialChunkSize: must be >= 0, got -1"),
    (TALKER, {"initialChunkSize": 2.5}, "spec.topology.stages[1].initialChunkSize: must be an integer"),
    (TALKER, {"initialChunkSize": "5"}, "spec.topology.stages[1].initialChunkSize: must be an integer"),
    (TALKER, {"initialChunkSize": 26, "chunkSize": 25},
     "spec.topology.stages[1].initialChunkSize: must be <= chunkSize (25), got 26"),
    (TALKER, {"initialChunkSize": 5, "chunkSize": 0},
     "spec.topology.stages[1].initialChunkSize: needs chunkSize > 0"),
    (TALKER, {"initialChunkSize": 5, "chunkSize": None},  # chunkSize defaults to 0
     "spec.topology.stages[1].initialChunkSize: needs chunkSize > 0"),
    (THINKER, {"initialChunkSize": 1},
     "spec.topology.stages[0].initialChunkSize: the qwen3-omni-thinker adapter emits every chunk at chunkSize"),
    (CODE2WAV, {"initialChunkSize": 1, "chunkSize": 4},
     "spec.topology.stages[2].initialChunkSize: the qwen3-omni-code2wav adapter emits every chunk at chunkSize"),
])
def test_initial_chunk_size_refused(index, fields, message):
    doc = with_stage(index, **fields)
    messages = [str(e) for e in validate(doc)]
    assert any(m.startswith(message) for m in messages), messages
    with pytest.raises(SpecError):
        parse_pipeline(doc)


# ------------------------------------------------------------------- the benchmark's playback gaps

@pytest.mark.parametrize(("chunks", "gaps"), [
    ([(0.5, 2.0)], []),                                  # one chunk: nothing to wait for
    ([(0.5, 0.4), (0.7, 2.0), (2.0, 2.0)], [0.0, 0.0]),  # each here before the previous ended
    ([(0.5, 0.4), (1.2, 2.0)], [0.3]),                   # played 0.5-0.9, the next came at 1.2
    ([(0.0, 1.0), (0.1, 1.0), (2.5, 1.0)], [0.0, 0.5]),  # queued audio delays the end: 0-1, 1-2, then 2.5
    ([(0.0, 1.0), (3.0, 1.0), (3.5, 1.0)], [2.0, 0.0]),  # after an underrun playback restarts at arrival
])
def test_playback_gaps(chunks, gaps):
    assert playback_gaps(chunks) == pytest.approx(gaps)
