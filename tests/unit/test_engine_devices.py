"""Every engine runs on the device its stage is given: the device plan as table tests, a stage that asks
for GPUs on this CPU-only host refused at construction (and served on the CPU with `device: cpu`),
explicit dtypes honoured on the CPU, the vLLM placement checks; and, where CUDA is present, an engine on
the GPU giving the CPU's greedy tokens in float32."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from omnistage.api import Parallelism, StageDeployment
from omnistage.api.model import VLLM_ARGS_OF_FIELDS
from omnistage.contract.devices import DevicePlan, DeviceUnavailable, plan_device
from stage_service.engines.registry import create_engine
from stage_service.engines.vllm.ar import check_build, check_experts, check_quantization, engine_args
from stage_service.runtime.base import EngineConfigError
from stage_service.runtime.invariance import applies_on
from stage_service.runtime.sampling import SamplingSettings

from ..harness import call_stage, example, header, start_stage, token_ids

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
no_cuda_here = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a host without CUDA")


def sd(gpus: int = 0, device: str = "auto", dtype: str = "auto", fraction: float = 0.0) -> StageDeployment:
    return StageDeployment(gpus=gpus, device=device, dtype=dtype, gpu_memory_fraction=fraction)


# (case, deployment, CUDA devices the process sees, expected plan)
PLANS = [
    ("no gpus, no CUDA", sd(), 0, DevicePlan("cpu", "float32")),
    ("no gpus on a CUDA host: the CPU", sd(), 2, DevicePlan("cpu", "float32")),
    ("one gpu", sd(1), 1, DevicePlan("cuda", "bfloat16", 1)),
    ("one gpu of two seen", sd(1), 2, DevicePlan("cuda", "bfloat16", 1)),
    ("two gpus", sd(2), 2, DevicePlan("cuda", "bfloat16", 2)),
    ("device cpu without CUDA", sd(1, "cpu"), 0, DevicePlan("cpu", "float32")),
    ("device cpu on a CUDA host", sd(2, "cpu"), 2, DevicePlan("cpu", "float32")),
    ("explicit dtype on the GPU", sd(1, dtype="float16"), 1, DevicePlan("cuda", "float16", 1)),
    ("explicit float32 on the GPU", sd(1, dtype="float32"), 1, DevicePlan("cuda", "float32", 1)),
    ("explicit dtype on the CPU", sd(dtype="bfloat16"), 0, DevicePlan("cpu", "bfloat16")),
    ("explicit dtype, device cpu", sd(1, "cpu", "bfloat16"), 1, DevicePlan("cpu", "bfloat16")),
    ("memory fraction carried", sd(1, fraction=0.4), 1, DevicePlan("cuda", "bfloat16", 1, 0.4)),
    ("memory fraction of two gpus", sd(2, fraction=0.5), 2, DevicePlan("cuda", "bfloat16", 2, 0.5)),
]


@pytest.mark.parametrize("case, deployment, cuda, expected", PLANS, ids=[p[0] for p in PLANS])
def test_plan(case, deployment, cuda, expected):
    plan = plan_device("llm", deployment, cuda)
    assert plan == expected
    assert plan.on_cuda == (expected.device == "cuda")


# (case, deployment, CUDA devices seen, what the refusal says)
REFUSED = [
    ("one gpu, no CUDA", sd(1), 0, "asks for 1 GPU(s) but this process sees no CUDA device"),
    ("two gpus, no CUDA", sd(2), 0, "asks for 2 GPU(s) but this process sees no CUDA device"),
    ("two gpus, one seen", sd(2), 1, "asks for 2 GPU(s) but this process sees only 1 CUDA device(s)"),
    ("fraction changes nothing", sd(1, fraction=0.5), 0, "sees no CUDA device"),
]


@pytest.mark.parametrize("case, deployment, cuda, says", REFUSED, ids=[r[0] for r in REFUSED])
def test_plan_refused(case, deployment, cuda, says):
    with pytest.raises(DeviceUnavailable) as e:
        plan_device("talker", deployment, cuda)
    msg = str(e.value)
    assert says in msg and "\n" not in msg
    assert msg.startswith("spec.deployment.stages.talker.gpus ")
    assert "spec.deployment.stages.talker.device: cpu" in msg


def on_gpus(stage: str, gpus: int = 1, **fields):
    """A pipeline edit giving `stage` GPUs (and other deployment fields, as the spec spells them)."""
    def edit(doc):
        doc["spec"]["deployment"]["stages"][stage].update(gpus=gpus, **fields)
    return edit


def llm_transformers(edit=None):
    """The tiny LM example on the transformers causal-LM engine."""
    def both(doc):
        doc["spec"]["topology"]["stages"][0]["engine"] = "transformers"
        if edit:
            edit(doc)
    return example("llm-tiny", both)


def pipeline_of(name: str, edit):
    return llm_transformers(edit) if name == "llm-tiny" else example(name, edit)


# (case, example, stage): a stage of each engine family, to be given one GPU.
GPU_STAGES = [
    ("causal-lm", "llm-tiny", "llm"),
    ("qwen3-omni thinker", "qwen3-omni-tiny", "thinker"),
    ("qwen3-omni talker", "qwen3-omni-tiny", "talker"),
    ("qwen3-omni code2wav", "qwen3-omni-tiny", "code2wav"),
    ("qwen2.5-omni token2wav", "qwen2.5-omni-tiny", "token2wav"),
    ("diffusers text encoder", "text-to-image-tiny", "text-encoder"),
    ("diffusers denoiser", "text-to-image-tiny", "denoise"),
    ("diffusers vae", "text-to-image-tiny", "vae-decode"),
]


@no_cuda_here
@pytest.mark.parametrize("case, name, stage", GPU_STAGES, ids=[s[0] for s in GPU_STAGES])
def test_a_stage_with_gpus_refuses_to_construct_without_cuda(case, name, stage, model_dir):
    p = pipeline_of(name, on_gpus(stage))
    with pytest.raises(EngineConfigError) as e:
        create_engine(p, p.stage(stage), model_dir)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"spec.deployment.stages.{stage}.gpus" in msg and f"spec.deployment.stages.{stage}.device: cpu" in msg


@pytest.mark.parametrize("case, name, stage", GPU_STAGES, ids=[s[0] for s in GPU_STAGES])
def test_device_cpu_places_a_stage_with_gpus_on_the_cpu(case, name, stage, model_dir):
    p = pipeline_of(name, on_gpus(stage, device="cpu"))
    engine = create_engine(p, p.stage(stage), model_dir)
    assert engine.placement == DevicePlan("cpu", "float32")
    assert engine.device == torch.device("cpu") and engine.dtype == torch.float32


async def test_device_cpu_loads_and_serves_on_the_cpu(model_dir):
    """A causal-LM stage with `gpus: 1, device: cpu` loads on the CPU and gives the greedy tokens of the same
    stage without GPUs."""
    prompt = header("r", prompt="The probe", max_tokens=12, ignore_eos=True)
    results = []
    for edit in (None, on_gpus("llm", device="cpu")):
        srv = await start_stage(llm_transformers(edit), "llm", model_dir)
        try:
            assert srv.engine.placement.device == "cpu"
            assert {t.device.type for t in srv.engine.lm.model.parameters()} == {"cpu"}
            results.append(token_ids(await call_stage(srv.port, prompt)))
        finally:
            await srv.drain()
    assert len(results[0]) == 12 and results[1] == results[0]


def with_dtype(stage: str, dtype: str):
    def edit(doc):
        doc["spec"]["deployment"]["stages"][stage]["dtype"] = dtype
    return edit


def test_explicit_bfloat16_loads_the_causal_lm_in_bfloat16_on_the_cpu(model_dir):
    p = llm_transformers(with_dtype("llm", "bfloat16"))
    engine = create_engine(p, p.stage("llm"), model_dir)
    assert engine.placement == DevicePlan("cpu", "bfloat16")
    engine.load()
    assert {t.dtype for t in engine.lm.model.parameters()} == {torch.bfloat16}
    assert {t.device.type for t in engine.lm.model.parameters()} == {"cpu"}
    [step] = engine.step([engine.lm.new_state([1, 2, 3], SamplingSettings(), max_tokens=2)])  # and it decodes
    assert 0 <= step.token < engine.vocab


@pytest.mark.parametrize("stage, weights", [("vae-decode", lambda e: e.vae), ("denoise", lambda e: e.model)])
def test_explicit_bfloat16_loads_a_diffusers_stage_in_bfloat16_on_the_cpu(stage, weights, model_dir):
    p = example("text-to-image-tiny", with_dtype(stage, "bfloat16"))
    engine = create_engine(p, p.stage(stage), model_dir)
    engine.load()
    params = list(weights(engine).parameters())
    assert {t.dtype for t in params} == {torch.bfloat16}
    assert {t.device.type for t in params} == {"cpu"}


def test_auto_dtype_on_the_cpu_is_float32(model_dir):
    p = example("text-to-image-tiny")
    engine = create_engine(p, p.stage("text-encoder"), model_dir)
    engine.load()
    assert {t.dtype for t in engine.encoder.encoder.parameters()} == {torch.float32}


# ------------------------------------------------------------------ vLLM

def vllm_settings(dtype: str = "auto", tensor: int = 1, pipeline: int = 1) -> StageDeployment:
    return StageDeployment(dtype=dtype, parallelism=Parallelism(tensor=tensor, pipeline=pipeline))


@pytest.mark.parametrize("plan, dtype, eager, utilization", [
    (DevicePlan("cpu", "float32"), "float32", True, None),
    (DevicePlan("cuda", "bfloat16", 1), "bfloat16", False, None),
    (DevicePlan("cuda", "float16", 2, 0.45), "float16", False, 0.45),
])
def test_vllm_engine_args_follow_the_plan(plan, dtype, eager, utilization):
    args = engine_args("/m", vllm_settings(tensor=plan.gpus or 1), plan)
    assert args["dtype"] == dtype and args["enforce_eager"] is eager
    assert args.get("gpu_memory_utilization") == utilization
    assert args["tensor_parallel_size"] == (plan.gpus or 1)


def test_vllm_engine_args_let_engine_args_override():
    args = engine_args("/m", StageDeployment(engine_args={"gpu_memory_utilization": 0.3}),
                       DevicePlan("cuda", "bfloat16", 1, 0.5))
    assert args["gpu_memory_utilization"] == 0.3


@pytest.mark.parametrize("parallelism, quantization, expected", [
    (Parallelism(), "", {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1,
                         "enable_expert_parallel": False}),
    (Parallelism(tensor=2, data=4), "", {"tensor_parallel_size": 2, "data_parallel_size": 4}),
    (Parallelism(tensor=2, data=2, expert=True), "", {"data_parallel_size": 2, "enable_expert_parallel": True}),
    (Parallelism(), "fp8", {"quantization": "fp8"}),
], ids=["defaults", "data-4", "expert", "fp8"])
def test_vllm_engine_args_carry_parallelism_and_quantization(parallelism, quantization, expected):
    args = engine_args("/m", StageDeployment(parallelism=parallelism, quantization=quantization),
                       DevicePlan("cuda", "bfloat16", parallelism.tensor * parallelism.data))
    assert {k: args[k] for k in expected} == expected
    assert ("quantization" in args) == bool(quantization)   # unset: vLLM reads the checkpoint's own


def test_every_engine_argument_a_field_owns_is_built_from_it():
    args = engine_args("/m", StageDeployment(quantization="fp8"), DevicePlan("cpu", "float32"))
    assert set(VLLM_ARGS_OF_FIELDS) <= set(args)


def test_vllm_engine_args_name_real_async_engine_args_fields():
    arg_utils = pytest.importorskip("vllm.engine.arg_utils")
    known = {f.name for f in dataclasses.fields(arg_utils.AsyncEngineArgs)}
    assert set(VLLM_ARGS_OF_FIELDS) <= known


def test_an_unknown_quantization_method_is_refused_naming_the_known_ones():
    quantization = pytest.importorskip("vllm.model_executor.layers.quantization")
    check_quantization("llm", "", quantization.QUANTIZATION_METHODS)       # unset
    check_quantization("llm", "fp8", quantization.QUANTIZATION_METHODS)
    with pytest.raises(EngineConfigError) as e:
        check_quantization("llm", "int3", quantization.QUANTIZATION_METHODS)
    msg = str(e.value)
    assert msg.startswith('spec.deployment.stages.llm.quantization: "int3" is not a quantization method of the '
                          "vLLM installed here; known: ") and "\n" not in msg
    assert all(m in msg for m in ("awq", "fp8", "gptq"))


async def test_a_vllm_stage_refuses_an_unknown_quantization_at_start_before_loading(model_dir, monkeypatch):
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")   # what start() sets, undone after
    p = example("llm-tiny", lambda doc: doc["spec"]["deployment"]["stages"]["llm"].update(quantization="int3"))
    engine = create_engine(p, p.stage("llm"), model_dir)
    with pytest.raises(EngineConfigError, match=r'stages\.llm\.quantization: "int3" .* known: .*fp8'):
        await engine.start()
    assert not hasattr(engine, "llm")   # refused before vLLM started


async def test_a_vllm_stage_refuses_expert_parallelism_for_a_dense_model_at_start(model_dir, monkeypatch):
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")   # what start() sets, undone after
    p = example("llm-tiny", lambda doc: doc["spec"]["deployment"]["stages"]["llm"].update(
        parallelism={"tensor": 2, "expert": True}))
    engine = create_engine(p, p.stage("llm"), model_dir)
    with pytest.raises(EngineConfigError, match=r"stages\.llm\.parallelism\.expert: the model's config\.json "
                                                "counts no experts"):
        await engine.start()
    assert not hasattr(engine, "llm")


@pytest.mark.parametrize("config, refused", [
    ({"num_experts": 4}, False),
    ({"thinker_config": {"text_config": {"num_experts": 128}}}, False),     # a combined omni checkpoint
    ({"num_local_experts": 8}, False),
    ({"n_routed_experts": 256}, False),
    ({"num_experts": 1}, True),
    ({"hidden_size": 64, "num_experts_per_tok": 2}, True),
    ({}, True),
], ids=["qwen-moe", "omni-nested", "mixtral", "deepseek", "one-expert", "dense", "no-config"])
def test_expert_parallelism_is_refused_for_a_model_without_experts(config, refused):
    check_experts("llm", False, config)      # off: never refused
    if not refused:
        check_experts("llm", True, config)
        return
    with pytest.raises(EngineConfigError) as e:
        check_experts("llm", True, config)
    assert str(e.value).startswith("spec.deployment.stages.llm.parallelism.expert: the model's config.json "
                                   "counts no experts")


@pytest.mark.parametrize("plan, build, says", [
    (DevicePlan("cpu", "float32"), "cpu", None),
    (DevicePlan("cuda", "bfloat16", 1), "cuda", None),
    (DevicePlan("cpu", "float32"), "cuda", "runs on the CPU (gpus: 0 or device: cpu) but the vLLM installed "
                                           "here is a cuda build"),
    (DevicePlan("cuda", "bfloat16", 1), "cpu", "spec.deployment.stages.llm.gpus asks for GPUs but the vLLM "
                                               "installed here is a cpu build"),
])
def test_vllm_refuses_a_placement_its_build_cannot_run(plan, build, says):
    if says is None:
        check_build("llm", plan, build)
        return
    with pytest.raises(EngineConfigError) as e:
        check_build("llm", plan, build)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_batch_invariance_pads_on_both_devices():
    assert applies_on(DevicePlan("cpu", "float32"))
    assert applies_on(DevicePlan("cuda", "bfloat16", 1))


# ------------------------------------------------------------------ CUDA

def float32_on_gpu(stage: str):
    return on_gpus(stage, dtype="float32")


@needs_cuda
async def test_causal_lm_on_cuda_gives_the_cpu_s_greedy_tokens(model_dir):
    prompt = header("r", prompt="The probe", max_tokens=12, ignore_eos=True)
    results = []
    for edit, device in ((None, "cpu"), (float32_on_gpu("llm"), "cuda")):
        srv = await start_stage(llm_transformers(edit), "llm", model_dir)
        try:
            assert next(srv.engine.lm.model.parameters()).device.type == device
            results.append(token_ids(await call_stage(srv.port, prompt)))
        finally:
            await srv.drain()
    assert len(results[0]) == 12 and results[1] == results[0]


@needs_cuda
async def test_qwen3_omni_thinker_on_cuda_gives_the_cpu_s_greedy_tokens(model_dir):
    prompt = header("r", prompt="Say something", max_tokens=8, ignore_eos=True)
    results = []
    for edit, device in ((None, "cpu"), (float32_on_gpu("thinker"), "cuda")):
        srv = await start_stage(example("qwen3-omni-tiny", edit), "thinker", model_dir)
        try:
            assert next(srv.engine.thinker.model.parameters()).device.type == device
            chunks = await call_stage(srv.port, prompt)
            results.append(token_ids(chunks))
        finally:
            await srv.drain()
    assert len(results[0]) == 8 and results[1] == results[0]


@pytest.mark.parametrize("config, context", [
    ({"max_position_embeddings": 32768}, 32768),
    ({"text_config": {"max_position_embeddings": 40960}}, 40960),
    ({"thinker_config": {"text_config": {"max_position_embeddings": 65536}}}, 65536),
    ({"model_type": "gguf-like"}, None),
])
def test_a_vllm_stage_takes_its_context_from_the_checkpoint_unless_engine_args_set_one(config, context):
    from stage_service.engines.vllm.ar import context_length, engine_args

    assert context_length(config) == context
    plan = DevicePlan("cpu", "float32")
    args = engine_args("/m", StageDeployment(), plan, context=context_length(config))
    assert args.get("max_model_len") == context   # absent: vLLM reads the model's own
    assert engine_args("/m", StageDeployment(engine_args={"max_model_len": 512}), plan,
                       context=context_length(config))["max_model_len"] == 512
