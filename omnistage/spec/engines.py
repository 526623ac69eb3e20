"""What each engine adapter serves, reads and emits: the contract a topology is checked against.

A stage is served by the adapter of its `engine`, `kind` and `component`. Each adapter reads some of
what its producers emit (the `emits` vocabulary is what edges carry) and emits a fixed set; validation
refuses a topology that no adapter can serve, a stage that claims to emit what its adapter does not,
and an edge whose producer emits nothing the consumer reads. The stage service's adapters name their
entry here (`ADAPTER`), and the engine registry checks that the model it loads agrees.
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

    @property
    def is_entry(self) -> bool:
        return not self.reads


CAUSAL_LM = Adapter("causal-lm", ("vllm", "transformers"), "ar", "", frozenset({"text", "tokens"}),
                    reads=frozenset({"tokens", "hidden"}))
QWEN3_OMNI_THINKER = Adapter("qwen3-omni-thinker", ("transformers",), "ar", "thinker",
                             frozenset({"text", "tokens", "hidden"}))
QWEN3_OMNI_TALKER = Adapter("qwen3-omni-talker", ("transformers",), "ar", "talker", frozenset({"codes"}),
                            reads=frozenset({"hidden"}), needs=frozenset({"hidden"}))
QWEN3_OMNI_CODE2WAV = Adapter("qwen3-omni-code2wav", ("transformers",), "generation", "code2wav",
                              frozenset({"audio"}), reads=frozenset({"codes"}), needs=frozenset({"codes"}))
TEXT_ENCODER = Adapter("text-encoder", ("diffusers",), "generation", "text_encoder", frozenset({"embeddings"}))
DENOISER = Adapter("denoiser", ("diffusers",), "diffusion", "unet", frozenset({"latents"}),
                   reads=frozenset({"embeddings"}), needs=frozenset({"embeddings"}))
VAE_DECODER = Adapter("vae-decoder", ("diffusers",), "generation", "vae", frozenset({"image"}),
                      reads=frozenset({"latents"}), needs=frozenset({"latents"}))

ADAPTERS = (CAUSAL_LM, QWEN3_OMNI_THINKER, QWEN3_OMNI_TALKER, QWEN3_OMNI_CODE2WAV, TEXT_ENCODER, DENOISER,
            VAE_DECODER)


ENGINE_NAMES = tuple(dict.fromkeys(e for a in ADAPTERS for e in a.engines))


def engines_for_kind(kind: str) -> tuple[str, ...]:
    """Engines with some adapter for this kind of stage, in catalog order."""
    out: list[str] = []
    for a in ADAPTERS:
        if a.kind == kind:
            out += [e for e in a.engines if e not in out]
    return tuple(out)


def components_for(engine: str, kind: str) -> tuple[str, ...]:
    return tuple(a.component for a in ADAPTERS if a.kind == kind and engine in a.engines)


def adapter_for(engine: str, kind: str, component: str) -> Adapter | None:
    for a in ADAPTERS:
        if engine in a.engines and a.kind == kind and a.component == component:
            return a
    return None
