"""Thinker, Talker and Code2Wav, each behind a real stage service on port 0, with the tiny model."""

from __future__ import annotations

import dataclasses
import json

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omnistage.client import build_request
from omnistage.contract import tensors
from omnistage.contract.params import InvalidRequest, resolve
from omnistage.v1 import stage_pb2
from stage_service.engines.omni.audio import to_pcm16

from ..harness import call_stage, example, header, stage_servers_fixture, tensor_of

PIPELINE = example("qwen3-omni-tiny")


servers = stage_servers_fixture(PIPELINE)


async def test_thinker_streams_text_and_rows_in_chunks(servers):
    out = await call_stage(servers["thinker"].port, header(max_tokens=10, ignore_eos=True))
    chunk_size = PIPELINE.stage("thinker").chunk_size
    assert [len(tensor_of(c, "token_ids")) for c in out] == [4, 4, 2]
    assert [c.chunk_id for c in out] == [0, 1, 2] and [c.end_of_stream for c in out] == [False, False, True]
    assert out[-1].finish_reason == "length" and chunk_size == 4
    prompt = tensor_of(out[0], "prompt_token_ids")
    rows = sum(len(tensor_of(c, "embeds")) for c in out)
    assert rows == len(prompt) + 10 - 1  # every position fed: the prompt, then each token but the last
    assert tensor_of(out[0], "hidden").shape == tensor_of(out[0], "embeds").shape
    assert "".join(c.text for c in out).strip()
    again = await call_stage(servers["thinker"].port, header(request_id="r2", max_tokens=10, ignore_eos=True))
    assert [tensor_of(c, "token_ids").tolist() for c in again] == [tensor_of(c, "token_ids").tolist() for c in out]


async def test_talker_and_code2wav_turn_thinker_rows_into_audio(servers):
    thinker_out = await call_stage(servers["thinker"].port, header(max_tokens=6, ignore_eos=True))
    talker_out = await call_stage(servers["talker"].port, header(max_codec_frames=30), thinker_out)
    codes = [tensor_of(c, "codes") for c in talker_out]
    assert all(c.shape[0] == 4 and c.dtype == torch.int64 for c in codes)
    frames = sum(c.shape[1] for c in codes)
    first = PIPELINE.stage("talker").chunk_units(0)  # initialChunkSize 15 as shipped: 30 frames are 15 + 15
    assert first == 15 and 0 < frames <= 30 and codes[0].shape[1] == min(first, frames)
    assert talker_out[-1].end_of_stream and talker_out[-1].finish_reason in ("stop", "length")
    wav_out = await call_stage(servers["code2wav"].port, header(), talker_out)
    pcm = torch.cat([tensor_of(c, "audio") for c in wav_out])
    assert all(c.sample_rate == 24000 for c in wav_out) and wav_out[-1].end_of_stream
    # Streaming decode equals transformers' chunked_decode at the talker's chunk size, sample for sample
    # (every chunk here holds `first` frames or fewer; tests/integration/test_initial_chunk.py checks
    # chunks of two sizes).
    c2w = servers["code2wav"].engine.c2w
    with torch.inference_mode():
        ref = c2w.model.chunked_decode(torch.cat(codes, 1)[None], chunk_size=first, left_context_size=25)
    assert torch.equal(pcm, to_pcm16(ref[0, 0])) and len(pcm) > frames * 1920 * 0.9


async def test_talker_output_does_not_depend_on_thinker_chunking(servers):
    """The Talker consumes rows one step at a time: whole-result and chunked hand-off agree."""
    thinker_out = await call_stage(servers["thinker"].port, header(max_tokens=8, ignore_eos=True))
    merged = stage_pb2.Chunk(stage="thinker", chunk_id=0, end_of_stream=True)
    for name in ("token_ids", "embeds", "hidden"):
        merged.tensors.append(tensors.to_proto(name, torch.cat([tensor_of(c, name) for c in thinker_out])))
    merged.tensors.append(thinker_out[0].tensors[[t.name for t in thinker_out[0].tensors].index("prompt_token_ids")])
    a = await call_stage(servers["talker"].port, header(max_codec_frames=20), thinker_out)
    b = await call_stage(servers["talker"].port, header(max_codec_frames=20), [merged])
    assert torch.equal(torch.cat([tensor_of(c, "codes") for c in a], 1),
                       torch.cat([tensor_of(c, "codes") for c in b], 1))


async def test_bad_input_is_invalid_argument_and_the_stage_keeps_serving(servers):
    port = servers["talker"].port
    bad_chunk = stage_pb2.Chunk(stage="thinker", chunk_id=0, end_of_stream=True,
                                tensors=[tensors.to_proto("token_ids", torch.tensor([1]))])
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call_stage(port, header(), [bad_chunk])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and 'no tensor "prompt_token_ids"' in e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call_stage(port, header(speaker="nobody"))  # the header alone: see test_engine_process.py
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "params.audio.speaker" in e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call_stage(servers["thinker"].port, header(max_tokens=100_000))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "params.text.max_tokens" in e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call_stage(servers["thinker"].port, None, [bad_chunk])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "header" in e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call_stage(servers["code2wav"].port, header(), [stage_pb2.Chunk(stage="thinker", chunk_id=0)])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not an input of this stage" in e.value.details()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    out = await call_stage(servers["thinker"].port, header(max_tokens=2))
    assert out[-1].end_of_stream


def params(prompt: str, **chat):
    return dataclasses.replace(resolve(build_request(prompt).params, PIPELINE.limits), **chat)


def test_the_thinker_applies_the_checkpoints_chat_template(servers):
    """System turn, user turn, assistant generation prompt, with the role words and markers at the ids the
    checkpoint's config names (the Talker finds the turns by them); raw mode sends the prompt as written."""
    engine = servers["thinker"].engine
    cfg = json.loads((engine.model_dir / "config.json").read_text())

    def words(text):
        return engine.thinker.tokenizer(text, add_special_tokens=False)["input_ids"]

    def turn(role, body=None):
        head = [cfg["im_start_token_id"], cfg[f"{role}_token_id"], *words("\n")]
        return head if body is None else head + words(body) + [cfg["im_end_token_id"], *words("\n")]

    assert engine.prompt_ids(params("Hello there")) == turn("user", "Hello there") + turn("assistant")
    with_system = engine.prompt_ids(params("Hello there", system_prompt="Answer briefly."))
    assert with_system == turn("system", "Answer briefly.") + turn("user", "Hello there") + turn("assistant")
    assert engine.prompt_ids(params("Hello there", raw_prompt=True)) == words("Hello there")
    with pytest.raises(InvalidRequest, match="params.system_prompt"):
        engine.prompt_ids(params("Hello there", raw_prompt=True, system_prompt="Answer briefly."))


async def test_the_talker_refuses_a_prompt_without_an_assistant_turn(servers):
    raw = servers["thinker"].engine.prompt_ids(params("Hello there", raw_prompt=True))
    thinker_out = await call_stage(servers["thinker"].port, header(prompt_token_ids=raw, max_tokens=3))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call_stage(servers["talker"].port, header(prompt_token_ids=raw), thinker_out)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no assistant turn" in e.value.details()


async def test_health_is_not_serving_until_the_model_is_loaded(model_dir):
    from stage_service.server import StageServer

    srv = StageServer(PIPELINE, "code2wav", "127.0.0.1", 0, model_root=str(model_dir))
    original = srv.engine.load
    seen = {}

    def load_and_look():
        import asyncio as _a  # noqa: F401 - runs on the loader thread

        seen["ready_during_load"] = srv.ready
        original()

    srv.engine.load = load_and_look
    await srv.start()
    assert seen["ready_during_load"] is False and srv.ready
    await srv.drain()


async def test_with_a_forced_tool_call_the_thinker_marks_the_calls_rows_unspoken(servers):
    """Tools in play: each chunk carries `spoken`; an answer that opens inside a call (the forced call's
    prefix) is unspoken throughout, and the Talker fed it speaks from the prompt alone."""
    from omnistage.v1 import common_pb2
    from orchestrator_service.tool_calls import call_prefix

    tool = common_pb2.Tool(name="get_weather", parameters='{"type": "object"}')
    forced = header(prompt="", parts=["Weather in Paris?"], turns=[common_pb2.Turn(role="user", parts=1)],
                    tools=[tool], answer_prefix=call_prefix("get_weather"), max_tokens=6, ignore_eos=True)
    out = await call_stage(servers["thinker"].port, forced)
    prompt = len(tensor_of(out[0], "prompt_token_ids"))
    spoken = torch.cat([tensor_of(c, "spoken") for c in out])
    assert len(spoken) == sum(len(tensor_of(c, "embeds")) for c in out)
    assert spoken[:prompt].all() and not spoken[prompt:].any()
    offered = header(prompt="", parts=["Weather in Paris?"], turns=[common_pb2.Turn(role="user", parts=1)],
                     tools=[tool], max_tokens=6, ignore_eos=True)
    free = await call_stage(servers["thinker"].port, offered)
    generated = torch.cat([tensor_of(c, "token_ids") for c in free]).tolist()
    tags = {servers["thinker"].engine.tokenizer.convert_tokens_to_ids(t) for t in ("<tool_call>", "</tool_call>")}
    if not tags & set(generated):   # no call in the answer: every row spoken
        assert torch.cat([tensor_of(c, "spoken") for c in free]).all()
    # The Talker fed the forced call's rows speaks from the prompt's rows only: as if the Thinker had sent
    # the prompt and no answer row.
    talker = await call_stage(servers["talker"].port, header(max_codec_frames=10, **{
        "prompt": "", "parts": ["Weather in Paris?"], "turns": [common_pb2.Turn(role="user", parts=1)]}), out)
    assert talker[-1].end_of_stream and sum(tensor_of(c, "codes").shape[1] for c in talker) > 0
