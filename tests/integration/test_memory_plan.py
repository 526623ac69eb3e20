"""The memory plan per stage on the tiny models and on the hollow Qwen3-Omni-30B-A3B layout: weights are
the bytes `models check` counts, in the stage's dtype; the Thinker's KV per token is the published config's;
a transformers AR stage's activations are its largest step's, and a diffusion, decoder or text-encoder
stage's are its largest step's shape from its config (vLLM stages and a UNet keep the estimate); and the
measured peaks of the tiny causal LM and the SD3 VAE (bench/real_scale_memory.py) hold at least their
weights (and the LM's the KV its context needs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from omnistage.checkpoints import plan as memory_plan
from omnistage.checkpoints.check import check_stage
from omnistage.checkpoints.configs import read_json
from omnistage.checkpoints.hollow import write_hollow
from omnistage.checkpoints.plan import ACTIVATION_FRACTION, ar_activation_bytes, ar_text_config, plan_stage
from omnistage.checkpoints.shards import ShardedCheckpoint

from ..conftest import EXAMPLES
from ..harness import example

REPO = Path(__file__).parents[2]
PUBLISHED_CONFIG = REPO / "omnistage/checkpoints/published/qwen3_omni/config.json"


def _with_dtype(name: str, dtype: str):
    def edit(doc):
        for sd in doc["spec"]["deployment"]["stages"].values():
            sd["dtype"] = dtype
    return example(name, edit)


@pytest.mark.parametrize("name", ["qwen3-omni-tiny", "llm-tiny"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weights_are_the_checked_bytes_in_the_stage_dtype(model_dir, name, dtype):
    pipeline = _with_dtype(name, dtype)
    for stage in pipeline.stages:
        load = check_stage(pipeline, stage, model_dir)
        stored = {info.dtype for info in load.tensors}
        assert stored == {"F32"}, stored  # the tiny models are stored in float32
        plan = plan_stage(pipeline, stage, model_dir)
        assert plan.weights_bytes == load.weight_bytes * {"float32": 4, "bfloat16": 2}[dtype] // 4
        assert (plan.kv_bytes_per_token > 0) == (stage.kind == "ar")


@pytest.fixture(scope="module")
def hollow_qwen3_omni(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hollow")
    write_hollow("qwen3_omni", root / "qwen3-omni-tiny")  # the example's model name
    return root


def test_the_30b_thinkers_kv_per_token_is_the_published_configs(hollow_qwen3_omni, monkeypatch):
    monkeypatch.setattr(ShardedCheckpoint, "_read", lambda *a: pytest.fail("read tensor data"))
    text = json.loads(PUBLISHED_CONFIG.read_text())["thinker_config"]["text_config"]
    assert (text["num_hidden_layers"], text["num_key_value_heads"], text["head_dim"]) == (48, 4, 128)
    pipeline = _with_dtype("qwen3-omni-tiny", "bfloat16")
    thinker = pipeline.stage("thinker")
    plan = plan_stage(pipeline, thinker, hollow_qwen3_omni)
    assert plan.kv_bytes_per_token == 48 * 4 * 128 * 2 * 2 == 98_304
    assert plan.context == text["max_position_embeddings"]  # the example sets no engineArgs.max_model_len
    assert plan.batch == pipeline.deployment.stages["thinker"].scheduler.max_batch
    load = check_stage(pipeline, thinker, hollow_qwen3_omni)
    assert {i.dtype for i in load.tensors} == {"BF16"}
    assert plan.weights_bytes == load.weight_bytes  # published in bf16: nothing to convert


def test_models_check_plan_prints_a_table(model_dir):
    args = ["models", "check", str(EXAMPLES / "llm-tiny.yaml"), "--plan", "--models", str(model_dir)]
    out = subprocess.run([sys.executable, "-m", "omnistage.local.cli", *args], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].split()[:2] == ["stage", "weights"]
    assert out.stdout.splitlines()[1].split()[0] == "llm"
    assert "estimate" in out.stdout


def _ar_edit(engine: str, context: int, batch: int, **engine_args):
    def edit(doc):
        doc["spec"]["topology"]["stages"][0]["engine"] = engine
        sd = doc["spec"]["deployment"]["stages"][doc["spec"]["topology"]["stages"][0]["name"]]
        sd.setdefault("scheduler", {})["maxBatch"] = batch
        sd.setdefault("engineArgs", {}).update(max_model_len=context, **engine_args)
    return edit


@pytest.mark.parametrize("name, engine, context, batch, engine_args, keeps_hidden", [
    ("llm-tiny", "transformers", 256, 32, {}, False),
    ("llm-tiny", "transformers", 512, 4, {}, False),
    ("llm-tiny", "transformers", 256, 2, {"batch_invariant": False}, False),
    ("qwen3-omni-tiny", "transformers", 256, 8, {}, True),
    ("qwen3-omni-tiny", "transformers", 256, 8, {"batch_invariant": False}, True),
    ("qwen2.5-omni-tiny", "transformers", 512, 8, {}, True),
])
def test_a_transformers_ar_stage_plans_its_largest_step(model_dir, name, engine, context, batch, engine_args,
                                                         keeps_hidden):
    pipeline = example(name, _ar_edit(engine, context, batch, **engine_args))
    stage = pipeline.stages[0]
    plan = plan_stage(pipeline, stage, model_dir)
    text = ar_text_config(read_json(model_dir / stage.model / "config.json"), stage.component)
    invariant = engine_args.get("batch_invariant", True)
    assert plan.activation_bytes == ar_activation_bytes(text, batch * context, batch, 4, invariant, keeps_hidden)
    assert plan.total_bytes == plan.weights_bytes + plan.kv_bytes + plan.activation_bytes
    # the largest step is every prompt at once: more sequences, more tokens in it
    twice = plan_stage(example(name, _ar_edit(engine, context, 2 * batch, **engine_args)), stage, model_dir)
    assert twice.activation_bytes > plan.activation_bytes


def test_batch_invariant_experts_hold_their_gathered_weights(model_dir):
    """Qwen3-Omni's batch-invariant experts gather each (token, expert) pair's gate-up and down projections."""
    plans = [plan_stage(p, p.stages[0], model_dir) for p in
             (example("qwen3-omni-tiny", _ar_edit("transformers", 256, 8, batch_invariant=b)) for b in (True, False))]
    text = ar_text_config(read_json(model_dir / "qwen3-omni-tiny/config.json"), "thinker")
    gathered = 8 * 256 * text["num_experts_per_tok"] * text["hidden_size"] * 3 * text["moe_intermediate_size"] * 4
    padded_logits = (16 - 8) * text["vocab_size"] * 4  # the head's rows padded to 16 for invariance only
    assert plans[0].activation_bytes - plans[1].activation_bytes == gathered + padded_logits


def test_vllm_stages_and_a_unet_keep_the_estimate(model_dir):
    vllm = example("llm-tiny")  # vLLM sizes its own activations: not modelled here
    sd = example("text-to-image-tiny")
    for pipeline, stage in ((vllm, vllm.stage("llm")), (sd, sd.stage("denoise"))):
        plan = plan_stage(pipeline, stage, model_dir)
        assert plan.activation_bytes == int(plan.weights_bytes * ACTIVATION_FRACTION), stage.name


def _deployment_edit(stage: str, side: int | None = None, batch: int | None = None, **engine_args):
    def edit(doc):
        if side is not None:
            doc["spec"]["topology"]["limits"]["defaultImageSide"] = side
        sd = doc["spec"]["deployment"]["stages"][stage]
        if batch is not None:
            sd.setdefault("scheduler", {})["maxBatch"] = batch
        sd.setdefault("engineArgs", {}).update(engine_args)
    return edit


def _activations(model_dir, name: str, stage: str, **edit) -> int:
    pipeline = example(name, _deployment_edit(stage, **edit))
    return plan_stage(pipeline, pipeline.stage(stage), model_dir).activation_bytes


@pytest.mark.parametrize("name, stage", [("sd3-tiny", "text-encoder"), ("sd3-tiny", "denoise"),
                                         ("sd3-tiny", "vae-decode"), ("text-to-image-tiny", "text-encoder"),
                                         ("text-to-image-tiny", "vae-decode")])
def test_a_diffusers_stage_plans_its_largest_step_from_its_config(model_dir, name, stage):
    """maxBatch images (two prompt rows each under the default guidance) at the default image side."""
    pipeline = example(name)
    plan = plan_stage(pipeline, pipeline.stage(stage), model_dir)
    assert plan.activation_bytes != int(plan.weights_bytes * ACTIVATION_FRACTION)
    assert plan.total_bytes == plan.weights_bytes + plan.activation_bytes
    root = model_dir / pipeline.stage(stage).model
    batch = pipeline.deployment.stages[stage].scheduler.max_batch
    side = pipeline.limits.default_image_side
    if stage == "vae-decode":
        channels = read_json(root / "vae/config.json")["block_out_channels"][0]
        expected = memory_plan.VAE_DECODER_WIDTHS * batch * side * side * channels * 4
    elif stage == "denoise":
        dit = read_json(root / "transformer/config.json")
        expected = memory_plan.dit_bytes_per_row(dit, side, root) * batch * 2 * 4
    else:
        expected = memory_plan.text_encoder_bytes_per_prompt(root) * batch * 2 * 4
    assert plan.activation_bytes == int(expected) + memory_plan.STEP_WORKSPACE_BYTES
    twice = _activations(model_dir, name, stage, batch=2 * batch)
    assert twice - memory_plan.STEP_WORKSPACE_BYTES == pytest.approx(
        2 * (plan.activation_bytes - memory_plan.STEP_WORKSPACE_BYTES), abs=2)
    if stage != "text-encoder":  # four times the pixels: four times the feature maps, or the DiT's image tokens
        larger = _activations(model_dir, name, stage, side=2 * side) - memory_plan.STEP_WORKSPACE_BYTES
        assert larger > (3 if stage == "vae-decode" else 2) * (plan.activation_bytes - memory_plan.STEP_WORKSPACE_BYTES)


@pytest.mark.parametrize("name, stage", [("qwen3-omni-tiny", "code2wav"), ("qwen2.5-omni-tiny", "token2wav")])
def test_an_audio_decoder_plans_the_chunks_of_its_largest_step(model_dir, name, stage):
    """On the CPU its default frames per step bound the chunks; engineArgs.max_batched_frames sets them. A
    convolution's batch is padded to MIN_CONV_BATCH: one chunk costs what two do (Code2Wav's default is two)."""
    default = _activations(model_dir, name, stage)
    one_chunk = _activations(model_dir, name, stage, max_batched_frames=1)
    every_chunk = _activations(model_dir, name, stage, max_batched_frames=1 << 20)
    assert one_chunk <= default < every_chunk
    assert _activations(model_dir, name, stage, batch=16, max_batched_frames=1 << 20) > every_chunk


def test_an_editing_encoder_plans_the_image_to_edit_at_its_largest_kontext_resolution(model_dir):
    """The image to edit is encoded at a preferred Kontext resolution (about 1 MP) whatever the size made."""
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

    assert memory_plan.EDIT_IMAGE_PIXELS == max(w * h for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
    pipeline = example("flux-kontext-tiny")
    plan = plan_stage(pipeline, pipeline.stage("image-encoder"), model_dir)
    channels = read_json(model_dir / "flux-kontext-tiny" / "vae/config.json")["block_out_channels"][0]
    batch = pipeline.deployment.stages["image-encoder"].scheduler.max_batch
    expected = memory_plan.VAE_DECODER_WIDTHS * batch * memory_plan.EDIT_IMAGE_PIXELS * channels * 4
    assert plan.activation_bytes == int(expected) + memory_plan.STEP_WORKSPACE_BYTES
    assert _activations(model_dir, "flux-kontext-tiny", "image-encoder", side=128) == plan.activation_bytes


def test_the_plans_engine_constants_are_the_engines():
    from stage_service.engines.diffusers.text import SD3_T5_TOKENS
    from stage_service.engines.qwen2_5_omni.engines import Token2WavEngine
    from stage_service.engines.qwen2_5_omni.token2wav import Token2Wav
    from stage_service.engines.qwen3_omni.engines import Code2WavEngine
    from stage_service.engines.qwen3_omni.steps import Code2Wav
    from stage_service.runtime.invariance import MIN_CONV_BATCH

    assert memory_plan.CODE2WAV_LEFT_CONTEXT == Code2Wav.LEFT_CONTEXT
    assert memory_plan.TOKEN2WAV_WINDOW_BLOCKS == Token2Wav.LEFT_BLOCKS + Token2Wav.RIGHT_BLOCKS
    assert memory_plan.CPU_MAX_BATCHED_FRAMES == {"code2wav": Code2WavEngine.CPU_MAX_BATCHED_FRAMES,
                                                  "token2wav": Token2WavEngine.CPU_MAX_BATCHED_FRAMES}
    assert memory_plan.SD3_T5_TOKENS == SD3_T5_TOKENS
    assert memory_plan.MIN_CONV_BATCH == MIN_CONV_BATCH


def test_the_sd3_vaes_measured_peak_holds_its_weights(model_dir):
    """The quick measurement of a decoder stage (a process of its own): maxBatch latents decoded at once hold at
    least the VAE's weights, and more than the weights alone (the step's feature maps)."""
    sys.path.insert(0, str(REPO / "bench"))
    from real_scale_memory import CASES, QUICK_CONTEXT, case_pipeline, measure

    case = next(c for c in CASES if (c.family, c.stage) == ("sd3", "vae-decode"))
    got = measure(case, QUICK_CONTEXT, model_dir)
    pipeline = case_pipeline(case, QUICK_CONTEXT)
    plan = plan_stage(pipeline, pipeline.stage(case.stage), model_dir)
    assert got["steps"] == 1 and got["batch"] == plan.batch
    assert got["peak_bytes"] >= plan.weights_bytes
    assert got["peak_bytes"] - got["loaded_bytes"] > memory_plan.VAE_DECODER_WIDTHS * plan.batch * 64 * 64 * 16 * 4 / 2


def test_the_causal_lms_measured_peak_holds_its_weights_and_kv(model_dir):
    """The quick measurement of bench/real_scale_memory.py (a process of its own): maxBatch sequences at the
    plan's context hold at least the weights and the KV their tokens need, at the peak."""
    sys.path.insert(0, str(REPO / "bench"))
    from real_scale_memory import CASES, QUICK_CONTEXT, case_pipeline, measure

    case = next(c for c in CASES if c.family == "causal_lm")
    got = measure(case, QUICK_CONTEXT, model_dir)
    pipeline = case_pipeline(case, QUICK_CONTEXT)
    plan = plan_stage(pipeline, pipeline.stage(case.stage), model_dir)
    assert got["steps"] > 1 and got["batch"] == plan.batch
    assert got["peak_bytes"] > 0
    assert got["peak_bytes"] >= plan.weights_bytes
    # every sequence's cache holds its prompt and all but its last token, in every layer
    assert got["kv_held_bytes"] >= plan.kv_bytes_per_token * plan.batch * (plan.context - 1)
    assert got["peak_bytes"] >= plan.weights_bytes + got["kv_held_bytes"]


def test_a_kv_budget_bounds_the_planned_kv(model_dir):
    def budgeted(doc):
        doc["spec"]["topology"]["stages"][0]["engine"] = "transformers"
        doc["spec"]["deployment"]["stages"]["llm"]["engineArgs"] = {"kvCacheBytes": 1 << 20}
    pipeline = example("llm-tiny", budgeted)
    plan = plan_stage(pipeline, pipeline.stage("llm"), model_dir)
    assert plan.kv_bounded and plan.kv_bytes == 1 << 20 < plan.kv_bytes_per_token * plan.context * plan.batch
    assert plan.total_bytes == plan.weights_bytes + (1 << 20) + plan.activation_bytes
    unbudgeted = example("llm-tiny", lambda d: d["spec"]["topology"]["stages"][0].update(engine="transformers"))
    assert not plan_stage(unbudgeted, unbudgeted.stage("llm"), model_dir).kv_bounded


def test_models_check_plan_annotate_writes_a_manifest_the_operator_and_validation_read(model_dir, tmp_path):
    """`--annotate`: the pipeline with its plan in `omnistage.io/memory-plan` on stdout (the table on stderr);
    it validates, the operator requests the planned memory, and a memory limit below the plan is refused."""
    import yaml

    from omnistage.api import parse_pipeline, validate
    from omnistage.api.memory_plan import ANNOTATION_MEMORY_PLAN
    from omnistage_operator.builders import build_stage_deployment, stage_plan
    from omnistage_operator.config import OperatorConfig

    args = ["models", "check", str(EXAMPLES / "qwen3-omni-tiny.yaml"), "--plan", "--annotate", "--models",
            str(model_dir)]
    out = subprocess.run([sys.executable, "-m", "omnistage.local.cli", *args], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines()[0].split()[:2] == ["stage", "weights"]
    doc = yaml.safe_load(out.stdout)
    plan = json.loads(doc["metadata"]["annotations"][ANNOTATION_MEMORY_PLAN])
    pipeline = example("qwen3-omni-tiny")
    assert plan == {s.name: plan_stage(pipeline, s, model_dir).total_bytes for s in pipeline.stages}
    assert validate(doc) == []
    annotated = parse_pipeline(doc)
    assert stage_plan(annotated, "talker") == plan["talker"]
    del doc["spec"]["deployment"]["stages"]["talker"]["resources"]["requests"]["memory"]
    talker = build_stage_deployment(parse_pipeline(doc), "talker", OperatorConfig())
    assert talker["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["memory"] == (
        f"{-(-plan['talker'] // (1 << 20))}Mi")
    doc["spec"]["deployment"]["stages"]["talker"]["resources"]["limits"] = {"memory": "1Mi"}
    assert [e.path for e in validate(doc)] == ["spec.deployment.stages.talker.resources.limits.memory"]
    bad = subprocess.run([sys.executable, "-m", "omnistage.local.cli", "models", "check",
                          str(EXAMPLES / "qwen3-omni-tiny.yaml"), "--annotate"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "--annotate goes with --plan" in bad.stderr
