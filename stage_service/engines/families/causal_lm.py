"""Plain causal LMs (any `*ForCausalLM` checkpoint): one `ar` stage on vLLM or transformers. vLLM reads
the model itself, so a vLLM stage takes any model vLLM knows, with or without a config.json we recognise."""

from __future__ import annotations

from omnistage.families import Family, Part, register
from omnistage.families.adapters import CAUSAL_LM

CHAT_FILES = ("chat_template.jinja", "chat_template.json", "generation_config.json")


def engines():
    from stage_service.engines.transformers.causal_lm import CausalLmEngine
    from stage_service.engines.vllm.ar import VllmEngine

    return {("transformers", CAUSAL_LM): CausalLmEngine, ("vllm", CAUSAL_LM): VllmEngine}


FAMILY = register(Family(
    "causal_lm", ("ForCausalLM",), (CAUSAL_LM,), engines,
    parts={"": Part("", "", ("vocab_size", "hidden_size", "num_hidden_layers"), tokenizer=True,
                    optional_files=CHAT_FILES)},
    suffix=True, reads_any_model_on=("vllm",)))
