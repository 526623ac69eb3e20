"""A token stage whose chunks only the client reads hands its first token on alone (the client's time to first
token), the rest at chunkSize; a stage feeding another stage, or one whose spec sets initialChunkSize, keeps its
own rule (pure, no model)."""

from __future__ import annotations

import dataclasses

import pytest

from stage_service.runtime.base import CLIENT_FIRST_CHUNK, Chunking, OutputChunk, first_chunk_units

from ..harness import example


def handed(chunking: Chunking, units: int) -> list[int]:
    """The units of each chunk `chunking` hands on when a request makes `units` units one at a time."""
    out = []
    for made in range(1, units + 1):
        if chunking.due(1, done=made == units):
            out.append(chunking.pending)
            chunking.hand_on(OutputChunk())
    return out


def test_a_stage_only_the_client_reads_hands_on_its_first_token_alone():
    pipeline = example("llm-tiny")
    llm = pipeline.stage("llm")
    assert llm.chunk_size == 4 and not llm.initial_chunk_size
    assert first_chunk_units(pipeline, llm) == CLIENT_FIRST_CHUNK == 1
    assert handed(Chunking(llm, always_end=True, first_units=first_chunk_units(pipeline, llm)), 24) == \
        [1, 4, 4, 4, 4, 4, 3]
    assert handed(Chunking(llm, always_end=True), 24) == [4] * 6  # the stage's own rule, unchanged


@pytest.mark.parametrize("units", [1, 2, 5])
def test_a_short_answer_still_ends_with_its_last_chunk(units):
    pipeline = example("llm-tiny")
    llm = pipeline.stage("llm")
    chunks = handed(Chunking(llm, first_units=first_chunk_units(pipeline, llm)), units)
    assert sum(chunks) == units and chunks[0] == 1


def test_a_stage_feeding_another_stage_keeps_its_chunk_rule():
    pipeline = example("qwen3-omni-vllm-tiny")
    fed = {e.source for s in pipeline.stages for e in s.inputs}
    assert fed
    for name in fed:
        assert first_chunk_units(pipeline, pipeline.stage(name)) == 0


def test_a_spec_first_chunk_or_no_chunks_keeps_the_spec():
    def edit(**fields):
        def apply(doc):
            doc["spec"]["topology"]["stages"][0].update(fields)
        return example("llm-tiny", apply)

    for pipeline in (edit(chunkSize=0), edit(chunkSize=1)):
        assert first_chunk_units(pipeline, pipeline.stage("llm")) == 0
    pipeline = example("llm-tiny")
    assert first_chunk_units(pipeline, dataclasses.replace(pipeline.stage("llm"), initial_chunk_size=2)) == 0
