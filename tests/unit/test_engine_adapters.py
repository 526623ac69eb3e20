"""Every stage-service engine adapter names its entry in the catalog validation checks topologies
against (omnistage/api/engines.py), and the registry refuses a model that another adapter serves."""

from __future__ import annotations

import json

import pytest

from omnistage.api import ADAPTERS
from omnistage.api.engines import engines_for_kind

from ..harness import example

ENGINE_CLASSES = [("stage_service.engines.vllm.ar", "VllmEngine"),
                  ("stage_service.engines.vllm.thinker", "VllmThinkerEngine"),
                  ("stage_service.engines.transformers.causal_lm", "CausalLmEngine"),
                  ("stage_service.engines.qwen3_omni.engines", "ThinkerEngine"),
                  ("stage_service.engines.qwen3_omni.engines", "TalkerEngine"),
                  ("stage_service.engines.qwen3_omni.engines", "Code2WavEngine"),
                  ("stage_service.engines.qwen3_omni.engines", "EncoderEngine"),
                  ("stage_service.engines.qwen2_5_omni.engines", "EncoderEngine"),
                  ("stage_service.engines.qwen2_5_omni.engines", "ThinkerEngine"),
                  ("stage_service.engines.qwen2_5_omni.engines", "TalkerEngine"),
                  ("stage_service.engines.qwen2_5_omni.engines", "Token2WavEngine"),
                  ("stage_service.engines.diffusers.engines", "TextEncoderEngine"),
                  ("stage_service.engines.diffusers.engines", "DenoiseEngine"),
                  ("stage_service.engines.diffusers.engines", "VaeDecodeEngine")]


def test_every_adapter_class_names_a_catalog_entry_and_every_entry_has_one():
    import importlib

    classes = [getattr(importlib.import_module(m), c) for m, c in ENGINE_CLASSES]
    named = {a for cls in classes for a in (getattr(cls, "ADAPTERS", None) or (cls.ADAPTER,))}
    assert named == set(ADAPTERS)


def test_kinds_and_engines_come_from_the_catalog():
    assert engines_for_kind("ar") == ("vllm", "transformers")
    assert engines_for_kind("diffusion") == ("diffusers",)
    assert engines_for_kind("generation") == ("transformers", "diffusers")


def test_registry_refuses_a_model_served_by_another_adapter(tmp_path):
    from stage_service.engines.registry import UnknownModel, create_engine

    pipeline = example("qwen3-omni-tiny")
    talker = pipeline.stage("talker")
    (tmp_path / "qwen3-omni-tiny").mkdir(parents=True)
    (tmp_path / "qwen3-omni-tiny" / "config.json").write_text(
        json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    with pytest.raises(UnknownModel, match='served by the causal-lm adapter, but stage "talker" .* declares '
                                           "qwen3-omni-talker"):
        create_engine(pipeline, talker, tmp_path)
