"""The family table refuses what would make validation ambiguous, and the built-in families load light."""

from __future__ import annotations

import subprocess
import sys

import pytest

from omnistage.families import (
    Adapter,
    Family,
    FamilyConflict,
    adapter_for,
    family_named,
    family_of,
    register,
    unregister,
)
from omnistage.families.adapters import CAUSAL_LM


def _family(name: str, *adapters: Adapter, architectures=("ToyForTesting",)) -> Family:
    return Family(name, architectures, adapters, lambda: {})


@pytest.mark.parametrize("family, error", [
    (_family("causal_lm"), 'a model family named "causal_lm" is already registered'),
    (_family("toy", Adapter("toy", ("onnx",), "ar", "toy", frozenset({"text"}))),
     "adapter toy names engine\\(s\\) onnx; known engines: vllm, transformers, diffusers"),
    (_family("toy", Adapter("toy", ("transformers",), "ar", "", frozenset({"audio"}))),
     'adapter toy serves the same stages as causal-lm \\(transformers, kind ar, component ""\\) but reads or '
     "emits different things"),
])
def test_a_family_that_would_make_validation_ambiguous_is_refused_by_name(family, error):
    with pytest.raises(FamilyConflict, match=error):
        register(family)
    assert family_named("causal_lm").adapters == (CAUSAL_LM,)


def test_registering_and_unregistering_a_family_changes_the_table():
    toy = _family("toy_reg", Adapter("toy-reg", ("transformers",), "ar", "toyreg", frozenset({"text"})))
    assert register(toy) is toy and register(toy) is toy   # the same family twice: no change
    try:
        assert family_of("ToyForTesting") is toy and adapter_for("transformers", "ar", "toyreg").name == "toy-reg"
    finally:
        unregister("toy_reg")
    assert family_of("ToyForTesting") is None and adapter_for("transformers", "ar", "toyreg") is None


def test_exact_class_names_win_over_suffix_rules():
    assert family_of("Qwen2ForCausalLM").name == "causal_lm"
    assert family_of("Qwen2_5OmniModel").name == "qwen2_5_omni"
    assert family_of("StableDiffusion3Pipeline").name == "sd3"


def test_validation_reads_the_table_without_loading_an_engine():
    code = ("import sys; from omnistage.api import validate; from omnistage.families import families; families(); "
            "print(sorted(m for m in ('torch', 'vllm', 'diffusers', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
