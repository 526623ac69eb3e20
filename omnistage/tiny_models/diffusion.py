"""A tiny Stable-Diffusion-style pipeline: CLIP text encoder, UNet2DCondition, AutoencoderKL, DDIM.

Saved in the standard diffusers layout, so each stage loads its own component folder; the denoiser is
sharded with an index, as large published denoisers are. `save_sharded` is shared with the SD3 builder.
"""

from __future__ import annotations

from pathlib import Path

WEIGHTS = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX = WEIGHTS + ".index.json"


def save_sharded(model, folder: Path, shards: int = 2) -> None:
    """Re-save a diffusers model into `folder` as at least `shards` safetensors files plus their index,
    replacing the single file `save_pretrained` wrote there."""
    total = sum(t.nbytes for t in model.state_dict().values())
    (folder / WEIGHTS).unlink(missing_ok=True)
    model.save_pretrained(folder, max_shard_size=total // shards + 1)
    if not (folder / WEIGHTS_INDEX).exists():
        raise RuntimeError(f"{folder}: saving in {shards} shards wrote no {WEIGHTS_INDEX}")


def build(out: Path, seed: int = 0) -> None:
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, PreTrainedTokenizerFast

    from omnistage.tiny_models.tokenizers_local import train_bpe

    torch.manual_seed(seed)
    tok = train_bpe(300, ["<unk>", "<|startoftext|>", "<|endoftext|>", "<pad>"])
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<|startoftext|>",
                                     eos_token="<|endoftext|>", pad_token="<pad>", model_max_length=77)
    clip = CLIPTextConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=77, projection_dim=32, bos_token_id=1,
                          eos_token_id=2, pad_token_id=3)
    unet = UNet2DConditionModel(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
                                block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
                                attention_head_dim=8, norm_num_groups=8)
    vae = AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(16, 32),
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        latent_channels=4, norm_num_groups=8, sample_size=32)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=CLIPTextModel(clip), tokenizer=hf_tok, unet=unet,
                                   scheduler=DDIMScheduler(beta_schedule="scaled_linear"), safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out)
    save_sharded(unet, out / "unet")
