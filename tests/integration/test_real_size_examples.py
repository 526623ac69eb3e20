"""The real-size examples (`examples/qwen3-omni-30b-a3b.yaml`, `qwen2.5-omni-7b.yaml`, `sd3.5-medium.yaml`)
against the hollow layouts of their checkpoints: every stage is planned from the published configs and
headers, and the plan fits a node of 80 GiB GPUs; on smaller GPUs the stage that no longer fits is refused
in one line with its numbers, by `omnistage models check --plan` and by `omnistage serve` before anything
starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from omnistage.api import load_pipeline
from omnistage.checkpoints.fit import misfit
from omnistage.checkpoints.plan import plan_pipeline
from omnistage.checkpoints.shards import ShardedCheckpoint
from omnistage.local.serve import LaunchError, LocalPipeline

from ..conftest import EXAMPLES
from ..harness import hollow_store

GiB = 1 << 30
EXAMPLE_MODELS = {  # example -> (family, the model name the example points at)
    "qwen3-omni-30b-a3b": ("qwen3_omni", "Qwen3-Omni-30B-A3B-Instruct"),
    "qwen2.5-omni-7b": ("qwen2_5_omni", "Qwen2.5-Omni-7B"),
    "sd3.5-medium": ("sd3", "stable-diffusion-3.5-medium"),
}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return hollow_store(tmp_path_factory.mktemp("store"), EXAMPLE_MODELS.values())


def _misfits(pipeline, plans, gpu_bytes):
    deps = pipeline.deployment.stages
    return [m for p in plans if (m := misfit(p, pipeline.stage(p.stage), deps[p.stage], gpu_bytes))]


@pytest.mark.parametrize("name", EXAMPLE_MODELS)
def test_every_stage_is_planned_and_fits_80_gib_gpus(store, name, monkeypatch):
    monkeypatch.setattr(ShardedCheckpoint, "_read", lambda *a: pytest.fail("read tensor data"))
    pipeline = load_pipeline(EXAMPLES / f"{name}.yaml")
    plans, errors = plan_pipeline(pipeline, store)
    assert errors == []
    assert [p.stage for p in plans] == [s.name for s in pipeline.stages]
    assert all(p.weights_bytes > 0 for p in plans)
    for p in plans:
        stage = pipeline.stage(p.stage)
        assert (p.kv_bytes > 0) == (stage.kind == "ar"), p
        if stage.kind == "ar":  # the context the file sets, not a tiny default
            assert p.context == pipeline.deployment.stages[p.stage].engine_args["max_model_len"] >= 8192
    assert _misfits(pipeline, plans, 80 * GiB) == []


def test_a_gpu_too_small_names_the_stage_and_the_numbers(store):
    pipeline = load_pipeline(EXAMPLES / "qwen3-omni-30b-a3b.yaml")
    plans, _ = plan_pipeline(pipeline, store)
    assert _misfits(pipeline, plans, 80 * GiB) == []
    (line,) = _misfits(pipeline, plans, 48 * GiB)
    thinker = next(p for p in plans if p.stage == "thinker")
    assert line == (f"thinker needs {thinker.total_bytes / 2 / GiB:.1f} GiB at maxModelLen 32768 x maxBatch 16 "
                    "per GPU (split over 2); gpuMemoryFraction 0.9 of 48.0 GiB gives 43.2 GiB")


def test_models_check_plan_refuses_with_the_numbers(store):
    args = ["models", "check", str(EXAMPLES / "qwen2.5-omni-7b.yaml"), "--plan", "--models", str(store)]
    run = [sys.executable, "-m", "omnistage.local.cli", *args]
    ok = subprocess.run([*run, "--gpu-memory", "80Gi"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert [line.split()[0] for line in ok.stdout.splitlines()[1:4]] == ["thinker", "talker", "token2wav"]
    small = subprocess.run([*run, "--gpu-memory", "24GiB"], capture_output=True, text=True, timeout=120)
    assert small.returncode == 2
    refused = [line for line in small.stderr.splitlines() if "needs" in line]
    assert [line.split(": ")[1].split()[0] for line in refused] == ["thinker", "talker"]  # token2wav still fits
    # A transformers stage on a GPU share has a KV budget: it needs its weights, its largest step's
    # activations and one sequence at the whole context; its budget bounds the rest.
    assert refused[0].startswith(f"{EXAMPLES / 'qwen2.5-omni-7b.yaml'}: thinker needs ")
    assert ("with one sequence at maxModelLen 32768 (its KV budget bounds the rest) per GPU; gpuMemoryFraction "
            "0.75 of 24.0 GiB gives 18.0 GiB") in refused[0]
    bad = subprocess.run([*run, "--gpu-memory", "lots"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--gpu-memory 'lots' is not a size" in bad.stderr


def test_serve_refuses_a_plan_that_does_not_fit_before_starting_anything(store, tmp_path):
    path = EXAMPLES / "sd3.5-medium.yaml"
    local = LocalPipeline(path, load_pipeline(path), model_dir=store, log_dir=tmp_path, progress=lambda m: None,
                          extra_env={"OMNISTAGE_GPUS": "1", "OMNISTAGE_GPU_MEMORY": "16Gi"})
    with pytest.raises(LaunchError, match=r"the memory plan does not fit: text-encoder needs \d+\.\d GiB per GPU; "
                                          r"gpuMemoryFraction 0.3 of 16.0 GiB gives 4.8 GiB"):
        local.start(timeout=5)
    assert local.stages == [] and local.orchestrator is None
