"""From a file, YAML text or a decoded object to a validated, typed `Pipeline`, and back to YAML.

Building walks the same declarations as validation: a key that is absent takes the model's default,
and a field whose default is another field's value (`default_from`: a stage's image) is resolved here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from omnistage.api.fields import FreeForm, ListOf, MapOf, Obj, Scalar, Shape, api_fields
from omnistage.api.model import Deployment, Metadata, Pipeline, Spec
from omnistage.api.validation import FieldError, SpecError, validate


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
    spec: Spec = build(Spec, doc["spec"])
    meta: Metadata = build(Metadata, doc["metadata"])
    topo = spec.topology
    return Pipeline(name=meta.name, namespace=doc["metadata"].get("namespace", "default"), stages=topo.stages,
                    outputs=topo.outputs, limits=topo.limits, deployment=_inherit_image(spec.deployment), raw=doc)


def dump_pipeline(pipeline: Pipeline) -> str:
    return yaml.safe_dump(dict(pipeline.raw), sort_keys=False)


def build(cls: type, value: dict) -> Any:
    """A model object from a validated mapping; absent keys take the model's defaults."""
    return cls(**{f.name: _build(f.shape, value[f.key]) for f in api_fields(cls) if f.key in value})


def _build(shape: Shape, value: Any) -> Any:
    if isinstance(shape, Obj):
        return build(shape.cls, value or {})
    if isinstance(shape, ListOf):
        return tuple(_build(shape.item, v) for v in value)
    if isinstance(shape, MapOf):
        return {k: _build(shape.value, v) for k, v in value.items()}
    if isinstance(shape, Scalar) and shape.type is float:
        return float(value)
    if isinstance(shape, FreeForm):
        return dict(value)
    return value


def _inherit_image(dep: Deployment) -> Deployment:
    """Stages and the orchestrator without an image of their own take spec.deployment.image."""
    def fill(x):
        return x if x.image else dataclasses.replace(x, image=dep.image)
    return dataclasses.replace(dep, stages={n: fill(s) for n, s in dep.stages.items()},
                               orchestrator=fill(dep.orchestrator))
