"""AR stages on the tiny Qwen2 LM: vLLM's AsyncLLM and the transformers engine, behind real stage services.

One vLLM engine serves the whole module (start-up is about 30 s here); the last test kills it."""

from __future__ import annotations

import urllib.request

import grpc
import psutil
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from omnistage.contract import launch, tensors
from omnistage.v1 import stage_pb2

from ..harness import call_stage, example, header, start_stage, tensor_of, token_ids
from .test_stage_batching import joins_a_running_batch
from .test_stage_cancel import run_hundred
from .test_stage_support import Call, assert_engine_death_ends_the_stage


def with_engine(engine: str):
    def edit(doc):
        doc["spec"]["topology"]["stages"][0]["engine"] = engine
    return example("llm-tiny", edit)


def templated(*turns: str) -> str:
    """qwen2-tiny's chat template rendered (omnistage/tiny_models/lm.py): each turn's content, then a newline."""
    return "".join(f"{t}\n" for t in turns)


async def prompt_ids_sent(stage, request_id: str, prompt: str = "Hello there", max_tokens: int = 2,
                          **params) -> list[int]:
    """The prompt token ids the stage fed its model for a request (its first chunk reports them)."""
    out = await call_stage(stage.port, header(request_id, prompt=prompt, max_tokens=max_tokens, **params))
    return tensor_of(out[0], "prompt_token_ids").tolist()


async def check_the_prompt_policy(stage, tokenizer) -> None:
    """The chat template by default, with the request's system turn when it has one; raw_prompt sends the
    text as written."""
    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    assert templated("Hello there") != "Hello there"  # the template shows in the ids
    assert await prompt_ids_sent(stage, "chat") == ids(templated("Hello there"))
    assert await prompt_ids_sent(stage, "system", system_prompt="Be brief.") == ids(templated("Be brief.",
                                                                                               "Hello there"))
    assert await prompt_ids_sent(stage, "raw", raw_prompt=True) == tokenizer("Hello there")["input_ids"]


async def check_the_length_bound_counts_the_templated_prompt(stage, tokenizer, max_len: int) -> None:
    """A prompt that, as written, exactly fills the model with max_tokens does not fit once templated."""
    text = "word"
    while len(tokenizer(text)["input_ids"]) < max_len - 200:
        text += " word"
    written = await prompt_ids_sent(stage, "fills", text, max_tokens=max_len - len(tokenizer(text)["input_ids"]),
                                    raw_prompt=True)
    fed = tokenizer(templated(text), add_special_tokens=False)["input_ids"]
    assert len(fed) > len(written)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await prompt_ids_sent(stage, "too-long", text, max_tokens=max_len - len(written))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"prompt ({len(fed)} tokens) plus max_tokens" in e.value.details()


@pytest.fixture(scope="module")
async def hf_stage(model_dir):
    srv = await start_stage(with_engine("transformers"), "llm", model_dir)
    yield srv
    await srv.drain()


def vllm_with_upstream():
    """llm-tiny, with an upstream stage feeding the vLLM stage (its prompt can come as embeddings)."""
    def edit(doc):
        stages = doc["spec"]["topology"]["stages"]
        stages.insert(0, {"name": "prefix", "kind": "ar", "engine": "transformers", "model": "qwen2-tiny",
                          "emits": ["tokens"]})
        stages[1]["inputs"] = [{"stage": "prefix"}]
        doc["spec"]["deployment"]["stages"]["prefix"] = {"replicas": 1}
        doc["spec"]["deployment"]["stages"]["llm"]["scheduler"] = {"maxBatch": 32, "maxQueued": 128}
    return example("llm-tiny", edit)


@pytest.fixture(scope="module")
async def vllm_stage(model_dir):
    srv = await start_stage(vllm_with_upstream(), "llm", model_dir, http_port=0)
    yield srv
    await srv.drain()


async def test_transformers_engine_streams_tokens(hf_stage):
    out = await call_stage(hf_stage.port, header(max_tokens=10, ignore_eos=True))
    assert [len(tensor_of(c, "token_ids")) for c in out] == [4, 4, 2]
    assert out[-1].end_of_stream and out[-1].finish_reason == "length"


async def test_transformers_engine_applies_the_chat_template_unless_the_prompt_is_raw(hf_stage):
    await check_the_prompt_policy(hf_stage, hf_stage.engine.tokenizer)
    await check_the_length_bound_counts_the_templated_prompt(hf_stage, hf_stage.engine.tokenizer,
                                                             hf_stage.engine.max_len)


async def test_a_system_prompt_on_a_model_without_a_chat_template_is_refused(hf_stage, monkeypatch):
    monkeypatch.setattr(hf_stage.engine, "chat_template", None)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await prompt_ids_sent(hf_stage, "no-template", system_prompt="Be brief.")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "params.system_prompt" in e.value.details()
    assert await prompt_ids_sent(hf_stage, "as-written") == hf_stage.engine.tokenizer("Hello there")["input_ids"]


@pytest.mark.vllm
async def test_vllm_engine_applies_the_chat_template_unless_the_prompt_is_raw(vllm_stage, hf_stage):
    await check_the_prompt_policy(vllm_stage, vllm_stage.engine.tokenizer)
    await check_the_length_bound_counts_the_templated_prompt(vllm_stage, vllm_stage.engine.tokenizer,
                                                             vllm_stage.engine.max_model_len)
    # Both engines feed their model the same ids for the same request.
    for params in ({}, {"system_prompt": "Be brief."}, {"raw_prompt": True}):
        assert await prompt_ids_sent(vllm_stage, "v", **params) == await prompt_ids_sent(hf_stage, "t", **params)


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
    # Each engine's work for the request, its generated tokens, on its last chunk only.
    for chunks in (out, hf):
        assert [(c.timing.units, c.timing.unit) for c in chunks] == [(0, "")] * (len(chunks) - 1) + [(10, "tokens")]


@pytest.mark.vllm
async def test_vllm_bad_request_is_invalid_argument(vllm_stage):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call_stage(vllm_stage.port, header(prompt="", prompt_token_ids=[1, 99999]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "params.prompt_token_ids" in e.value.details()
    out = await call_stage(vllm_stage.port, header(max_tokens=2))
    assert out[-1].end_of_stream


@pytest.mark.vllm
async def test_vllm_prompt_from_upstream_embeddings_or_tokens(vllm_stage, hf_stage):
    ids = [5, 17, 42, 99, 123, 7]
    by_ids = token_ids(await call_stage(vllm_stage.port, header("ids", prompt="", prompt_token_ids=ids,
                                                                 max_tokens=10, ignore_eos=True)))
    with torch.inference_mode():
        rows = hf_stage.engine.lm.embed(torch.tensor(ids))  # the same model's input embeddings
    for name, t in (("embeds", rows), ("prompt_embeds", rows), ("token_ids", torch.tensor(ids))):
        chunks = [stage_pb2.Chunk(stage="prefix", chunk_id=0, tensors=[tensors.to_proto(name, t[:4])]),
                  stage_pb2.Chunk(stage="prefix", chunk_id=1, end_of_stream=True,
                                  tensors=[tensors.to_proto(name, t[4:])])]
        out = await call_stage(vllm_stage.port, header(f"up-{name}", max_tokens=10, ignore_eos=True), chunks)
        assert token_ids(out) == by_ids, name
    bad = stage_pb2.Chunk(stage="prefix", chunk_id=0, end_of_stream=True,
                          tensors=[tensors.to_proto("embeds", torch.zeros(3, 7))])
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call_stage(vllm_stage.port, header("bad"), [bad])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "[positions, 256]" in e.value.details()


@pytest.mark.vllm
async def test_vllm_hundred_requests_ten_cancelled(vllm_stage):
    def make(ch, i, cancel):
        return Call(ch, header(f"c{i}", prompt=f"request {i}", max_tokens=200 if cancel else 12, ignore_eos=True))

    def check(i, chunks):
        assert len(token_ids(chunks)) == 12 and chunks[-1].finish_reason == "length"

    await run_hundred(vllm_stage, make, check)  # then: vLLM tracks no request and its KV cache is free


@pytest.mark.vllm
async def test_vllm_request_joining_a_batch_gets_what_it_gets_alone(vllm_stage):
    probe = (header("probe", prompt="The probe", max_tokens=30, ignore_eos=True, temperature=0.9, seed=5), ())
    fillers = [(header(f"f{i}", prompt=f"filler {i}", max_tokens=250, ignore_eos=True), ()) for i in range(6)]
    alone, joined = await joins_a_running_batch(vllm_stage, probe, fillers, token_ids)
    assert len(alone) == 30 and joined == alone


@pytest.mark.vllm
async def test_vllm_stage_serves_vllms_own_metrics_with_its_own(vllm_stage):
    """vLLM's `vllm:*` metrics (its registry, read at each scrape) on the stage's /metrics, next to the stage's."""
    def scrape() -> dict[str, float]:
        """Each sample name's values summed over its labels."""
        with urllib.request.urlopen(f"http://127.0.0.1:{vllm_stage.http.port}{launch.METRICS_PATH}",
                                    timeout=30) as r:
            out: dict[str, float] = {}
            for family in text_string_to_metric_families(r.read().decode()):
                for s in family.samples:
                    out[s.name] = out.get(s.name, 0.0) + s.value
            return out

    before = scrape()
    await call_stage(vllm_stage.port, header("vllm-metrics", max_tokens=10, ignore_eos=True))
    after = scrape()
    assert after["vllm:generation_tokens_total"] - before.get("vllm:generation_tokens_total", 0.0) == 10
    assert after["vllm:request_success_total"] >= 1 and "vllm:kv_cache_usage_perc" in after
    assert "omnistage_stage_step_seconds_count" in after            # the stage's own, on the same page
    assert not [name for name in after if name.startswith(("python_", "process_"))]   # only vLLM's taken


@pytest.mark.vllm
async def test_vllm_engine_death_fails_requests_flips_health_and_stops(vllm_stage):
    """Last in the module: kills the shared engine's core process, a real failure."""
    def kill_the_core():
        core = [p for p in psutil.Process().children(recursive=True) if "EngineCore" in p.name()]
        assert core, "no vLLM engine core process found"
        for p in core:
            p.kill()

    await assert_engine_death_ends_the_stage(vllm_stage, kill_the_core, "stage llm: engine failed for good")
