"""Where `omnistage serve` says a user reaches its processes: the API URL, each process's status URL and the
Prometheus file-SD targets, from the ports the ready files named (no process started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnistage.api import load_pipeline
from omnistage.contract.launch import ReadyPorts
from omnistage.local.serve import LaunchError, LocalPipeline, Proc

from ..conftest import EXAMPLES


def local(tmp_path: Path, **kw) -> LocalPipeline:
    path = EXAMPLES / "text-to-image-tiny.yaml"
    lp = LocalPipeline(path, load_pipeline(path), tmp_path / "models", log_dir=tmp_path, progress=lambda m: None, **kw)
    for i, (stage, ports) in enumerate([("text_encoder", ReadyPorts(101, 201)), ("unet", ReadyPorts(102, 202)),
                                        ("vae", ReadyPorts(103))]):   # the vae's ready file named no status port
        lp.stages.append(Proc(f"stage {stage}[0]", [], tmp_path / f"{i}.log", tmp_path / f"{i}.ready", stage=stage,
                              ports=ports))
    return lp


def test_status_urls_and_scrape_targets_of_every_process_with_a_status_port(tmp_path):
    lp = local(tmp_path)
    lp.orchestrator = Proc("orchestrator", [], tmp_path / "o.log", tmp_path / "o.ready",
                           ports=ReadyPorts(100, 200, 300))
    assert lp.status_urls == {"stage text_encoder[0]": "http://127.0.0.1:201", "stage unet[0]": "http://127.0.0.1:202",
                              "orchestrator": "http://127.0.0.1:200"}
    assert lp.scrape_targets()[0] == {"targets": ["127.0.0.1:201"], "labels": {
        "job": "omnistage", "pipeline": lp.pipeline.name, "process": "stage text_encoder[0]"}}
    assert [t["labels"]["process"] for t in lp.scrape_targets()] == list(lp.status_urls)
    assert lp.api_url == "http://127.0.0.1:300/v1"
    assert lp.stages[1].port == 102


def test_no_api_url_without_an_api_port_or_before_the_orchestrator_is_ready(tmp_path):
    lp = local(tmp_path)
    assert lp.api_url is None
    lp.orchestrator = Proc("orchestrator", [], tmp_path / "o.log", tmp_path / "o.ready")
    assert lp.api_url is None and lp.orchestrator.port is None
    lp.orchestrator.ports = ReadyPorts(100, 200)
    assert lp.api_url is None


@pytest.mark.parametrize("keys", [["a,b"], [""], [" a"]])
def test_api_keys_that_cannot_travel_are_refused_before_anything_starts(tmp_path, keys):
    lp = local(tmp_path, api_port=0, api_keys=keys)
    lp.check_models = lambda: None
    with pytest.raises(LaunchError, match="API key"):
        lp.start()
    assert all(p.popen is None for p in lp.stages)
