"""`omnistage models pull` end to end with the real Hub client: a stand-in Hub on 127.0.0.1 (tests/hub_server.py)
serves the tiny LM as a private repository; the pull (HF_ENDPOINT, HF_TOKEN) puts it where the check, serve, run
and the stage read hf:// models, byte for byte; a wrong or missing token fails with one line saying so; a model
not pulled is refused before anything starts, naming the stage and the command to run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from omnistage.api import load_pipeline
from omnistage.api.model_sources import local_path
from omnistage.checkpoints.check import check_pipeline
from omnistage.local import cli

from ..conftest import REPO
from ..harness import example, write_pipeline
from ..hub_server import COMMIT, HubServer

OMNISTAGE = [sys.executable, "-m", "omnistage.local.cli"]
REPO_ID, TOKEN = "omnistage-tests/qwen2-tiny", "hf_test_token"
HF = f"hf://{REPO_ID}@main"


def _hf_pipeline(tmp_path: Path) -> Path:
    """llm-tiny on the transformers engine (no vLLM needed), its model the stand-in Hub's repository."""
    def edit(doc):
        stage = doc["spec"]["topology"]["stages"][0]
        stage["engine"], stage["model"] = "transformers", HF
    return write_pipeline(example("llm-tiny", edit), tmp_path / "llm-hf.yaml")


@pytest.fixture
def hub(model_dir):
    with HubServer(REPO_ID, model_dir / "qwen2-tiny", TOKEN) as server:
        yield server


def _pull(file: Path, store: Path, hub: HubServer, token: str | None, *extra: str) -> subprocess.CompletedProcess:
    # The client reads HF_HUB_OFFLINE at import (the tests' environment sets it): the pull runs as a user runs it.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_TOKEN")}
    env["HF_ENDPOINT"] = hub.endpoint
    if token is not None:
        env["HF_TOKEN"] = token
    return subprocess.run([*OMNISTAGE, "models", "pull", str(file), "--models", str(store), *extra], env=env,
                          capture_output=True, text=True, cwd=REPO, timeout=300)


def _model_files(folder: Path) -> dict[str, bytes]:
    """The model's files by relative path; the client's own download state (.cache) left out."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and ".cache" not in p.relative_to(folder).parts}


def test_pull_then_check_passes_with_the_files_byte_for_byte(model_dir, hub, tmp_path, capsys):
    file, store = _hf_pipeline(tmp_path), tmp_path / "store"
    r = _pull(file, store, hub, TOKEN)
    assert r.returncode == 0, r.stderr
    pulled = local_path(HF, store, {})
    assert f"llm: {HF}: " in r.stdout and str(pulled) in r.stdout
    assert _model_files(pulled) == _model_files(model_dir / "qwen2-tiny")
    # through the Hub's API and file endpoints at the commit the revision resolved to
    assert ("GET", f"/api/models/{REPO_ID}/revision/main") in hub.requests
    assert ("GET", f"/{REPO_ID}/resolve/{COMMIT}/config.json") in hub.requests
    assert cli.main(["models", "check", str(file), "--models", str(store)]) == 0
    assert cli.main(["models", "check", str(file), "--models", str(store), "--stage", "llm"]) == 0
    assert str(pulled) in capsys.readouterr().out
    # pulled again: nothing is fetched twice, the files stay the same
    before = sum(1 for m, path in hub.requests if m == "GET" and "/resolve/" in path)
    again = _pull(file, store, hub, TOKEN)
    assert again.returncode == 0, again.stderr
    assert sum(1 for m, path in hub.requests if m == "GET" and "/resolve/" in path) == before
    assert _model_files(pulled) == _model_files(model_dir / "qwen2-tiny")


@pytest.mark.parametrize("token", ["hf_wrong_token", None])
def test_a_wrong_or_missing_token_fails_with_one_clear_line(hub, tmp_path, token):
    file, store = _hf_pipeline(tmp_path), tmp_path / "store"
    r = _pull(file, store, hub, token)
    assert r.returncode == 2
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("omnistage models pull:")]
    assert f"llm: cannot pull {HF} from {hub.endpoint}" in line and "401" in line and "HF_TOKEN" in line
    assert not any(p.is_file() and ".cache" not in p.parts for p in store.rglob("*"))


def test_pull_refuses_while_the_client_is_told_to_stay_offline(hub, tmp_path):
    file = _hf_pipeline(tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": TOKEN}
    r = subprocess.run([*OMNISTAGE, "models", "pull", str(file), "--models", str(tmp_path / "s")], env=env,
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 2 and "HF_HUB_OFFLINE is set" in r.stderr
    assert hub.requests == []


def test_a_model_not_pulled_is_refused_naming_the_stage_and_the_command(tmp_path, capsys):
    file, store = _hf_pipeline(tmp_path), tmp_path / "store"
    _, errors = check_pipeline(load_pipeline(file), store)
    (e,) = errors
    assert e.stage == "llm" and e.field == "spec.topology.stages[0].model"
    assert f"{HF} is not pulled: run `omnistage models pull`" in e.message
    # the check an init container runs for its stage: the same line, exit 2
    assert cli.main(["models", "check", str(file), "--models", str(store), "--stage", "llm"]) == 2
    assert "(llm)" in capsys.readouterr().err
    assert cli.main(["models", "check", str(file), "--models", str(store), "--stage", "nope"]) == 2
    assert "has no stage 'nope'" in capsys.readouterr().err
    # serve and run refuse before any process starts, with the same line (no download at serve time)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", str(file), "--models", str(store), "--prompt", "hi"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "omnistage run: " in err and "(llm)" in err and "omnistage models pull" in err


def test_run_answers_with_the_pulled_model(hub, tmp_path):
    file, store = _hf_pipeline(tmp_path), tmp_path / "store"
    assert _pull(file, store, hub, TOKEN).returncode == 0
    requests = len(hub.requests)
    r = subprocess.run([*OMNISTAGE, "run", str(file), "--models", str(store), "--prompt", "hello",
                        "--max-tokens", "4", "--log-dir", str(tmp_path / "logs")],
                       capture_output=True, text=True, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "serving on" in r.stdout
    assert len(hub.requests) == requests   # served from the cache: the Hub is never asked at serve time
