"""Adding a model family is one module that registers itself: a throwaway family registered here is
picked up by validation, the checkpoint check (`omnistage models check`), `explain` and the stage service,
with nothing else edited, and is gone again once unregistered."""

from __future__ import annotations

import json
import shutil

import pytest

from omnistage.api import SpecError, parse_pipeline, validate
from omnistage.api.explain import explain
from omnistage.checkpoints.check import check_pipeline
from omnistage.contract import tensors
from omnistage.families import Adapter, Family, Part, register, unregister
from stage_service.engines.transformers.causal_lm import CausalLmEngine

from ..harness import call_stage, header, start_stage

TOY_ARCHITECTURE = "ToyLmForTesting"
TOY = Adapter("toy-lm", ("transformers",), "ar", "toy", frozenset({"text", "tokens"}),
              reads=frozenset({"tokens", "hidden"}))


class ToyLmEngine(CausalLmEngine):
    """The causal-LM engine under the toy family's name: the class the stage must pick for it."""


def engines():
    return {("transformers", TOY): ToyLmEngine}


TOY_FAMILY = Family("toy_lm", (TOY_ARCHITECTURE,), (TOY,), engines, parts={
    "toy": Part("", "", ("vocab_size", "hidden_size", "num_hidden_layers"), tokenizer=True)})


def toy_pipeline() -> dict:
    return {
        "apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline", "metadata": {"name": "toy"},
        "spec": {"topology": {"stages": [{"name": "toy", "kind": "ar", "engine": "transformers", "component": "toy",
                                          "model": "toy-tiny", "emits": ["text", "tokens"], "chunkSize": 4}],
                              "outputs": [{"modality": "text", "stage": "toy"}]},
                 "deployment": {"stages": {"toy": {"replicas": 1}}}}}


@pytest.fixture
def toy_family():
    register(TOY_FAMILY)
    yield TOY_FAMILY
    unregister(TOY_FAMILY.name)


@pytest.fixture
def toy_models(tmp_path, model_dir):
    """The tiny Qwen2 LM, published as the toy family's class."""
    root = tmp_path / "models"
    shutil.copytree(model_dir / "qwen2-tiny", root / "toy-tiny")
    config = root / "toy-tiny" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "architectures": [TOY_ARCHITECTURE]}))
    return root


def test_an_unregistered_family_is_refused_by_validation_by_name():
    [error] = validate(toy_pipeline())
    assert error.path == "spec.topology.stages[0].component"
    assert error.message.startswith('no transformers adapter serves a "ar" stage with component "toy"')
    with pytest.raises(SpecError, match="component"):
        parse_pipeline(toy_pipeline())
    assert "toy_lm" not in explain("omnipipeline.spec.topology.stages")


async def test_a_registered_family_reaches_validation_models_check_explain_and_the_stage(toy_family, toy_models):
    pipeline = parse_pipeline(toy_pipeline())  # validated against the toy adapter
    [plan], errors = check_pipeline(pipeline, toy_models)
    assert errors == []
    assert plan.family == "toy_lm/toy" and plan.weights
    assert "toy_lm (toy)" in explain("omnipipeline.spec.topology.stages")
    srv = await start_stage(pipeline, "toy", toy_models)
    try:
        assert type(srv.engine) is ToyLmEngine
        out = await call_stage(srv.port, header(max_tokens=6, ignore_eos=True))
        ids = [tensors.from_proto(t) for c in out for t in c.tensors if t.name == "token_ids"]
        assert sum(len(t) for t in ids) == 6 and out[-1].end_of_stream
    finally:
        await srv.drain()
