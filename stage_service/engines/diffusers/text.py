"""Prompt conditioning per diffusers pipeline family: what the text-encoder stage runs and emits.

The text stage serves `component: text_encoder`; which encoders it runs, and how their outputs
become the denoiser's conditioning, depends on the pipeline class in `model_index.json`:

- `StableDiffusionPipeline`: one CLIP encoder; `embeddings` is its last hidden state.
- `StableDiffusion3Pipeline`: CLIP-L (`text_encoder`) and CLIP-G (`text_encoder_2`), and T5
  (`text_encoder_3`) when the pipeline has one, combined as `StableDiffusion3Pipeline.encode_prompt`
  does: `embeddings` is both CLIPs' penultimate hidden states side by side, zero-padded to T5's width,
  followed by T5's tokens (zeros when there is no T5); `pooled_embeddings` is both CLIPs' projected
  pooled outputs side by side.
- `WanPipeline`: one UMT5 encoder; `embeddings` is its last hidden state over each prompt's own tokens
  (the prompt cleaned as WanPipeline cleans it), zero rows after them up to WanPipeline's
  `max_sequence_length`, as `WanPipeline.encode_prompt` trims and pads them.
- `FluxPipeline`: CLIP (`text_encoder`) and T5 (`text_encoder_2`), as `FluxPipeline.encode_prompt` combines
  them: `pooled_embeddings` is CLIP's pooled output, `embeddings` T5's last hidden state over the prompt padded to
  FluxPipeline's `max_sequence_length` (512; no attention mask, as the pipeline runs it). One row per request:
  FLUX.1-dev's guidance scale is the transformer's input, not a second, unconditional row. Two rows,
  [negative, prompt], only under FluxPipeline's true classifier-free guidance (`params.image.true_cfg_scale` above
  1 with a negative prompt); a negative prompt without it is refused by name, as is the scale without one.
  FluxKontextPipeline encodes its prompt alike. Every other class has no true classifier-free guidance (its
  guidance scale is classifier-free guidance) and refuses `true_cfg_scale` by name.
- `QwenImagePipeline`: the Qwen2.5-VL text encoder over the prompt in the pipeline's template, its last hidden
  states past the template's first 34 tokens (the system turn), at most 512 of them, as
  `QwenImagePipeline.encode_prompt` gives them; `embeddings_mask` says which tokens are the prompt's. A request's
  rows (under true CFG [negative prompt, prompt], QwenImagePipeline's `true_cfg_scale` being the request's
  guidance scale, run, as the pipeline runs it, only when a negative prompt is given) are padded with zero rows to
  the longer one's tokens rounded up to 64 (`QWEN_IMAGE_TOKEN_BUCKET`): the denoiser masks the padding, so it
  changes no image, and requests whose prompts round to the same length share the denoise loop's model calls.

Every prompt of a batch is padded to the encoders' fixed lengths (the Qwen2.5-VL encoder runs the prompts of one
token count together instead: a causal model's padding would change its kernels' shapes), so a prompt encodes the
same alone or in a batch. Another family plugs in as one more `PromptEncoder` in `PROMPT_ENCODERS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the ecosystem's name for it

from omnistage.contract.params import InvalidRequest, RequestParams
from stage_service.engines.diffusers.layout import PipelineDir
from stage_service.runtime.errors import EngineConfigError
from stage_service.runtime.invariance import make_batch_invariant

# StableDiffusion3Pipeline's default `max_sequence_length`: the T5 tokens (or zero rows) after the CLIP tokens.
SD3_T5_TOKENS = 256
# WanPipeline's default `max_sequence_length`: every prompt's embeddings are padded with zero rows to it.
WAN_TEXT_TOKENS = 512
# FluxPipeline's default `max_sequence_length`: the T5 tokens every prompt is padded (or cut) to.
FLUX_T5_TOKENS = 512
# QwenImagePipeline's `prompt_template_encode`, the template tokens before the prompt its encoding drops
# (`prompt_template_encode_start_idx`), the prompt tokens its tokenizer keeps past them (`tokenizer_max_length`)
# and the most tokens it conditions on (`max_sequence_length`'s default).
QWEN_IMAGE_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
                       "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
                       "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
QWEN_IMAGE_DROPPED_TOKENS = 34
QWEN_IMAGE_TOKENIZER_TOKENS = 1024
QWEN_IMAGE_TEXT_TOKENS = 512
# A request's text tokens are padded to a multiple of this: more requests share a denoise step (the text's length
# is part of what a step's images must share), for at most 63 masked tokens each.
QWEN_IMAGE_TOKEN_BUCKET = 64


class PromptEncoder(ABC):
    """Loads a pipeline's text encoders on `device`; `encode(prompts)` gives each output tensor, one row
    per prompt, on that device."""

    def __init__(self, pipe: PipelineDir, dtype: torch.dtype, batch_invariant: bool,
                 device: torch.device | str = "cpu"):
        self.pipe, self.dtype, self.batch_invariant, self.device = pipe, dtype, batch_invariant, torch.device(device)

    def _encoder(self, component: str) -> torch.nn.Module:
        model = self.pipe.load(component, device=self.device, dtype=self.dtype)
        return make_batch_invariant(model) if self.batch_invariant else model

    def _ids(self, tokenizer, prompts: list[str], length: int) -> torch.Tensor:
        return tokenizer(prompts, padding="max_length", max_length=length, truncation=True,
                         return_tensors="pt").input_ids.to(self.device)

    def prompts(self, params: RequestParams) -> list[str]:
        """The prompts of a request's rows: [prompt], or [negative prompt, prompt] under classifier-free guidance
        (`guidance_scale > 1`), as the denoise loop takes them."""
        if params.true_cfg_scale != 1.0:
            raise InvalidRequest("params.image.true_cfg_scale", f"a {self.pipe.pipeline_class} has no true "
                                 "classifier-free guidance: its guidance_scale (params.image.guidance_scale) is "
                                 "classifier-free guidance over [negative, prompt] rows")
        return [params.text] if params.guidance_scale <= 1.0 else [params.negative_prompt, params.text]

    @abstractmethod
    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Blocking; runs under inference mode on the stage's worker thread."""

    def request_rows(self, encoded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One request's rows of `encode`'s output, as the text stage sends them (by default as they are)."""
        return encoded


class ClipPromptEncoder(PromptEncoder):
    """StableDiffusionPipeline: `embeddings` [n, 77, width] from one CLIP text encoder."""

    def __init__(self, pipe: PipelineDir, dtype: torch.dtype, batch_invariant: bool,
                 device: torch.device | str = "cpu"):
        super().__init__(pipe, dtype, batch_invariant, device)
        self.tokenizer = pipe.load("tokenizer")
        self.encoder = self._encoder("text_encoder")

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        ids = self._ids(self.tokenizer, prompts, self.tokenizer.model_max_length)
        return {"embeddings": self.encoder(ids)[0]}


class Sd3PromptEncoder(PromptEncoder):
    """StableDiffusion3Pipeline: `embeddings` [n, 77 + 256, joint width] and `pooled_embeddings` [n, pooled width]."""

    def __init__(self, pipe: PipelineDir, dtype: torch.dtype, batch_invariant: bool,
                 device: torch.device | str = "cpu"):
        super().__init__(pipe, dtype, batch_invariant, device)
        self.clips = [(pipe.load("tokenizer"), self._encoder("text_encoder")),
                      (pipe.load("tokenizer_2"), self._encoder("text_encoder_2"))]
        self.clip_tokens = self.clips[0][0].model_max_length  # both CLIPs take the first tokenizer's length
        self.t5 = None
        if pipe.has("text_encoder_3"):
            self.t5 = (pipe.load("tokenizer_3"), self._encoder("text_encoder_3"))
        else:  # no T5: its tokens are zeros as wide as the transformer's joint attention
            width = pipe.config("transformer").get("joint_attention_dim")
            if not isinstance(width, int):
                raise EngineConfigError(f"{pipe.root / 'transformer' / 'config.json'}: no joint_attention_dim "
                                        "(the width of the text tokens when the pipeline has no text_encoder_3)")
            self.t5_width = width

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        hidden, pooled = [], []
        for tokenizer, encoder in self.clips:
            out = encoder(self._ids(tokenizer, prompts, self.clip_tokens), output_hidden_states=True)
            pooled.append(out[0])               # the projected pooled output
            hidden.append(out.hidden_states[-2])  # SD3 conditions on the penultimate layer
        clip = torch.cat(hidden, dim=-1)
        if self.t5 is None:
            t5 = torch.zeros(len(prompts), SD3_T5_TOKENS, self.t5_width, dtype=clip.dtype, device=clip.device)
        else:
            tokenizer, encoder = self.t5
            t5 = encoder(self._ids(tokenizer, prompts, SD3_T5_TOKENS))[0].to(clip.dtype)
        clip = F.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return {"embeddings": torch.cat([clip, t5], dim=-2), "pooled_embeddings": torch.cat(pooled, dim=-1)}


class Umt5PromptEncoder(PromptEncoder):
    """WanPipeline: `embeddings` [n, 512, width] from the UMT5 encoder: each prompt's own tokens (its end
    token included), then zero rows, not the encoder's output at the padding."""

    def __init__(self, pipe: PipelineDir, dtype: torch.dtype, batch_invariant: bool,
                 device: torch.device | str = "cpu"):
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        super().__init__(pipe, dtype, batch_invariant, device)
        self.clean = prompt_clean  # WanPipeline's own: HTML unescaped (ftfy where installed), whitespace folded
        self.tokenizer = pipe.load("tokenizer")
        self.encoder = self._encoder("text_encoder")

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        t = self.tokenizer([self.clean(p) for p in prompts], padding="max_length", max_length=WAN_TEXT_TOKENS,
                           truncation=True, add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        mask = t.attention_mask.to(self.device)
        hidden = self.encoder(t.input_ids.to(self.device), mask).last_hidden_state
        return {"embeddings": hidden.masked_fill(mask.unsqueeze(-1) == 0, 0.0)}


class FluxPromptEncoder(PromptEncoder):
    """FluxPipeline: `embeddings` [1, 512, T5 width] and `pooled_embeddings` [1, CLIP width]."""

    def __init__(self, pipe: PipelineDir, dtype: torch.dtype, batch_invariant: bool,
                 device: torch.device | str = "cpu"):
        super().__init__(pipe, dtype, batch_invariant, device)
        self.clip = (pipe.load("tokenizer"), self._encoder("text_encoder"))
        self.t5 = (pipe.load("tokenizer_2"), self._encoder("text_encoder_2"))

    def prompts(self, params: RequestParams) -> list[str]:
        """[prompt]; [negative prompt, prompt] under true classifier-free guidance (`true_cfg_scale > 1` with a
        negative prompt, as FluxPipeline runs it)."""
        if params.negative_prompt and params.true_cfg_scale <= 1.0:
            raise InvalidRequest("params.image.negative_prompt", f"a {self.pipe.pipeline_class} reads a negative "
                                 "prompt only for its true classifier-free guidance: set params.image.true_cfg_scale "
                                 "above 1 (its guidance_scale is the distilled guidance, one row)")
        if params.true_cfg_scale > 1.0 and not params.negative_prompt:
            raise InvalidRequest("params.image.true_cfg_scale", f"a {self.pipe.pipeline_class} runs true "
                                 "classifier-free guidance against a negative prompt: send one "
                                 "(params.image.negative_prompt)")
        return [params.negative_prompt, params.text] if params.true_cfg else [params.text]

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        tokenizer, clip = self.clip
        pooled = clip(self._ids(tokenizer, prompts, tokenizer.model_max_length)).pooler_output
        tokenizer, t5 = self.t5
        return {"embeddings": t5(self._ids(tokenizer, prompts, FLUX_T5_TOKENS))[0], "pooled_embeddings": pooled}


class QwenImagePromptEncoder(PromptEncoder):
    """QwenImagePipeline: `embeddings` [1 or 2, tokens, width] and `embeddings_mask` [1 or 2, tokens] (bool), tokens
    a multiple of `QWEN_IMAGE_TOKEN_BUCKET` (module docstring)."""

    def __init__(self, pipe: PipelineDir, dtype: torch.dtype, batch_invariant: bool,
                 device: torch.device | str = "cpu"):
        super().__init__(pipe, dtype, batch_invariant, device)
        self.tokenizer = pipe.load("tokenizer")
        self.encoder = self._encoder("text_encoder")
        config: Any = self.encoder.config  # Qwen2.5-VL's: the text model's width under text_config
        self.width = int(config.get_text_config().hidden_size)

    def prompts(self, params: RequestParams) -> list[str]:
        """[negative prompt, prompt] under true CFG, which QwenImagePipeline runs when its `true_cfg_scale` (the
        guidance scale) is above 1 and a negative prompt is given; else [prompt]. A negative prompt the scale would
        leave unread, and `true_cfg_scale` (the guidance scale is it here), are refused by name."""
        if params.true_cfg_scale != 1.0:
            raise InvalidRequest("params.image.true_cfg_scale", f"a {self.pipe.pipeline_class}'s true classifier-free "
                                 "guidance scale is its guidance_scale (params.image.guidance_scale)")
        if params.negative_prompt and params.guidance_scale <= 1.0:
            raise InvalidRequest("params.image.negative_prompt", f"a {self.pipe.pipeline_class} reads a negative "
                                 "prompt only under true classifier-free guidance: set params.image.guidance_scale "
                                 "above 1")
        if params.guidance_scale > 1.0 and params.negative_prompt:
            return [params.negative_prompt, params.text]
        return [params.text]

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        ids = [self.tokenizer(QWEN_IMAGE_TEMPLATE.format(p), truncation=True,
                              max_length=QWEN_IMAGE_TOKENIZER_TOKENS + QWEN_IMAGE_DROPPED_TOKENS).input_ids
               for p in prompts]
        embeddings = torch.zeros(len(prompts), QWEN_IMAGE_TEXT_TOKENS, self.width, dtype=self.dtype,
                                 device=self.device)
        mask = torch.zeros(len(prompts), QWEN_IMAGE_TEXT_TOKENS, dtype=torch.bool, device=self.device)
        by_length: dict[int, list[int]] = defaultdict(list)
        for i, row in enumerate(ids):
            by_length[len(row)].append(i)
        for rows in by_length.values():  # unpadded, with the pipeline's all-ones attention mask
            batch = torch.tensor([ids[i] for i in rows], device=self.device)
            # the language model's last hidden states (the pipeline's hidden_states[-1]), no vocabulary projection
            hidden = self.encoder.model(input_ids=batch, attention_mask=torch.ones_like(batch)).last_hidden_state
            kept = hidden[:, QWEN_IMAGE_DROPPED_TOKENS:][:, :QWEN_IMAGE_TEXT_TOKENS]
            index = torch.tensor(rows, device=self.device)
            embeddings[index, :kept.shape[1]] = kept.to(self.dtype)
            mask[index, :kept.shape[1]] = True
        return {"embeddings": embeddings, "embeddings_mask": mask}

    def request_rows(self, encoded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The request's rows cut to its longest prompt's tokens rounded up to `QWEN_IMAGE_TOKEN_BUCKET`."""
        tokens = int(encoded["embeddings_mask"].sum(dim=1).max())
        keep = min(-(-tokens // QWEN_IMAGE_TOKEN_BUCKET) * QWEN_IMAGE_TOKEN_BUCKET, QWEN_IMAGE_TEXT_TOKENS)
        return {name: t[:, :keep].contiguous() for name, t in encoded.items()}


PROMPT_ENCODERS: dict[str, type[PromptEncoder]] = {
    "StableDiffusionPipeline": ClipPromptEncoder,
    "StableDiffusion3Pipeline": Sd3PromptEncoder,
    "WanPipeline": Umt5PromptEncoder,
    # The same text encoder and prompt encoding (its own prompt cleaning needs ftfy installed; WanPipeline's
    # uses it where it is installed, and folds whitespace alike where it is not).
    "WanImageToVideoPipeline": Umt5PromptEncoder,
    "FluxPipeline": FluxPromptEncoder,
    "QwenImagePipeline": QwenImagePromptEncoder,
    "FluxKontextPipeline": FluxPromptEncoder,
}


def prompt_encoder(pipe: PipelineDir, dtype: torch.dtype, batch_invariant: bool,
                   device: torch.device | str = "cpu") -> PromptEncoder:
    cls = PROMPT_ENCODERS.get(pipe.pipeline_class)
    if cls is None:
        raise EngineConfigError(f"{pipe.index_file}: the text-encoder stage has no prompt encoding for a "
                                f"{pipe.pipeline_class} (known: {', '.join(PROMPT_ENCODERS)})")
    return cls(pipe, dtype, batch_invariant, device)
