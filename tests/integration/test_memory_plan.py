"""The memory plan per stage on the tiny models and on the hollow Qwen3-Omni-30B-A3B layout: weights are
the bytes `models check` counts, in the stage's dtype; the Thinker's KV per token is the published config's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from omnistage.checkpoints.check import check_stage
from omnistage.checkpoints.hollow import write_hollow
from omnistage.checkpoints.plan import plan_stage
from omnistage.checkpoints.shards import ShardedCheckpoint

from ..conftest import EXAMPLES
from ..harness import example

PUBLISHED_CONFIG = Path(__file__).parents[2] / "omnistage/checkpoints/published/qwen3_omni/config.json"


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
