"""The omni Thinkers' text decoders as vLLM models (imported by vLLM's model registry only): each reads
its decoder's weights straight from the published combined checkpoint, named as in the plain LM."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

PREFIXES = ("thinker.model.", "thinker.lm_head.")


def thinker_text_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """The Thinker text decoder's weights of a combined checkpoint (the Talker, the audio decoder and the
    encoders are skipped), without the `thinker.` prefix."""
    for name, w in weights:
        if name.startswith(PREFIXES):
            yield name.removeprefix("thinker."), w


class Qwen3OmniThinkerText(Qwen3MoeForCausalLM):
    """Qwen3-Omni's Thinker decoder: Qwen3-MoE's layout."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(thinker_text_weights(weights))


class Qwen2_5OmniThinkerText(Qwen2ForCausalLM):
    """Qwen2.5-Omni's Thinker decoder: Qwen2's layout."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(thinker_text_weights(weights))
