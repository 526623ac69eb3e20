"""What a model family declares: the adapters its stages are served by, the layout of its published
checkpoint, and its engine classes. Pure declarations: no torch, nothing loaded."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

# The engine runtimes a stage can name (`spec.topology.stages[].engine`). A family serves its stages on
# some of them; a new runtime is new stage-service code, a new family is one module.
ENGINES = ("vllm", "transformers", "diffusers")


@dataclass(frozen=True)
class Adapter:
    """The contract of one kind of stage: what it serves, reads and emits. Validation checks a topology
    against it; the stage registry gives the stage the engine class its family maps it to."""
    name: str
    engines: tuple[str, ...]
    kind: str
    component: str                    # "" for a whole model (no component)
    emits: frozenset[str]
    reads: frozenset[str] = frozenset()      # what it can take from a producer's edge
    needs: frozenset[str] = frozenset()      # what some input edge must carry (a subset of reads)
    inputs: frozenset[str] = frozenset({"text"})  # the request's content parts it reads (text, image, ...)
    needs_one: frozenset[str] = frozenset()  # the content parts a request must carry exactly one of (a reference image)
    initial_chunk: bool = False              # emits its first chunk at the stage's initialChunkSize
    language: bool = False                   # reads params.audio.language (a speech recognition stage)
    instructions: bool = False               # reads params.audio.instructions (a text-to-speech stage)
    clones: bool = False                     # may read a reference clip and params.audio.ref_text (voice cloning)

    @property
    def is_entry(self) -> bool:
        return not self.reads

    def contract(self) -> tuple:
        """What validation sees: adapters of several families serving the same stages must agree on it."""
        return (self.emits, self.reads, self.needs, self.inputs, self.needs_one, self.initial_chunk,
                self.language, self.instructions)


@dataclass(frozen=True)
class Part:
    """One component of a combined transformers checkpoint (prefix "" for a whole model)."""
    prefix: str | tuple[str, ...]          # the name prefix of its tensors (or several)
    config: str = ""                       # the part's sub-config key in config.json ("" = the root)
    config_keys: tuple[str, ...] = ()      # dotted keys of config.json the engine reads
    borrows: tuple[str, ...] = ()          # tensors of another part it reads rows of
    tokenizer: bool = False                # reads the tokenizer at the root
    files: tuple[str, ...] = ()            # other files at the root it reads
    optional_files: tuple[str, ...] = ()   # ... where the checkpoint has them
    # The sub-folder holding the part's own config.json and shards ("" = the root): a checkpoint that nests a
    # sub-model (Qwen3-TTS's speech tokenizer in speech_tokenizer/). `config` and `config_keys` are its config's.
    folder: str = ""


@dataclass(frozen=True)
class PipelinePart:
    """One stage component of a diffusers pipeline: the sub-folders whose weights it loads, then those it
    reads configuration from. A trailing "?" marks a sub-folder the published pipeline may leave out
    (null in model_index.json), e.g. SD3 without T5."""
    weights: tuple[str, ...]
    configs: tuple[str, ...] = ()


# Returns {(engine, adapter): engine class}. A function, so that validation (the operator's webhook, `omnistage
# validate`) reads a family without importing torch or vLLM; its imports are real imports, so a renamed
# class fails the type check and the import graph, not a running stage.
EngineTable = Callable[[], Mapping[tuple[str, Adapter], Any]]


@dataclass(frozen=True)
class Family:
    """One model family: a transformers checkpoint class (config.json `architectures[0]`) or a diffusers
    pipeline class (model_index.json `_class_name`), and everything omnistage needs to serve it."""
    name: str                                  # the figure and doc name, e.g. qwen3_omni
    architectures: tuple[str, ...]             # the class names its published checkpoints carry
    adapters: tuple[Adapter, ...]
    engines: EngineTable
    parts: Mapping[str, Part] = field(default_factory=dict)             # transformers: by stage component
    pipeline: Mapping[str, PipelinePart] = field(default_factory=dict)  # diffusers: by stage component
    suffix: bool = False          # architectures match as name suffixes (any *ForCausalLM)
    reads_any_model_on: tuple[str, ...] = ()   # engines that read the model themselves: no architecture check
    # The published pipeline's own default of denoise steps (its `__call__` default; no config file holds
    # it): a pipeline's limits.defaultInferenceSteps when its file sets none. 0: the family has none.
    default_inference_steps: int = 0
    # Its `__call__`'s default guidance scale: a pipeline's limits.defaultGuidanceScale when its file sets none.
    # 0: the family has none.
    default_guidance_scale: float = 0.0
    # Its `__call__`'s default (width, height) where no checkpoint config gives the side (a video pipeline's
    # non-square frame: WanPipeline's 832 x 480): limits.defaultWidth / defaultHeight when the file sets no size.
    default_size: tuple[int, int] | None = None

    def matches(self, architecture: str) -> bool:
        if self.suffix:
            return any(architecture.endswith(a) for a in self.architectures)
        return architecture in self.architectures

    @property
    def components(self) -> tuple[str, ...]:
        return tuple(self.pipeline or self.parts)
