"""The request limits a pipeline file leaves to the model (0) come from its checkpoints
(omnistage/checkpoints/defaults.py): the text stage's context, generation_config.json's max_new_tokens,
the denoiser's sample size x the VAE's scale, the published pipeline's steps. What the file sets is kept;
a checkpoint that cannot be read leaves the fallbacks, with a note naming it. The orchestrator reads them
at start without torch."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from omnistage.api import MODEL_LIMIT_FALLBACKS
from omnistage.checkpoints.defaults import with_model_limits
from omnistage.client import build_request
from omnistage.contract.launch import orchestrator_command, service_env
from omnistage.contract.params import resolve

from ..harness import example, hollow_store, write_pipeline
from ..polling import wait_until_sync

UNSET = {"max_tokens": 0, "default_max_tokens": 0, "default_image_side": 0, "default_inference_steps": 0}


def _unset(name: str, **engine_args):
    def edit(doc):
        limits = doc["spec"]["topology"].setdefault("limits", {})
        for key in ("maxTokens", "defaultMaxTokens", "defaultImageSide", "defaultInferenceSteps", "maxImageSide"):
            limits.pop(key, None)
        for sd in doc["spec"]["deployment"]["stages"].values():
            sd.setdefault("engineArgs", {}).pop("max_model_len", None)
            sd["engineArgs"].update(engine_args)
    return example(name, edit)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    # the examples' model names, at real size
    return hollow_store(tmp_path_factory.mktemp("store"), [("qwen3_omni", "qwen3-omni-tiny"), ("sd3", "sd3-tiny")])


def test_the_30b_thinkers_context_and_sd35s_image_come_from_the_checkpoints(store):
    pipeline, notes = with_model_limits(_unset("qwen3-omni-tiny"), store)
    thinker = json.loads((store / "qwen3-omni-tiny/config.json").read_text())["thinker_config"]["text_config"]
    assert pipeline.limits.max_tokens == thinker["max_position_embeddings"] == 65536
    assert pipeline.limits.default_max_tokens == MODEL_LIMIT_FALLBACKS["default_max_tokens"]  # none published
    assert any("max_position_embeddings" in n for n in notes) and any("the fallback" in n for n in notes)
    images, notes = with_model_limits(_unset("sd3-tiny"), store)
    assert (images.limits.default_image_side, images.limits.default_inference_steps) == (1024, 28)
    assert "transformer.sample_size 128 x the VAE's scale 8" in " ".join(notes)
    assert resolve(build_request("a cat").params, images.limits).width == 1024


def test_the_files_own_values_win_and_engine_args_set_the_context(store):
    kept, notes = with_model_limits(example("qwen3-omni-tiny"), store)
    assert (kept.limits.max_tokens, kept.limits.default_max_tokens) == (512, 16) and notes == []
    short, _ = with_model_limits(_unset("qwen3-omni-tiny", max_model_len=4096), store)
    assert short.limits.max_tokens == 4096
    sd3 = example("sd3-tiny")  # sets every image limit but the guidance, which is StableDiffusion3Pipeline's
    assert with_model_limits(sd3, store)[0].limits == dataclasses.replace(sd3.limits, default_guidance_scale=7.0)


def test_generation_configs_max_new_tokens_is_the_default_within_the_context(model_dir, tmp_path):
    shutil.copytree(model_dir / "qwen2-tiny", tmp_path / "qwen2-tiny")
    generation = tmp_path / "qwen2-tiny/generation_config.json"
    doc = json.loads(generation.read_text())
    generation.write_text(json.dumps({**doc, "max_new_tokens": 300}))
    pipeline, notes = with_model_limits(_unset("llm-tiny", max_model_len=1024), tmp_path)
    assert (pipeline.limits.max_tokens, pipeline.limits.default_max_tokens) == (1024, 300)
    assert f"limits.default_max_tokens = 300 (max_new_tokens of {generation})" in notes
    capped, _ = with_model_limits(_unset("llm-tiny", max_model_len=128), tmp_path)
    assert capped.limits.default_max_tokens == 128


def test_a_checkpoint_it_cannot_read_leaves_the_fallbacks_and_says_why(tmp_path):
    pipeline, notes = with_model_limits(_unset("sd3-tiny"), tmp_path)
    assert (pipeline.limits.default_image_side, pipeline.limits.default_inference_steps) == (0, 0)
    (note,) = notes
    assert note.startswith("denoise: ") and "no model_index.json" in note and "the fallbacks apply" in note
    assert resolve(build_request("a cat").params, pipeline.limits).width == 512  # the fallback


def test_the_orchestrator_reads_them_without_torch():
    code = ("import sys, orchestrator_service.server, omnistage.checkpoints.defaults; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_the_orchestrator_process_fills_them_from_its_model_store(model_dir, tmp_path):
    pipeline = _unset("qwen3-omni-tiny")
    path = write_pipeline(pipeline, tmp_path / "pipeline.yaml")
    ready, log = tmp_path / "ready", tmp_path / "orchestrator.log"
    endpoints = {s.name: ["127.0.0.1:9"] for s in pipeline.stages}  # nothing there: it starts all the same
    argv = orchestrator_command(path, stage_endpoints=endpoints, port=0, http_port=0, ready_file=ready)
    env = {**os.environ, **service_env(model_dir), "PYTHONPATH": str(Path(__file__).parents[2])}
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_sync(lambda: ready.exists() or proc.poll() is not None, timeout=60)
        assert proc.poll() is None, log.read_text()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    text = log.read_text()
    assert f"limits.max_tokens = 32768 (thinker's max_position_embeddings ({model_dir}" in text, text
