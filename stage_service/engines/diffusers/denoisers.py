"""How the denoise loop calls each diffusers denoiser class: one `DenoiserCall` per class, keyed by the
`_class_name` of the component's `config.json`.

The loop itself (`DenoiseEngine`) is the same for every class: per image its own scheduler object and
step, classifier-free guidance over [unconditional, conditional] rows, one model call per step for
every image in the batch. What differs between classes is only how that call is spelled, which is
what an entry says:

- `latents_kwarg`: the forward argument that takes the (packed) latents;
- `text`: which tensors of the text stage's chunk go to which forward argument, and the config key
  giving each one's width (checked before a request joins a batch);
- `timestep_divisor`: FLUX-style models take t / 1000 where the scheduler's timesteps run to 1000 (the
  timestep cast to the stage dtype first, as FluxPipeline casts it to its latents');
- `guidance_rows`: whether guidance runs over [unconditional, conditional] rows (classifier-free guidance, the
  text stage sending two rows when `guidance_scale > 1`); False: one row per image whatever the scale, which the
  model takes as an input where its config has one (FLUX.1-dev's distilled guidance, through `extra`), and two
  rows, [negative, prompt], only under true classifier-free guidance (FluxPipeline's: a `true_cfg_scale` above 1
  with a negative prompt), combined at that scale, each row taking the guidance scale as its input as before;
- `combine`: how an image's two rows' predictions become the one its scheduler steps with (by default
  classifier-free guidance's `uncond + scale x (cond - uncond)`; QwenImagePipeline's true CFG rescales that to the
  conditional prediction's norm per packed token);
- `latent_channels`: the channels of the latents the loop keeps (and the VAE decodes) from the model's config:
  by default its `out_channels` (else `in_channels`); FLUX and Qwen-Image pack four latent channels into each of
  their inputs; `condition_channels`: those it takes beyond them (by default `in_channels` past `out_channels`);
- `patch`: latent pixels per image token along a side (for the size check and the image's token
  count); `max_latent_side`: the largest latent side the model's position embedding covers;
- `video`: the model denoises a video's latents [batch, channels, latent frames, h, w] (Wan), the frame
  count set by the request's `num_frames` and the VAE's temporal compression; `max_latent_frames`: the
  most latent frames its position embedding covers;
- `image` / `takes_image`: image-to-video (WanImageToVideoPipeline): when the model's config says it takes an image
  (`takes_image`), the reference image's stage sends these per-token tensors (one row, shared by the guidance
  rows; checked like the text's) beside the text stage's; its `condition` channels (the model's `in_channels`
  past its `out_channels`) go beside the latents at every step, as any model whose config has more channels in
  than out takes them;
- `reference_tokens` / `with_reference`: image editing (FluxKontextPipeline): for the pipeline classes in
  `reference_tokens`, the reference image's stage sends the image's VAE latents (`image_latents`, one row, shared by
  the guidance rows); `with_reference` puts them into the forward arguments as tokens after the noise's, with their
  own positions, and the loop keeps the model's prediction for the noise's tokens alone;
- `pins_first_step`: the pipeline classes that pin their scheduler's step index at 0 before the loop
  (`set_begin_index(0)`, as WanPipeline does) rather than have the first step look its timestep up (which
  differs where the schedule repeats its first timestep: WanImageToVideoPipeline looks it up);
- `latents_dtype`: the dtype the loop keeps each image's latents (and its scheduler's state) in, the model's
  input cast to the stage dtype from it; None: the stage dtype, as StableDiffusionPipeline and
  StableDiffusion3Pipeline keep them (in their prompt embeddings' dtype). WanPipeline keeps them in float32;
- `schedule`: extra `set_timesteps` arguments for an image (by default the resolution-dependent
  shift `mu` of a flow-matching scheduler whose config asks for `use_dynamic_shifting`);
- `pack` / `unpack`: the model's latent layout when it is not [batch, channels, h, w] (FLUX and
  Qwen-Image take 2x2 patches as a token sequence);
- `extra`: further forward arguments built from the model's input before packing ([rows, C, h, w]), the text
  tensors and each row's guidance scale (FLUX's `img_ids` / `txt_ids` and its distilled `guidance`, Qwen-Image's
  `img_shapes`);
- `blocks`: how a DiT's forward splits after its first transformer block (step_cache.py), for the step cache
  (`engineArgs.step_cache_threshold`); None: the class runs whole at every step (the UNet);
- `unserved`: why a pipeline of this class's that the loop would run wrongly is refused (from its
  `model_index.json`), rather than served as another pipeline than published.

So a FluxTransformer2DModel (FLUX.1) and a QwenImageTransformer2DModel (Qwen-Image) each plug in as one more entry,
plus, for their text conditioning, a `PromptEncoder` in text.py, not as another engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from omnistage.families import Adapter
from omnistage.families.adapters import DENOISER, DIT_DENOISER
from stage_service.engines.diffusers.step_cache import (
    FLUX_BLOCKS,
    QWEN_IMAGE_BLOCKS,
    SD3_BLOCKS,
    WAN_BLOCKS,
    DitBlocks,
)

Config = dict[str, Any]


@dataclass(frozen=True)
class TextInput:
    kwarg: str         # the model's forward argument
    tensor: str        # the tensor of the text stage's chunk
    width: str         # the config key of its last dimension ("" for a mask)
    per_token: bool    # [rows, tokens, width]; else [rows, width]
    mask: bool = False  # [rows, tokens] (bool): which of the per-token tensor's tokens are the prompt's


def resolution_shift(image_tokens: int, scheduler_cfg: Config) -> float:
    """`mu` of a flow-matching scheduler with `use_dynamic_shifting`: the time shift grows linearly with
    the image's token count, from `base_shift` at `base_image_seq_len` to `max_shift` at `max_image_seq_len`."""
    lo_n, hi_n = scheduler_cfg.get("base_image_seq_len", 256), scheduler_cfg.get("max_image_seq_len", 4096)
    lo, hi = scheduler_cfg.get("base_shift", 0.5), scheduler_cfg.get("max_shift", 1.15)
    return lo + (hi - lo) * (image_tokens - lo_n) / (hi_n - lo_n)


def default_schedule(steps: int, image_tokens: int, scheduler_cfg: Config) -> dict[str, Any]:
    if scheduler_cfg.get("use_dynamic_shifting"):
        return {"mu": resolution_shift(image_tokens, scheduler_cfg)}
    return {}


def _same(x: torch.Tensor, *_: Any) -> torch.Tensor:
    return x


def _nothing(*_: Any) -> dict[str, Any]:
    return {}


def guided(uncond: torch.Tensor, cond: torch.Tensor, scale: float, cfg: Config) -> torch.Tensor:
    """Classifier-free guidance: the unconditional prediction moved `scale` times its distance to the conditional."""
    return uncond + scale * (cond - uncond)


@dataclass(frozen=True)
class DenoiserCall:
    adapter: Adapter
    latents_kwarg: str
    text: tuple[TextInput, ...]
    timestep_divisor: float = 1.0
    guidance_rows: bool = True
    # (unconditional prediction, conditional prediction, guidance scale, model config) -> the image's prediction
    combine: Callable[[torch.Tensor, torch.Tensor, float, Config], torch.Tensor] = guided
    latent_channels: Callable[[Config], int] = lambda cfg: cfg.get("out_channels") or cfg["in_channels"]
    # the channels it takes beyond its latents' (a condition another stage sends: image-to-video)
    condition_channels: Callable[[Config], int] = (
        lambda cfg: cfg["in_channels"] - (cfg.get("out_channels") or cfg["in_channels"]))
    patch: Callable[[Config], int] = lambda cfg: 1
    max_latent_side: Callable[[Config], int | None] = lambda cfg: None
    video: bool = False
    max_latent_frames: Callable[[Config], int | None] = lambda cfg: None
    image: tuple[TextInput, ...] = ()
    takes_image: Callable[[Config], bool] = lambda cfg: False
    reference_tokens: frozenset[str] = frozenset()
    # (forward arguments, the reference's latents [rows, C, h', w'], model config) -> the forward arguments with them
    with_reference: Callable[[dict[str, Any], torch.Tensor, Config], dict[str, Any]] | None = None
    pins_first_step: frozenset[str] = frozenset()
    latents_dtype: torch.dtype | None = None
    schedule: Callable[[int, int, Config], dict[str, Any]] = default_schedule
    pack: Callable[[torch.Tensor, Config], torch.Tensor] = _same
    unpack: Callable[[torch.Tensor, torch.Size, Config], torch.Tensor] = _same
    # (model input before packing, text forward arguments, guidance scale per row, model config) -> forward arguments
    extra: Callable[[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, Config], dict[str, Any]] = _nothing
    blocks: DitBlocks | None = None
    # (model_index.json, the model's config) -> why such a pipeline is not served, or "" (served)
    unserved: Callable[[Config, Config], str] = lambda index, cfg: ""


def wan_unserved(index: Config, cfg: Config) -> str:
    """Wan 2.2 pipelines share WanPipeline's (and WanImageToVideoPipeline's) class but not its loop: two experts
    switched at a timestep (`transformer_2`, `boundary_ratio`), or a timestep per latent token (`expand_timesteps`,
    TI2V-5B). A first-last-frame DiT (FLF2V: `pos_embed_seq_len`) takes two reference images' embeddings."""
    second = index.get("transformer_2")
    if (isinstance(second, list) and any(second)) or index.get("boundary_ratio") is not None:
        return ("a two-expert WanPipeline (transformer_2, boundary_ratio: Wan 2.2 A14B) is not served: the "
                "denoise loop runs one transformer")
    if index.get("expand_timesteps"):
        return "a WanPipeline with expand_timesteps (Wan 2.2 TI2V) is not served: the denoise loop takes one timestep"
    if cfg.get("pos_embed_seq_len"):
        return ("a first-last-frame Wan transformer (pos_embed_seq_len: Wan2.1 FLF2V) is not served: the reference "
                "image's stage sends one image")
    return ""


# FluxPipeline's packing (QwenImagePipeline's too): each 2x2 patch of latents is one token of 4 x the latent channels.
FLUX_PATCH = 2


def flux_pack(x: torch.Tensor, cfg: Config) -> torch.Tensor:
    """[b, c, h, w] -> [b, h/2 x w/2, 4c], as FluxPipeline packs its latents."""
    b, c, h, w = x.shape
    x = x.view(b, c, h // FLUX_PATCH, FLUX_PATCH, w // FLUX_PATCH, FLUX_PATCH).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // FLUX_PATCH) * (w // FLUX_PATCH), c * FLUX_PATCH * FLUX_PATCH)


def flux_unpack(pred: torch.Tensor, shape: torch.Size, cfg: Config) -> torch.Tensor:
    """[b, h/2 x w/2, 4c] -> [b, c, h, w] (`shape`: the model input's before packing)."""
    b, c, h, w = shape
    pred = pred.view(b, h // FLUX_PATCH, w // FLUX_PATCH, c, FLUX_PATCH, FLUX_PATCH).permute(0, 3, 1, 4, 2, 5)
    return pred.reshape(b, c, h, w)


def flux_positions(x: torch.Tensor, image: int = 0) -> torch.Tensor:
    """[h/2 x w/2, 3]: each 2x2 patch of latents `x` [..., h, w] at (image, its row, its column), as FluxPipeline
    numbers them (`_prepare_latent_image_ids`); FluxKontextPipeline numbers its reference image's patches 1."""
    h, w = x.shape[-2] // FLUX_PATCH, x.shape[-1] // FLUX_PATCH
    ids = torch.zeros(h, w, 3)
    ids[..., 0] = image
    ids[..., 1] = ids[..., 1] + torch.arange(h)[:, None]
    ids[..., 2] = ids[..., 2] + torch.arange(w)[None, :]
    return ids.reshape(h * w, 3)


def flux_extra(x: torch.Tensor, text: dict[str, torch.Tensor], guidance: torch.Tensor,
               cfg: Config) -> dict[str, Any]:
    """FluxPipeline's rotary positions, shared by every row: each text token at (0, 0, 0), each latent patch at
    (0, its row, its column); and, where the config embeds it (`guidance_embeds`: FLUX.1-dev, not -schnell), each
    row's guidance scale (float32, as the pipeline passes it)."""
    context = text["encoder_hidden_states"]
    out: dict[str, Any] = {"img_ids": flux_positions(x).to(context.device, context.dtype),
                           "txt_ids": torch.zeros(context.shape[1], 3, device=context.device, dtype=context.dtype)}
    if cfg.get("guidance_embeds"):
        out["guidance"] = guidance.float()
    return out


def flux_with_reference(forward: dict[str, Any], reference: torch.Tensor, cfg: Config) -> dict[str, Any]:
    """FluxKontextPipeline's editing input: the reference image's latents packed as the noise's are, their tokens
    after the noise's in the sequence, their positions after the noise's as (1, row, column)."""
    ids = forward["img_ids"]
    return {**forward,
            "hidden_states": torch.cat([forward["hidden_states"], flux_pack(reference, cfg)], dim=1),
            "img_ids": torch.cat([ids, flux_positions(reference, image=1).to(ids.device, ids.dtype)])}


def flux_schedule(steps: int, image_tokens: int, scheduler_cfg: Config) -> dict[str, Any]:
    """FluxPipeline's (and QwenImagePipeline's): its own sigmas, linspace(1, 1/steps) (unless the scheduler makes flow
    sigmas itself), with the resolution shift `mu` (used where the scheduler shifts dynamically)."""
    sigmas = None if scheduler_cfg.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps)
    return {"sigmas": sigmas, "mu": resolution_shift(image_tokens, scheduler_cfg)}


def flux_unserved(index: Config, cfg: Config) -> str:
    """A FLUX.1 transformer taking channels beyond its latents' (Fill, Depth, Canny: a masked or control image's
    latents packed beside them) is another pipeline's."""
    channels_in, channels_out = cfg.get("in_channels"), cfg.get("out_channels") or cfg.get("in_channels")
    if channels_in != channels_out:
        return (f"a FluxTransformer2DModel with in_channels {channels_in} and out_channels {channels_out} (FLUX.1 "
                "Fill, Depth or Canny) is not served: the denoise loop sends it its latents alone")
    return ""


def qwen_image_extra(x: torch.Tensor, text: dict[str, torch.Tensor], guidance: torch.Tensor,
                     cfg: Config) -> dict[str, Any]:
    """QwenImagePipeline's `img_shapes`: each row's one frame of h/2 x w/2 packed patches (the image tokens' rotary
    positions, centred; the text tokens' follow them)."""
    h, w = x.shape[-2] // FLUX_PATCH, x.shape[-1] // FLUX_PATCH
    return {"img_shapes": [[(1, h, w)]] * len(x)}


def qwen_image_true_cfg(uncond: torch.Tensor, cond: torch.Tensor, scale: float, cfg: Config) -> torch.Tensor:
    """QwenImagePipeline's true CFG (`true_cfg_scale`): guidance, then each packed token's prediction rescaled to the
    norm of the conditional one's (over its 4 x latent channels, as the pipeline takes the norm of its packed
    predictions)."""
    combined = flux_pack(guided(uncond, cond, scale, cfg), cfg)
    cond_norm = torch.norm(flux_pack(cond, cfg), dim=-1, keepdim=True)
    noise_norm = torch.norm(combined, dim=-1, keepdim=True)
    return flux_unpack(combined * (cond_norm / noise_norm), cond.shape, cfg)


def qwen_image_unserved(index: Config, cfg: Config) -> str:
    """Variants of the transformer whose loop is another pipeline's, or which diffusers' own forward cannot run."""
    name = "a QwenImageTransformer2DModel"
    if cfg.get("guidance_embeds"):
        return (f"{name} with guidance_embeds (guidance-distilled) is not served: QwenImagePipeline's guidance is "
                "true CFG over two rows, and the model has no guidance embedding to take a scale")
    if cfg.get("zero_cond_t"):
        return (f"{name} with zero_cond_t (Qwen-Image-Edit-2511) is not served: it denoises beside a reference "
                "image's latents, which the text-to-image loop does not send")
    if cfg.get("use_additional_t_cond") or cfg.get("use_layer3d_rope"):
        return (f"{name} with use_additional_t_cond or use_layer3d_rope (Qwen-Image-Layered) is not served: it "
                "denoises image layers, not one image")
    channels_in, channels_out, patch = cfg.get("in_channels"), cfg.get("out_channels"), cfg.get("patch_size")
    if patch != FLUX_PATCH or not channels_out or channels_in != FLUX_PATCH * FLUX_PATCH * channels_out:
        return (f"{name} with in_channels {channels_in}, out_channels {channels_out} and patch_size {patch} is not "
                "served: QwenImagePipeline packs 2x2 patches of its latents alone (in_channels 4 x out_channels)")
    return ""


DENOISERS: dict[str, DenoiserCall] = {
    "UNet2DConditionModel": DenoiserCall(
        adapter=DENOISER, latents_kwarg="sample",
        text=(TextInput("encoder_hidden_states", "embeddings", "cross_attention_dim", per_token=True),)),
    "SD3Transformer2DModel": DenoiserCall(
        adapter=DIT_DENOISER, latents_kwarg="hidden_states",
        text=(TextInput("encoder_hidden_states", "embeddings", "joint_attention_dim", per_token=True),
              TextInput("pooled_projections", "pooled_embeddings", "pooled_projection_dim", per_token=False)),
        patch=lambda cfg: cfg["patch_size"],
        max_latent_side=lambda cfg: cfg["pos_embed_max_size"] * cfg["patch_size"], blocks=SD3_BLOCKS),
    # Wan's patches are (frames, height, width) = (1, 2, 2): square in space. Its rotary position embedding
    # has `rope_max_seq_len` positions along each of time, height and width. Wan2.1-I2V's DiT also attends to the
    # reference image's CLIP embeddings (`image_dim`) and takes 20 condition channels (mask + the VAE's latents).
    "WanTransformer3DModel": DenoiserCall(
        adapter=DIT_DENOISER, latents_kwarg="hidden_states",
        text=(TextInput("encoder_hidden_states", "embeddings", "text_dim", per_token=True),),
        patch=lambda cfg: cfg["patch_size"][2],
        max_latent_side=lambda cfg: cfg["rope_max_seq_len"] * cfg["patch_size"][2],
        video=True, max_latent_frames=lambda cfg: cfg["rope_max_seq_len"] * cfg["patch_size"][0],
        image=(TextInput("encoder_hidden_states_image", "image_embeddings", "image_dim", per_token=True),),
        takes_image=lambda cfg: cfg.get("image_dim") is not None,
        pins_first_step=frozenset({"WanPipeline"}), unserved=wan_unserved,
        # WanPipeline's prepare_latents(..., torch.float32): UniPC steps float32 latents whatever the model's dtype
        latents_dtype=torch.float32, blocks=WAN_BLOCKS),
    # FLUX.1: 2x2 latent patches packed into tokens, rotary positions, t / 1000; FLUX.1-dev's guidance is an input
    # (distilled), not a second row; T5 tokens as the text and CLIP's pooled output beside them.
    "FluxTransformer2DModel": DenoiserCall(
        adapter=DIT_DENOISER, latents_kwarg="hidden_states",
        text=(TextInput("encoder_hidden_states", "embeddings", "joint_attention_dim", per_token=True),
              TextInput("pooled_projections", "pooled_embeddings", "pooled_projection_dim", per_token=False)),
        timestep_divisor=1000.0, guidance_rows=False,
        latent_channels=lambda cfg: (cfg.get("out_channels") or cfg["in_channels"]) // (FLUX_PATCH * FLUX_PATCH),
        patch=lambda cfg: FLUX_PATCH, pins_first_step=frozenset({"FluxPipeline", "FluxKontextPipeline"}),
        schedule=flux_schedule, pack=flux_pack, unpack=flux_unpack, extra=flux_extra, blocks=FLUX_BLOCKS,
        unserved=flux_unserved,
        # FLUX.1 Kontext: the same transformer, the image to edit as tokens after the noise's
        reference_tokens=frozenset({"FluxKontextPipeline"}), with_reference=flux_with_reference),
    # Qwen-Image: FLUX's 2x2 packing, sigmas and t / 1000; the prompt's tokens (the text stage's mask says which) as
    # the text; guidance is true CFG over [negative, prompt] rows, rescaled to the conditional prediction's norm.
    "QwenImageTransformer2DModel": DenoiserCall(
        adapter=DIT_DENOISER, latents_kwarg="hidden_states",
        text=(TextInput("encoder_hidden_states", "embeddings", "joint_attention_dim", per_token=True),
              TextInput("encoder_hidden_states_mask", "embeddings_mask", "", per_token=False, mask=True)),
        timestep_divisor=1000.0, combine=qwen_image_true_cfg,
        latent_channels=lambda cfg: cfg["in_channels"] // (FLUX_PATCH * FLUX_PATCH),
        condition_channels=lambda cfg: 0,  # in_channels are the packed latents' alone (`qwen_image_unserved`)
        patch=lambda cfg: FLUX_PATCH, pins_first_step=frozenset({"QwenImagePipeline"}), schedule=flux_schedule,
        pack=flux_pack, unpack=flux_unpack, extra=qwen_image_extra, blocks=QWEN_IMAGE_BLOCKS,
        unserved=qwen_image_unserved),
}
