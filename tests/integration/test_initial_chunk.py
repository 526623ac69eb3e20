"""A Talker stage with initialChunkSize hands Code2Wav a small first chunk, then chunkSize frames, and the
audio decoded chunk by chunk is the same as transformers' decode at those chunk boundaries."""

from __future__ import annotations

import torch

from stage_service.engines.omni.audio import to_pcm16

from ..harness import call_stage, example, header, stage_servers, tensor_of

INITIAL, EVERY = 5, 25


def talker_chunks(doc) -> None:
    talker = next(s for s in doc["spec"]["topology"]["stages"] if s["name"] == "talker")
    talker["initialChunkSize"], talker["chunkSize"] = INITIAL, EVERY


PIPELINE = example("qwen3-omni-tiny", talker_chunks)


def decoded_at(model, codes: torch.Tensor, bounds: list[int], left_context: int) -> torch.Tensor:
    """transformers' Code2Wav `chunked_decode`, with the chunk ends given rather than one chunk size."""
    upsample, out, start = int(model.total_upsample), [], 0
    with torch.inference_mode():
        for end in bounds:
            context = min(start, left_context)
            out.append(model(codes[None, :, start - context:end])[0, 0, context * upsample:])
            start = end
    return torch.cat(out)


async def test_first_chunk_at_initial_size_then_chunk_size(model_dir):
    assert PIPELINE.stage("talker").chunk_units(0) == INITIAL
    async with stage_servers(PIPELINE, model_dir) as servers:
        await first_chunk_small_then_full(servers)


async def first_chunk_small_then_full(servers) -> None:
    thinker_out = await call_stage(servers["thinker"].port, header(max_tokens=8, ignore_eos=True))
    talker_out = await call_stage(servers["talker"].port, header(max_codec_frames=40), thinker_out)
    sizes = [tensor_of(c, "codes").shape[1] for c in talker_out]
    frames = sum(sizes)
    assert frames > INITIAL, "the tiny Talker stopped too early to test chunking"
    assert sizes[0] == INITIAL
    assert all(n == EVERY for n in sizes[1:-1]) and 0 < sizes[-1] <= EVERY
    assert [c.chunk_id for c in talker_out] == list(range(len(sizes)))
    assert talker_out[-1].end_of_stream and not any(c.end_of_stream for c in talker_out[:-1])

    wav_out = await call_stage(servers["code2wav"].port, header(), talker_out)
    pcm = [tensor_of(c, "audio") for c in wav_out]
    c2w = servers["code2wav"].engine.c2w
    assert 0 < len(pcm[0]) <= INITIAL * c2w.upsample  # the first audio chunk is the small one
    codes = torch.cat([tensor_of(c, "codes") for c in talker_out], 1)
    bounds = torch.tensor(sizes).cumsum(0).tolist()
    ref = decoded_at(c2w.model, codes, bounds, c2w.LEFT_CONTEXT)
    assert torch.equal(torch.cat(pcm), to_pcm16(ref))
