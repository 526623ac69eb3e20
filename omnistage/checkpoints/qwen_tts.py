"""Qwen3-TTS's own classes (the `qwen-tts` package its authors publish) under the transformers omnistage runs.

`qwen-tts` (the release `VERSION` names) is written against transformers 4.57 and pins it; omnistage installs it
at pyproject.toml's `[tool.omnistage]` no-deps pin without its dependencies (`scripts/install_qwen_tts.sh`, run by
`make setup` and in the image's build) and imports its 12 Hz parts through `classes()`, which bridges the few
names transformers 5 changed, in omnistage's process only and without touching the package:

- `check_model_inputs` became a bare decorator (the package calls it with `()`): both forms are accepted
  while the package's modules are imported;
- the mask builders' `input_embeds=` became `inputs_embeds=` and they no longer take `cache_position`;
- RoPE's `"default"` initializer left `ROPE_INIT_FUNCTIONS` (each model computes it itself now): the table
  gets it back, as transformers 4 computed it;
- configs no longer carry `pad_token_id` by default: `load_config` sets it where config.json has none;
- models are built on the meta device and buffers come back only through a class's `_init_weights`, which the
  package's classes predate: their RoPE frequencies (`inv_freq`, not saved) come out unset. `with_rope_buffers`
  computes them again on a loaded model, as the module's own `__init__` did;
- `_tied_weights_keys` became a mapping (tied name -> source): the package's lists name heads that transformers
  4 tied only under `tie_word_embeddings`, which Qwen3-TTS's configs set false, so they become empty mappings.

The package's `__init__` modules import its 25 Hz speech tokenizer, which needs torchaudio, sox and
onnxruntime (none installed: torchaudio's builds do not load against this torch). The 12 Hz checkpoints never
use it, so the package is entered below its `__init__`s and the 25 Hz model class stands as `Unserved25Hz`,
which refuses to be built, naming why.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import threading
import types
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from omnistage.checkpoints.configs import CheckpointError

PACKAGE = "qwen_tts"
# The release the bridges below are written for: pyproject.toml's no-deps pin, which scripts/install_qwen_tts.sh
# installs (tests/unit/test_dockerfile.py holds the two equal; an installed omnistage has no pyproject.toml).
VERSION = "0.1.1"
SPEECH_TOKENIZER_DIR = "speech_tokenizer"  # the 12 Hz codec's sub-folder of a published checkpoint
_lock = threading.Lock()
_classes: "QwenTtsClasses | None" = None


class QwenTtsMissing(CheckpointError):
    """The qwen-tts package is not installed."""


class Unserved25Hz:
    """Stands for the 25 Hz speech tokenizer's model class: never built by omnistage (see the module doc)."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise CheckpointError("the 25 Hz Qwen3-TTS speech tokenizer is not served: it needs torchaudio, sox and "
                              "onnxruntime; omnistage serves the 12 Hz checkpoints")


@dataclass(frozen=True)
class QwenTtsClasses:
    """The package's classes omnistage uses."""
    config: type          # Qwen3TTSConfig
    model: type           # Qwen3TTSForConditionalGeneration
    processor: type       # Qwen3TTSProcessor
    codec_config: type    # Qwen3TTSTokenizerV2Config (the 12 Hz speech tokenizer)
    codec: type           # Qwen3TTSTokenizerV2Model
    talker: type          # Qwen3TTSTalkerForConditionalGeneration (the talker and its code predictor)
    codec_decoder: type   # Qwen3TTSTokenizerV2Decoder (codes -> waveform)
    wrapper: type         # inference's Qwen3TTSModel (generate_custom_voice, ...)
    speaker_encoder: type  # Qwen3TTSSpeakerEncoder (a Base checkpoint's: mel spectrogram -> speaker row)
    codec_encoder: type   # Qwen3TTSTokenizerV2Encoder (the speech tokenizer's Mimi encoder: waveform -> codes)
    mel_spectrogram: Any  # the function the speaker encoder's input is computed with


def _decorator_either_way(decorator):
    """`decorator` usable bare (`@d`) or called (`@d()` / `@d(**options)`), as transformers 4 wrote it."""
    def either(func=None, **_options):
        return decorator if func is None else decorator(func)
    return either


def _renamed_mask_arguments(build):
    """A transformers 5 mask builder that takes transformers 4's argument names."""
    def call(*args, input_embeds=None, cache_position=None, **kwargs):
        if input_embeds is not None:
            kwargs["inputs_embeds"] = input_embeds
        return build(*args, **kwargs)
    return call


def _default_rope(config, device=None, seq_len=None):
    """transformers 4's "default" RoPE: inverse frequencies over the head dimension, no scaling."""
    import torch

    base = getattr(config, "rope_theta", None)
    if base is None:
        base = config.rope_parameters["rope_theta"]
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    steps = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float)
    return 1.0 / (base ** (steps / dim)), 1.0


@contextmanager
def _transformers4_names() -> Iterator[None]:
    """While the package's modules import: the names they take from transformers, as transformers 4 had them."""
    import transformers.masking_utils as masks
    import transformers.utils.generic as generic
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    ROPE_INIT_FUNCTIONS.setdefault("default", _default_rope)  # read when a model is built: it stays
    saved = (generic.check_model_inputs, masks.create_causal_mask, masks.create_sliding_window_causal_mask)
    generic.check_model_inputs = _decorator_either_way(generic.merge_with_config_defaults)
    masks.create_causal_mask = _renamed_mask_arguments(saved[1])
    masks.create_sliding_window_causal_mask = _renamed_mask_arguments(saved[2])
    try:
        yield
    finally:
        generic.check_model_inputs, masks.create_causal_mask, masks.create_sliding_window_causal_mask = saved


def _package_shell(name: str, path: Path) -> types.ModuleType:
    """A package module for `name` at `path` whose `__init__` is not run."""
    module = types.ModuleType(name)
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = [str(path)]
    module.__spec__, module.__path__ = spec, [str(path)]
    sys.modules[name] = module
    return module


def classes() -> QwenTtsClasses:
    """The package's classes (imported once per process); QwenTtsMissing when it is not installed."""
    global _classes
    with _lock:
        if _classes is None:
            _classes = _import()
        return _classes


def _import() -> QwenTtsClasses:
    spec = importlib.util.find_spec(PACKAGE) if PACKAGE not in sys.modules else sys.modules[PACKAGE].__spec__
    if spec is None or not spec.submodule_search_locations:
        raise QwenTtsMissing(f"Qwen3-TTS needs the qwen-tts package (qwen-tts=={VERSION}, installed without its "
                             "dependencies): the image carries it; elsewhere scripts/install_qwen_tts.sh installs "
                             "it (`make setup` runs it)")
    root = Path(list(spec.submodule_search_locations)[0])
    with _transformers4_names():
        if PACKAGE not in sys.modules:
            _package_shell(PACKAGE, root)
        core = sys.modules.get(f"{PACKAGE}.core") or _package_shell(f"{PACKAGE}.core", root / "core")
        v1 = importlib.import_module(f"{PACKAGE}.core.tokenizer_25hz.configuration_qwen3_tts_tokenizer_v1")
        v2_config = importlib.import_module(f"{PACKAGE}.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2")
        v2 = importlib.import_module(f"{PACKAGE}.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2")
        # What the package's `core/__init__` exports, the 25 Hz model aside.
        core.Qwen3TTSTokenizerV1Config = v1.Qwen3TTSTokenizerV1Config
        core.Qwen3TTSTokenizerV1Model = getattr(core, "Qwen3TTSTokenizerV1Model", Unserved25Hz)
        core.Qwen3TTSTokenizerV2Config = v2_config.Qwen3TTSTokenizerV2Config
        core.Qwen3TTSTokenizerV2Model = v2.Qwen3TTSTokenizerV2Model
        models = importlib.import_module(f"{PACKAGE}.core.models")
        inference = importlib.import_module(f"{PACKAGE}.inference.qwen3_tts_model")
    for module in (models.modeling_qwen3_tts, v2):
        _untie_listed_heads(module)
    modeling = models.modeling_qwen3_tts
    return QwenTtsClasses(models.Qwen3TTSConfig, models.Qwen3TTSForConditionalGeneration, models.Qwen3TTSProcessor,
                          v2_config.Qwen3TTSTokenizerV2Config, v2.Qwen3TTSTokenizerV2Model,
                          modeling.Qwen3TTSTalkerForConditionalGeneration, v2.Qwen3TTSTokenizerV2Decoder,
                          inference.Qwen3TTSModel, modeling.Qwen3TTSSpeakerEncoder, v2.Qwen3TTSTokenizerV2Encoder,
                          modeling.mel_spectrogram)


def _untie_listed_heads(module: types.ModuleType) -> None:
    from transformers import PreTrainedModel

    for value in vars(module).values():
        if isinstance(value, type) and issubclass(value, PreTrainedModel) and \
                isinstance(value.__dict__.get("_tied_weights_keys"), list):
            value._tied_weights_keys = {}


def with_rope_buffers(model):
    """`model` (loaded by transformers 5) with every rotary embedding's frequencies computed as its `__init__`
    computes them (see the module docstring)."""
    import torch

    with torch.no_grad():
        for module in model.modules():
            init = getattr(module, "rope_init_fn", None)
            if init is None or not isinstance(getattr(module, "inv_freq", None), torch.Tensor):
                continue
            inv_freq, module.attention_scaling = init(module.config, module.inv_freq.device)
            module.inv_freq = inv_freq.to(module.inv_freq.dtype)  # a registered buffer: stays one
            module.original_inv_freq = module.inv_freq
    return model


def reference_model(root: str | Path):
    """The package's own inference wrapper (`Qwen3TTSModel`: generate_custom_voice, ...) over a checkpoint, as
    qwen-tts loads it, ready under transformers 5: what omnistage's staged Qwen3-TTS is measured against."""
    wrapper = classes().wrapper.from_pretrained(str(root), config=load_config(root))
    with_rope_buffers(wrapper.model)
    with_rope_buffers(wrapper.model.speech_tokenizer.model)
    return wrapper


def greedy_speech(model, text: str, speaker: str, frames: int, instruction: str | None = None,
                  language: str = "Auto", clip: tuple | None = None, ref_text: str | None = None):
    """`reference_model`'s speech for one request as the staged pipeline makes it: greedy (talker and code
    predictor), reading the text as it speaks (`non_streaming_mode` off), at most `frames` codec frames. With
    `clip` ((samples, sample rate)), a Base checkpoint's voice clone of it (`generate_voice_clone`: ICL mode with
    its transcript `ref_text`, x-vector mode without; `speaker` and `instruction` unread). Returns (waveform as
    floats, sample rate)."""
    greedy = dict(non_streaming_mode=False, do_sample=False, subtalker_dosample=False, max_new_tokens=frames + 1)
    if clip is not None:
        wavs, rate = model.generate_voice_clone(text, language=language, ref_audio=clip, ref_text=ref_text,
                                                x_vector_only_mode=not ref_text, **greedy)
    else:
        wavs, rate = model.generate_custom_voice(text, speaker=speaker, language=language, instruct=instruction,
                                                 **greedy)
    return wavs[0], rate


def with_pad_token(config):
    """`config` with `pad_token_id` (None) on it and its talker configs where config.json gives none: the
    package's modules read it, and transformers 5 configs no longer default it."""
    talker = getattr(config, "talker_config", None)
    for c in (config, talker, getattr(talker, "code_predictor_config", None)):
        if c is not None and "pad_token_id" not in c.__dict__:
            c.pad_token_id = None
    return config


def load_config(root: str | Path):
    """A Qwen3-TTS checkpoint's Qwen3TTSConfig, ready for the package's modules."""
    return with_pad_token(classes().config.from_pretrained(str(root)))
