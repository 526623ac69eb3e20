"""Weight quantization of a torch engine's model at load (`spec.deployment.stages.<name>.quantization`).

The methods, by the name the spec gives them (`omnistage.api.TRANSFORMERS_QUANTIZATION`; validation
accepts them on transformers AR stages: causal LM, Thinker, Talker):

- `int8`: weight-only int8 with one scale per output row (torchao's `Int8WeightOnlyConfig`). Every
  `nn.Linear` of the model is quantized in place, as torchao's default filter picks them, except an
  output head whose weight is the input embedding's (tied: quantizing it would keep a float copy for the
  embedding and add an int8 one, more memory, not less). Embeddings, norms, convolutions and the fused
  MoE expert weights (not `nn.Linear`) stay in the stage's dtype; activations are never quantized. What
  stays in the dtype is then copied off the checkpoint's memory map (`own_memory`), so that the memory of
  the float weights int8 replaced goes. The load still peaks at the model's size in the dtype.

Batch invariance (`invariance.py`) holds as before: its padded `F.linear` reaches torchao's weight-only
linear, which casts the int8 weight to the activations' dtype and runs the same float matmul kernel,
then scales the output rows elementwise, so a row's result still does not depend on its neighbours. The
cast costs a float copy of each weight per call: the method saves memory, not time, on the CPU.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch

from omnistage.api import TRANSFORMERS_QUANTIZATION
from stage_service.runtime.errors import EngineConfigError

log = logging.getLogger("omnistage.stage")

PACKAGE = "torchao"  # the package that implements the methods
# Each method's torchao config, by its spec name (the names are the API's: a test holds the two together).
# set_inductor_config: torchao would tune torch.compile's settings for its kernels; nothing compiles here.
CONFIGS = {
    "int8": lambda ao: ao.Int8WeightOnlyConfig(set_inductor_config=False),
}

# Importing torchao (transformers' from_pretrained does it whenever it is installed, quantized or not) warns
# that its CUDA-only kernel libraries (mxfp8, sm90 cutlass) do not load on a CPU host; no method here uses them.
logging.getLogger(PACKAGE).setLevel(logging.ERROR)


def check_method(stage: str, method: str) -> None:
    """Refuse a method the transformers engine does not apply, naming the ones it does ("" is none)."""
    if method and method not in TRANSFORMERS_QUANTIZATION:
        raise EngineConfigError(f'spec.deployment.stages.{stage}.quantization: "{method}" is not a method the '
                                f"transformers engine applies; it takes {', '.join(TRANSFORMERS_QUANTIZATION)}")


def _torchao(stage: str):
    try:
        import torchao.quantization as ao
    except ImportError as e:
        raise EngineConfigError(f"spec.deployment.stages.{stage}.quantization: the package {PACKAGE} is not "
                                f"installed here ({e}); pip install {PACKAGE}, or unset the field") from None
    return ao


def tied_to_embeddings(model: torch.nn.Module) -> set[int]:
    """The ids of the weights that an embedding of `model` shares (a tied output head's)."""
    return {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}


def quantizes(module: torch.nn.Module, tied: set[int]) -> bool:
    """Whether `int8` quantizes `module`: an `nn.Linear` as torchao's default filter picks it (not the
    multi-head attention's output projection, whose weight that module reads itself), unless its weight
    is an embedding's."""
    return (isinstance(module, torch.nn.Linear)
            and not isinstance(module, torch.nn.modules.linear.NonDynamicallyQuantizableLinear)
            and id(module.weight) not in tied)


def own_memory(model: torch.nn.Module) -> None:
    """Copy every CPU tensor of `model` left in its dtype into memory of its own. transformers loads a
    checkpoint whose dtype is the stage's as windows of each shard's memory map, and one window left (an
    embedding, a norm, a bias) keeps its whole shard mapped: the float weights int8 replaced included, in
    the process's RSS once read (measured: an int8 model as large as the float one)."""
    seen: set[int] = set()
    for module in model.modules():
        for tensors in (module._parameters, module._buffers):
            for t in tensors.values():
                if t is None or id(t) in seen or type(t.data) is not torch.Tensor or t.device.type != "cpu":
                    continue   # a quantized weight (a tensor subclass) owns its new memory already
                seen.add(id(t))
                t.data = t.data.clone()


def quantize_weights(model: torch.nn.Module, method: str, stage: str = "",
                     parts: Iterable[torch.nn.Module] | None = None) -> torch.nn.Module:
    """Quantize `model`'s weights by `method` in place (nothing for ""), on the device they are on, only
    within `parts` when given (sub-modules of `model`); returns the model. An unknown method or a missing
    torchao is an `EngineConfigError` (the stage does not start)."""
    if not method:
        return model
    check_method(stage, method)
    ao = _torchao(stage)
    tied = tied_to_embeddings(model)
    inside = None if parts is None else {id(m) for part in parts for m in part.modules()}
    picked = {id(m) for m in model.modules() if quantizes(m, tied) and (inside is None or id(m) in inside)}
    ao.quantize_(model, CONFIGS[method](ao), filter_fn=lambda m, _: id(m) in picked)
    own_memory(model)
    log.info("stage %s: %d linear layers quantized to %s (weight-only)", stage or "-", len(picked), method)
    return model
