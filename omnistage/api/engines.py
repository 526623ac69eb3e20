"""What each engine adapter serves, reads and emits: the contract a topology is checked against.

A stage is served by the adapter of its `engine`, `kind` and `component`. Each adapter reads some of
what its producers emit (the `emits` vocabulary is what edges carry) and emits a fixed set; validation
refuses a topology that no adapter can serve, a stage that claims to emit what its adapter does not,
and an edge whose producer emits nothing the consumer reads. Several families may serve the same
(engine, kind, component) (the Thinker of Qwen3-Omni and of Qwen2.5-Omni): their entries must read and
emit the same, since validation cannot see the checkpoint. The stage service's engine classes name
their entry here (`ADAPTER`, or `ADAPTERS` for a class serving several, like the denoise loop for UNets
and DiTs), and the engine registry checks that the model it loads agrees with the stage.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Adapter:
    name: str
    engines: tuple[str, ...]
    kind: str
    component: str                    # "" for a whole model (no component)
    emits: frozenset[str]
    reads: frozenset[str] = frozenset()      # what it can take from a producer's edge
    needs: frozenset[str] = frozenset()      # what some input edge must carry (a subset of reads)
    inputs: frozenset[str] = frozenset({"text"})  # the request's content parts it reads (text, image, ...)
    initial_chunk: bool = False              # emits its first chunk at the stage's initialChunkSize

    @property
    def is_entry(self) -> bool:
        return not self.reads


CAUSAL_LM = Adapter("causal-lm", ("vllm", "transformers"), "ar", "", frozenset({"text", "tokens"}),
                    reads=frozenset({"tokens", "hidden"}))


MEDIA_INPUTS = frozenset({"text", "image", "audio", "video"})


def _omni(family: str, decoder: str) -> tuple[Adapter, Adapter, Adapter, Adapter]:
    """An omni family's Thinker, Talker, audio decoder (the `decoder` component) and the Thinker's encoders
    as a stage of their own (`kind: encoder`, opt-in: without one the Thinker runs them inline). Every
    family's parts share (engine, kind, component) and so read and emit the same: validation cannot see
    the checkpoint, the engine registry picks the family by its architecture."""
    return (Adapter(f"{family}-thinker", ("transformers",), "ar", "thinker", frozenset({"text", "tokens", "hidden"}),
                    reads=frozenset({"media"}), inputs=MEDIA_INPUTS),
            Adapter(f"{family}-talker", ("transformers",), "ar", "talker", frozenset({"codes"}),
                    reads=frozenset({"hidden"}), needs=frozenset({"hidden"}), initial_chunk=True),
            Adapter(f"{family}-{decoder}", ("transformers",), "generation", decoder, frozenset({"audio"}),
                    reads=frozenset({"codes"}), needs=frozenset({"codes"})),
            Adapter(f"{family}-encoder", ("transformers",), "encoder", "encoder", frozenset({"media"}),
                    inputs=MEDIA_INPUTS))


QWEN3_OMNI_THINKER, QWEN3_OMNI_TALKER, QWEN3_OMNI_CODE2WAV, QWEN3_OMNI_ENCODER = _omni("qwen3-omni", "code2wav")
# The omni Thinkers on vLLM (stage_service/engines/vllm/thinker.py): the same rows out; text prompts in, and
# audio, images and video from an encoder stage.
OMNI_THINKER_VLLM = Adapter("omni-thinker-vllm", ("vllm",), "ar", "thinker", frozenset({"text", "tokens", "hidden"}),
                            reads=frozenset({"media"}))
QWEN2_5_OMNI_THINKER, QWEN2_5_OMNI_TALKER, QWEN2_5_OMNI_TOKEN2WAV, QWEN2_5_OMNI_ENCODER = _omni("qwen2.5-omni",
                                                                                            "token2wav")

# Diffusers: `component` is the pipeline's sub-folder. The text-encoder stage also reads the other text
# encoders and tokenizers its pipeline class uses (SD3: text_encoder_2, and text_encoder_3 when present).
TEXT_ENCODER = Adapter("text-encoder", ("diffusers",), "generation", "text_encoder", frozenset({"embeddings"}))
DENOISER = Adapter("denoiser", ("diffusers",), "diffusion", "unet", frozenset({"latents"}),
                   reads=frozenset({"embeddings"}), needs=frozenset({"embeddings"}))
DIT_DENOISER = Adapter("dit-denoiser", ("diffusers",), "diffusion", "transformer", frozenset({"latents"}),
                       reads=frozenset({"embeddings"}), needs=frozenset({"embeddings"}))
VAE_DECODER = Adapter("vae-decoder", ("diffusers",), "generation", "vae", frozenset({"image"}),
                      reads=frozenset({"latents"}), needs=frozenset({"latents"}))

ADAPTERS = (CAUSAL_LM, QWEN3_OMNI_THINKER, QWEN3_OMNI_TALKER, QWEN3_OMNI_CODE2WAV, TEXT_ENCODER, DENOISER,
            DIT_DENOISER, VAE_DECODER, QWEN2_5_OMNI_THINKER, QWEN2_5_OMNI_TALKER, QWEN2_5_OMNI_TOKEN2WAV,
            QWEN3_OMNI_ENCODER, QWEN2_5_OMNI_ENCODER, OMNI_THINKER_VLLM)


ENGINE_NAMES = tuple(dict.fromkeys(e for a in ADAPTERS for e in a.engines))


def engines_for_kind(kind: str) -> tuple[str, ...]:
    """Engines with some adapter for this kind of stage, in catalog order."""
    out: list[str] = []
    for a in ADAPTERS:
        if a.kind == kind:
            out += [e for e in a.engines if e not in out]
    return tuple(out)


def components_for(engine: str, kind: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(a.component for a in ADAPTERS if a.kind == kind and engine in a.engines))


def adapters_for(engine: str, kind: str, component: str) -> tuple[Adapter, ...]:
    """Every adapter that may serve such a stage (one per model family), in catalog order."""
    return tuple(a for a in ADAPTERS if engine in a.engines and a.kind == kind and a.component == component)


def adapter_for(engine: str, kind: str, component: str) -> Adapter | None:
    """The contract validation checks such a stage against (every adapter of `adapters_for` agrees on it)."""
    found = adapters_for(engine, kind, component)
    return found[0] if found else None


def _check_catalog() -> None:
    for a in ADAPTERS:
        for e in a.engines:
            first = adapter_for(e, a.kind, a.component)
            if (a.emits, a.reads, a.needs, a.inputs, a.initial_chunk) != (
                    first.emits, first.reads, first.needs, first.inputs, first.initial_chunk):
                raise AssertionError(f"adapters {first.name} and {a.name} serve the same stages but read or emit "
                                     "different things: validation could not tell which one a stage gets")


_check_catalog()
