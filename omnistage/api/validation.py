"""Every problem with an OmniPipeline document, as field-path errors, all at once.

Two passes. The first walks the document against the model's declarations (`model.py`): shapes,
types, bounds, enums, patterns, required and unknown fields (with a "did you mean" hint). The second
checks what one field cannot say alone: the stage graph (edges name stages, no cycle, every stage feeds
an output), each stage against its engine adapter (the family table, `omnistage/families/`: what it
emits, what its edges carry), name lengths that add up, defaults within their maximums, a deployment
entry for every stage, the autoscaling bounds against the stages and the budget, and an HTTP API port
apart from the orchestrator's other ports.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any, Iterable

from omnistage import families
from omnistage.api.fields import (
    QUANTITY_PATTERN,
    ApiField,
    FreeForm,
    ListOf,
    MapOf,
    Obj,
    Quantity,
    Scalar,
    Shape,
    api_fields,
)
from omnistage.api.graph import ancestors, find_cycle
from omnistage.api.memory_plan import ANNOTATION_MEMORY_PLAN, gib, parse_bytes, planned_bytes
from omnistage.api.model import (
    API_GROUP,
    API_VERSION,
    ENGINES,
    FRAME_STEP,
    KIND,
    LABEL_KEY,
    LABEL_KEY_HINT,
    LABEL_VALUE,
    LABEL_VALUE_HINT,
    LIMIT_DEFAULTS,
    MAX_MESSAGE_BYTES,
    MAX_NAME_LEN,
    REQUEST_TOTALS,
    RESERVED_STAGE_NAMES,
    TRANSFORMERS_QUANTIZATION,
    VLLM_ARGS_OF_FIELDS,
    Limits,
    Metadata,
    Spec,
    StageAutoscaling,
    StageDeployment,
)
from omnistage.api.model_sources import hub_revision, is_commit, source_error
from omnistage.api.ports import GRPC_PORT, GRPC_PORT_NAME, HTTP_PORT, HTTP_PORT_NAME
from omnistage.store_url import redacted_url


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


ROOT_FIELDS = ("apiVersion", "kind", "metadata", "spec", "status")
ROOT_REQUIRED = ("apiVersion", "kind", "metadata", "spec")


def validate(doc: Any) -> list[FieldError]:
    """Every problem with an OmniPipeline document, as field-path errors."""
    w = _Walker()
    root = w.mapping(doc, "<root>", ROOT_FIELDS, ROOT_REQUIRED)
    if not root:
        return w.errors
    if "apiVersion" in root and root["apiVersion"] != f"{API_GROUP}/{API_VERSION}":
        w.err("apiVersion", f'must be "{API_GROUP}/{API_VERSION}", got {_show(root["apiVersion"])}')
    if "kind" in root and root["kind"] != KIND:
        w.err("kind", f'must be "{KIND}", got {_show(root["kind"])}')
    if "metadata" in root:
        # Kubernetes owns the rest of metadata (namespace, labels, uid, ...): only the name is ours.
        w.obj(root["metadata"], Metadata, "metadata", open_ended=True)
    if "spec" in root and w.obj(root["spec"], Spec, "spec"):
        _Relations(w, root).check()
    return w.errors


# ------------------------------------------------------------- pass 1: the declarations

class _Walker:
    def __init__(self) -> None:
        self.errors: list[FieldError] = []

    def err(self, path: str, message: str) -> None:
        self.errors.append(FieldError(path, message))

    def mapping(self, value: Any, path: str, allowed: Iterable[str] | None, required: Iterable[str] = ()) -> dict:
        """`value` as a mapping ({} when it is not one); unknown and missing keys reported."""
        if not isinstance(value, dict):
            self.err(path, f"must be a mapping, got {_type_name(value)}")
            return {}
        if allowed is not None:
            allowed = list(allowed)
            for key in value:
                if key not in allowed:
                    self.err(f"{path}.{key}", "unknown field" + _hint(str(key), allowed))
        for key in required:
            if key not in value:
                self.err(f"{path}.{key}", "required field is missing")
        return value

    def obj(self, value: Any, cls: type, path: str, open_ended: bool = False) -> bool:
        """Check one model object; True when it is a mapping (its fields may still have errors)."""
        fields = api_fields(cls)
        m = self.mapping(value, path, None if open_ended else [f.key for f in fields],
                         [f.key for f in fields if f.api.required])
        if not isinstance(value, dict):
            return False
        for f in fields:
            if f.key in m:
                self.value(m[f.key], f.shape, f.api, f"{path}.{f.key}")
        return True

    def value(self, value: Any, shape: Shape, api: ApiField, path: str) -> None:
        if isinstance(shape, Obj):
            self.obj(value, shape.cls, path)
        elif isinstance(shape, Scalar):
            self.scalar(value, shape.type, api, path)
        elif isinstance(shape, ListOf):
            self.list(value, shape.item, api, path)
        elif isinstance(shape, MapOf):
            for key, item in self.mapping(value, path, None).items():
                if item is None and api.nullable:
                    continue
                self.value(item, shape.value, api if isinstance(shape.value, Scalar) else ApiField(), f"{path}.{key}")
        elif isinstance(shape, FreeForm):
            self.mapping(value, path, None)

    def list(self, value: Any, item: Shape, api: ApiField, path: str) -> None:
        if not isinstance(value, list):
            self.err(path, f"must be a list, got {_type_name(value)}")
            return
        if api.non_empty and not value:
            self.err(path, "must not be empty")
        seen: list[Any] = []
        for i, v in enumerate(value):
            self.value(v, item, api if isinstance(item, Scalar) else ApiField(), f"{path}[{i}]")
            key = v.get(api.list_map_key) if api.list_map_key and isinstance(v, dict) else v if api.unique else None
            if key is None or isinstance(key, (dict, list)):
                continue
            if key in seen:
                where = f"{path}[{i}].{api.list_map_key}" if api.list_map_key else f"{path}[{i}]"
                what = f"{api.item or 'item'} {api.list_map_key}" if api.list_map_key else "entry"
                self.err(where, f"duplicate {what} {_show(key)}")
            seen.append(key)

    def scalar(self, value: Any, kind: type, api: ApiField, path: str) -> None:
        if kind is Quantity:
            if (isinstance(value, bool) or not isinstance(value, (int, str))
                    or not re.match(QUANTITY_PATTERN, str(value))):
                self.err(path, f"not a resource quantity: {_show(value)}")
        elif kind is str:
            if not isinstance(value, str) or (not value and not api.empty_ok):
                self.err(path, f"must be a non-empty string, got {_show(value)}")
            elif api.enum and value not in api.enum:
                self.err(path, f"{_show(value)} is not one of {', '.join(api.enum)}")
            elif api.pattern and not re.match(api.pattern, value):
                self.err(path, f"{_show(value)} {api.pattern_hint or 'must match ' + api.pattern}")
            elif api.max_length is not None and len(value) > api.max_length:
                self.err(path, f"{_show(value)} is too long: at most {api.max_length} characters"
                               + (f" ({api.length_hint})" if api.length_hint else ""))
        elif kind is bool:
            if not isinstance(value, bool):
                self.err(path, f"must be true or false, got {_show(value)}")
        else:
            wanted = (int,) if kind is int else (int, float)
            if isinstance(value, bool) or not isinstance(value, wanted):
                self.err(path, f"must be {'an integer' if kind is int else 'a number'}, got {_show(value)}")
            elif api.minimum is not None and value < api.minimum:
                self.err(path, f"must be >= {_num(api.minimum)}, got {value}")
            elif api.maximum is not None and value > api.maximum:
                self.err(path, f"must be <= {_num(api.maximum)}, got {value}")


# ------------------------------------------------------------ pass 2: across fields

class _Relations:
    """The cross-field rules, over a document whose spec is a mapping (its parts may be anything)."""

    def __init__(self, w: _Walker, root: dict):
        self.w = w
        self.pipeline = _get(root, "metadata", "name")
        self.annotations = _get(root, "metadata", "annotations")
        spec = root["spec"]
        self.topology = _dict(spec.get("topology"))
        self.deployment = _dict(spec.get("deployment"))
        self.stages = [(i, s) for i, s in enumerate(_list(self.topology.get("stages"))) if isinstance(s, dict)]
        self.names = [s["name"] for _, s in self.stages if isinstance(s.get("name"), str)]
        self.emits = {s["name"]: {e for e in _list(s.get("emits")) if isinstance(e, str)}
                      for _, s in self.stages if isinstance(s.get("name"), str)}

    def check(self) -> None:
        graph = self.stage_graph()
        cycle = find_cycle(graph)
        if cycle:
            self.w.err("spec.topology.stages", "the stage graph has a cycle: " + " -> ".join(cycle))
        output_stages = self.outputs()
        if not cycle and output_stages:
            feeds = ancestors(graph, output_stages)
            for i, s in self.stages:
                if isinstance(s.get("name"), str) and s["name"] in graph and s["name"] not in feeds:
                    self.w.err(f"spec.topology.stages[{i}]", f'stage "{s["name"]}" feeds no pipeline output')
        self.limits()
        self.stage_deployments()
        self.autoscaling()
        self.api_port()
        self.jobs()
        self.model_sources()

    def stage_graph(self) -> dict[str, list[str]]:
        graph: dict[str, list[str]] = {n: [] for n in self.names}
        for i, s in self.stages:
            path = f"spec.topology.stages[{i}]"
            name = s.get("name") if isinstance(s.get("name"), str) else None
            self.names_fit(name, path)
            adapter = self.adapter(s, path)
            carried: set[str] = set()
            edges = [(j, e) for j, e in enumerate(_list(s.get("inputs"))) if isinstance(e, dict)]
            for j, edge in edges:
                src = edge.get("stage")
                if not isinstance(src, str) or not src:
                    continue
                epath = f"{path}.inputs[{j}]"
                if not self.known(epath, src):
                    continue
                if src == name:
                    self.w.err(epath, f'stage "{name}" cannot take its own output as input')
                    continue
                if name in graph and src not in graph[name]:
                    graph[name].append(src)
                if adapter is None:
                    continue
                if adapter.is_entry:
                    self.w.err(epath, f'stage "{name}" ({adapter.name}) takes no input edges')
                elif not self.emits[src] & adapter.reads:
                    self.w.err(epath, f'stage "{name}" ({adapter.name}) reads {_words(adapter.reads)}, but stage '
                                      f'"{src}" emits {_words(self.emits[src]) or "nothing"}')
                carried |= self.emits[src]
            if adapter is not None and adapter.needs - carried:
                self.w.err(f"{path}.inputs" if edges else path,
                           f'stage "{name}" ({adapter.name}) needs an input edge carrying '
                           f"{_words(adapter.needs - carried)}")
        return graph

    def names_fit(self, name: str | None, path: str) -> None:
        if name is None:
            return
        if name in RESERVED_STAGE_NAMES:
            self.w.err(f"{path}.name", f'"{name}" is reserved for the orchestrator\'s objects')
        if isinstance(self.pipeline, str) and len(f"{self.pipeline}-{name}") > MAX_NAME_LEN:
            self.w.err(f"{path}.name", f'"{self.pipeline}-{name}" (pipeline name + "-" + stage name) is longer '
                                       f"than {MAX_NAME_LEN} characters")

    def known(self, path: str, name: object) -> bool:
        """Whether `name` is a stage of the topology; reports it at `path` when not."""
        if name in self.emits:
            return True
        self.w.err(path, f'unknown stage "{name}"' + _hint(str(name), self.names))
        return False

    def adapter(self, s: dict, path: str) -> families.Adapter | None:
        kind, engine, component = s.get("kind"), s.get("engine"), s.get("component", "")
        if not (isinstance(kind, str) and isinstance(engine, str) and isinstance(component, str)):
            return None
        fits = families.engines_for_kind(kind)
        if not fits:
            return None   # an unknown kind, reported by pass 1
        if engine not in fits:
            if engine in ENGINES:
                self.w.err(f"{path}.engine", f'engine "{engine}" cannot serve a "{kind}" stage (use '
                                             f"{' or '.join(fits)})")
            return None
        adapter = families.adapter_for(engine, kind, component)
        if adapter is None:
            known = [c or "none" for c in families.components_for(engine, kind)]
            self.w.err(f"{path}.component" if component else path,
                       f'no {engine} adapter serves a "{kind}" stage with component "{component or "none"}" '
                       f"(components: {', '.join(known)})")
            return None
        for j, e in enumerate(_list(s.get("emits"))):
            if isinstance(e, str) and e not in adapter.emits:
                self.w.err(f"{path}.emits[{j}]", f'the {adapter.name} adapter does not emit "{e}" (it emits '
                                                 f"{_words(adapter.emits)})")
        self.initial_chunk(s, path, adapter)
        return adapter

    def initial_chunk(self, s: dict, path: str, adapter: families.Adapter) -> None:
        """A smaller first chunk needs chunks (chunkSize > 0), no larger than the rest, from an adapter
        that emits one."""
        first, every = s.get("initialChunkSize", 0), s.get("chunkSize", 0)
        if type(first) is not int or type(every) is not int or first <= 0:
            return   # not a count (reported by pass 1), or unset
        key = f"{path}.initialChunkSize"
        if not adapter.initial_chunk:
            self.w.err(key, f"the {adapter.name} adapter emits every chunk at chunkSize (initialChunkSize applies "
                            f"to {_words(a.name for a in families.all_adapters() if a.initial_chunk)})")
        elif every == 0:
            self.w.err(key, "needs chunkSize > 0: with chunkSize 0 the whole result is one chunk")
        elif first > every:
            self.w.err(key, f"must be <= chunkSize ({every}), got {first}: the first chunk is the small one")

    def outputs(self) -> set[str]:
        found: set[str] = set()
        for i, out in enumerate(_list(self.topology.get("outputs"))):
            stage, modality = _get(out, "stage"), _get(out, "modality")
            if not isinstance(stage, str) or not stage:
                continue
            path = f"spec.topology.outputs[{i}].stage"
            if not self.known(path, stage):
                continue
            found.add(stage)
            if isinstance(modality, str) and modality not in self.emits[stage]:
                self.w.err(path, f'stage "{stage}" does not emit {modality} (it emits '
                                 f"{_words(self.emits[stage]) or 'nothing'})")
        return found

    def limits(self) -> None:
        limits = _dict(self.topology.get("limits"))
        for dflt, mx in LIMIT_DEFAULTS:
            dkey, mkey = _key(Limits, dflt), _key(Limits, mx)
            d = limits.get(dkey, getattr(Limits(), dflt))
            m = limits.get(mkey, getattr(Limits(), mx))
            if type(d) is int and type(m) is int and d and m and d > m:  # 0: from the model
                self.w.err(f"spec.topology.limits.{dkey}", f"must be <= {mkey} ({m}), got {d}")
        for total, part in REQUEST_TOTALS:
            tkey, pkey = _key(Limits, total), _key(Limits, part)
            t = limits.get(tkey, getattr(Limits(), total))
            m = limits.get(pkey, getattr(Limits(), part))
            if _number(t) and _number(m) and t and t < m:  # 0: follows the per-part limits
                self.w.err(f"spec.topology.limits.{tkey}", f"must be 0 or at least {pkey} ({m}), got {t}")
        frames = limits.get(_key(Limits, "default_frames"), 0)
        if type(frames) is int and frames > 0 and (frames - 1) % FRAME_STEP:
            self.w.err(f"spec.topology.limits.{_key(Limits, 'default_frames')}",
                       f"must be {FRAME_STEP}k + 1 frames (what the video VAE makes), got {frames}")
        parts, size = (limits.get(_key(Limits, k), getattr(Limits(), k)) for k in ("max_parts", "max_part_bytes"))
        if type(parts) is int and type(size) is int and parts * size + (1 << 20) > MAX_MESSAGE_BYTES:
            self.w.err(f"spec.topology.limits.{_key(Limits, 'max_part_bytes')}",
                       f"{_key(Limits, 'max_parts')} x {_key(Limits, 'max_part_bytes')} is {parts * size} bytes; a "
                       f"request must fit the {MAX_MESSAGE_BYTES >> 20} MiB one message between services may carry")

    def stage_deployments(self) -> None:
        entries = self.deployment.get("stages")
        if isinstance(entries, dict):
            for name in self.names:
                if name not in entries:
                    self.w.err("spec.deployment.stages", f'missing entry for stage "{name}"')
            for name in entries:
                self.known(f"spec.deployment.stages.{name}", name)
        for i, name in enumerate(_list(_get(self.deployment, "rollout", "order"))):
            if isinstance(name, str) and name:
                self.known(f"spec.deployment.rollout.order[{i}]", name)
        engines_of = {s["name"]: s.get("engine") for _, s in self.stages if isinstance(s.get("name"), str)}
        kinds_of = {s["name"]: s.get("kind") for _, s in self.stages if isinstance(s.get("name"), str)}
        if isinstance(entries, dict):
            for name, sd in entries.items():
                if isinstance(sd, dict) and name in engines_of:
                    self.placement(f"spec.deployment.stages.{name}", engines_of[name], sd)
                    self.quantization(f"spec.deployment.stages.{name}", engines_of[name], kinds_of[name], sd)
                    self.kv_cache_bytes(f"spec.deployment.stages.{name}", engines_of[name], kinds_of[name], sd)
            self.memory_plan(entries)

    def memory_plan(self, entries: dict) -> None:
        """The plan the manifest carries (api/memory_plan.py): well formed, and no CPU stage's memory limit
        below its plan (a GPU stage's plan is GPU memory, which its container limit does not bound)."""
        path = f'metadata.annotations["{ANNOTATION_MEMORY_PLAN}"]'
        try:
            plan = planned_bytes(self.annotations, frozenset(self.names))
        except ValueError as e:
            self.w.err(path, str(e))
            return
        for name, planned in plan.items():
            sd = _dict(entries.get(name))
            limit = _get(sd, "resources", "limits", "memory")
            on_gpu = sd.get("gpus", 0) not in (0, None) and sd.get("device", "auto") != "cpu"
            if limit is None or on_gpu:
                continue
            try:
                given = parse_bytes(limit)
            except ValueError:
                continue  # the quantity's own check names it
            if given < planned:
                self.w.err(f"spec.deployment.stages.{name}.resources.limits.memory",
                           f"{name} needs {gib(planned)} by its memory plan ({path}); the limit {limit} gives "
                           f"{gib(given)}")

    def placement(self, path: str, engine: object, sd: dict) -> None:
        """Devices a replica asks for against what its engine uses, and the pod placement fields."""
        gpus = sd.get("gpus", 0)
        par = _dict(sd.get("parallelism"))
        degrees = [par.get(k, 1) for k in ("tensor", "pipeline", "data")]
        if type(gpus) is int and all(type(d) is int for d in degrees):
            uses = degrees[0] * degrees[1] * degrees[2]
            if engine == "vllm":
                if gpus and gpus != uses:
                    self.w.err(f"{path}.gpus", f"a vLLM stage uses tensor x pipeline x data parallel = {uses} "
                                               f"GPU(s) per replica; gpus is {gpus}")
            elif isinstance(engine, str) and engine in ENGINES:
                if degrees[2] != 1:
                    self.w.err(f"{path}.parallelism.data", f"the {engine} engine runs one model per replica; "
                                                           "data parallelism applies to vLLM stages (scale with "
                                                           "replicas)")
                elif uses != 1:
                    self.w.err(f"{path}.parallelism", f"the {engine} engine runs one model per replica; "
                                                      "parallelism applies to vLLM stages (scale with replicas)")
                if gpus > 1:
                    self.w.err(f"{path}.gpus", f"the {engine} engine runs on one GPU per replica; gpus: {gpus} "
                                               "reserves GPUs it never uses (scale with replicas)")
        self.vllm_only(path, engine, sd, par)
        fraction = sd.get("gpuMemoryFraction", 0)
        if isinstance(fraction, (int, float)) and fraction and (gpus == 0 or sd.get("device") == "cpu"):
            self.w.err(f"{path}.gpuMemoryFraction", "applies to a stage on GPUs (gpus > 0 and device auto)")
        for key, value in _dict(sd.get("nodeSelector")).items():
            if not re.match(LABEL_KEY, key) or len(key.rpartition("/")[2]) > 63:
                self.w.err(f"{path}.nodeSelector", f"{key!r} {LABEL_KEY_HINT} (the name part at most 63)")
            elif isinstance(value, str) and (not re.match(LABEL_VALUE, value) or len(value) > 63):
                self.w.err(f"{path}.nodeSelector.{key}", f"{value!r} {LABEL_VALUE_HINT}")
        roll = _dict(sd.get("rollingUpdate"))
        if roll.get("maxSurge", 1) == 0 and roll.get("maxUnavailable", 0) == 0:
            self.w.err(f"{path}.rollingUpdate", "maxSurge and maxUnavailable cannot both be 0 (nothing could roll)")
        for i, t in enumerate(_list(sd.get("tolerations"))):
            t = _dict(t)
            if t.get("operator") == "Exists" and t.get("value"):
                self.w.err(f"{path}.tolerations[{i}].value", "must be empty with operator Exists")
            if not t.get("key") and t.get("operator", "Equal") == "Equal":
                self.w.err(f"{path}.tolerations[{i}].key", "an empty key needs operator Exists")
            if t.get("tolerationSeconds") and t.get("effect") != "NoExecute":
                self.w.err(f"{path}.tolerations[{i}].tolerationSeconds", "applies to effect NoExecute only")

    def vllm_only(self, path: str, engine: object, sd: dict, par: dict) -> None:
        """Expert parallelism, which only vLLM stages honour, and engineArgs that would set what a field of
        the entry sets."""
        expert = par.get("expert", False)
        if engine != "vllm":
            if isinstance(engine, str) and engine in ENGINES and expert is True:
                self.w.err(f"{path}.parallelism.expert", f"applies to vLLM stages serving a mixture-of-experts "
                                                         f"model; the {engine} engine runs one model per replica")
            return
        tensor, data = par.get("tensor", 1), par.get("data", 1)
        if expert is True and type(tensor) is int and type(data) is int and tensor * data == 1:
            self.w.err(f"{path}.parallelism.expert", "spreads the experts over tensor x data parallel GPUs; with "
                                                     "tensor x data = 1 there is one (raise tensor or data)")
        for key in _dict(sd.get("engineArgs")):
            field = VLLM_ARGS_OF_FIELDS.get(str(key).replace("-", "_"))
            if field is not None:
                self.w.err(f"{path}.engineArgs.{key}", f"set {path}.{field} instead (the stage's GPUs and its "
                                                       "checks follow the field)")

    def kv_cache_bytes(self, path: str, engine: object, kind: object, sd: dict) -> None:
        """engineArgs.kvCacheBytes, the KV budget of a transformers AR stage (stage_service/runtime/kv_budget.py):
        a positive integer of bytes, on transformers AR stages only (vLLM sizes its own cache; other kinds
        keep none)."""
        args = _dict(sd.get("engineArgs"))
        if "kvCacheBytes" not in args:
            return
        value = args["kvCacheBytes"]
        if type(value) is not int or value < 1:
            self.w.err(f"{path}.engineArgs.kvCacheBytes", f"expected a positive integer (bytes), got {value!r}")
        elif isinstance(engine, str) and engine in ENGINES and engine != "transformers":
            self.w.err(f"{path}.engineArgs.kvCacheBytes", f"bounds the KV cache of transformers AR stages; the "
                                                          f"{engine} engine takes no KV budget")
        elif engine == "transformers" and isinstance(kind, str) and kind != "ar":
            self.w.err(f"{path}.engineArgs.kvCacheBytes", f"bounds the KV cache of transformers AR stages; a "
                                                          f"{kind} stage keeps none")

    def quantization(self, path: str, engine: object, kind: object, sd: dict) -> None:
        """Which stages take which weight quantization: a vLLM stage vLLM's methods (checked against the
        installed vLLM when the stage starts), a transformers AR stage TRANSFORMERS_QUANTIZATION, no other."""
        method = sd.get("quantization", "")
        if not isinstance(method, str) or not method or engine == "vllm" or engine not in ENGINES:
            return
        accepted = ", ".join(TRANSFORMERS_QUANTIZATION)
        who = (f"vLLM stages take vLLM's methods (e.g. fp8, awq, gptq), transformers AR stages (causal LM, Thinker, "
               f"Talker) take {accepted}")
        if engine == "transformers" and kind == "ar":
            if method not in TRANSFORMERS_QUANTIZATION:
                self.w.err(f"{path}.quantization", f'"{method}" is not a method the transformers engine applies; '
                                                   f"it takes {accepted} (weight-only, at load); vLLM's methods apply "
                                                   "to vLLM stages")
        elif engine == "transformers":
            self.w.err(f"{path}.quantization", f"the transformers engine quantizes AR stages only; this {kind} stage "
                                               f"loads its weights in the stage's dtype ({who})")
        else:
            self.w.err(f"{path}.quantization", f"the {engine} engine loads its weights in the stage's dtype (no "
                                               f"quantized path); {who}")

    def autoscaling(self) -> None:
        """The planner's bounds: per-stage entries name stages and have min <= max, and the budget leaves
        room for every stage at its minReplicas. A value of the wrong type (reported by pass 1) skips the
        rules that read it."""
        path = "spec.deployment.autoscaling"
        auto = _dict(self.deployment.get("autoscaling"))
        default = StageAutoscaling()
        floor: dict[str, Any] = {n: default.min_replicas for n in self.names}   # every stage's minReplicas
        for name, entry in _dict(auto.get("stages")).items():
            if not self.known(f"{path}.stages.{name}", name):
                continue
            if not isinstance(entry, dict):
                floor[name] = None
                continue
            lo, hi = entry.get("minReplicas", default.min_replicas), entry.get("maxReplicas", default.max_replicas)
            floor[name] = lo if type(lo) is int else None
            if type(lo) is int and type(hi) is int and lo > hi:
                said = "" if "maxReplicas" in entry else ", the default"
                self.w.err(f"{path}.stages.{name}.minReplicas", f"must be <= maxReplicas ({hi}{said}), got {lo}")
        if any(v is None for v in floor.values()):
            return
        budget = _dict(auto.get("budget"))
        max_replicas, max_gpus = budget.get("maxReplicas", 0), budget.get("maxGpus", 0)
        if type(max_replicas) is int and 0 < max_replicas < sum(floor.values()):
            each = ", ".join(f"{n} {lo}" for n, lo in floor.items())
            self.w.err(f"{path}.budget.maxReplicas",
                       f"must be >= {sum(floor.values())}, the sum of every stage's minReplicas ({each}), got "
                       f"{max_replicas}: the planner could not keep every stage at its minimum")
        if type(max_gpus) is int and max_gpus > 0:
            self.gpu_budget(f"{path}.budget.maxGpus", max_gpus, floor)

    def gpu_budget(self, path: str, max_gpus: int, floor: dict[str, int]) -> None:
        """maxGpus against each stage's GPUs per replica (a stage needing more could never run) and against
        what every stage needs at its minReplicas."""
        entries = _dict(self.deployment.get("stages"))
        gpus = {n: _dict(entries.get(n)).get("gpus", StageDeployment().gpus) for n in floor}
        if not all(type(g) is int for g in gpus.values()):
            return
        too_big = [n for n, g in gpus.items() if g > max_gpus]
        for n in too_big:
            self.w.err(path, f'stage "{n}" needs {gpus[n]} GPUs per replica (spec.deployment.stages.{n}.gpus), more '
                             f"than maxGpus ({max_gpus}): it could never get a replica")
        total = sum(floor[n] * gpus[n] for n in floor)
        if not too_big and max_gpus < total:
            each = ", ".join(f"{n} {floor[n]} x {gpus[n]}" for n in floor if gpus[n])
            self.w.err(path, f"must be >= {total}, the GPUs every stage needs at its minReplicas (minReplicas x "
                             f"gpus: {each}), got {max_gpus}")

    def api_port(self) -> None:
        """The API's port shares the orchestrator pod with the fixed gRPC and status ports."""
        http = _dict(_get(self.deployment, "orchestrator", "http"))
        port = http.get("port")
        if http.get("enabled") is False:
            return   # no API: its port binds nothing
        taken = {GRPC_PORT: f"the gRPC port ({GRPC_PORT_NAME})", HTTP_PORT: f"the HTTP status port ({HTTP_PORT_NAME})"}
        if type(port) is int and port in taken:
            self.w.err("spec.deployment.orchestrator.http.port",
                       f"{port} is {taken[port]} of the orchestrator; choose another port")


    def jobs(self) -> None:
        """The job store is named once; its content and (SQLite) database outlive a pod, and every replica reads
        what any replica wrote."""
        path = "spec.deployment.orchestrator.jobs"
        orchestrator = _dict(self.deployment.get("orchestrator"))
        jobs = _dict(orchestrator.get("jobs"))
        store = _dict(jobs.get("store"))
        url, secret = store.get("url"), _dict(store.get("secretRef")).get("name")
        volume, replicas = jobs.get("contentVolume"), orchestrator.get("replicas", 1)
        if url and secret:
            self.w.err(f"{path}.store", "name one of url or secretRef, not both")
        if volume and not (url or secret):
            self.w.err(f"{path}.contentVolume", "keeps a job store's content: name jobs.store (url or secretRef) too")
        sqlite = isinstance(url, str) and url.startswith("sqlite:")
        if sqlite and type(replicas) is int and replicas > 1:
            self.w.err(f"{path}.store.url", f"SQLite serves one orchestrator replica, not {replicas}: its file "
                                            "locks do not hold across nodes; use a postgresql:// store")
        elif sqlite and not volume:
            self.w.err(f"{path}.contentVolume", "a SQLite store needs a volume its file outlives the pod on: name "
                                               "a PersistentVolumeClaim (the file goes on it)")
        elif (url or secret) and not volume and type(replicas) is int and replicas > 1:
            self.w.err(f"{path}.contentVolume", f"with {replicas} orchestrator replicas any of them answers a job's "
                                               "download: name a ReadWriteMany PersistentVolumeClaim they share")

    def model_sources(self) -> None:
        """Each stage's `model` is a source omnistage reads (omnistage.api.model_sources); the hf:// cache
        is one volume."""
        cache = _dict(self.deployment.get("modelCache"))
        claim, host = cache.get("persistentVolumeClaim"), cache.get("hostPath")
        for i, s in self.stages:
            model = s.get("model")
            if not (isinstance(model, str) and model):
                continue
            if problem := source_error(model):
                self.w.err(f"spec.topology.stages[{i}].model", problem)
            elif (claim or host) and (revision := hub_revision(model)) is not None and not is_commit(revision):
                # a branch moves: a later pod's pull would rewrite the folder the running replicas loaded
                self.w.err(f"spec.topology.stages[{i}].model",
                           f"{_show(revision)} is a branch or tag; with spec.deployment.modelCache, shared by "
                           "every pod of the pipeline, pin a commit (hf://ORG/NAME@<40 hex digits>) so every "
                           "replica loads the same files")
        if claim and host:
            self.w.err("spec.deployment.modelCache", "name one of persistentVolumeClaim or hostPath, not both")
        if isinstance(host, str) and host and not host.startswith("/"):
            self.w.err("spec.deployment.modelCache.hostPath", f"{_show(host)} must be an absolute folder")
        hub = _dict(self.deployment.get("hub"))
        endpoint = hub.get("endpoint")
        if isinstance(endpoint, str) and endpoint.startswith("http://") and hub.get("tokenSecret"):
            self.w.err("spec.deployment.hub.endpoint", f"{_show(endpoint)} is plain HTTP: the token would travel "
                                                       "in the clear; use https:// with tokenSecret")


# ------------------------------------------------------------------------- helpers

def _number(value: Any) -> bool:
    """An int or float as YAML gives one (not a bool): a value whose own check passed or will say so."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _key(cls: type, attr: str) -> str:
    return next(f.key for f in api_fields(cls) if f.name == attr)


def _get(value: Any, *keys: str) -> Any:
    for k in keys:
        value = value.get(k) if isinstance(value, dict) else None
    return value


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _hint(word: str, choices: Iterable[str]) -> str:
    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.75)
    return f' (did you mean "{found[0]}"?)' if found else ""


def _words(values: Iterable[str]) -> str:
    return ", ".join(sorted(values))


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _type_name(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", type(None): "nothing"}.get(
        type(value), type(value).__name__)


def _show(value: Any) -> str:
    """A value as a message quotes it; a URL's password hidden (a job store URL's: messages reach events and logs)."""
    return f'"{redacted_url(value)}"' if isinstance(value, str) else repr(value)
