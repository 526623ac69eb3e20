"""The GPU check's parts that run anywhere: every example placed on a GPU is a valid pipeline, the
comparison of a CPU answer with a GPU answer, and the scripts' syntax."""

from __future__ import annotations

import copy
import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from omnistage.api import parse_pipeline, validate

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
from common import on_gpu, results_name  # noqa: E402


def _compare_module():
    spec = importlib.util.spec_from_file_location("gpu_compare", REPO / "scripts" / "gpu_compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gpu_compare = _compare_module()
EXAMPLES = sorted((REPO / "examples").glob("*-tiny.yaml"))  # what gpu_compare.py serves


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_on_one_shared_gpu_is_valid(path):
    doc = yaml.safe_load(path.read_text())
    n = len(doc["spec"]["deployment"]["stages"])
    placed = on_gpu(copy.deepcopy(doc), fraction=round(0.9 / n, 2), dtype="float32")
    assert validate(placed) == []
    p = parse_pipeline(placed)
    assert all(sd.gpus == 1 and sd.dtype == "float32" for sd in p.deployment.stages.values())
    assert sum(sd.gpu_memory_fraction for sd in p.deployment.stages.values()) <= 1


def test_results_on_cuda_go_under_gpu():
    assert results_name("transport", "cuda") == "gpu/transport"
    assert results_name("transport", "cpu") == "transport"


def _png(value: int) -> bytes:
    from ..media_builders import png

    return png(np.full((8, 8, 3), value, dtype=np.uint8))


def _answer(tokens=(1, 2, 3), pcm=(0, 100, -100), images=()) -> dict:
    return {"tokens": list(tokens), "pcm": np.array(pcm, dtype="<i2").tobytes(), "images": list(images),
            "seconds": 1.0}


@pytest.mark.parametrize("gpu, ok, field, value", [
    (_answer(), True, "audio_max_abs_diff", 0),
    (_answer(pcm=(0, 100 + gpu_compare.AUDIO_TOLERANCE, -100)), True, "audio_max_abs_diff",
     gpu_compare.AUDIO_TOLERANCE),
    (_answer(pcm=(0, 101 + gpu_compare.AUDIO_TOLERANCE, -100)), False, "audio_max_abs_diff",
     gpu_compare.AUDIO_TOLERANCE + 1),
    (_answer(pcm=(0, 100)), False, "audio_samples_equal_length", 0),
    (_answer(tokens=(1, 2, 4)), False, "tokens_equal", 0),
])
def test_speech_answers_compare_on_tokens_and_audio(gpu, ok, field, value):
    out = gpu_compare.compare(_answer(), gpu)
    assert out["ok"] == float(ok)
    assert out[field] == value


def test_images_compare_within_tolerance():
    cpu = _answer(tokens=(), pcm=(), images=[_png(100)])
    near = gpu_compare.compare(cpu, _answer(tokens=(), pcm=(), images=[_png(103)]))
    far = gpu_compare.compare(cpu, _answer(tokens=(), pcm=(), images=[_png(110)]))
    assert (near["ok"], near["image_mean_abs_diff"]) == (1.0, 3.0)
    assert (far["ok"], far["image_mean_abs_diff"]) == (0.0, 10.0)


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_wheels.sh"])
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(REPO / "scripts" / script)], check=True)


@pytest.mark.parametrize("path", sorted((REPO / "bench").glob("*.py")) + sorted((REPO / "scripts").glob("*.py")),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_benchmarks_and_scripts_compile(path):
    """No test imports every benchmark: at least each must compile (a GPU run must not die on a typo)."""
    compile(path.read_text(), str(path), "exec")
