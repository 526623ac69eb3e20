"""Weight quantization at load (stage_service/runtime/quantize.py): which layers `int8` quantizes, what it
refuses, and that batch invariance survives it. Models are built here from a config (random weights)."""

from __future__ import annotations

import sys

import pytest
import torch

from omnistage.api import TRANSFORMERS_QUANTIZATION
from stage_service.runtime.errors import EngineConfigError
from stage_service.runtime.invariance import MIN_MATMUL_ROWS, make_batch_invariant
from stage_service.runtime.quantize import CONFIGS, quantize_weights

Int8Tensor = pytest.importorskip("torchao.quantization").Int8Tensor


def tiny_lm(tied: bool) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, tie_word_embeddings=tied)
    return Qwen2ForCausalLM(config).eval()


def linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def is_int8(weight: torch.Tensor) -> bool:
    return isinstance(weight, Int8Tensor) and weight.qdata.dtype == torch.int8


def test_the_engine_applies_exactly_the_methods_the_api_accepts():
    assert set(CONFIGS) == set(TRANSFORMERS_QUANTIZATION)


def test_int8_quantizes_every_linear_and_keeps_a_tied_head_with_its_embedding():
    model = tiny_lm(tied=True)
    quantize_weights(model, "int8", "llm")
    layers = linears(model)
    assert {n for n, m in layers.items() if not is_int8(m.weight)} == {"lm_head"}
    for m in layers.values():
        if is_int8(m.weight):
            assert m.weight.qdata.shape == (m.out_features, m.in_features)
            assert m.weight.scale.shape == (m.out_features, 1)   # one scale per output row
    embed = model.get_input_embeddings().weight
    assert embed.dtype == torch.float32 and not isinstance(embed, Int8Tensor)
    assert model.lm_head.weight is embed   # still one tensor, in the dtype
    assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 128)


def test_int8_quantizes_an_untied_head():
    model = tiny_lm(tied=False)
    quantize_weights(model, "int8", "llm")
    assert all(is_int8(m.weight) for m in linears(model).values())
    assert not isinstance(model.get_input_embeddings().weight, Int8Tensor)


def test_int8_within_parts_leaves_the_rest_in_the_dtype():
    model = tiny_lm(tied=False)
    quantize_weights(model, "int8", "thinker", parts=(model.model.layers[1],))
    quantized = {n for n, m in linears(model).items() if is_int8(m.weight)}
    assert quantized and all(n.startswith("model.layers.1.") for n in quantized)
    assert not is_int8(model.lm_head.weight)


def test_no_method_leaves_the_model_as_loaded():
    model = tiny_lm(tied=False)
    before = {n: m.weight for n, m in linears(model).items()}
    assert quantize_weights(model, "", "llm") is model
    assert all(m.weight is before[n] for n, m in linears(model).items())


def test_an_unknown_method_is_refused_naming_the_field_and_the_accepted_ones():
    with pytest.raises(EngineConfigError) as e:
        quantize_weights(tiny_lm(tied=False), "fp8", "llm")
    assert str(e.value) == ('spec.deployment.stages.llm.quantization: "fp8" is not a method the transformers '
                            "engine applies; it takes int8")


def test_without_torchao_the_stage_is_refused_naming_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)   # as if it were not installed
    with pytest.raises(EngineConfigError, match=r"^spec\.deployment\.stages\.talker\.quantization: the package "
                                                r"torchao is not installed here"):
        quantize_weights(tiny_lm(tied=False), "int8", "talker")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantized_linear_padded_for_batch_invariance_gives_a_row_the_same_bits_in_any_batch(dtype):
    torch.manual_seed(1)
    layer = torch.nn.Sequential(torch.nn.Linear(512, 384)).to(dtype)
    quantize_weights(layer, "int8")
    make_batch_invariant(layer)   # patches the forward of the same nn.Linear, now over an int8 weight
    assert is_int8(layer[0].weight)
    x = torch.randn(2 * MIN_MATMUL_ROWS + 1, 512, dtype=dtype)
    with torch.inference_mode():
        alone = [layer(x[i:i + 1]) for i in range(len(x))]
        for n in range(1, len(x) + 1):
            together = layer(x[:n])
            for i in range(n):
                assert torch.equal(together[i:i + 1], alone[i]), (n, i)


def test_the_kv_budget_counts_the_bytes_an_int8_model_really_holds():
    """device.weights_bytes: torchao's int8 weight reports its float size as nbytes; its int8 data and scales
    are what it holds, so the budget left beside the weights (kv_budget.resolve_budget) is not halved."""
    from stage_service.runtime.device import weights_bytes

    model = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False).to(torch.bfloat16))
    assert weights_bytes(model) == 256 * 256 * 2
    quantize_weights(model, "int8", "talker")
    assert model[0].weight.nbytes == 256 * 256 * 2  # what torchao says
    assert 256 * 256 <= weights_bytes(model) <= 256 * 256 + 256 * 8  # int8 rows, a few bytes of scales per row
