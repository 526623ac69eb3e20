"""A step's tokens bounded (`engineArgs.max_num_batched_tokens`, as vLLM names it) on the transformers AR
engines: prompts join a step while their tokens fit it, a text prompt longer than the bound is prefilled in
pieces of the bound beside the others' decoding, decoding sequences cost one token each; the tokens each
request gets are those it gets unbounded. The memory plan sizes the step's activations by the rule of prompts
with media rows, which are fed whole (`plan.step_tokens`): for text prompts an upper bound."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from omnistage.checkpoints.plan import plan_stage, step_tokens
from stage_service.engines.registry import create_engine
from stage_service.runtime.errors import EngineConfigError

from ..harness import call_stage, example, header, stage_servers, tensor_of, token_ids

BOUND = 24
PROMPTS = [[5 + i] * n for i, n in enumerate((10, 10, 10, 30, 4, 12, 10, 8))]  # one longer than the bound


def lm(bound: int | None, engine_process: bool = False):
    def edit(doc):
        doc["spec"]["topology"]["stages"][0]["engine"] = "transformers"
        doc["spec"]["deployment"]["stages"]["llm"]["engineArgs"] = {
            "engine_process": engine_process, **({} if bound is None else {"max_num_batched_tokens": bound})}
    return example("llm-tiny", edit)


def record_step_tokens(engine) -> list[int]:
    """Tokens each step feeds, as the states' costs say on the step thread before the step runs."""
    fed: list[int] = []
    step = engine.scheduler.step_fn

    def counted(batch):
        fed.append(sum(st.cost for st in batch))
        return step(batch)
    engine.scheduler.step_fn = counted
    return fed


async def _run(pipeline, model_dir) -> tuple[list[list[int]], list[int]]:
    async with stage_servers(pipeline, model_dir) as servers:
        srv = servers["llm"]
        fed = record_step_tokens(srv.engine)
        outs = await asyncio.gather(*(call_stage(srv.port, header(f"r{i}", prompt="", prompt_token_ids=ids,
                                                                  max_tokens=6, ignore_eos=True))
                                      for i, ids in enumerate(PROMPTS)))
        return [token_ids(o) for o in outs], fed


@pytest.mark.parametrize("engine_process", [False, True], ids=["in-process", "engine-process"])
async def test_steps_take_at_most_the_bound_and_a_longer_prompt_in_pieces(model_dir, engine_process):
    unbounded, fed_unbounded = await _run(lm(None, engine_process), model_dir)
    bounded, fed = await _run(lm(BOUND, engine_process), model_dir)
    assert bounded == unbounded and all(len(t) == 6 for t in bounded)
    assert max(fed) <= BOUND < max(map(len, PROMPTS))  # the long prompt too: prefilled in pieces
    assert sum(fed) == sum(fed_unbounded) == sum(map(len, PROMPTS)) + 5 * len(PROMPTS)  # the same work


def test_the_plan_sizes_the_largest_step_by_the_same_rule(model_dir):
    assert step_tokens({}, context=512, batch=32) == 32 * 512
    assert step_tokens({"max_num_batched_tokens": 2048}, context=512, batch=32) == 2048
    assert step_tokens({"max_num_batched_tokens": 256}, context=512, batch=32) == 512  # a whole prompt alone
    assert step_tokens({"max_num_batched_tokens": 1 << 20}, context=512, batch=32) == 32 * 512
    pipeline = lm(2048)
    bounded = plan_stage(pipeline, pipeline.stage("llm"), model_dir)
    unbounded = plan_stage(lm(None), pipeline.stage("llm"), model_dir)
    assert bounded.activation_bytes < unbounded.activation_bytes
    assert bounded.weights_bytes == unbounded.weights_bytes and bounded.kv_bytes == unbounded.kv_bytes


def test_an_engine_that_does_not_count_tokens_refuses_the_bound(model_dir):
    pipeline = example("qwen3-omni-tiny", lambda d: d["spec"]["deployment"]["stages"]["code2wav"].setdefault(
        "engineArgs", {}).update(max_num_batched_tokens=64))
    with pytest.raises(EngineConfigError, match=r"spec\.deployment\.stages\.code2wav\.engineArgs\."
                                                r"max_num_batched_tokens: this engine .* does not count its steps"):
        create_engine(pipeline, pipeline.stage("code2wav"), model_dir)


def thinker(bound: int | None, prompt_limit: int | None = None):
    def edit(doc):
        if prompt_limit is not None:
            doc["spec"]["topology"]["limits"]["maxPromptChars"] = prompt_limit
        if bound is not None:
            args = doc["spec"]["deployment"]["stages"]["thinker"].setdefault("engineArgs", {})
            args["max_num_batched_tokens"] = bound
    return example("qwen3-omni-tiny", edit)


async def _thinker_run(pipeline, model_dir):
    async with stage_servers(pipeline, model_dir, ("thinker",)) as servers:
        srv = servers["thinker"]
        fed = record_step_tokens(srv.engine)
        firsts = []
        for i, ids in enumerate(([7] * 40, [9] * 5)):
            first = header(f"t{i}", prompt="", prompt_token_ids=ids, max_tokens=4, ignore_eos=True)
            first.header.inline_outputs = True
            firsts.append(first)
        outs = await asyncio.gather(*(call_stage(srv.port, f) for f in firsts))
    rows = [{name: torch.cat([tensor_of(c, name) for c in o if any(t.name == name for t in c.tensors)])
             for name in ("embeds", "hidden")} for o in outs]
    return [token_ids(o) for o in outs], rows, fed


async def test_the_thinker_prefills_a_long_text_prompt_in_pieces_and_hands_on_the_same_rows(model_dir):
    """The Talker is conditioned on the Thinker's rows of every position: a prompt fed in pieces gives it
    the same rows, and the same tokens, as one fed whole."""
    whole_tokens, whole_rows, _ = await _thinker_run(thinker(None), model_dir)
    tokens, rows, fed = await _thinker_run(thinker(8), model_dir)
    assert max(fed) <= 8 and tokens == whole_tokens
    for got, want in zip(rows, whole_rows):
        assert got["embeds"].shape[0] == want["embeds"].shape[0]  # every position, once
        torch.testing.assert_close(got["embeds"], want["embeds"])
        torch.testing.assert_close(got["hidden"], want["hidden"], rtol=1e-4, atol=1e-4)


async def test_the_qwen3_thinker_counts_a_prompt_in_tokens_against_its_checkpoints_length(model_dir):
    """Its length came only from engineArgs.max_model_len (unset: no bound); now the checkpoint's positions
    bound prompt + max_tokens, refused before any step."""
    async with stage_servers(thinker(None, prompt_limit=40_000), model_dir, ("thinker",)) as servers:
        srv = servers["thinker"]
        length = srv.engine.max_len
        assert length == 32768  # the tiny checkpoint's max_position_embeddings
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call_stage(srv.port, header("long", prompt="", prompt_token_ids=[7] * (length - 2), max_tokens=4))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "exceeds the model's length 32768" in e.value.details()
