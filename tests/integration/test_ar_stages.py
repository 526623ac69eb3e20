"""AR stages on the tiny Qwen2 LM: vLLM's AsyncLLM and the transformers engine, behind real stage services."""

from __future__ import annotations

import grpc
import pytest

from omnistage import tensors

from ..harness import call_stage, example, header, start_stage


def with_engine(engine: str):
    def edit(doc):
        doc["spec"]["topology"]["stages"][0]["engine"] = engine
    return example("llm-tiny", edit)


def tensor_of(chunk, name):
    return next(tensors.from_proto(t) for t in chunk.tensors if t.name == name)


@pytest.fixture(scope="module")
async def hf_stage(model_dir):
    srv = await start_stage(with_engine("transformers"), "llm", model_dir)
    yield srv
    await srv.drain()


@pytest.fixture(scope="module")
async def vllm_stage(model_dir):
    srv = await start_stage(example("llm-tiny"), "llm", model_dir)
    yield srv
    await srv.drain()


async def test_transformers_engine_streams_tokens(hf_stage):
    out = await call_stage(hf_stage.port, header(max_tokens=10, ignore_eos=True))
    assert [len(tensor_of(c, "token_ids")) for c in out] == [4, 4, 2]
    assert out[-1].end_of_stream and out[-1].finish_reason == "length"


@pytest.mark.vllm
async def test_vllm_engine_streams_tokens(vllm_stage, hf_stage):
    out = await call_stage(vllm_stage.port, header(max_tokens=10, ignore_eos=True))
    ids = [t for c in out for t in tensor_of(c, "token_ids").tolist()]
    assert len(ids) == 10 and out[-1].end_of_stream and out[-1].finish_reason == "length"
    assert len(out) >= 2 and tensor_of(out[0], "prompt_token_ids").numel() > 0
    # Same weights, greedy: vLLM and the transformers engine agree on the first tokens.
    hf = await call_stage(hf_stage.port, header(max_tokens=10, ignore_eos=True))
    hf_ids = [t for c in hf for t in tensor_of(c, "token_ids").tolist()]
    assert ids[:3] == hf_ids[:3]


@pytest.mark.vllm
async def test_vllm_bad_request_is_invalid_argument(vllm_stage):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call_stage(vllm_stage.port, header(prompt="", prompt_token_ids=[1, 99999]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "params.prompt_token_ids" in e.value.details()
    out = await call_stage(vllm_stage.port, header(max_tokens=2))
    assert out[-1].end_of_stream
