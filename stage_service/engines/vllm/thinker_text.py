"""The omni Thinkers' text decoders as vLLM models (imported by vLLM's model registry only): each reads
its decoder's weights straight from the published combined checkpoint, named as in the plain LM.

Media (`vllm_media`): when the config names the Thinker's M-RoPE sections (`omnistage_mrope`, written by
`vllm_thinker.thinker_text_config`) and the engine is eager, every attention layer's rotary embedding is vLLM's
`MRotaryEmbedding` (1-D positions: plain RoPE, as before; [3, N]: the multimodal one), and a forward
whose step carries image or video requests (our KV connector's metadata) runs on their 3-D positions,
with the deepstack rows added to the residual stream after the first layers at their visual positions
(before the next layer reads it, so the rows captured as hidden states are the layers' outputs, as
transformers records them)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

from stage_service.engines.vllm.media import batch_inputs, media_refusal

PREFIXES = ("thinker.model.", "thinker.lm_head.")
MROPE_KEY = "omnistage_mrope"  # config.json: {"section": [t, h, w], "interleaved": bool}


def thinker_text_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """The Thinker text decoder's weights of a combined checkpoint (the Talker, the audio decoder and the
    encoders are skipped), without the `thinker.` prefix."""
    for name, w in weights:
        if name.startswith(PREFIXES):
            yield name.removeprefix("thinker."), w


def media_steps() -> list:
    """This step's image and video requests (`vllm_media.MediaStep`), from our KV connector's metadata
    bound in this worker; none in profiling and warm-up runs."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return []
    steps = getattr(get_kv_transfer_group(), "media_steps", None)
    return steps() if steps is not None else []


class OmniThinkerText:
    """What the omni decoders add to vLLM's plain-LM class (a mixin before it)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._deepstack: list[torch.Tensor] = []
        mrope = getattr(vllm_config.model_config.hf_config, MROPE_KEY, None)
        # Eager, one slot mapping a step (vllm_media.media_refusal): else the stage refuses images and video
        # and text and audio run as before.
        self.media = bool(mrope) and media_refusal(vllm_config) is None
        if not self.media:
            return
        from vllm.model_executor.layers.rotary_embedding import get_rope

        layers = [m for m in self.model.layers if hasattr(m, "self_attn")]  # this pipeline rank's
        for layer in layers:
            old = layer.self_attn.rotary_emb
            layer.self_attn.rotary_emb = get_rope(
                old.head_size, max_position=old.max_position_embeddings, is_neox_style=old.is_neox_style,
                rope_parameters={"rope_type": "default", "rope_theta": old.base,
                                 "mrope_section": list(mrope["section"]),
                                 "mrope_interleaved": bool(mrope["interleaved"])}, dtype=old.dtype)
        self._slots_layer = layers[0].self_attn.attn.layer_name
        # Deepstack row i goes into the stream after layer i: before layer i + 1 reads it (its hidden-states
        # argument; the final norm's first) so the captured row of layer i stays the layer's output.
        after = list(self.model.layers[1:]) + [self.model.norm]
        for i, module in enumerate(after):
            module.register_forward_pre_hook(self._deepstack_hook(i, 0 if module is self.model.norm else 1))

    def _deepstack_hook(self, layer: int, arg: int):
        def hook(module, args):
            if layer < len(self._deepstack):
                args = list(args)
                args[arg] = args[arg] + self._deepstack[layer].to(args[arg].dtype)
                return tuple(args)
            return None
        return hook

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        steps = media_steps() if self.media else []
        if not steps:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)
        from vllm.forward_context import get_forward_context

        slot_mapping = get_forward_context().slot_mapping
        if not isinstance(slot_mapping, dict):
            raise RuntimeError("the vLLM Thinker's media positions need one slot mapping per step (no micro-batches)")
        positions, self._deepstack = batch_inputs(steps, slot_mapping[self._slots_layer], positions)
        try:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)
        finally:
            self._deepstack = []


class Qwen3OmniThinkerText(OmniThinkerText, Qwen3MoeForCausalLM):
    """Qwen3-Omni's Thinker decoder: Qwen3-MoE's layout, M-RoPE and deepstack."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(thinker_text_weights(weights))


class Qwen2_5OmniThinkerText(OmniThinkerText, Qwen2ForCausalLM):  # noqa: N801 - named after transformers' class
    """Qwen2.5-Omni's Thinker decoder: Qwen2's layout and M-RoPE."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(thinker_text_weights(weights))
