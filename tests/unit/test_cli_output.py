"""The `omnistage` command's machine-readable answers: `--version`, and `-o json` of validate and explain
(models check's is in tests/integration/test_models_check.py, with the models it reads)."""

from __future__ import annotations

import json
from importlib.metadata import version

import pytest

from omnistage.api.explain import explain
from omnistage.local.cli import main

from ..conftest import EXAMPLES


def test_version_is_the_installed_package(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"omnistage {version('omnistage')}"


def test_validate_as_json_has_each_file_with_its_errors_by_path(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text((EXAMPLES / "llm-tiny.yaml").read_text().replace("replicas: 1", "replicas: -1", 1))
    good = EXAMPLES / "qwen3-omni-tiny.yaml"
    assert main(["validate", "-o", "json", str(good), str(bad)]) == 1
    out = capsys.readouterr()
    assert out.err == ""
    ok, refused = json.loads(out.out)
    assert ok == {"file": str(good), "valid": True, "pipeline": "qwen3-omni-tiny",
                  "stages": ["thinker", "talker", "code2wav"], "errors": [],
                  "outputs": [{"modality": "text", "stage": "thinker"}, {"modality": "audio", "stage": "code2wav"}]}
    assert refused["valid"] is False and refused["errors"]
    assert all(set(e) == {"path", "message"} for e in refused["errors"])
    assert any(e["message"] == "must be >= 0, got -1" for e in refused["errors"]), refused


def test_explain_as_json_has_the_fields_the_text_lists(capsys):
    assert main(["explain", "-o", "json", "spec.deployment.stages"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["field"]["name"] == "stages" and doc["field"]["required"] is True
    text = explain("spec.deployment.stages")
    assert [f["name"] for f in doc["fields"]] and all(f"   {f['name']}\t<{f['type']}>" in text for f in doc["fields"])
    assert main(["explain", "-o", "json", "--recursive", "spec.topology"]) == 0
    tree = json.loads(capsys.readouterr().out)
    stages = next(f for f in tree["fields"] if f["name"] == "stages")
    assert "inputs" in [f["name"] for f in stages["fields"]]


def test_explain_of_an_unknown_field_is_refused_in_either_output(capsys):
    assert main(["explain", "-o", "json", "spec.deployment.stages.replica"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and 'field "replica" does not exist' in out.err and 'did you mean "replicas"' in out.err
