"""The checkpoint families omnistage serves, and what each stage of one reads.

A published transformers checkpoint names its class in `config.json` (`architectures`); a combined
omni model keeps every part's tensors under one name prefix (`thinker.`, `talker.`, ...) in one set of
shards and every part's config under one key (`talker_config`). A diffusers pipeline names its class in
`model_index.json`, each component in its own sub-folder. This table is what `omnistage models check`,
`serve` and the stage service check a model directory against before any weights are read; the
engines read exactly these parts.
"""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.checkpoints.names import PROCESSOR_CONFIG, QWEN2_5_OMNI_SPEAKERS, THINKER_TOWERS



@dataclass(frozen=True)
class Part:
    """One component of a combined checkpoint (prefix "" for a whole model)."""
    prefix: str | tuple[str, ...]          # the name prefix of its tensors (or several)
    config: str = ""                       # the part's sub-config key in config.json ("" = the root)
    config_keys: tuple[str, ...] = ()      # dotted keys of config.json the engine reads
    borrows: tuple[str, ...] = ()          # tensors of another part it reads rows of
    tokenizer: bool = False                # reads the tokenizer at the root
    files: tuple[str, ...] = ()            # other files at the root it reads
    optional_files: tuple[str, ...] = ()   # ... where the checkpoint has them


@dataclass(frozen=True)
class Family:
    name: str                  # the figure and doc name, e.g. qwen3_omni
    architecture: str          # config.json `architectures[0]` (or a suffix, for `suffix=True`)
    parts: dict[str, Part]     # by stage component ("" for a whole model)
    suffix: bool = False
    aliases: tuple[str, ...] = ()   # other class names published checkpoints of the family carry

    def matches(self, architecture: str) -> bool:
        if self.suffix:
            return architecture.endswith(self.architecture)
        return architecture == self.architecture or architecture in self.aliases


_CHAT = ("chat_template.jinja", "chat_template.json", "generation_config.json")
_TEXT = ("text_config.vocab_size", "text_config.hidden_size", "text_config.num_hidden_layers")

# The Thinker's encoders served on their own (`kind: encoder`): the towers, the tokenizer, the chat template
# and the processor's settings.
_ENCODER_KEYS = ("thinker_config.vision_config", "thinker_config.audio_config")

QWEN3_OMNI = Family("qwen3_omni", "Qwen3OmniMoeForConditionalGeneration", {
    "encoder": Part(THINKER_TOWERS, "thinker_config", _ENCODER_KEYS, tokenizer=True, files=(PROCESSOR_CONFIG,),
                    optional_files=_CHAT),
    "thinker": Part("thinker.", "thinker_config", tuple(f"thinker_config.{k}" for k in _TEXT) +
                    ("talker_config.accept_hidden_layer", "im_end_token_id"), tokenizer=True,
                    optional_files=_CHAT + (PROCESSOR_CONFIG,)),
    "talker": Part("talker.", "talker_config",
                   ("talker_config.accept_hidden_layer", "talker_config.num_code_groups", "talker_config.codec_bos_id",
                    "talker_config.codec_eos_token_id", "talker_config.codec_pad_id", "talker_config.speaker_id",
                    "tts_bos_token_id", "tts_eos_token_id", "tts_pad_token_id", "im_start_token_id",
                    "im_end_token_id", "user_token_id", "assistant_token_id", "thinker_config.audio_token_id",
                    "thinker_config.image_token_id", "thinker_config.video_token_id"),
                   borrows=("thinker.model.embed_tokens.weight",)),
    "code2wav": Part("code2wav.", "code2wav_config", ("code2wav_config.num_quantizers",
                                                      "code2wav_config.upsample_rates")),
})

QWEN2_5_OMNI = Family("qwen2_5_omni", "Qwen2_5OmniForConditionalGeneration", {
    "encoder": Part(THINKER_TOWERS, "thinker_config", _ENCODER_KEYS, tokenizer=True, files=(PROCESSOR_CONFIG,),
                    optional_files=_CHAT),
    "thinker": Part("thinker.", "thinker_config", tuple(f"thinker_config.{k}" for k in _TEXT) +
                    ("thinker_config.text_config.max_position_embeddings",), tokenizer=True,
                    optional_files=_CHAT + (PROCESSOR_CONFIG,)),
    "talker": Part("talker.", "talker_config",
                   tuple(f"talker_config.{k}" for k in (
                       "tts_codec_start_token_id", "tts_codec_end_token_id", "tts_codec_pad_token_id",
                       "tts_codec_mask_token_id", "tts_text_end_token_id", "tts_text_pad_token_id",
                       "embedding_size", "vocab_size")) +
                   tuple(f"thinker_config.{k}" for k in ("audio_token_index", "image_token_index",
                                                         "video_token_index")),
                   borrows=("thinker.model.embed_tokens.weight",), files=(QWEN2_5_OMNI_SPEAKERS,)),
    "token2wav": Part("token2wav.", "token2wav_config",
                      tuple(f"token2wav_config.dit_config.{k}" for k in (
                          "block_size", "repeats", "mel_dim", "num_embeds", "max_position_embeddings")) +
                      tuple(f"token2wav_config.bigvgan_config.{k}" for k in (
                          "upsample_rates", "upsample_kernel_sizes", "resblock_kernel_sizes",
                          "resblock_dilation_sizes")),
                      files=(QWEN2_5_OMNI_SPEAKERS,)),
}, aliases=("Qwen2_5OmniModel",))   # the name the published Qwen2.5-Omni-7B config.json carries

CAUSAL_LM = Family("causal_lm", "ForCausalLM", {
    "": Part("", "", ("vocab_size", "hidden_size", "num_hidden_layers"), tokenizer=True, optional_files=_CHAT),
}, suffix=True)

FAMILIES = (QWEN3_OMNI, QWEN2_5_OMNI, CAUSAL_LM)

# Diffusers pipelines: `model_index.json` `_class_name` -> (family name, per stage component: the
# sub-folders whose weights it loads, then those it reads configuration from). A trailing "?" marks a
# sub-folder the published pipeline may leave out (null in model_index.json), e.g. SD3 without T5.
@dataclass(frozen=True)
class DiffusersStage:
    weights: tuple[str, ...]
    configs: tuple[str, ...] = ()


DIFFUSERS_PIPELINES: dict[str, tuple[str, dict[str, DiffusersStage]]] = {
    "StableDiffusionPipeline": ("sd", {
        "text_encoder": DiffusersStage(("text_encoder",), ("tokenizer",)),
        "unet": DiffusersStage(("unet",), ("scheduler", "vae")),
        "vae": DiffusersStage(("vae",)),
    }),
    "StableDiffusion3Pipeline": ("sd3", {
        "text_encoder": DiffusersStage(("text_encoder", "text_encoder_2", "text_encoder_3?"),
                                       ("tokenizer", "tokenizer_2", "tokenizer_3?", "transformer")),
        "transformer": DiffusersStage(("transformer",), ("scheduler", "vae")),
        "vae": DiffusersStage(("vae",)),
    }),
}


def family_of(architecture: str) -> Family | None:
    return next((f for f in FAMILIES if f.matches(architecture)), None)


def served_architectures() -> str:
    names = [("*" if f.suffix else "") + f.architecture for f in FAMILIES]
    return ", ".join(names + sorted(DIFFUSERS_PIPELINES))
