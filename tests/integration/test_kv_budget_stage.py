"""The KV budget on the tiny LM behind real stage services (`engineArgs.kvCacheBytes`, kv_budget.py): many
long requests under a budget that fits a few all complete with the tokens they get unbounded, the caches
never hold more than the budget (measured after every step, in the stage process or in the engine process),
some are preempted on the way; a request that could never fit is refused at once with the numbers; a bad
kvCacheBytes is refused naming the field."""

from __future__ import annotations

import asyncio
import weakref

import grpc
import pytest

from omnistage.api import SpecError
from stage_service.engines.registry import create_engine
from stage_service.runtime.errors import EngineConfigError
from stage_service.runtime.kv_budget import KvPages

from ..harness import all_queued, call_stage, example, header, stage_servers, token_ids
from .test_stage_support import assert_nothing_held

PROMPT_TOKENS = 8
MAX_TOKENS = 40
REQUESTS = 16
ROOM_FOR = 4  # long requests the budget holds at their longest
PER_TOKEN = 4 * 2 * 64 * 2 * 4  # qwen2-tiny in float32: layers x KV heads x head dim x (K, V) x bytes
BUDGET = ROOM_FOR * KvPages(PER_TOKEN).bytes_for(PROMPT_TOKENS + MAX_TOKENS - 1)


def lm(kv_cache_bytes, engine_process: bool = False):
    """llm-tiny on the transformers engine with that KV budget (None: none)."""
    def edit(doc):
        doc["spec"]["topology"]["stages"][0]["engine"] = "transformers"
        doc["spec"]["deployment"]["stages"]["llm"]["engineArgs"] = {
            "engine_process": engine_process, **({} if kv_cache_bytes is None else {"kvCacheBytes": kv_cache_bytes})}
    return example("llm-tiny", edit)


def request(i: int, **params):
    ids = [5 + i, 17, 42, 99, 123, 7, 9 + i, 11]
    assert len(ids) == PROMPT_TOKENS
    return header(f"r{i}", prompt="", prompt_token_ids=ids, max_tokens=MAX_TOKENS, ignore_eos=True, **params)


def params(i: int) -> dict:
    """Greedy, but every fourth request samples with its seed: its generator survives a preemption too."""
    return {"temperature": 0.9, "seed": i} if i % 4 == 3 else {}


def measure_after_each_step(engine) -> list[int]:
    """The bytes the request states' KV caches really hold, read on the step thread after every step (in the
    stage process: every state's SequenceKV; with an engine process: what the child reports it holds)."""
    held: list[int] = []
    states = []
    if engine.core is None:
        new_state = engine.new_state
        def tracked(*a):
            st = new_state(*a)
            states.append(weakref.ref(st))  # weak: the leak check after the run must see them gone
            return st
        engine.new_state = tracked
    step = engine.scheduler.step_fn

    def measured(batch):
        out = step(batch)
        held.append(sum(st.kv.nbytes for st in (r() for r in list(states)) if st is not None)
                    if engine.core is None else engine.core.stats()[1])
        return out
    engine.scheduler.step_fn = measured
    return held


def preemptions_counted(srv) -> float | None:
    return srv.metrics.registry.get_sample_value("omnistage_stage_kv_preemptions_total", {"stage": "llm"})


@pytest.fixture(scope="module")
async def unbounded(model_dir):
    async with stage_servers(lm(None), model_dir) as servers:
        srv = servers["llm"]
        outs = await asyncio.gather(*(call_stage(srv.port, request(i, **params(i))) for i in range(REQUESTS)))
        yield [token_ids(o) for o in outs]


@pytest.mark.parametrize("engine_process", [False, True], ids=["in-process", "engine-process"])
async def test_long_requests_under_a_budget_for_a_few_all_finish_as_unbounded(model_dir, unbounded, engine_process):
    async with stage_servers(lm(BUDGET, engine_process), model_dir) as servers:
        srv = servers["llm"]
        sched = srv.engine.scheduler
        assert sched.kv_budget == BUDGET
        held = measure_after_each_step(srv.engine)
        outs = await all_queued(sched, asyncio.gather(*(call_stage(srv.port, request(i, **params(i)))
                                                        for i in range(REQUESTS))), REQUESTS)
        assert [token_ids(o) for o in outs] == unbounded
        assert all(len(t) == MAX_TOKENS for t in unbounded) and all(o[-1].finish_reason == "length" for o in outs)
        assert sched.preemptions > 0 and preemptions_counted(srv) == sched.preemptions
        assert 0 < max(held) <= BUDGET and sched.kv_peak <= BUDGET
        await assert_nothing_held(srv)


async def test_a_request_that_could_never_fit_the_budget_is_refused_with_the_numbers(model_dir):
    async with stage_servers(lm(BUDGET), model_dir) as servers:
        srv = servers["llm"]
        too_long = header("long", prompt="", prompt_token_ids=[5] * PROMPT_TOKENS, max_tokens=5 * MAX_TOKENS)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call_stage(srv.port, too_long)
        need = KvPages(PER_TOKEN).bytes_for(PROMPT_TOKENS + 5 * MAX_TOKENS - 1)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (f"params.text.max_tokens: prompt ({PROMPT_TOKENS} tokens) plus max_tokens ({5 * MAX_TOKENS}) needs "
                f"{need} bytes of KV cache" in e.value.details())
        assert f"whole KV budget of {BUDGET} bytes" in e.value.details()
        assert len(token_ids(await call_stage(srv.port, request(0)))) == MAX_TOKENS  # one that fits still runs
        await assert_nothing_held(srv)


@pytest.mark.parametrize("value", [0, "1Gi"])
def test_a_bad_kv_cache_bytes_is_refused_naming_the_field(value):
    """By validation: the pipeline never loads (a stage started anyway refuses it too: tests/unit/test_kv_budget.py)."""
    with pytest.raises(SpecError, match=r"spec\.deployment\.stages\.llm\.engineArgs\.kvCacheBytes: expected a "
                                        r"positive integer"):
        lm(value)


def test_an_engine_that_does_not_bound_its_kv_refuses_a_budget(model_dir):
    """Validation refuses kvCacheBytes on a stage that keeps no KV (tests/unit/test_kv_budget.py); a stage
    started with one anyway (a file not validated) refuses it too, naming the field."""
    import dataclasses

    pipeline = example("qwen3-omni-tiny")
    dep = dataclasses.replace(pipeline.deployment.stages["code2wav"], engine_args={"kvCacheBytes": 1 << 20})
    deployment = dataclasses.replace(pipeline.deployment,
                                     stages={**pipeline.deployment.stages, "code2wav": dep})
    pipeline = dataclasses.replace(pipeline, deployment=deployment)
    with pytest.raises(EngineConfigError, match=r"spec\.deployment\.stages\.code2wav\.engineArgs\.kvCacheBytes: "
                                                r"this engine .* does not bound its KV cache"):
        create_engine(pipeline, pipeline.stage("code2wav"), model_dir)


@pytest.mark.parametrize("name, stage", [("llm-tiny", "llm"), ("qwen3-omni-tiny", "thinker"),
                                         ("qwen3-omni-tiny", "talker"), ("qwen2.5-omni-tiny", "talker")])
def test_on_a_gpu_the_budget_leaves_out_the_activations_the_memory_plan_counts(model_dir, name, stage):
    """One rule: what a stage leaves beside its KV budget for its largest step is the plan's activations."""
    from omnistage.checkpoints.plan import plan_stage

    pipeline = lm(None) if name == "llm-tiny" else example(name)
    engine = create_engine(pipeline, pipeline.stage(stage), model_dir)
    planned = plan_stage(pipeline, pipeline.stage(stage), model_dir)
    assert engine.step_activation_bytes() == planned.activation_bytes > 0
