"""The OmniPipeline API (omnistage.io/v1alpha1), declared once.

`spec.topology` says which stages exist and how data flows between them; `spec.deployment` says how
each stage runs; `status` is what the operator reports. Each field's type, default, bounds and
description live here and nowhere else: validation (`validation.py`), building (`loading.py`), the CRD
schema (`crd.py`) and `omnistage explain` (`explain.py`) read these declarations (see `fields.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from omnistage.api.fields import Quantity, api_field
from omnistage.api.ports import API_PORT, API_PORT_NAME, ENV_API_KEYS
from omnistage.families import ENGINES, adapter_for, component_catalog

API_GROUP = "omnistage.io"
API_VERSION = "v1alpha1"
KIND = "OmniPipeline"
PLURAL = "omnipipelines"

STAGE_KINDS = ("ar", "diffusion", "generation", "encoder")
# What stages emit, and so what their edges carry.
# `media`: an encoder stage's prompt ids and encoder rows, for the Thinker it feeds.
# `video`: decoded frames (uint8 [n, H, W, 3]), streamed as a video VAE decodes them.
EMITS = ("text", "tokens", "hidden", "codes", "embeddings", "latents", "audio", "image", "video", "media")
MODALITIES = ("text", "audio", "image", "video")
TRANSPORTS = ("auto", "inline", "shm", "ucx")
DTYPES = ("auto", "float32", "float16", "bfloat16")
# The weight quantization methods the transformers engine applies at load to its AR stages (causal LM, Thinker,
# Talker), by `quantization` name (stage_service/runtime/quantize.py does it): int8, weight-only, one scale
# per output row (torchao). vLLM stages take vLLM's own names, checked against the installed vLLM at start.
TRANSFORMERS_QUANTIZATION = ("int8",)
DEVICES = ("auto", "cpu")
TOLERATION_OPERATORS = ("Equal", "Exists")
TAINT_EFFECTS = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")
# Label keys (an optional DNS-subdomain prefix and "/") and values, as Kubernetes checks them.
LABEL_KEY = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
             r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
LABEL_KEY_HINT = 'must be a label key: an optional DNS prefix and "/", then letters, digits, "-", "_" and "."'
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
LABEL_VALUE_HINT = ('must be a label value: at most 63 letters, digits, "-", "_" and ".", starting and ending '
                    "with a letter or digit")
ROLLOUT_STRATEGIES = ("OneStageAtATime", "Parallel")
FAIRNESS_POLICIES = ("InFlightFirst", "ShortestFirst")
AUTOSCALING_SCALE, AUTOSCALING_RECOMMEND = "Scale", "Recommend"
AUTOSCALING_MODES = (AUTOSCALING_SCALE, AUTOSCALING_RECOMMEND)
# Planned: set by the stage planner (autoscaling); its reason says the last decision.
CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "Planned")
CONDITION_STATUSES = ("True", "False", "Unknown")
DEFAULT_IMAGE = "ghcr.io/omnistage/omnistage:0.1.0"

# Kubernetes objects are named "<pipeline>-<stage>" and "<pipeline>-orchestrator"; Service names
# must be DNS-1035 labels: a letter first, at most 63 characters.
DNS_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS_LABEL_HINT = ('must be lower-case letters, digits and "-", start with a letter and end with a letter or '
                  "digit (it names Kubernetes Services)")
MAX_NAME_LEN = 63
# A Secret's name (a DNS-1123 subdomain) and a key in its data.
SECRET_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SECRET_NAME_HINT = 'must be lower-case letters, digits, "-" and ".", starting and ending with a letter or digit'
SECRET_KEY = r"^[-._a-zA-Z0-9]+$"
SECRET_KEY_HINT = 'must be letters, digits, "-", "_" and "."'
DEFAULT_API_KEYS_KEY = "api-keys"
DEFAULT_HUB_TOKEN_KEY = "token"
DEFAULT_JOBS_STORE_KEY = "url"
# The job store backends the orchestrator opens (orchestrator_service/jobs: open_store).
JOBS_STORE_URL = r"^(sqlite:///|postgresql://|postgres://)[^\s]+$"
JOBS_STORE_URL_HINT = "must be a postgresql://USER:PASS@HOST/DB or sqlite:///FILE URL"
# A pipeline with an output of this modality serves durable jobs (/v1/videos): `omnistage serve` and the operator
# (with the chart's jobs.*) give it a job store when it names none.
JOBS_MODALITY = "video"
ORCHESTRATOR_SUFFIX = "-orchestrator"
RESERVED_STAGE_NAMES = ("orchestrator",)
# A voice name's length, as a request may give it (the request path refuses a longer params.audio.speaker).
MAX_VOICE_CHARS = 64


# ------------------------------------------------------------------------- topology

@dataclass(frozen=True)
class Edge:
    source: str = api_field("The producing stage; its chunks arrive at its chunkSize.", key="stage",
                            required=True)
    transport: str = api_field("How tensors cross this edge: auto (shared memory on one host, else UCX), "
                               "inline (in the gRPC stream), shm or ucx.", default="auto", enum=TRANSPORTS)


@dataclass(frozen=True)
class Stage:
    name: str = api_field("Stage name, unique in the pipeline; names the stage's Kubernetes objects.",
                          required=True, pattern=DNS_LABEL, pattern_hint=DNS_LABEL_HINT,
                          max_length=MAX_NAME_LEN - 2, length_hint="with the pipeline name it names Services")
    kind: str = api_field("ar (token loop), diffusion (denoise loop) or generation (one-shot or chunked).",
                          required=True, enum=STAGE_KINDS)
    engine: str = api_field("The engine serving the stage.", required=True, enum=ENGINES)
    model: str = api_field("Where the weights come from: a folder (absolute, or relative to the model store); "
                           "pvc://CLAIM/PATH (PATH inside an existing PersistentVolumeClaim of the pipeline's "
                           "namespace, mounted read-only in the stage's pods); or hf://ORG/NAME@REVISION (a "
                           "Hugging Face Hub repository at a branch, tag or commit, pulled into "
                           "spec.deployment.modelCache by the stage pod's init container; locally by "
                           "`omnistage models pull`).", required=True)
    emits: tuple[str, ...] = api_field("What the stage emits: what its edges carry and what outputs it can "
                                       "serve; each must be something its engine produces.",
                                       required=True, enum=EMITS, non_empty=True)
    component: str = api_field("Part of a combined checkpoint this stage runs (thinker, talker, code2wav, "
                               "token2wav; a diffusers sub-folder: text_encoder, unet, transformer, vae); "
                               "selects the engine adapter.", default="", catalog=component_catalog)
    trust_remote_code: bool = api_field("Import any component class a diffusers checkpoint's model_index.json "
                                        "names (code the checkpoint chooses); false: only the diffusers and "
                                        "transformers classes of the served families.", default=False)
    inputs: tuple[Edge, ...] = api_field("Edges from producing stages.", default=(), list_map_key="stage",
                                         item="input")
    chunk_size: int = api_field("Units (tokens, frames, steps) per chunk on every edge leaving this stage; "
                                "0 is the whole result in one chunk.", default=0, minimum=0)
    initial_chunk_size: int = api_field("Units in the first chunk on every edge leaving this stage, smaller "
                                        "than chunkSize so consumers (and the client's first audio) start "
                                        "sooner; at most chunkSize, and only on stages that emit one (Talker "
                                        "stages: codec frames). 0: the same as chunkSize.", default=0, minimum=0)

    def chunk_units(self, index: int) -> int:
        """Units the stage's chunk number `index` (0 first) holds before it is handed on; 0: the whole
        result (the last chunk holds whatever is left in any case)."""
        if index == 0 and self.chunk_size and self.initial_chunk_size:
            return self.initial_chunk_size
        return self.chunk_size

    def chunk_due(self, index: int, pending: int, done: bool, *, always_end: bool = False) -> bool:
        """Whether the stage, holding `pending` units not yet handed on, hands on its chunk number `index`
        now: once that chunk is full, and at the end with whatever is left (an empty chunk only when it is
        the first, so every consumer sees an end of stream; or always, with `always_end`, for an engine
        whose end can come with no unit but with what its last chunk must carry: vLLM's finish reason).
        Every engine follows this rule through `stage_service.runtime.base.Chunking`."""
        if done:
            return pending > 0 or index == 0 or always_end
        every = self.chunk_units(index)
        return bool(every) and pending >= every


@dataclass(frozen=True)
class Output:
    modality: str = api_field("What the client receives.", required=True, enum=MODALITIES)
    stage: str = api_field("The stage whose chunks carry it.", required=True)


@dataclass(frozen=True)
class Limits:
    """Bounds on requests: parameters beyond them are INVALID_ARGUMENT; a request that runs past its deadline
    is DEADLINE_EXCEEDED."""

    max_prompt_chars: int = api_field("Longest prompt, in characters (or token ids).", default=8192, minimum=1)
    max_tokens: int = api_field("Most text tokens a request may ask for. 0: the model's context (the text stage's "
                                "engineArgs.max_model_len, else its checkpoint's max_position_embeddings).",
                                default=0, minimum=0)
    default_max_tokens: int = api_field("Text tokens when a request does not say. 0: the checkpoint's "
                                        "generation_config.json max_new_tokens, else 256 (at most the context).",
                                        default=0, minimum=0)
    max_codec_frames: int = api_field("Most audio codec frames a request may ask for.", default=2048, minimum=1)
    default_codec_frames: int = api_field("Audio codec frames when a request does not say.", default=100,
                                          minimum=1)
    default_voice: str = api_field("Voice of the audio output when a request names none (or \"default\"): one of "
                                   "the checkpoint's speakers. \"\": the model's own default (Ethan for Qwen3-Omni, "
                                   "Chelsie for Qwen2.5-Omni), else its first speaker.", default="", empty_ok=True,
                                   max_length=MAX_VOICE_CHARS)
    voice_aliases: Mapping[str, str] = api_field("Other names a request may give a voice by (matched in any case), "
                                                 "each to one of the checkpoint's speakers: e.g. OpenAI's "
                                                 "{alloy: Chelsie}. OpenAI voice names not mapped here are "
                                                 "refused with the list of voices.", default_factory=dict)
    max_image_side: int = api_field("Largest image width or height, in pixels.", default=1024, minimum=1)
    default_image_side: int = api_field("Image width and height when a request does not say. 0: the denoiser's "
                                        "sample_size x the VAE's scale factor, from the checkpoint (1024 for SD3.5, "
                                        "512 for SD 1.5), else 512; at most maxImageSide.", default=0, minimum=0)
    max_inference_steps: int = api_field("Most denoise steps a request may ask for.", default=200, minimum=1)
    default_inference_steps: int = api_field("Denoise steps when a request does not say. 0: the published "
                                             "pipeline's own default (28 for SD3, 50 for SD), else 28.",
                                             default=0, minimum=0)
    default_width: int = api_field("Image or video width when a request does not say. 0: the published video "
                                   "pipeline's own (832 for Wan) when the file sets no defaultImageSide nor "
                                   "defaultHeight, else defaultImageSide.", default=0, minimum=0)
    default_height: int = api_field("Image or video height when a request does not say. 0: the published video "
                                    "pipeline's own (480 for Wan) when the file sets no defaultImageSide nor "
                                    "defaultWidth, else defaultImageSide.", default=0, minimum=0)
    default_guidance_scale: float = api_field("Classifier-free guidance scale when a request does not say (1 or "
                                              "less: unguided). 0: the published pipeline's own default (5.0 for "
                                              "Wan, 7.0 for SD3, 7.5 for SD), else 7.5.", default=0.0, minimum=0,
                                              maximum=100)
    max_frames: int = api_field("Most video frames a request may ask a video pipeline for.", default=81, minimum=1)
    default_frames: int = api_field("Video frames when a request does not say. 0: the published pipeline's own "
                                    "default (81 for Wan), at most maxFrames.", default=0, minimum=0)
    default_fps: int = api_field("Frame rate of a video when a request does not say (16: Wan's).", default=16,
                                 minimum=1)
    max_fps: int = api_field("Highest frame rate a request may ask for.", default=60, minimum=1)
    max_parts: int = api_field("Most media parts (image, audio, video) in one request, across all its messages; "
                               "text is bounded by maxPromptChars.", default=16,
                               minimum=1, maximum=1024)
    max_part_bytes: int = api_field("Largest content part, in bytes as sent (encoded).", default=16 << 20,
                                    minimum=1, maximum=1 << 30)
    max_image_pixels: int = api_field("Most pixels (width x height) of an image or video frame; read from its "
                                      "header, before it is decoded.", default=12845056, minimum=1)
    max_image_aspect_ratio: float = api_field("Most the longer side of an image or video frame may be over its "
                                              "shorter side (the Qwen-VL processors' bound).", default=200.0,
                                              minimum=1.0)
    max_audio_seconds: float = api_field("Longest audio part, in seconds.", default=300.0, minimum=0.001)
    max_video_frames: int = api_field("Most frames in a video part.", default=128, minimum=1)
    max_video_pixels: int = api_field("Most pixels in all frames of a video part together.", default=90316800,
                                      minimum=1)
    # A request's totals over its parts of one kind: what a stage that reads media holds decoded at once (and
    # its processor's work) is the sum, which maxParts alone lets grow to maxParts x the largest part. Each 0
    # (the default) follows the per-part limits, so any request of one part within them passes.
    max_request_audio_seconds: float = api_field("Most audio, in seconds, in all audio parts of a request "
                                                 "together. 0: maxAudioSeconds.", default=0.0, minimum=0)
    max_request_image_pixels: int = api_field("Most pixels in all images of a request together. 0: as many as one "
                                              "video part may hold (maxVideoPixels; 7 images at maxImagePixels by "
                                              "default), at least maxImagePixels.", default=0, minimum=0)
    max_request_video_frames: int = api_field("Most frames in all video parts of a request together. 0: "
                                              "maxVideoFrames.", default=0, minimum=0)
    max_request_video_pixels: int = api_field("Most pixels in all frames of all video parts of a request together. "
                                              "0: maxVideoPixels.", default=0, minimum=0)
    media_decode_seconds: float = api_field("Bound on decoding a request's media parts at admission; beyond it "
                                            "the request is INVALID_ARGUMENT.", default=10.0, minimum=0.001)
    request_timeout_seconds: float = api_field("Deadline of a request whose caller set none (or a later one), "
                                               "from its arrival; past it the request is DEADLINE_EXCEEDED and "
                                               "every stage call is cancelled. 0: no default deadline.",
                                               default=600.0, minimum=0)

    @property
    def request_audio_seconds(self) -> float:
        """maxRequestAudioSeconds as it applies (0: one part's most)."""
        return self.max_request_audio_seconds or self.max_audio_seconds

    @property
    def request_image_pixels(self) -> int:
        """maxRequestImagePixels as it applies (0: one video part's most, and never under one image's)."""
        return self.max_request_image_pixels or max(self.max_video_pixels, self.max_image_pixels)

    @property
    def request_video_frames(self) -> int:
        """maxRequestVideoFrames as it applies (0: one part's most)."""
        return self.max_request_video_frames or self.max_video_frames

    @property
    def request_video_pixels(self) -> int:
        """maxRequestVideoPixels as it applies (0: one part's most)."""
        return self.max_request_video_pixels or self.max_video_pixels

    @property
    def max_request_bytes(self) -> int:
        """The largest request these limits admit: every part at its largest, and 1 MiB for the rest."""
        return self.max_parts * self.max_part_bytes + (1 << 20)


# The largest gRPC message any omnistage service sends or takes (client, orchestrator, stages): a request's
# parts at their limits must fit in one (checked by validation).
MAX_MESSAGE_BYTES = 512 << 20

# What a limit left at 0 ("from the model") comes to when no checkpoint says (`omnistage.checkpoints.defaults`
# reads them where the checkpoints are at hand; `resolve` falls back to these): no bound on max_tokens
# beyond the model's own context, which the engine applies.
# default_frames: WanPipeline's own `num_frames` default (its `__call__`'s; no config file holds it).
MODEL_LIMIT_FALLBACKS = {"default_max_tokens": 256, "default_image_side": 512, "default_inference_steps": 28,
                         "default_frames": 81}
# What limits.defaultGuidanceScale left at 0 comes to when no family says: StableDiffusionPipeline's (the scale
# every request got before it was taken per family).
FALLBACK_GUIDANCE_SCALE = 7.5

# Each request total, when set, must be at least the per-part limit it sums (checked by validation): below it, a
# request of one part within its limit would be refused.
REQUEST_TOTALS = (("max_request_audio_seconds", "max_audio_seconds"),
                  ("max_request_image_pixels", "max_image_pixels"),
                  ("max_request_video_frames", "max_video_frames"),
                  ("max_request_video_pixels", "max_video_pixels"))

# A video's frame count is 1 + FRAME_STEP x k: Wan's VAE keeps the first frame alone and compresses each later
# FRAME_STEP frames into one latent frame (its temporal scale), so no other count decodes.
FRAME_STEP = 4

# Each default must not exceed its maximum (checked by validation, where both are set).
LIMIT_DEFAULTS = (("default_max_tokens", "max_tokens"), ("default_codec_frames", "max_codec_frames"),
                  ("default_image_side", "max_image_side"), ("default_inference_steps", "max_inference_steps"),
                  ("default_frames", "max_frames"), ("default_fps", "max_fps"),
                  ("default_width", "max_image_side"), ("default_height", "max_image_side"))


@dataclass(frozen=True)
class Topology:
    stages: tuple[Stage, ...] = api_field("The stages, in any order; edges say the data flow.", required=True,
                                          non_empty=True, list_map_key="name", item="stage")
    outputs: tuple[Output, ...] = api_field("What the client receives, and from which stage.", required=True,
                                            non_empty=True, list_map_key="modality", item="output")
    limits: Limits = api_field("Bounds on requests: parameters beyond them are INVALID_ARGUMENT; a request past "
                               "its deadline is DEADLINE_EXCEEDED.", default_factory=Limits)


# ----------------------------------------------------------------------- deployment

@dataclass(frozen=True)
class Resources:
    requests: Mapping[str, Quantity] = api_field("Resources reserved per replica (cpu, memory, ...).",
                                                 default_factory=dict)
    limits: Mapping[str, Quantity] = api_field("Resources a replica may use at most.", default_factory=dict)

    def to_dict(self) -> dict:
        """As a container's `resources`, without empty parts."""
        return {part: dict(v) for part, v in (("requests", self.requests), ("limits", self.limits)) if v}


# The vLLM engine arguments a stage entry's own fields set (`stage_service/engines/vllm/ar.py` builds them),
# by the field's path under the entry: `engineArgs` may not set them too, since the GPUs a replica reserves
# and validation follow the fields.
VLLM_ARGS_OF_FIELDS = {
    "tensor_parallel_size": "parallelism.tensor",
    "pipeline_parallel_size": "parallelism.pipeline",
    "data_parallel_size": "parallelism.data",
    "enable_expert_parallel": "parallelism.expert",
    "quantization": "quantization",
}


@dataclass(frozen=True)
class Parallelism:
    tensor: int = api_field("Tensor-parallel degree.", default=1, minimum=1, maximum=1024)
    pipeline: int = api_field("Pipeline-parallel degree.", default=1, minimum=1, maximum=1024)
    data: int = api_field("Data-parallel degree: vLLM's data_parallel_size, engine copies within a replica.",
                          default=1, minimum=1, maximum=1024)
    expert: bool = api_field("Expert parallelism for a mixture-of-experts model (vLLM's enable_expert_parallel): "
                             "the experts are spread over the tensor x data GPUs instead of each split by "
                             "tensor parallelism.", default=False)


@dataclass(frozen=True)
class SchedulerSettings:
    max_batch: int = api_field("Most requests in one engine step.", default=8, minimum=1, maximum=4096)
    max_queued: int = api_field("Requests waiting for a batch slot at most; beyond it the stage refuses "
                                "(RESOURCE_EXHAUSTED).", default=64, minimum=0, maximum=1_000_000)
    max_wait_ms: float = api_field("How long a step waits for more requests to join its batch.", default=2.0,
                                   minimum=0)
    stall_seconds: float = api_field("Liveness bound: an engine step running longer than this, or requests held "
                                     "this long with no step, make the replica not live (/livez 503; the "
                                     "kubelet restarts it).", default=300.0, minimum=0.001)


@dataclass(frozen=True)
class TransferSettings:
    """The stage's data-plane buffers: bytes it may hold for consumers, and how long unfetched ones live."""

    max_buffered_bytes: int = api_field("Bytes held for consumers at most; over it the stage waits.",
                                        default=256 << 20, minimum=1 << 20)
    ttl_seconds: float = api_field("Held chunks nobody fetched are freed after this long.", default=120.0,
                                   minimum=1)


@dataclass(frozen=True)
class Toleration:
    """A taint the stage's pods tolerate (as a pod's `tolerations` entry): GPU nodes are usually tainted."""

    key: str = api_field("The taint's key; empty with operator Exists: every taint.", default="", empty_ok=True,
                         max_length=317)
    operator: str = api_field("Equal: the taint's value must be `value`; Exists: any value.", default="Equal",
                              enum=TOLERATION_OPERATORS)
    value: str = api_field("The taint's value (operator Equal).", default="", empty_ok=True, max_length=63)
    effect: str = api_field("The effect tolerated; empty: every effect.", default="", enum=TAINT_EFFECTS)
    toleration_seconds: int = api_field("How long a NoExecute taint is tolerated once added; 0: for ever.",
                                        default=0, minimum=0, int_format="int64")

    def to_dict(self) -> dict:
        """As a pod's toleration, without empty parts."""
        out = {"key": self.key, "operator": self.operator, "value": self.value, "effect": self.effect,
               "tolerationSeconds": self.toleration_seconds}
        return {k: v for k, v in out.items() if v}


@dataclass(frozen=True)
class RollingUpdate:
    """How many of the stage's pods a rollout adds beyond `replicas` and takes away at once. A GPU stage on
    a full node rolls with maxSurge 0 and maxUnavailable 1 (an old pod gives its GPU back first)."""

    max_surge: int = api_field("Pods above replicas during a rollout.", default=1, minimum=0, maximum=1000)
    max_unavailable: int = api_field("Pods below replicas during a rollout.", default=0, minimum=0, maximum=1000)


@dataclass(frozen=True)
class StageDeployment:
    replicas: int = api_field("Replicas of the stage.", default=1, minimum=0, maximum=1000)
    image: str = api_field("Container image.", default="", default_from="spec.deployment.image")
    resources: Resources = api_field("Kubernetes resources per replica.", default_factory=Resources)
    gpus: int = api_field("GPUs per replica, requested as nvidia.com/gpu; the engine runs on them. A torch "
                          "engine (transformers, diffusers) uses one; a vLLM stage tensor x pipeline x data "
                          "parallel.", default=0, minimum=0, maximum=64)
    device: str = api_field("auto: the stage's GPUs when gpus > 0 (a replica that finds no CUDA device refuses "
                            "to start), the CPU otherwise; cpu: the CPU whatever gpus says.", default="auto",
                            enum=DEVICES)
    gpu_memory_fraction: float = api_field(
        "The share of each of its GPUs the stage may use (vLLM's gpu_memory_utilization; a torch engine's "
        "per-process memory fraction); stages whose fractions add up to at most 1 may share a GPU under "
        "`omnistage serve`. 0: the whole GPU (vLLM keeps its default 0.9).", default=0.0, minimum=0, maximum=1)
    parallelism: Parallelism = api_field("Engine parallelism within a replica.", default_factory=Parallelism)
    dtype: str = api_field("Weights and activations dtype; auto: bfloat16 on a GPU, float32 on the CPU.",
                           default="auto", enum=DTYPES)
    quantization: str = api_field("Quantization method of the weights. vLLM stages: as vLLM names it (vLLM's "
                                  "quantization, e.g. fp8, awq, gptq), checked against the installed vLLM when the "
                                  "stage starts; unset: the checkpoint's own (or none). transformers AR stages "
                                  "(causal LM, Thinker, Talker): int8 (weight-only, torchao), applied at load; "
                                  "unset: the stage's dtype. Not for diffusers stages.", default="",
                                  max_length=64)
    engine_args: Mapping[str, Any] = api_field("Passed to the engine as is (for vLLM, engine arguments by "
                                               "name).", default_factory=dict, free_form=True)
    scheduler: SchedulerSettings = api_field("The stage's step scheduler.", default_factory=SchedulerSettings)
    drain_seconds: float = api_field("Bound on finishing admitted work when a replica stops.", default=30.0,
                                     minimum=0)
    env: Mapping[str, str] = api_field("Extra environment variables of the stage process.", default_factory=dict,
                                       empty_ok=True)
    transfer: TransferSettings = api_field("The stage's data-plane buffers for its consumers.",
                                           default_factory=TransferSettings)
    node_selector: Mapping[str, str] = api_field("Node labels the stage's pods must run on (GPU nodes).",
                                                 default_factory=dict, empty_ok=True)
    tolerations: tuple[Toleration, ...] = api_field("Taints the stage's pods tolerate.", default=())
    affinity: Mapping[str, Any] = api_field("The pods' affinity, as a Kubernetes pod's `affinity`.",
                                            default_factory=dict, free_form=True)
    priority_class_name: str = api_field("The pods' PriorityClass.", default="", pattern=SECRET_NAME,
                                         pattern_hint=SECRET_NAME_HINT, max_length=253)
    runtime_class_name: str = api_field("The pods' RuntimeClass (e.g. nvidia, where the GPU runtime is not the "
                                        "default).", default="", pattern=SECRET_NAME,
                                        pattern_hint=SECRET_NAME_HINT, max_length=253)
    rolling_update: RollingUpdate = api_field("The stage Deployment's rollout surge.",
                                              default_factory=RollingUpdate)


@dataclass(frozen=True)
class ApiKeySecret:
    """Where the OpenAI-compatible API's bearer keys come from: one key of a Secret in the pipeline's
    namespace, its value a comma-separated list of keys."""

    name: str = api_field("The Secret's name.", required=True, default="", pattern=SECRET_NAME,
                          pattern_hint=SECRET_NAME_HINT, max_length=253)
    key: str = api_field("The key of the Secret whose value is the comma-separated list of API keys.",
                         default=DEFAULT_API_KEYS_KEY, pattern=SECRET_KEY, pattern_hint=SECRET_KEY_HINT,
                         max_length=253)


@dataclass(frozen=True)
class OrchestratorHttp:
    """The orchestrator's OpenAI-compatible HTTP API: the same admission, routing and cancellation as the
    gRPC API, on a port of its own."""

    enabled: bool = api_field("Serve the OpenAI-compatible HTTP API.", default=True)
    port: int = api_field(f'Its container and Service port (named "{API_PORT_NAME}"); not the gRPC or HTTP '
                          "status port.", default=API_PORT, minimum=1, maximum=65535)
    api_key_secret: ApiKeySecret = api_field(
        f"A Secret holding the bearer keys a client must send on either API, gRPC or HTTP (it reaches the "
        f"orchestrator as ${ENV_API_KEYS}; comma-separated entries KEY or KEY:N, N the highest priority that key "
        "may ask for); absent: no key needed.", default_factory=ApiKeySecret)

    @property
    def keys_secret(self) -> ApiKeySecret | None:
        """The Secret the keys come from, None when none is named."""
        return self.api_key_secret if self.api_key_secret.name else None


@dataclass(frozen=True)
class OrchestratorTls:
    """The certificate the orchestrator's client-facing ports (gRPC and the HTTP API) serve TLS with: a Secret
    in the pipeline's namespace with tls.crt and tls.key (e.g. cert-manager's), mounted into its pods."""

    secret_name: str = api_field("The Secret's name.", required=True, default="", pattern=SECRET_NAME,
                                 pattern_hint=SECRET_NAME_HINT, max_length=253)


@dataclass(frozen=True)
class JobStoreSecret:
    """A Secret in the pipeline's namespace whose value is the job store's URL (it holds the database password)."""

    name: str = api_field("The Secret's name.", required=True, default="", pattern=SECRET_NAME,
                          pattern_hint=SECRET_NAME_HINT, max_length=253)
    key: str = api_field("The key of the Secret whose value is the URL.", default=DEFAULT_JOBS_STORE_KEY,
                         pattern=SECRET_KEY, pattern_hint=SECRET_KEY_HINT, max_length=253)


@dataclass(frozen=True)
class JobStore:
    """The database the durable jobs (/v1/videos) are kept in, shared by every orchestrator replica: one of a
    URL or a Secret holding it."""

    url: str = api_field("postgresql://USER:PASS@HOST/DB, or sqlite:///FILE for one replica (the file on "
                         "contentVolume). A password here is readable by whoever reads the pipeline: prefer "
                         "secretRef.", default="", pattern=JOBS_STORE_URL, pattern_hint=JOBS_STORE_URL_HINT,
                         max_length=2048)
    secret_ref: JobStoreSecret = api_field("A Secret whose value is the URL (set in the orchestrator's "
                                           "environment by the kubelet).", default_factory=JobStoreSecret)

    @property
    def secret(self) -> JobStoreSecret | None:
        """The Secret the URL comes from, None when none is named."""
        return self.secret_ref if self.secret_ref.name else None

    @property
    def configured(self) -> bool:
        return bool(self.url or self.secret_ref.name)


@dataclass(frozen=True)
class OrchestratorJobs:
    """Durable jobs (/v1/videos and the gRPC Jobs API): where they are kept and how each replica runs them.
    Absent store: the orchestrator refuses job creation (503)."""

    store: JobStore = api_field("The job store: url or secretRef.", default_factory=JobStore)
    content_volume: str = api_field(
        "A PersistentVolumeClaim of the pipeline's namespace where finished content (MP4, thumbnails) is kept, "
        "mounted by every replica (ReadWriteMany with more than one replica: any replica answers any job's "
        "download). Absent: each pod's own volume, lost with the pod.", default="", pattern=SECRET_NAME,
        pattern_hint=SECRET_NAME_HINT, max_length=253)
    ttl_seconds: int = api_field("How long a finished job and its content are kept.", default=86400, minimum=60,
                                 maximum=31_536_000)
    concurrency: int = api_field("Jobs each replica runs at once (each through the usual admission); the rest "
                                 "wait in the store, where the stage planner counts them.", default=2, minimum=1,
                                 maximum=1000)
    max_queued_per_key: int = api_field("Queued jobs one API key may have at most; beyond it 429.", default=16,
                                        minimum=1, maximum=1_000_000)


@dataclass(frozen=True)
class OrchestratorDeployment:
    replicas: int = api_field("Replicas of the orchestrator.", default=1, minimum=0, maximum=1000)
    image: str = api_field("Container image.", default="", default_from="spec.deployment.image")
    resources: Resources = api_field("Kubernetes resources per replica.", default_factory=Resources)
    max_inflight: int = api_field("Requests in flight at once per replica; more wait in the queue.", default=64,
                                  minimum=1, maximum=1_000_000)
    max_queued: int = api_field("Requests waiting for admission at most; beyond it RESOURCE_EXHAUSTED.",
                                default=256, minimum=0, maximum=1_000_000)
    max_retries: int = api_field("Retries of a stage call on another replica after a lost replica.", default=2,
                                 minimum=0, maximum=10)
    max_priority: int = api_field("The highest request priority a client may ask for without an API key that "
                                  "allows more (a KEY:N entry); above it the request is refused "
                                  "(PERMISSION_DENIED).", default=0, minimum=0, maximum=1_000_000)
    fairness: str = api_field("Which waiting request is admitted first.", default="InFlightFirst",
                              enum=FAIRNESS_POLICIES)
    drain_seconds: float = api_field("Bound on finishing admitted work when a replica stops.", default=30.0,
                                     minimum=0)
    http: OrchestratorHttp = api_field("The OpenAI-compatible HTTP API.", default_factory=OrchestratorHttp)
    tls: OrchestratorTls = api_field("Client-facing TLS; absent: the client ports are plaintext.",
                                     default_factory=OrchestratorTls)
    jobs: OrchestratorJobs = api_field("Durable jobs (/v1/videos): the store, the content volume, limits.",
                                       default_factory=OrchestratorJobs)

    @property
    def client_tls_secret(self) -> str | None:
        """The Secret the client-facing certificate comes from, None when none is named."""
        return self.tls.secret_name or None


@dataclass(frozen=True)
class Rollout:
    strategy: str = api_field("OneStageAtATime rolls a changed stage only once every other is rolled out and "
                              "ready; Parallel rolls all at once.", default=ROLLOUT_STRATEGIES[0],
                              enum=ROLLOUT_STRATEGIES)
    order: tuple[str, ...] = api_field("Stages first in the rollout order; the rest follow in data-flow order.",
                                       default=(), unique=True)


@dataclass(frozen=True)
class AutoscalingTargets:
    """What the stage planner sizes the stages to meet; each target 0 is no target."""

    ttfp_p95_ms: float = api_field("Target 95th-percentile time to first packet of output (the first text or "
                                   "audio the client receives), in milliseconds, as the orchestrators measure "
                                   "it. While missed, the busiest stage that may grow is planned for up to "
                                   "twice its load (p95 over target), so it gets the next replica. 0: no "
                                   "target.", default=0.0, minimum=0)
    rtf: float = api_field("Target 95th-percentile real-time factor of audio output: a request's seconds from "
                           "its arrival to its last audio chunk over the seconds of audio it produced (below 1: "
                           "faster than real time), as the orchestrators measure it for requests with audio. "
                           "While missed, the busiest stage that may grow is planned for up to twice its load "
                           "(p95 over target; with ttfpP95Ms also missed, the larger), so it gets the next "
                           "replica. 0: no target.", default=0.0, minimum=0)
    underruns: float = api_field("Target share of audio chunks that reach the client late (an underrun: after "
                                 "the audio before them had finished playing, so a listener playing the answer "
                                 "as it arrives hears a gap), over the last 10 s as the orchestrators count them "
                                 "(at least 100 chunks; 0.01: 1%). While missed, the busiest stage on the audio "
                                 "path that may grow (the stage whose output is audio and the stages upstream of "
                                 "it) is planned for up to twice its load (share over target), so it gets the "
                                 "next replica. 0: no target.", default=0.0, minimum=0, maximum=1)
    queue_seconds: float = api_field("How soon a stage's queued work should be worked off, in seconds (the "
                                     "planner spreads a backlog over this or 30 s, whichever is longer). 0: the "
                                     "30 s alone.", default=1.0, minimum=0)
    utilization: float = api_field("The share of a replica's measured capacity the planner plans to use; the "
                                   "rest is headroom for bursts (0.8: 20% spare).", default=0.8, minimum=0.05,
                                   maximum=1)


@dataclass(frozen=True)
class AutoscalingBudget:
    """Bounds on what the autoscaled stages use together."""

    max_gpus: int = api_field("GPUs all stages may use together (each stage's replicas x its "
                              "spec.deployment.stages.<name>.gpus, summed); at least what every stage needs at "
                              "its minReplicas. 0: no bound.", default=0, minimum=0, maximum=1_000_000)
    max_replicas: int = api_field("Replicas of all stages together; at least the sum of every stage's "
                                  "minReplicas. 0: no bound.", default=0, minimum=0, maximum=1_000_000)


@dataclass(frozen=True)
class StageAutoscaling:
    """One stage's replica bounds under autoscaling."""

    min_replicas: int = api_field("Fewest replicas the planner keeps; at least 1 (a stage is never scaled to "
                                  "zero).", default=1, minimum=1, maximum=1000)
    max_replicas: int = api_field("Most replicas the planner gives the stage; at least minReplicas.", default=8,
                                  minimum=1, maximum=1000)
    scale_down_delay_seconds: float = api_field("How long a lower desired count must hold before replicas are "
                                                "removed, in seconds. 0: removed at once.", default=60.0,
                                                minimum=0)


@dataclass(frozen=True)
class Autoscaling:
    """The stage planner: it sizes every stage from live measurements, within per-stage bounds and a budget."""

    enabled: bool = api_field("Let the stage planner set each stage's replicas from live measurements, within "
                              "`stages` and `budget`. Then spec.deployment.stages.<name>.replicas is the starting "
                              "count only (the planner clamps it to the stage's bounds); false: replicas is the "
                              "count.", default=False)
    mode: str = api_field("Scale: the planner sets each stage's replicas (the stage Deployments' scale "
                          "subresource; local replica processes under serve). Recommend: it only decides and "
                          "reports (status, events, omnistage_planner_desired_replicas), for an autoscaler of "
                          "your own (a KEDA ScaledObject, an HPA external metric) to act on; replicas are then "
                          "left to it.", default=AUTOSCALING_SCALE, enum=AUTOSCALING_MODES)
    interval_seconds: float = api_field("How often the planner observes the stages and decides, in seconds.",
                                        default=1.0, minimum=0.1, maximum=60)
    targets: AutoscalingTargets = api_field("What the planner sizes the stages to meet.",
                                            default_factory=AutoscalingTargets)
    budget: AutoscalingBudget = api_field("Bounds on GPUs and replicas of all stages together.",
                                          default_factory=AutoscalingBudget)
    stages: Mapping[str, StageAutoscaling] = api_field(
        "Replica bounds per stage, by stage name; a stage not listed gets the defaults (minReplicas 1, "
        "maxReplicas 8, scaleDownDelaySeconds 60).", default_factory=dict)

    def bounds(self, stage: str) -> StageAutoscaling:
        """The stage's bounds: its entry under `stages`, else the defaults."""
        return self.stages.get(stage, StageAutoscaling())

    @property
    def scales(self) -> bool:
        """Whether the planner sets replicas itself (mode Scale), rather than only recommending them."""
        return self.mode == AUTOSCALING_SCALE


@dataclass(frozen=True)
class ModelCache:
    """Where the stages' hf:// models are pulled to on the cluster: one of a claim or a node folder."""

    persistent_volume_claim: str = api_field(
        "A PersistentVolumeClaim of the pipeline's namespace (ReadWriteMany where stages run on several nodes): "
        "pulled once, shared by every replica.", default="", pattern=SECRET_NAME, pattern_hint=SECRET_NAME_HINT,
        max_length=253)
    host_path: str = api_field("An absolute folder on each node, writable by the pods' user (the operator's "
                               "runAsUser; the kubelet creates a missing one owned by root): pulled once per node. "
                               "A hostPath volume is outside Pod Security's baseline and restricted levels.",
                               default="")


@dataclass(frozen=True)
class HubTokenSecret:
    """A Secret in the pipeline's namespace holding the Hub token (private or gated repositories)."""

    name: str = api_field("The Secret's name.", required=True, default="", pattern=SECRET_NAME,
                          pattern_hint=SECRET_NAME_HINT, max_length=253)
    key: str = api_field("The key of the Secret whose value is the token.", default=DEFAULT_HUB_TOKEN_KEY,
                         pattern=SECRET_KEY, pattern_hint=SECRET_KEY_HINT, max_length=253)


@dataclass(frozen=True)
class Hub:
    """The Hugging Face Hub the stages' hf:// models are pulled from."""

    endpoint: str = api_field("The Hub's URL (a mirror or a private Hub); empty: the public Hub.", default="",
                              pattern=r"^https?://[^\s]+$", pattern_hint="must be an http:// or https:// URL")
    token_secret: HubTokenSecret = api_field("The token the pull sends (HF_TOKEN); absent: none.",
                                             default_factory=HubTokenSecret)

    @property
    def token(self) -> HubTokenSecret | None:
        """The Secret the token comes from, None when none is named."""
        return self.token_secret if self.token_secret.name else None


@dataclass(frozen=True)
class Deployment:
    stages: Mapping[str, StageDeployment] = api_field("One entry per stage of the topology, by stage name.",
                                                      required=True, nullable=True)
    orchestrator: OrchestratorDeployment = api_field("The orchestrator: admission, routing, the client API.",
                                                     default_factory=OrchestratorDeployment)
    rollout: Rollout = api_field("How changes roll out.", default_factory=Rollout)
    autoscaling: Autoscaling = api_field("The stage planner: replicas of every stage set from live "
                                         "measurements; off by default.", default_factory=Autoscaling)
    image: str = api_field("Default image of every stage and the orchestrator. Empty: the operator's own image "
                           "(the chart's image.*), so one image runs everything.", default="")
    image_pull_secrets: tuple[str, ...] = api_field(
        "Secrets in the pipeline's namespace to pull its images with, by name; besides those the operator gives "
        "every pipeline (the chart's pipelinePods.imagePullSecrets).", default=(), unique=True,
        pattern=SECRET_NAME, pattern_hint=SECRET_NAME_HINT, max_length=253)
    model_cache: ModelCache = api_field(
        "Where hf:// models are pulled to on the cluster: persistentVolumeClaim or hostPath. Absent: a volume of "
        "each pod's own (emptyDir), so every pod start pulls again.", default_factory=ModelCache)
    hub: Hub = api_field("The Hugging Face Hub hf:// models come from: endpoint and token.", default_factory=Hub)


@dataclass(frozen=True)
class Spec:
    topology: Topology = api_field("Which stages exist and how data flows between them.", required=True)
    deployment: Deployment = api_field("How each stage runs; changing one entry rolls that stage alone.",
                                       required=True)


@dataclass(frozen=True)
class Metadata:
    name: str = api_field("Pipeline name; with a suffix it names every object of the pipeline.",
                          required=True, pattern=DNS_LABEL, pattern_hint=DNS_LABEL_HINT,
                          max_length=MAX_NAME_LEN - len(ORCHESTRATOR_SUFFIX),
                          length_hint=f'"<name>{ORCHESTRATOR_SUFFIX}" names a Service, at most {MAX_NAME_LEN} '
                                      "characters")


# --------------------------------------------------------------------------- status

@dataclass(frozen=True)
class ContainerFailure:
    pod: str = api_field("The pod whose container failed.", default="")
    container: str = api_field("The container that failed (absent for a pod the scheduler cannot place).",
                               default="")
    exit_code: int = api_field("How the container last exited (absent when it never ran).", default=0,
                               int_format="int32")
    reason: str = api_field("Why it is not running: Unschedulable (the scheduler cannot place the pod), the "
                            "kubelet's waiting reason (CrashLoopBackOff, ImagePullBackOff) or how it ended (Error, "
                            "OOMKilled).", default="")
    message: str = api_field("Its termination message (what a stage that refuses to start writes to "
                             "/dev/termination-log, else its last log lines), the waiting message, or the "
                             "scheduler's (\"0/3 nodes are available: 3 Insufficient nvidia.com/gpu.\").",
                             default="")
    finished_at: str = api_field("When it last exited (RFC 3339).", default="")


@dataclass(frozen=True)
class ReplicaStatus:
    replicas: int = api_field("Replicas that exist.", default=0, int_format="int32")
    ready_replicas: int = api_field("Replicas ready to serve.", default=0, int_format="int32")
    updated_replicas: int = api_field("Replicas running the current spec.", default=0, int_format="int32")
    last_failure: ContainerFailure = api_field(
        "While replicas are missing: the newest failure of a pod that is not ready (absent otherwise).",
        default_factory=ContainerFailure)
    desired_replicas: int = api_field("Replicas the planner wants (autoscaling enabled); 0: not planned.",
                                      default=0, int_format="int32")
    capacity: float = api_field("Work units per second one replica serves, as the planner measured it (0: not "
                                "measured yet); capacityUnit says the unit.", default=0.0)
    capacity_unit: str = api_field("The unit of capacity: tokens/s, frames/s, steps/s, ... (empty: not measured "
                                   "yet).", default="", empty_ok=True)
    utilization: float = api_field("Offered load over the capacity of the replicas running, as measured: above 1 "
                                   "the stage is the bottleneck.", default=0.0)
    demand_per_request: float = api_field("Work units (capacityUnit's) one request entering the pipeline takes at this "
                                          "stage on average, as the planner measured it: the stage's units per request "
                                          "times the share of requests that reach it (0: not measured yet).",
                                          default=0.0)


@dataclass(frozen=True)
class Condition:
    type: str = api_field("Ready, Progressing, Degraded or Planned (set by the stage planner when autoscaling "
                          "is enabled).", required=True, enum=CONDITION_TYPES)
    status: str = api_field("True, False or Unknown.", required=True, enum=CONDITION_STATUSES)
    reason: str = api_field("Why, in CamelCase.", default="")
    message: str = api_field("Why, for a person.", default="")
    last_transition_time: str = api_field("When the status last changed (RFC 3339).", default="")
    observed_generation: int = api_field("The generation the condition describes.", default=0,
                                         int_format="int64")


@dataclass(frozen=True)
class Status:
    observed_generation: int = api_field("The generation last reconciled.", default=0, int_format="int64")
    stages_ready: str = api_field('Stages with every replica ready, out of all stages ("2/3").', default="")
    orchestrator_endpoint: str = api_field("host:port of the client API (Generate) inside the cluster.",
                                           default="")
    stages: Mapping[str, ReplicaStatus] = api_field("Replicas of each stage, by stage name.", default_factory=dict)
    orchestrator: ReplicaStatus = api_field("Replicas of the orchestrator.", default_factory=ReplicaStatus)
    conditions: tuple[Condition, ...] = api_field("Ready, Progressing, Degraded and Planned.", default=(),
                                                  list_map_key="type", item="condition")


# ------------------------------------------------------------------- the whole object

@dataclass(frozen=True)
class Pipeline:
    """One validated OmniPipeline, as every service and the operator read it."""

    name: str
    namespace: str
    stages: tuple[Stage, ...]
    outputs: tuple[Output, ...]
    limits: Limits
    deployment: Deployment
    raw: Mapping[str, Any] = field(repr=False, compare=False, default_factory=dict)

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    def consumers(self, name: str) -> tuple[Stage, ...]:
        return tuple(s for s in self.stages if any(e.source == name for e in s.inputs))

    @property
    def entry_stages(self) -> tuple[Stage, ...]:
        return tuple(s for s in self.stages if not s.inputs)

    def topo_order(self) -> tuple[Stage, ...]:
        """Stages with every producer before its consumers (ties: file order)."""
        from omnistage.api.graph import topo_order

        order = topo_order({s.name: [e.source for e in s.inputs] for s in self.stages})
        return tuple(self.stage(n) for n in order)

    def outputs_of(self, stage: str) -> tuple[Output, ...]:
        return tuple(o for o in self.outputs if o.stage == stage)


def stage_inputs(stage: Stage) -> frozenset[str]:
    """The request's content parts (text, image, audio, video) that the stage's engine adapter reads. A
    stage fed `media` by an encoder stage (a Thinker with its encoders split out) reads their text only:
    the encoder read the rest."""
    adapter = adapter_for(stage.engine, stage.kind, stage.component)
    assert adapter is not None   # validation refuses a stage no adapter serves
    if "media" in adapter.reads and stage.inputs:
        return frozenset({"text"})
    return adapter.inputs


def accepted_inputs(pipeline: Pipeline) -> frozenset[str]:
    """The content parts some stage of the pipeline reads: the ones a request may carry."""
    return frozenset().union(*(stage_inputs(s) for s in pipeline.stages))


def one_of_each_input(pipeline: Pipeline) -> dict[str, str]:
    """The content parts a request must carry exactly one of (an image-to-video pipeline's reference image),
    each with the stage that reads it."""
    needed: dict[str, str] = {}
    for s in pipeline.stages:
        adapter = adapter_for(s.engine, s.kind, s.component)
        for kind in adapter.needs_one if adapter is not None else ():
            needed.setdefault(kind, s.name)
    return needed


def _some_stage_reads(pipeline: Pipeline, flag: str) -> bool:
    adapters = (adapter_for(s.engine, s.kind, s.component) for s in pipeline.stages)
    return any(a is not None and getattr(a, flag) for a in adapters)


def reads_language(pipeline: Pipeline) -> bool:
    """Whether some stage of the pipeline reads `params.audio.language` (a request may carry it only then)."""
    return _some_stage_reads(pipeline, "language")


def clones_voices(pipeline: Pipeline) -> bool:
    """Whether some stage of the pipeline may clone a voice: read a reference clip and `params.audio.ref_text`
    (a request may carry the transcript only then; the stage checks that its checkpoint clones)."""
    return _some_stage_reads(pipeline, "clones")


def reads_instructions(pipeline: Pipeline) -> bool:
    """Whether some stage of the pipeline reads `params.audio.instructions`: a text-to-speech stage, which speaks
    the request's text itself (a request may carry instructions only then)."""
    return _some_stage_reads(pipeline, "instructions")
