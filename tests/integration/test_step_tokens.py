"""A step's tokens bounded (`engineArgs.max_num_batched_tokens`, as vLLM names it) on the transformers AR
engines: prompts join a step while their tokens fit it, a prompt longer than the bound steps alone, decoding
sequences cost one token each; the tokens each request gets are those it gets unbounded. The memory plan
sizes the step's activations by the same rule (`plan.step_tokens`)."""

from __future__ import annotations

import asyncio

import pytest

from omnistage.checkpoints.plan import plan_stage, step_tokens
from stage_service.engines.registry import create_engine
from stage_service.runtime.errors import EngineConfigError

from ..harness import call_stage, example, header, stage_servers, token_ids

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
async def test_steps_take_at_most_the_bound_or_one_longer_prompt_alone(model_dir, engine_process):
    unbounded, fed_unbounded = await _run(lm(None, engine_process), model_dir)
    bounded, fed = await _run(lm(BOUND, engine_process), model_dir)
    assert bounded == unbounded and all(len(t) == 6 for t in bounded)
    longest = max(map(len, PROMPTS))
    assert max(fed) <= max(BOUND, longest)
    assert longest in fed  # the long prompt stepped, alone
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
