"""A diffusers checkpoint's `model_index.json` names each component's `[library, class]`: the stage loader
and `omnistage models check` import only the allowlisted pairs unless the stage sets `trustRemoteCode`."""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from omnistage.api import parse_pipeline
from omnistage.checkpoints.check import StageCheckError, check_stage
from omnistage.checkpoints.components import allowed
from stage_service.engines.diffusers.layout import PipelineDir
from stage_service.runtime.errors import EngineConfigError

from ..conftest import EXAMPLES

PLANTED = "planted_component_module"  # a module a hostile checkpoint ships next to its weights


@pytest.fixture
def hostile_pipeline(tmp_path, monkeypatch):
    """A StableDiffusionPipeline folder whose text encoder is `planted_component_module.Evil`, a module on
    sys.path (as a checkpoint under ./models is, with the cwd first on it) that leaves a mark when imported."""
    mark = tmp_path / "imported"
    (tmp_path / f"{PLANTED}.py").write_text(f"open({str(mark)!r}, 'w').close()\nclass Evil:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, PLANTED, raising=False)
    root = tmp_path / "sd-hostile"
    (root / "text_encoder").mkdir(parents=True)
    (root / "tokenizer").mkdir()
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": "StableDiffusionPipeline", "text_encoder": [PLANTED, "Evil"],
        "tokenizer": ["transformers", "CLIPTokenizer"], "unet": ["diffusers", "UNet2DConditionModel"]}))
    return root, mark


def _text_to_image(model: str, trust: bool = False):
    doc = yaml.safe_load((EXAMPLES / "text-to-image-tiny.yaml").read_text())
    for s in doc["spec"]["topology"]["stages"]:
        s["model"] = model
        if trust:
            s["trustRemoteCode"] = True
    return parse_pipeline(doc)


def test_the_loader_refuses_a_component_outside_the_allowlist_by_name(hostile_pipeline):
    root, mark = hostile_pipeline
    with pytest.raises(EngineConfigError) as e:
        PipelineDir(root / "text_encoder").component_class("text_encoder")
    assert f'component "text_encoder" names library "{PLANTED}", class "Evil"' in str(e.value)
    assert "trustRemoteCode" in str(e.value)
    assert not mark.exists() and PLANTED not in sys.modules


def test_the_loader_imports_it_when_the_stage_trusts_remote_code(hostile_pipeline):
    root, mark = hostile_pipeline
    cls = PipelineDir(root / "text_encoder", trust_remote_code=True).component_class("text_encoder")
    assert cls.__name__ == "Evil" and mark.exists()


def test_models_check_refuses_the_same_component(hostile_pipeline):
    root, mark = hostile_pipeline
    pipeline = _text_to_image(str(root))
    with pytest.raises(StageCheckError) as e:
        check_stage(pipeline, pipeline.stage("text-encoder"))
    assert e.value.field == "spec.topology.stages[0].model"
    assert f'component "text_encoder" names library "{PLANTED}", class "Evil"' in str(e.value)
    assert not mark.exists()


def test_models_check_passes_the_allowlist_when_the_stage_trusts_remote_code(hostile_pipeline):
    root, _ = hostile_pipeline
    pipeline = _text_to_image(str(root), trust=True)
    assert pipeline.stage("text-encoder").trust_remote_code
    with pytest.raises(StageCheckError) as e:  # what is left to refuse is the folder's missing files
        check_stage(pipeline, pipeline.stage("text-encoder"))
    assert "Evil" not in str(e.value)


@pytest.mark.parametrize("library,name,ok", [
    ("diffusers", "UNet2DConditionModel", True), ("diffusers", "SD3Transformer2DModel", True),
    ("transformers", "CLIPTextModelWithProjection", True), ("diffusers", "FlowMatchEulerDiscreteScheduler", True),
    ("transformers", "TokenizersBackend", True),
    ("models.sd.evil", "Evil", False), ("os", "system", False), ("diffusers", "DiffusionPipeline", False),
    ("transformers", "AutoModel", False), ("diffusers", "Evil.Scheduler", False), (None, "AutoencoderKL", False),
])
def test_allowlist(library, name, ok):
    assert allowed(library, name) is ok


def test_every_component_of_the_published_layouts_is_allowed():
    from pathlib import Path

    import omnistage.checkpoints as ckpts

    index = json.loads((Path(ckpts.__file__).parent / "published" / "sd3" / "model_index.json").read_text())
    assert all(allowed(*entry) for key, entry in index.items() if not key.startswith("_"))


def test_serve_starts_stages_without_the_working_directory_on_their_import_path(tmp_path):
    """`omnistage serve` runs in the user's directory, where ./models lies: a stage started with `python -P`
    cannot import a module a checkpoint planted there, whatever model_index.json names."""
    import subprocess

    from omnistage.api import load_pipeline
    from omnistage.local.serve import LocalPipeline

    path = EXAMPLES / "text-to-image-tiny.yaml"
    lp = LocalPipeline(path, load_pipeline(path), tmp_path / "models", log_dir=tmp_path, progress=lambda m: None)
    argv = lp._stage_proc("text-encoder", "t", "stage text-encoder[0]").argv
    assert argv[:4] == [sys.executable, "-P", "-m", "stage_service"]
    (tmp_path / f"{PLANTED}.py").write_text("")
    probe = [*argv[:2], "-c", f"import importlib.util as u; print(u.find_spec({PLANTED!r}) is None)"]
    assert subprocess.run(probe, cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip() == "True"
