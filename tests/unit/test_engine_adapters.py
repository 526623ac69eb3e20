"""Every adapter in the family table is served by an engine class of its family, and the registry refuses a
model that another adapter serves."""

from __future__ import annotations

import json

import pytest

from omnistage.families import all_adapters, engines_for_kind, families

from ..harness import example


def test_every_adapter_has_an_engine_class_in_its_family_and_every_class_is_an_engine():
    from stage_service.runtime.base import Engine

    for family in families():
        table = family.engines()
        served = {a for (_, a) in table}
        assert served == set(family.adapters), family.name
        for (engine, adapter), cls in table.items():
            assert engine in adapter.engines and issubclass(cls, Engine), (family.name, adapter.name)
    assert set(all_adapters()) == {a for f in families() for a in f.adapters}


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
