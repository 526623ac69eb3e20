"""Which component classes a diffusers pipeline's `model_index.json` may name.

Each component's `[library, class]` is imported and its `from_pretrained` called, as
`DiffusionPipeline.from_pretrained` does: a library that is any importable module is code execution
chosen by the checkpoint (a `models.<name>.evil` next to the weights, or any installed module's import
side effects). So a stage loads only the pairs below unless it sets `trustRemoteCode: true`; the stage
service (`PipelineDir`) and `omnistage models check` refuse the same pairs, by component, library and class.
"""

from __future__ import annotations

# The classes the served families' published checkpoints name (sd: StableDiffusionPipeline, sd3:
# StableDiffusion3Pipeline, wan: WanPipeline, wan_i2v: WanImageToVideoPipeline, flux: FluxPipeline, qwen_image:
# QwenImagePipeline; `omnistage/families`), and the tokenizer and processor classes transformers writes for them.
# The families list their components, not these classes, so the set is explicit: a new family adds its own.
COMPONENT_CLASSES: frozenset[tuple[str, str]] = frozenset({
    ("diffusers", "UNet2DConditionModel"),          # sd denoiser
    ("diffusers", "SD3Transformer2DModel"),         # sd3 denoiser
    ("diffusers", "AutoencoderKL"),                 # sd, sd3, flux: VAE
    ("diffusers", "FluxTransformer2DModel"),        # flux denoiser
    ("diffusers", "WanTransformer3DModel"),         # wan denoiser
    ("diffusers", "AutoencoderKLWan"),              # wan: the causal video VAE
    ("diffusers", "QwenImageTransformer2DModel"),   # qwen_image denoiser
    ("diffusers", "AutoencoderKLQwenImage"),        # qwen_image: its one-frame causal VAE
    ("transformers", "CLIPTextModel"),              # sd text encoder; flux text encoder 1 (pooled)
    ("transformers", "CLIPTextModelWithProjection"),  # sd3 text encoders 1 and 2
    ("transformers", "T5EncoderModel"),             # sd3 text encoder 3; flux text encoder 2
    ("transformers", "UMT5EncoderModel"),           # wan text encoder
    ("transformers", "Qwen2_5_VLForConditionalGeneration"),  # qwen_image text encoder
    ("transformers", "Qwen2Tokenizer"),             # qwen_image tokenizer
    ("transformers", "CLIPTokenizer"),
    ("transformers", "CLIPTokenizerFast"),
    ("transformers", "T5Tokenizer"),
    ("transformers", "T5TokenizerFast"),
    ("transformers", "TokenizersBackend"),          # what transformers 5 writes for a fast tokenizer
    ("transformers", "CLIPImageProcessor"),         # sd's feature extractor (never loaded); wan i2v's image processor
    ("transformers", "CLIPImageProcessorPil"),      # what transformers 5 writes for it
    ("transformers", "CLIPVisionModel"),            # wan i2v image encoder
})

# Schedulers are every class of diffusers' own whose name ends so (dozens, all configs with no code of their
# own): the library is fixed, so the class cannot bring a module with it.
SCHEDULER_LIBRARY, SCHEDULER_SUFFIX = "diffusers", "Scheduler"


def allowed(library: object, name: object) -> bool:
    """Whether a component's `[library, class]` is one omnistage loads without `trustRemoteCode`."""
    if not isinstance(library, str) or not isinstance(name, str):
        return False
    if library == SCHEDULER_LIBRARY and name.endswith(SCHEDULER_SUFFIX) and name.isidentifier():
        return True
    return (library, name) in COMPONENT_CLASSES


def refusal(component: str, entry: object, trust_remote_code: bool) -> str | None:
    """Why a component's `model_index.json` entry may not be loaded (None: it may): the entry is not
    `[library, class]`, or the pair is outside the allowlist and the stage does not trust remote code."""
    if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, str) for x in entry)):
        return f'component "{component}" is {entry!r}, not [library, class]'
    library, name = entry
    if trust_remote_code or allowed(library, name):
        return None
    return (f'component "{component}" names library "{library}", class "{name}": not a class omnistage loads '
            f"from a checkpoint ({', '.join(sorted({lib for lib, _ in COMPONENT_CLASSES}))} classes of the served "
            f"families only); set trustRemoteCode: true on the stage to import it")
