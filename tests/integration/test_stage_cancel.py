"""100 concurrent requests, 10 cancelled mid-way, on each batching engine behind a real stage service:
the other 90 finish with the right lengths, then the engine holds no unfinished request and the
stage holds no request state. Deadlines end requests the same way. (vLLM: test_ar_stages.py.)"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch

from omnistage.contract import tensors
from omnistage.v1 import stage_pb2, stage_pb2_grpc

from ..harness import call_stage, example, header, start_stage, tensor_of, token_ids
from .test_stage_support import Call, assert_nothing_held, scheduler

N, CANCELLED = 100, set(range(0, 100, 10))


def llm_transformers():
    def edit(doc):
        doc["spec"]["topology"]["stages"][0]["engine"] = "transformers"
        scheduler("llm")(doc)
    return example("llm-tiny", edit)


def chunk_every_step(stage: str):
    def edit(doc):
        next(s for s in doc["spec"]["topology"]["stages"] if s["name"] == stage)["chunkSize"] = 1
        scheduler(stage)(doc)
    return edit


def codes_chunk(chunk_id: int, frames: int, end: bool, seed: int = 0) -> stage_pb2.Chunk:
    codes = torch.randint(0, 2048, (4, frames), generator=torch.Generator().manual_seed(seed + chunk_id))
    return stage_pb2.Chunk(stage="talker", chunk_id=chunk_id, end_of_stream=end,
                           tensors=[tensors.to_proto("codes", codes)])


def embeddings_chunk(rows: int = 2) -> stage_pb2.Chunk:
    """Text-encoder output as the denoise stage takes it: [unconditional, conditional] (2 rows) or 1 row."""
    emb = torch.randn(rows, 77, 32, generator=torch.Generator().manual_seed(0))
    return stage_pb2.Chunk(stage="text-encoder", chunk_id=0, end_of_stream=True,
                           tensors=[tensors.to_proto("embeddings", emb)])


async def run_hundred(srv, make, check):
    """`make(channel, i, cancel)` starts call i; the calls in CANCELLED are cancelled after their first chunk."""
    before = outcomes(srv)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
        calls = [make(ch, i, i in CANCELLED) for i in range(N)]
        for i in CANCELLED:
            await asyncio.wait_for(calls[i].started.wait(), 120)
            calls[i].cancel()
        codes = [await asyncio.wait_for(c.outcome(), 300) for c in calls]
    assert [i for i, c in enumerate(codes) if c != grpc.StatusCode.OK] == sorted(CANCELLED)
    assert all(codes[i] == grpc.StatusCode.CANCELLED for i in CANCELLED)
    for i, c in enumerate(calls):
        if i not in CANCELLED:
            check(i, c.chunks)
    await assert_nothing_held(srv)
    after = outcomes(srv)  # the stage counted them the same way
    assert {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)} == {
        "cancelled": len(CANCELLED), "finished": N - len(CANCELLED)}


def outcomes(srv) -> dict[str, int]:
    return {s.labels["outcome"]: int(s.value) for m in srv.metrics.requests.collect() for s in m.samples
            if s.name.endswith("_total") and s.value}


async def test_transformers_lm(model_dir):
    srv = await start_stage(llm_transformers(), "llm", model_dir)
    try:
        def make(ch, i, cancel):
            return Call(ch, header(f"r{i}", prompt=f"request {i}", max_tokens=200 if cancel else 12, ignore_eos=True))

        def check(i, chunks):
            assert len(token_ids(chunks)) == 12 and chunks[-1].end_of_stream and chunks[-1].finish_reason == "length"

        await run_hundred(srv, make, check)
    finally:
        await srv.drain()


async def test_thinker(model_dir):
    srv = await start_stage(example("qwen3-omni-tiny", scheduler("thinker")), "thinker", model_dir)
    try:
        def make(ch, i, cancel):
            return Call(ch, header(f"r{i}", prompt=f"request {i}", max_tokens=200 if cancel else 8, ignore_eos=True,
                                   temperature=0.8, seed=i))

        def check(i, chunks):
            rows = sum(len(tensor_of(c, "embeds")) for c in chunks)
            assert len(token_ids(chunks)) == 8 and rows == len(tensor_of(chunks[0], "prompt_token_ids")) + 7

        await run_hundred(srv, make, check)
    finally:
        await srv.drain()


async def test_talker_fed_by_a_thinker_stream(model_dir):
    pipeline = example("qwen3-omni-tiny", scheduler("talker"))
    thinker = await start_stage(pipeline, "thinker", model_dir)
    srv = await start_stage(pipeline, "talker", model_dir)
    try:
        rows = await call_stage(thinker.port, header(max_tokens=6, ignore_eos=True))
        reference = await call_stage(srv.port, header("ref", max_codec_frames=12), rows)
        ref_codes = torch.cat([tensor_of(c, "codes") for c in reference], 1)

        def make(ch, i, cancel):  # greedy, this input runs past 200 frames: a cancelled call is mid-way
            return Call(ch, header(f"r{i}", max_codec_frames=200 if cancel else 12), rows)

        def check(i, chunks):
            assert torch.equal(torch.cat([tensor_of(c, "codes") for c in chunks], 1), ref_codes)

        await run_hundred(srv, make, check)
    finally:
        await srv.drain()
        await thinker.drain()


async def test_code2wav_streams(model_dir):
    srv = await start_stage(example("qwen3-omni-tiny", scheduler("code2wav")), "code2wav", model_dir)
    try:
        hold = asyncio.Event()  # cancelled calls have sent one chunk and wait for more: mid-way
        stream = [codes_chunk(0, 25, False), codes_chunk(1, 10, True)]
        reference = [tensor_of(c, "audio") for c in await call_stage(srv.port, header("ref"), stream)]
        assert len(reference) == 2 and all(len(a) > 0 for a in reference)

        def make(ch, i, cancel):
            if cancel:
                return Call(ch, header(f"r{i}"), [codes_chunk(0, 25, False, seed=i)], hold_open=hold)
            return Call(ch, header(f"r{i}"), stream)

        def check(i, chunks):
            audio = [tensor_of(c, "audio") for c in chunks]
            assert len(audio) == 2 and all(torch.equal(a, r) for a, r in zip(audio, reference))

        await run_hundred(srv, make, check)
        hold.set()
    finally:
        await srv.drain()


async def test_denoise_loop(model_dir):
    pipeline = example("text-to-image-tiny", chunk_every_step("denoise"))
    srv = await start_stage(pipeline, "denoise", model_dir)
    try:
        emb = embeddings_chunk()

        def make(ch, i, cancel):
            steps = 60 if cancel else 3
            return Call(ch, header(f"r{i}", width=32, height=32, num_inference_steps=steps, seed=i), [emb])

        def check(i, chunks):
            assert len(chunks) == 3 and chunks[-1].end_of_stream
            assert tensor_of(chunks[-1], "latents").shape == (1, 4, 16, 16)

        await run_hundred(srv, make, check)
    finally:
        await srv.drain()


async def test_deadline_ends_the_engine_request(model_dir):
    srv = await start_stage(llm_transformers(), "llm", model_dir)
    try:
        deadline = int((time.time() + 0.5) * 1000)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call_stage(srv.port, header("late", max_tokens=256, ignore_eos=True, deadline_unix_ms=deadline))
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "stage llm" in e.value.details()
        await assert_nothing_held(srv)
        out = await call_stage(srv.port, header("next", max_tokens=3))
        assert out[-1].end_of_stream
    finally:
        await srv.drain()


async def test_release_ends_what_the_stage_still_runs_for_a_request(model_dir):
    srv = await start_stage(llm_transformers(), "llm", model_dir)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
            stub = stage_pb2_grpc.StageServiceStub(ch)
            call = Call(ch, header("orphan", max_tokens=256, ignore_eos=True))
            await asyncio.wait_for(call.started.wait(), 30)
            freed = await stub.Release(stage_pb2.ReleaseRequest(request_id="orphan"))
            assert freed.bytes_freed > 0  # its KV cache
            assert await asyncio.wait_for(call.outcome(), 30) == grpc.StatusCode.CANCELLED
            assert (await stub.Release(stage_pb2.ReleaseRequest(request_id="orphan"))).bytes_freed == 0  # idempotent
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Release(stage_pb2.ReleaseRequest())
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in e.value.details()
        await assert_nothing_held(srv)
    finally:
        await srv.drain()
