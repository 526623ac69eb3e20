"""GPU placement under `omnistage serve` on a machine the parent shows no GPU (CUDA_VISIBLE_DEVICES=""): a file
with a GPU stage is refused before anything starts, with the one message; a `gpus: 1, device: cpu` stage runs
as a real process whose CUDA_VISIBLE_DEVICES is empty."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from omnistage.api import load_pipeline
from omnistage.local.gpu_placement import ENV_GPUS, ENV_VISIBLE
from omnistage.local.serve import LocalPipeline

from ..conftest import EXAMPLES, REPO

OMNISTAGE = [sys.executable, "-m", "omnistage.local.cli"]


def pipeline_file(tmp_path: Path, edits: dict[str, dict]) -> Path:
    """text-to-image-tiny (three diffusers stages, each on one GPU at most) with deployment edits per stage."""
    doc = yaml.safe_load((EXAMPLES / "text-to-image-tiny.yaml").read_text())
    for stage, fields in edits.items():
        doc["spec"]["deployment"]["stages"][stage].update(fields)
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def no_gpu_env() -> dict[str, str]:
    """The parent shows no GPU, on this CPU machine and on a GPU one alike."""
    env = {k: v for k, v in os.environ.items() if k != ENV_GPUS}
    env[ENV_VISIBLE] = ""
    return env


def test_serve_refuses_a_gpu_stage_on_a_machine_without_gpus_before_starting_anything(model_dir, tmp_path):
    path = pipeline_file(tmp_path, {"denoise": {"gpus": 1}})
    logs = tmp_path / "logs"
    r = subprocess.run([*OMNISTAGE, "serve", str(path), "--models", str(model_dir), "--log-dir", str(logs)],
                       capture_output=True, text=True, timeout=120, cwd=REPO, env=no_gpu_env())
    assert r.returncode == 1, r.stdout + r.stderr
    errors = r.stderr.strip().splitlines()
    assert errors == [
        "omnistage serve: the pipeline asks for 1 whole GPU across 1 stage replica; this machine has 0 GPUs "
        "(CUDA_VISIBLE_DEVICES=): the whole ones alone do not fit. Per stage (replicas x GPUs each): denoise 1 x 1 "
        "whole. Set device: cpu on a stage, lower its gpus or replicas, or let stages share a GPU with "
        "gpuMemoryFraction"], r.stderr
    assert "starting" not in r.stdout and not list(logs.glob("*.log"))   # no stage process, no orchestrator


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads a process's environment from /proc")
def test_a_gpu_stage_set_to_device_cpu_gets_no_gpu(model_dir, tmp_path, monkeypatch):
    for key, value in no_gpu_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv(ENV_GPUS, raising=False)
    path = pipeline_file(tmp_path, {"vae-decode": {"gpus": 1, "device": "cpu"}})
    printed: list[str] = []
    with LocalPipeline(path, load_pipeline(path), model_dir, log_dir=tmp_path / "logs", progress=printed.append,
                       tls=False) as local:
        local.start(timeout=300)
        assert local.gpu_assignment == {("text-encoder", 0): (), ("denoise", 0): (), ("vae-decode", 0): ()}
        for proc in local.all_procs():
            environ = Path(f"/proc/{proc.popen.pid}/environ").read_bytes().split(b"\0")
            assert f"{ENV_VISIBLE}=".encode() in environ, proc.name
    assert not any(line.startswith("gpu  ") for line in printed)   # no stage on a GPU: nothing to print
