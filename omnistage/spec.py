"""The OmniPipeline spec model: parse and validate the YAML that both
`kubectl apply -f` and `omnistage serve` take, into typed, immutable objects.

`spec.topology` says which stages exist and how data flows between them;
`spec.deployment` says how each stage runs. Every error names its field path,
and all errors are reported at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

API_GROUP = "omnistage.io"
API_VERSION = "v1alpha1"
KIND = "OmniPipeline"

STAGE_KINDS = ("ar", "diffusion", "generation")
ENGINES = ("vllm", "transformers", "diffusers")
# Which engines can serve which kind of stage.
ENGINES_FOR_KIND = {
    "ar": ("vllm", "transformers"),
    "diffusion": ("diffusers",),
    "generation": ("transformers", "diffusers"),
}
EMITS = ("text", "tokens", "hidden", "codes", "embeddings", "latents", "audio", "image")
MODALITIES = ("text", "audio", "image")
TRANSPORTS = ("auto", "inline", "shm", "ucx")
DTYPES = ("auto", "float32", "float16", "bfloat16")
ROLLOUT_STRATEGIES = ("OneStageAtATime", "Parallel")
FAIRNESS_POLICIES = ("InFlightFirst", "ShortestFirst")
DEFAULT_IMAGE = "ghcr.io/omnistage/omnistage:0.1.0"

_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# Kubernetes objects are named "<pipeline>-<stage>" and "<pipeline>-orchestrator"; Service names
# must be DNS-1035 labels: a letter first, at most 63 characters.
MAX_NAME_LEN = 63
RESERVED_STAGE_NAMES = ("orchestrator",)


@dataclass(frozen=True)
class FieldError:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class SpecError(ValueError):
    """An invalid pipeline: carries every error found, each with its field path."""

    def __init__(self, errors: Iterable[FieldError]):
        self.errors = tuple(errors)
        super().__init__("\n".join(str(e) for e in self.errors))


@dataclass(frozen=True)
class Edge:
    source: str      # producing stage; chunks arrive at the producer's chunkSize
    transport: str   # auto | inline | shm | ucx


@dataclass(frozen=True)
class Stage:
    name: str
    kind: str
    engine: str
    model: str
    component: str
    inputs: tuple[Edge, ...]
    emits: tuple[str, ...]
    chunk_size: int  # units (tokens, frames, steps) per chunk on every edge leaving it; 0 = whole result


@dataclass(frozen=True)
class Output:
    modality: str
    stage: str


@dataclass(frozen=True)
class Limits:
    """Bounds on request parameters; beyond them a request is INVALID_ARGUMENT."""

    max_prompt_chars: int = 8192
    max_tokens: int = 512
    default_max_tokens: int = 32
    max_codec_frames: int = 2048
    default_codec_frames: int = 100
    max_image_side: int = 1024
    default_image_side: int = 64
    max_inference_steps: int = 200
    default_inference_steps: int = 10


@dataclass(frozen=True)
class SchedulerSettings:
    max_batch: int = 8
    max_queued: int = 64
    max_wait_ms: float = 2.0


@dataclass(frozen=True)
class TransferSettings:
    """The stage's data-plane buffers: bytes it may hold for consumers, and how long unfetched ones live."""

    max_buffered_bytes: int = 256 << 20
    ttl_seconds: float = 120.0


@dataclass(frozen=True)
class StageDeployment:
    replicas: int = 1
    image: str = DEFAULT_IMAGE
    resources: Mapping[str, Any] = field(default_factory=dict)
    gpus: int = 0
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1
    dtype: str = "auto"
    engine_args: Mapping[str, Any] = field(default_factory=dict)
    scheduler: SchedulerSettings = SchedulerSettings()
    drain_seconds: float = 30.0
    env: Mapping[str, str] = field(default_factory=dict)
    transfer: TransferSettings = TransferSettings()


@dataclass(frozen=True)
class OrchestratorDeployment:
    replicas: int = 1
    image: str = DEFAULT_IMAGE
    resources: Mapping[str, Any] = field(default_factory=dict)
    max_inflight: int = 64
    max_queued: int = 256
    max_retries: int = 2
    fairness: str = "InFlightFirst"
    drain_seconds: float = 30.0


@dataclass(frozen=True)
class Rollout:
    strategy: str = "OneStageAtATime"
    order: tuple[str, ...] = ()


@dataclass(frozen=True)
class Deployment:
    stages: Mapping[str, StageDeployment]
    orchestrator: OrchestratorDeployment
    rollout: Rollout
    image: str = DEFAULT_IMAGE


@dataclass(frozen=True)
class Pipeline:
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
        order = _topo_order({s.name: [e.source for e in s.inputs] for s in self.stages})
        return tuple(self.stage(n) for n in order)

    def outputs_of(self, stage: str) -> tuple[Output, ...]:
        return tuple(o for o in self.outputs if o.stage == stage)


# ---------------------------------------------------------------- loading

def load_pipeline(path: str | Path) -> Pipeline:
    """Read and validate one OmniPipeline file; SpecError lists every problem."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise SpecError([FieldError(str(p), f"cannot read file: {e.strerror}")]) from None
    return parse_pipeline_yaml(text, source=str(p))


def parse_pipeline_yaml(text: str, source: str = "<input>") -> Pipeline:
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        raise SpecError([FieldError(source, f"not valid YAML: {e}")]) from None
    if len(docs) != 1:
        raise SpecError([FieldError(source, f"expected exactly one YAML document, found {len(docs)}")])
    return parse_pipeline(docs[0])


def parse_pipeline(doc: Any) -> Pipeline:
    """Validate a decoded OmniPipeline object and build the typed model."""
    errors = validate(doc)
    if errors:
        raise SpecError(errors)
    return _build(doc)


def dump_pipeline(pipeline: Pipeline) -> str:
    return yaml.safe_dump(dict(pipeline.raw), sort_keys=False)


# ------------------------------------------------------------- validation

class _Checker:
    """Collects field errors while walking the document."""

    def __init__(self) -> None:
        self.errors: list[FieldError] = []

    def err(self, path: str, message: str) -> None:
        self.errors.append(FieldError(path, message))

    def mapping(self, value: Any, path: str, allowed: Iterable[str], required: Iterable[str] = ()) -> dict:
        if not isinstance(value, dict):
            self.err(path, f"must be a mapping, got {_type_name(value)}")
            return {}
        allowed = set(allowed)
        for key in value:
            if key not in allowed:
                hint = _closest(str(key), allowed)
                self.err(f"{path}.{key}", "unknown field" + (f' (did you mean "{hint}"?)' if hint else ""))
        for key in required:
            if key not in value:
                self.err(f"{path}.{key}", "required field is missing")
        return value

    def string(self, value: Any, path: str, choices: Iterable[str] | None = None, *, allow_empty=False) -> str | None:
        if not isinstance(value, str) or (not allow_empty and not value):
            self.err(path, f"must be a non-empty string, got {_show(value)}")
            return None
        if choices is not None and value not in choices:
            self.err(path, f"{_show(value)} is not one of {', '.join(choices)}")
            return None
        return value

    def integer(self, value: Any, path: str, minimum: int | None = None, maximum: int | None = None) -> int | None:
        if isinstance(value, bool) or not isinstance(value, int):
            self.err(path, f"must be an integer, got {_show(value)}")
            return None
        if minimum is not None and value < minimum:
            self.err(path, f"must be >= {minimum}, got {value}")
            return None
        if maximum is not None and value > maximum:
            self.err(path, f"must be <= {maximum}, got {value}")
            return None
        return value

    def number(self, value: Any, path: str, minimum: float | None = None) -> float | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.err(path, f"must be a number, got {_show(value)}")
            return None
        if minimum is not None and value < minimum:
            self.err(path, f"must be >= {minimum}, got {value}")
            return None
        return float(value)

    def seq(self, value: Any, path: str, *, non_empty: bool = False) -> list:
        if not isinstance(value, list):
            self.err(path, f"must be a list, got {_type_name(value)}")
            return []
        if non_empty and not value:
            self.err(path, "must not be empty")
        return value


def validate(doc: Any) -> list[FieldError]:
    """Every problem with an OmniPipeline document, as field-path errors."""
    c = _Checker()
    root = c.mapping(doc, "<root>", ("apiVersion", "kind", "metadata", "spec", "status"),
                     ("apiVersion", "kind", "metadata", "spec"))
    if not root:
        return c.errors
    if "apiVersion" in root and root["apiVersion"] != f"{API_GROUP}/{API_VERSION}":
        c.err("apiVersion", f'must be "{API_GROUP}/{API_VERSION}", got {_show(root["apiVersion"])}')
    if "kind" in root and root["kind"] != KIND:
        c.err("kind", f'must be "{KIND}", got {_show(root["kind"])}')
    meta = root.get("metadata")
    if meta is not None:
        if not isinstance(meta, dict):
            c.err("metadata", f"must be a mapping, got {_type_name(meta)}")
        else:
            name = c.string(meta.get("name"), "metadata.name")
            if name is not None:
                _check_dns_label(c, name, "metadata.name")
                if len(f"{name}-orchestrator") > MAX_NAME_LEN:
                    c.err("metadata.name", f'"{name}" is too long: "{name}-orchestrator" must be at most '
                                           f"{MAX_NAME_LEN} characters")
    spec = root.get("spec")
    if spec is None:
        return c.errors
    spec = c.mapping(spec, "spec", ("topology", "deployment"), ("topology", "deployment"))
    stage_names = _validate_topology(c, spec.get("topology"), root)
    if "deployment" in spec:
        _validate_deployment(c, spec["deployment"], stage_names)
    return c.errors


def _validate_topology(c: _Checker, topo: Any, root: dict) -> list[str]:
    if topo is None:
        return []
    topo = c.mapping(topo, "spec.topology", ("stages", "outputs", "limits"), ("stages", "outputs"))
    stages = c.seq(topo.get("stages", []), "spec.topology.stages", non_empty="stages" in topo)
    names: list[str] = []
    emits: dict[str, set[str]] = {}
    graph: dict[str, list[str]] = {}
    parsed: list[tuple[int, dict]] = []
    for i, st in enumerate(stages):
        path = f"spec.topology.stages[{i}]"
        st = c.mapping(st, path, ("name", "kind", "engine", "model", "component", "inputs", "emits", "chunkSize"),
                       ("name", "kind", "engine", "model", "emits"))
        if not st:
            continue
        name = c.string(st.get("name"), f"{path}.name") if "name" in st else None
        if name is not None:
            _check_dns_label(c, name, f"{path}.name")
            if name in RESERVED_STAGE_NAMES:
                c.err(f"{path}.name", f'"{name}" is reserved for the orchestrator\'s objects')
            pipeline_name = (root.get("metadata") or {}).get("name") if isinstance(root.get("metadata"), dict) else None
            if isinstance(pipeline_name, str) and len(f"{pipeline_name}-{name}") > MAX_NAME_LEN:
                c.err(f"{path}.name", f'"{pipeline_name}-{name}" (pipeline name + "-" + stage name) is longer '
                                      f"than {MAX_NAME_LEN} characters")
            if name in names:
                c.err(f"{path}.name", f'duplicate stage name "{name}"')
            names.append(name)
        kind = c.string(st["kind"], f"{path}.kind", STAGE_KINDS) if "kind" in st else None
        engine = c.string(st["engine"], f"{path}.engine", ENGINES) if "engine" in st else None
        if kind and engine and engine not in ENGINES_FOR_KIND[kind]:
            c.err(f"{path}.engine", f'engine "{engine}" cannot serve a "{kind}" stage '
                                    f"(use {' or '.join(ENGINES_FOR_KIND[kind])})")
        if "model" in st:
            c.string(st["model"], f"{path}.model")
        if "component" in st:
            c.string(st["component"], f"{path}.component")
        stage_emits: set[str] = set()
        if "emits" in st:
            for j, e in enumerate(c.seq(st["emits"], f"{path}.emits", non_empty=True)):
                if c.string(e, f"{path}.emits[{j}]", EMITS):
                    stage_emits.add(e)
        if "chunkSize" in st:
            c.integer(st["chunkSize"], f"{path}.chunkSize", minimum=0)
        if name is not None:
            emits[name] = stage_emits
            graph[name] = []
        parsed.append((i, st))
    known = set(names)
    for i, st in parsed:
        path = f"spec.topology.stages[{i}]"
        name = st.get("name")
        seen: set[str] = set()
        for j, edge in enumerate(c.seq(st.get("inputs", []), f"{path}.inputs")):
            epath = f"{path}.inputs[{j}]"
            edge = c.mapping(edge, epath, ("stage", "transport"), ("stage",))
            if not edge:
                continue
            src = c.string(edge.get("stage"), f"{epath}.stage") if "stage" in edge else None
            if src is not None:
                if src not in known:
                    hint = _closest(src, known)
                    c.err(epath, f'unknown stage "{src}"' + (f' (did you mean "{hint}"?)' if hint else ""))
                elif src == name:
                    c.err(epath, f'stage "{name}" cannot take its own output as input')
                elif src in seen:
                    c.err(epath, f'duplicate input from stage "{src}"')
                else:
                    seen.add(src)
                    if isinstance(name, str) and name in graph:
                        graph[name].append(src)
            if "transport" in edge:
                c.string(edge["transport"], f"{epath}.transport", TRANSPORTS)
    cycle = _find_cycle(graph)
    if cycle:
        c.err("spec.topology.stages", "the stage graph has a cycle: " + " -> ".join(cycle))

    outputs = c.seq(topo.get("outputs", []), "spec.topology.outputs", non_empty="outputs" in topo)
    output_stages: set[str] = set()
    seen_modalities: set[str] = set()
    for i, out in enumerate(outputs):
        path = f"spec.topology.outputs[{i}]"
        out = c.mapping(out, path, ("modality", "stage"), ("modality", "stage"))
        if not out:
            continue
        modality = c.string(out.get("modality"), f"{path}.modality", MODALITIES) if "modality" in out else None
        stage = c.string(out.get("stage"), f"{path}.stage") if "stage" in out else None
        if modality in seen_modalities:
            c.err(f"{path}.modality", f'duplicate output modality "{modality}"')
        if modality:
            seen_modalities.add(modality)
        if stage is None:
            continue
        if stage not in known:
            hint = _closest(stage, known)
            c.err(f"{path}.stage", f'unknown stage "{stage}"' + (f' (did you mean "{hint}"?)' if hint else ""))
            continue
        output_stages.add(stage)
        if modality and modality not in emits.get(stage, set()):
            c.err(f"{path}.stage", f'stage "{stage}" does not emit {modality} (it emits '
                                   f"{', '.join(sorted(emits.get(stage, ()))) or 'nothing'})")
    # Every stage must feed some pipeline output, else its work goes nowhere.
    if not cycle and output_stages:
        feeds_output = _ancestors(graph, output_stages)
        for i, st in parsed:
            name = st.get("name")
            if isinstance(name, str) and name in graph and name not in feeds_output:
                c.err(f"spec.topology.stages[{i}]", f'stage "{name}" feeds no pipeline output')
    if "limits" in topo:
        _validate_limits(c, topo["limits"])
    return names


_LIMIT_FIELDS = {
    "maxPromptChars": "max_prompt_chars", "maxTokens": "max_tokens", "defaultMaxTokens": "default_max_tokens",
    "maxCodecFrames": "max_codec_frames", "defaultCodecFrames": "default_codec_frames",
    "maxImageSide": "max_image_side", "defaultImageSide": "default_image_side",
    "maxInferenceSteps": "max_inference_steps", "defaultInferenceSteps": "default_inference_steps",
}


def _validate_limits(c: _Checker, limits: Any) -> None:
    limits = c.mapping(limits, "spec.topology.limits", _LIMIT_FIELDS)
    for key, value in limits.items():
        if key in _LIMIT_FIELDS:
            c.integer(value, f"spec.topology.limits.{key}", minimum=1)
    for dflt, mx in (("defaultMaxTokens", "maxTokens"), ("defaultCodecFrames", "maxCodecFrames"),
                     ("defaultImageSide", "maxImageSide"), ("defaultInferenceSteps", "maxInferenceSteps")):
        d = limits.get(dflt, getattr(Limits, _LIMIT_FIELDS[dflt]))
        m = limits.get(mx, getattr(Limits, _LIMIT_FIELDS[mx]))
        if isinstance(d, int) and isinstance(m, int) and d > m:
            c.err(f"spec.topology.limits.{dflt}", f"must be <= {mx} ({m}), got {d}")


_STAGE_DEPLOY_FIELDS = ("replicas", "image", "resources", "gpus", "parallelism", "dtype", "engineArgs",
                        "scheduler", "drainSeconds", "env", "transfer")


def _validate_deployment(c: _Checker, dep: Any, stage_names: list[str]) -> None:
    dep = c.mapping(dep, "spec.deployment", ("stages", "orchestrator", "rollout", "image"), ("stages",))
    if "image" in dep:
        c.string(dep["image"], "spec.deployment.image")
    stages = dep.get("stages", {})
    if not isinstance(stages, dict):
        c.err("spec.deployment.stages", f"must be a mapping of stage name to settings, got {_type_name(stages)}")
        stages = {}
    known = set(stage_names)
    for name in stage_names:
        if name not in stages and "stages" in dep:
            c.err("spec.deployment.stages", f'missing entry for stage "{name}"')
    for name, sd in stages.items():
        path = f"spec.deployment.stages.{name}"
        if name not in known:
            hint = _closest(str(name), known)
            c.err(path, f'unknown stage "{name}"' + (f' (did you mean "{hint}"?)' if hint else ""))
        if sd is None:
            sd = {}
        sd = c.mapping(sd, path, _STAGE_DEPLOY_FIELDS)
        if "replicas" in sd:
            c.integer(sd["replicas"], f"{path}.replicas", minimum=0, maximum=1000)
        if "image" in sd:
            c.string(sd["image"], f"{path}.image")
        if "gpus" in sd:
            c.integer(sd["gpus"], f"{path}.gpus", minimum=0, maximum=64)
        if "dtype" in sd:
            c.string(sd["dtype"], f"{path}.dtype", DTYPES)
        if "drainSeconds" in sd:
            c.number(sd["drainSeconds"], f"{path}.drainSeconds", minimum=0)
        if "resources" in sd:
            _validate_resources(c, sd["resources"], f"{path}.resources")
        if "parallelism" in sd:
            par = c.mapping(sd["parallelism"], f"{path}.parallelism", ("tensor", "pipeline", "data"))
            for key, value in par.items():
                if key in ("tensor", "pipeline", "data"):
                    c.integer(value, f"{path}.parallelism.{key}", minimum=1, maximum=1024)
        if "engineArgs" in sd:
            c.mapping(sd["engineArgs"], f"{path}.engineArgs", sd["engineArgs"] if isinstance(sd["engineArgs"], dict) else ())
        if "env" in sd:
            env = c.mapping(sd["env"], f"{path}.env", sd["env"] if isinstance(sd["env"], dict) else ())
            for key, value in env.items():
                if not isinstance(value, str):
                    c.err(f"{path}.env.{key}", f"must be a string, got {_show(value)}")
        if "transfer" in sd:
            tr = c.mapping(sd["transfer"], f"{path}.transfer", ("maxBufferedBytes", "ttlSeconds"))
            if "maxBufferedBytes" in tr:
                c.integer(tr["maxBufferedBytes"], f"{path}.transfer.maxBufferedBytes", minimum=1 << 20)
            if "ttlSeconds" in tr:
                c.number(tr["ttlSeconds"], f"{path}.transfer.ttlSeconds", minimum=1)
        if "scheduler" in sd:
            sch = c.mapping(sd["scheduler"], f"{path}.scheduler", ("maxBatch", "maxQueued", "maxWaitMs"))
            if "maxBatch" in sch:
                c.integer(sch["maxBatch"], f"{path}.scheduler.maxBatch", minimum=1, maximum=4096)
            if "maxQueued" in sch:
                c.integer(sch["maxQueued"], f"{path}.scheduler.maxQueued", minimum=0, maximum=1_000_000)
            if "maxWaitMs" in sch:
                c.number(sch["maxWaitMs"], f"{path}.scheduler.maxWaitMs", minimum=0)
    if "orchestrator" in dep:
        path = "spec.deployment.orchestrator"
        orc = c.mapping(dep["orchestrator"], path, ("replicas", "image", "resources", "maxInflight", "maxQueued",
                                                    "maxRetries", "fairness", "drainSeconds"))
        if "replicas" in orc:
            c.integer(orc["replicas"], f"{path}.replicas", minimum=0, maximum=1000)
        if "image" in orc:
            c.string(orc["image"], f"{path}.image")
        if "resources" in orc:
            _validate_resources(c, orc["resources"], f"{path}.resources")
        if "maxInflight" in orc:
            c.integer(orc["maxInflight"], f"{path}.maxInflight", minimum=1, maximum=1_000_000)
        if "maxQueued" in orc:
            c.integer(orc["maxQueued"], f"{path}.maxQueued", minimum=0, maximum=1_000_000)
        if "maxRetries" in orc:
            c.integer(orc["maxRetries"], f"{path}.maxRetries", minimum=0, maximum=10)
        if "fairness" in orc:
            c.string(orc["fairness"], f"{path}.fairness", FAIRNESS_POLICIES)
        if "drainSeconds" in orc:
            c.number(orc["drainSeconds"], f"{path}.drainSeconds", minimum=0)
    if "rollout" in dep:
        path = "spec.deployment.rollout"
        ro = c.mapping(dep["rollout"], path, ("strategy", "order"))
        if "strategy" in ro:
            c.string(ro["strategy"], f"{path}.strategy", ROLLOUT_STRATEGIES)
        seen: set[str] = set()
        for i, name in enumerate(c.seq(ro.get("order", []), f"{path}.order")):
            if c.string(name, f"{path}.order[{i}]") is None:
                continue
            if name not in known:
                c.err(f"{path}.order[{i}]", f'unknown stage "{name}"')
            elif name in seen:
                c.err(f"{path}.order[{i}]", f'stage "{name}" is listed twice')
            seen.add(name)


_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")


def _validate_resources(c: _Checker, res: Any, path: str) -> None:
    res = c.mapping(res, path, ("requests", "limits"))
    for part in ("requests", "limits"):
        if part not in res:
            continue
        values = c.mapping(res[part], f"{path}.{part}", res[part] if isinstance(res[part], dict) else ())
        for key, value in values.items():
            if isinstance(value, bool) or not _QUANTITY.match(str(value)):
                c.err(f"{path}.{part}.{key}", f"not a resource quantity: {_show(value)}")


def _check_dns_label(c: _Checker, name: str, path: str) -> None:
    if not _DNS_LABEL.match(name):
        c.err(path, f'"{name}" must be lower-case letters, digits and "-", start with a letter and end with a '
                    "letter or digit (it names Kubernetes Services)")


# ------------------------------------------------------------ graph utils

def _find_cycle(graph: Mapping[str, list[str]]) -> list[str] | None:
    """A cycle in a graph of node -> its inputs, as a path, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in graph.get(n, ()):
            if state.get(m) == 1:
                cyc = stack[stack.index(m):] + [m]
                return list(reversed(cyc))  # data-flow direction
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in graph:
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def _topo_order(graph: Mapping[str, list[str]]) -> list[str]:
    done: list[str] = []
    remaining = list(graph)
    while remaining:
        for n in remaining:
            if all(m in done for m in graph[n]):
                done.append(n)
                remaining.remove(n)
                break
        else:  # pragma: no cover - validate() rejects cycles before this runs
            raise ValueError("cycle")
    return done


def _ancestors(graph: Mapping[str, list[str]], nodes: set[str]) -> set[str]:
    seen = set(nodes)
    todo = list(nodes)
    while todo:
        for m in graph.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def _closest(word: str, choices: Iterable[str]) -> str | None:
    import difflib

    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.75)
    return found[0] if found else None


def _type_name(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", type(None): "nothing"}.get(
        type(value), type(value).__name__)


def _show(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


# ---------------------------------------------------------------- building

def _build(doc: dict) -> Pipeline:
    spec = doc["spec"]
    topo = spec["topology"]
    stages = []
    for st in topo["stages"]:
        inputs = []
        for e in st.get("inputs", []) or []:
            inputs.append(Edge(source=e["stage"], transport=e.get("transport", "auto")))
        stages.append(Stage(
            name=st["name"], kind=st["kind"], engine=st["engine"], model=st["model"],
            component=st.get("component", ""), inputs=tuple(inputs), emits=tuple(st["emits"]),
            chunk_size=st.get("chunkSize", 0)))
    outputs = tuple(Output(modality=o["modality"], stage=o["stage"]) for o in topo["outputs"])
    limits = Limits(**{_LIMIT_FIELDS[k]: v for k, v in (topo.get("limits") or {}).items()})
    dep = spec["deployment"]
    default_image = dep.get("image", DEFAULT_IMAGE)
    stage_deps = {}
    for st in stages:
        sd = dep["stages"].get(st.name) or {}
        par = sd.get("parallelism", {})
        sch = sd.get("scheduler", {})
        stage_deps[st.name] = StageDeployment(
            replicas=sd.get("replicas", 1), image=sd.get("image", default_image),
            resources=sd.get("resources", {}), gpus=sd.get("gpus", 0),
            tensor_parallel=par.get("tensor", 1), pipeline_parallel=par.get("pipeline", 1),
            data_parallel=par.get("data", 1), dtype=sd.get("dtype", "auto"),
            engine_args=dict(sd.get("engineArgs", {})),
            scheduler=SchedulerSettings(max_batch=sch.get("maxBatch", SchedulerSettings.max_batch),
                                        max_queued=sch.get("maxQueued", SchedulerSettings.max_queued),
                                        max_wait_ms=float(sch.get("maxWaitMs", SchedulerSettings.max_wait_ms))),
            drain_seconds=float(sd.get("drainSeconds", StageDeployment.drain_seconds)),
            env=dict(sd.get("env", {})),
            transfer=TransferSettings(
                max_buffered_bytes=(sd.get("transfer") or {}).get("maxBufferedBytes", TransferSettings.max_buffered_bytes),
                ttl_seconds=float((sd.get("transfer") or {}).get("ttlSeconds", TransferSettings.ttl_seconds))))
    orc = dep.get("orchestrator") or {}
    orchestrator = OrchestratorDeployment(
        replicas=orc.get("replicas", 1), image=orc.get("image", default_image), resources=orc.get("resources", {}),
        max_inflight=orc.get("maxInflight", OrchestratorDeployment.max_inflight),
        max_queued=orc.get("maxQueued", OrchestratorDeployment.max_queued),
        max_retries=orc.get("maxRetries", OrchestratorDeployment.max_retries),
        fairness=orc.get("fairness", OrchestratorDeployment.fairness),
        drain_seconds=float(orc.get("drainSeconds", OrchestratorDeployment.drain_seconds)))
    ro = dep.get("rollout") or {}
    rollout = Rollout(strategy=ro.get("strategy", "OneStageAtATime"), order=tuple(ro.get("order", ())))
    meta = doc.get("metadata") or {}
    return Pipeline(name=meta["name"], namespace=meta.get("namespace", "default"), stages=tuple(stages),
                    outputs=outputs, limits=limits,
                    deployment=Deployment(stages=stage_deps, orchestrator=orchestrator, rollout=rollout,
                                          image=default_image),
                    raw=doc)
