"""`omnistage models check` (and the same check in `serve` and the stage service) on the tiny models in
their published layouts, and on broken copies of them: one line naming the stage, the file or key."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from omnistage.checkpoints.check import StageCheckError, check_pipeline, check_stage
from omnistage.checkpoints.shards import ShardedCheckpoint
from omnistage.contract import launch

from ..conftest import EXAMPLES
from ..harness import example


def _set_model(name: str, stage: str, model: str, component: str | None = None):
    def edit(doc):
        for s in doc["spec"]["topology"]["stages"]:
            if s["name"] == stage:
                s["model"] = model
                if component is not None:
                    s["component"] = component
    return example(name, edit)


@pytest.fixture
def lm_copy(model_dir, tmp_path):
    shutil.copytree(model_dir / "qwen2-tiny", tmp_path / "qwen2-tiny")
    return tmp_path / "qwen2-tiny"


def _refusal(pipeline, stage: str, root) -> StageCheckError:
    with pytest.raises(StageCheckError) as e:
        check_stage(pipeline, pipeline.stage(stage), root)
    return e.value


def test_every_tiny_example_passes_with_its_files_and_bytes(model_dir):
    for path in sorted(EXAMPLES.glob("*-tiny.yaml")):  # the real-size ones: test_real_size_examples.py
        pipeline = example(path.stem)
        plans, errors = check_pipeline(pipeline, model_dir)
        assert errors == [], path.name
        for plan in plans:
            assert plan.weight_bytes > 0 and plan.device == "cpu"
            for name, n in plan.weights:
                assert (plan.directory / name).is_file() and n > 0


def test_a_stage_of_a_combined_checkpoint_counts_only_its_part(model_dir):
    pipeline = example("qwen3-omni-tiny")
    plans = {p.stage: p for p in check_pipeline(pipeline, model_dir)[0]}
    ckpt = ShardedCheckpoint(model_dir / "qwen3-omni-tiny")
    for stage, prefix in (("thinker", "thinker."), ("talker", "talker."), ("code2wav", "code2wav.")):
        assert plans[stage].weight_bytes == ckpt.nbytes(prefix)
    assert sum(p.weight_bytes for p in plans.values()) == ckpt.nbytes("")


def test_the_published_lm_is_sharded_with_an_index(model_dir):
    plan = check_pipeline(example("llm-tiny"), model_dir)[0][0]
    assert len(plan.weights) >= 2
    assert "model.safetensors.index.json" in {f.name for f in (model_dir / "qwen2-tiny").iterdir()}


def test_not_a_model_directory(tmp_path):
    (tmp_path / "qwen2-tiny").mkdir()
    e = _refusal(example("llm-tiny"), "llm", tmp_path)
    assert e.field == "spec.topology.stages[0].model" and e.stage == "llm"
    assert "qwen2-tiny: no config.json (not a checkpoint)" in str(e)
    e = _refusal(example("llm-tiny"), "llm", tmp_path / "absent")
    assert "no such model directory" in str(e)


def test_truncated_shard(lm_copy):
    shard = sorted(lm_copy.glob("model-*.safetensors"))[-1]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    e = _refusal(example("llm-tiny"), "llm", lm_copy.parent)
    assert f"{shard}: truncated" in str(e)


def test_index_naming_a_missing_shard(lm_copy):
    shard = sorted(lm_copy.glob("model-*.safetensors"))[0]
    shard.unlink()
    e = _refusal(example("llm-tiny"), "llm", lm_copy.parent)
    assert f"model.safetensors.index.json: names shard {shard.name}, which is missing" in str(e)


def test_index_placing_a_tensor_in_a_shard_without_it(lm_copy):
    index_file = lm_copy / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["model.layers.99.mlp.up_proj.weight"] = sorted(set(index["weight_map"].values()))[0]
    index_file.write_text(json.dumps(index))
    e = _refusal(example("llm-tiny"), "llm", lm_copy.parent)
    assert "model.layers.99.mlp.up_proj.weight" in str(e) and "shard has no such tensor" in str(e)


def test_unknown_architecture(lm_copy):
    cfg = json.loads((lm_copy / "config.json").read_text())
    cfg["architectures"] = ["WhisperForConditionalGeneration"]
    (lm_copy / "config.json").write_text(json.dumps(cfg))
    e = _refusal(example("llm-tiny"), "llm", lm_copy.parent)
    assert "architecture WhisperForConditionalGeneration is not one omnistage serves" in str(e)
    assert "Qwen3OmniMoeForConditionalGeneration" in str(e)   # it says what is served


def test_a_component_the_architecture_does_not_have(lm_copy):
    pipeline = _set_model("qwen3-omni-tiny", "talker", str(lm_copy))
    e = _refusal(pipeline, "talker", None)
    assert e.field == "spec.topology.stages[1].model"
    assert 'Qwen2ForCausalLM has no component "talker" to serve' in str(e)


def test_a_config_key_the_engine_needs(lm_copy):
    cfg = json.loads((lm_copy / "config.json").read_text())
    del cfg["num_hidden_layers"]
    (lm_copy / "config.json").write_text(json.dumps(cfg))
    e = _refusal(example("llm-tiny"), "llm", lm_copy.parent)
    assert f"{lm_copy / 'config.json'}: missing key num_hidden_layers" in str(e)


def test_a_missing_tokenizer(lm_copy):
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (lm_copy / f).unlink()
    assert "no tokenizer" in str(_refusal(example("llm-tiny"), "llm", lm_copy.parent))


def test_a_diffusers_pipeline_without_the_component(model_dir, tmp_path):
    shutil.copytree(model_dir / "sd-tiny", tmp_path / "sd-tiny")
    shutil.rmtree(tmp_path / "sd-tiny" / "vae")
    e = _refusal(example("text-to-image-tiny"), "vae-decode", tmp_path)
    assert f"{tmp_path / 'sd-tiny' / 'vae'}: missing (model_index.json lists vae)" in str(e)
    index = json.loads((tmp_path / "sd-tiny" / "model_index.json").read_text())
    index["_class_name"] = "KandinskyPipeline"
    (tmp_path / "sd-tiny" / "model_index.json").write_text(json.dumps(index))
    e = _refusal(example("text-to-image-tiny"), "denoise", tmp_path)
    assert "pipeline KandinskyPipeline is not one omnistage serves" in str(e)


# ------------------------------------------------------------------ the commands

def _omnistage(*args, **kw):
    return subprocess.run([sys.executable, "-m", "omnistage.local.cli", *args], capture_output=True, text=True,
                          timeout=120, **kw)


def test_models_check_prints_the_plan(model_dir):
    r = _omnistage("models", "check", str(EXAMPLES / "qwen3-omni-tiny.yaml"), "--models", str(model_dir))
    assert r.returncode == 0, r.stderr
    for stage in ("thinker", "talker", "code2wav"):
        assert f"{stage}: qwen3_omni/{stage} from {model_dir / 'qwen3-omni-tiny'} on cpu" in r.stdout


def test_models_check_as_json_lists_each_stage_and_each_error(model_dir, lm_copy):
    r = _omnistage("models", "check", str(EXAMPLES / "qwen3-omni-tiny.yaml"), "--models", str(model_dir), "-o", "json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] and doc["errors"] == []
    assert [s["stage"] for s in doc["stages"]] == ["thinker", "talker", "code2wav"]
    for s in doc["stages"]:
        assert s["weight_bytes"] == sum(w["bytes"] for w in s["weights"]) > 0 and s["device"] == "cpu"
    (lm_copy / "config.json").unlink()
    r = _omnistage("models", "check", str(EXAMPLES / "llm-tiny.yaml"), "--models", str(lm_copy.parent), "-o", "json")
    assert r.returncode == 2
    assert json.loads(r.stdout)["errors"] == [{"field": "spec.topology.stages[0].model", "stage": "llm",
                                               "message": f"{lm_copy}: no config.json (not a checkpoint)"}]


def test_models_check_and_serve_refuse_with_exit_2_and_one_line(lm_copy):
    (lm_copy / "config.json").unlink()
    file = str(EXAMPLES / "llm-tiny.yaml")
    r = _omnistage("models", "check", file, "--models", str(lm_copy.parent))
    assert r.returncode == 2
    assert r.stderr.strip() == (f"{file}: spec.topology.stages[0].model (llm): "
                                f"{lm_copy}: no config.json (not a checkpoint)")
    r = _omnistage("serve", file, "--models", str(lm_copy.parent))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == (f"omnistage serve: {file}: spec.topology.stages[0].model (llm): {lm_copy}: "
                                "no config.json (not a checkpoint)")


def test_the_stage_service_refuses_before_loading_and_writes_its_termination_message(lm_copy, tmp_path):
    (lm_copy / "config.json").unlink()
    file = str(EXAMPLES / "llm-tiny.yaml")
    r = subprocess.run(launch.stage_command(file, "llm", port=0, model_dir=lm_copy.parent), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().endswith("spec.topology.stages[0].model (llm): "
                                     f"{lm_copy}: no config.json (not a checkpoint)")


def test_report_exit_writes_the_termination_log(tmp_path, capsys):
    log = tmp_path / "termination-log"
    log.write_text("")
    launch.report_exit("stage talker: model-00002-of-00003.safetensors: truncated", str(log))
    assert log.read_text() == "stage talker: model-00002-of-00003.safetensors: truncated"
    assert "truncated" in capsys.readouterr().err
    launch.report_exit("no log here", str(tmp_path / "absent"))   # outside a container: stderr only
    assert not (tmp_path / "absent").exists()
