"""Batching must not change results: for each engine, a request that joins a running batch gets
exactly what it gets alone (same seed), and the stage's metrics show the batches. (vLLM:
test_ar_stages.py.)"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from ..harness import call_stage, example, header, start_stage, tensor_of, token_ids
from ..polling import wait_until
from .test_stage_cancel import codes_chunk, embeddings_chunk, llm_transformers
from .test_stage_support import Call, assert_nothing_held, scheduler


def batched_steps(srv) -> float:
    """Engine steps so far that served more than one request."""
    r, labels = srv.metrics.registry, {"stage": srv.stage.name}
    return r.get_sample_value("omnistage_stage_batch_size_count", labels) - \
        r.get_sample_value("omnistage_stage_batch_size_bucket", {**labels, "le": "1.0"})


async def joins_a_running_batch(srv, probe, fillers, result):
    """`probe` and each filler are (header, chunks). The probe runs alone, then again while the fillers
    (long requests) are running; returns both results, after checking that they shared steps."""
    alone = result(await call_stage(srv.port, *probe))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
        calls = [Call(ch, h, chunks) for h, chunks in fillers]
        await wait_until(lambda: srv.engine.running >= len(fillers), 60, what="fillers running")
        shared_before = batched_steps(srv)
        joined = result(await call_stage(srv.port, *probe))
        assert all(not c.task.done() for c in calls), "fillers ended before the probe: it ran alone"
        assert batched_steps(srv) > shared_before
        for c in calls:
            c.cancel()
        await asyncio.gather(*(c.outcome() for c in calls))
    await assert_nothing_held(srv)
    return alone, joined


async def joins_a_burst(srv, probe, burst, result):
    """For engines that batch what is queued: the probe alone, then in the middle of a burst."""
    alone = result(await call_stage(srv.port, *probe))
    shared_before = batched_steps(srv)
    tasks = [asyncio.create_task(call_stage(srv.port, *b)) for b in burst[:len(burst) // 2]]
    joined_task = asyncio.create_task(call_stage(srv.port, *probe))
    tasks += [asyncio.create_task(call_stage(srv.port, *b)) for b in burst[len(burst) // 2:]]
    joined = result(await joined_task)
    await asyncio.gather(*tasks)
    assert batched_steps(srv) > shared_before
    await assert_nothing_held(srv)
    return alone, joined


async def test_transformers_lm(model_dir):
    srv = await start_stage(llm_transformers(), "llm", model_dir)
    try:
        probe = (header("probe", prompt="The probe", max_tokens=30, ignore_eos=True, temperature=0.9, seed=5), ())
        fillers = [(header(f"f{i}", prompt=f"filler {i} " * (i + 1), max_tokens=250, ignore_eos=True), ())
                   for i in range(6)]
        alone, joined = await joins_a_running_batch(srv, probe, fillers, token_ids)
        assert len(alone) == 30 and joined == alone
    finally:
        await srv.drain()


async def test_thinker_tokens_and_rows(model_dir):
    srv = await start_stage(example("qwen3-omni-tiny"), "thinker", model_dir)
    try:
        def result(chunks):
            return token_ids(chunks), [torch.cat([tensor_of(c, n) for c in chunks]) for n in ("embeds", "hidden")]

        probe = (header("probe", max_tokens=16, ignore_eos=True, temperature=0.9, seed=5), ())
        fillers = [(header(f"f{i}", prompt=f"filler {i}", max_tokens=250, ignore_eos=True), ()) for i in range(5)]
        (tok_a, rows_a), (tok_j, rows_j) = await joins_a_running_batch(srv, probe, fillers, result)
        assert len(tok_a) == 16 and tok_j == tok_a
        assert all(torch.equal(a, j) for a, j in zip(rows_a, rows_j))
    finally:
        await srv.drain()


async def test_talker(model_dir):
    pipeline = example("qwen3-omni-tiny")
    thinker = await start_stage(pipeline, "thinker", model_dir)
    srv = await start_stage(pipeline, "talker", model_dir)
    try:
        rows = await call_stage(thinker.port, header(max_tokens=6, ignore_eos=True))
        other = await call_stage(thinker.port, header(prompt="Another one", max_tokens=9, ignore_eos=True))

        def codes(chunks):
            return torch.cat([tensor_of(c, "codes") for c in chunks], 1)

        probe = (header("probe", max_codec_frames=20, temperature=0.9, seed=3), rows)
        fillers = [(header(f"f{i}", max_codec_frames=300), other) for i in range(4)]
        alone, joined = await joins_a_running_batch(srv, probe, fillers, codes)
        assert alone.shape[1] > 0 and torch.equal(joined, alone)
    finally:
        await srv.drain()
        await thinker.drain()


async def test_code2wav(model_dir):
    srv = await start_stage(example("qwen3-omni-tiny", scheduler("code2wav")), "code2wav", model_dir)
    try:
        stream = [codes_chunk(0, 25, False), codes_chunk(1, 25, False), codes_chunk(2, 7, True)]
        probe = (header("probe"), stream)
        burst = [(header(f"b{i}"), [codes_chunk(0, 25, False, seed=i), codes_chunk(1, 25, False, seed=i),
                                     codes_chunk(2, 7, True, seed=i)]) for i in range(12)]
        alone, joined = await joins_a_burst(srv, probe, burst, lambda cs: [tensor_of(c, "audio") for c in cs])
        assert len(alone) == 3 and all(torch.equal(a, j) for a, j in zip(alone, joined))
    finally:
        await srv.drain()


@pytest.mark.parametrize("guidance", [7.5, 1.0], ids=["guided", "unguided"])
async def test_denoise(model_dir, guidance):
    srv = await start_stage(example("text-to-image-tiny", scheduler("denoise")), "denoise", model_dir)
    try:
        emb = embeddings_chunk()
        if guidance == 1.0:  # one row of embeddings: it joins a batch of two-row (guided) images
            emb = embeddings_chunk(rows=1)
        probe = (header("probe", width=32, height=32, num_inference_steps=6, seed=9, guidance_scale=guidance), [emb])
        fillers = [(header(f"f{i}", width=32, height=32, num_inference_steps=100, seed=i), [embeddings_chunk()])
                   for i in range(3)]
        alone, joined = await joins_a_running_batch(srv, probe, fillers, lambda cs: tensor_of(cs[-1], "latents"))
        assert torch.equal(joined, alone)
    finally:
        await srv.drain()


async def test_text_encoder_and_vae(model_dir):
    pipeline = example("text-to-image-tiny", lambda d: (scheduler("text-encoder")(d), scheduler("vae-decode")(d)))
    enc = await start_stage(pipeline, "text-encoder", model_dir)
    vae = await start_stage(pipeline, "vae-decode", model_dir)
    try:
        probe = (header("probe", prompt="a red car", guidance_scale=1.0), ())
        burst = [(header(f"b{i}", prompt=f"prompt {i}"), ()) for i in range(12)]
        alone, joined = await joins_a_burst(enc, probe, burst, lambda cs: tensor_of(cs[0], "embeddings"))
        assert alone.shape == (1, 77, 32) and torch.equal(joined, alone)

        def latents(seed):
            from omnistage.contract import tensors
            from omnistage.v1 import stage_pb2
            t = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(seed))
            return [stage_pb2.Chunk(stage="denoise", chunk_id=0, end_of_stream=True,
                                    tensors=[tensors.to_proto("latents", t)])]

        png = lambda cs: tensor_of(cs[0], "image")  # noqa: E731
        alone, joined = await joins_a_burst(vae, (header("probe"), latents(0)),
                                            [(header(f"b{i}"), latents(i + 1)) for i in range(12)], png)
        assert torch.equal(joined, alone)
    finally:
        await enc.drain()
        await vae.drain()
