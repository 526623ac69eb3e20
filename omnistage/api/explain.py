"""`omnistage explain PATH`: the fields of the API at a path, like `kubectl explain`, from the model."""

from __future__ import annotations

import difflib
import textwrap

from omnistage.api.crd import describe
from omnistage.api.fields import ApiField, ListOf, MapOf, ModelField, Obj, Scalar, Shape, api_fields, type_name
from omnistage.api.model import API_GROUP, API_VERSION, KIND, Metadata, Spec, Status

ROOT: tuple[ModelField, ...] = (
    ModelField("api_version", "apiVersion", Scalar(str), ApiField(doc=f"{API_GROUP}/{API_VERSION}"), None),
    ModelField("kind", "kind", Scalar(str), ApiField(doc=KIND), None),
    ModelField("metadata", "metadata", Obj(Metadata), ApiField(doc="Standard object metadata; the name is ours."),
               None),
    ModelField("spec", "spec", Obj(Spec), ApiField(doc="The pipeline: its topology and its deployment.",
                                                   required=True), None),
    ModelField("status", "status", Obj(Status), ApiField(doc="What the operator observed."), None),
)


DESCRIPTION = "A generative pipeline served as a graph of independently deployed stages."


class UnknownField(LookupError):
    pass


def resolve(path: str) -> tuple[ModelField | None, tuple[ModelField, ...]]:
    """The field at `path` (None: the object itself) and the fields below it; UnknownField names the first
    part not found."""
    parts = [p.replace("[]", "") for p in path.split(".") if p] if path else []
    if parts and parts[0] == KIND.lower():
        parts = parts[1:]
    fields, here = ROOT, None
    walked: list[str] = []
    for part in parts:
        found = next((f for f in fields if f.key == part), None)
        if found is None:
            hint = difflib.get_close_matches(part, [f.key for f in fields], n=1, cutoff=0.6)
            where = ".".join(walked) or KIND
            raise UnknownField(f'field "{part}" does not exist in {where}'
                               + (f' (did you mean "{hint[0]}"?)' if hint else ""))
        here = found
        walked.append(part)
        fields = _children(found.shape)
    return here, fields


def explain(path: str = "", recursive: bool = False) -> str:
    """The text `omnistage explain PATH` prints; UnknownField names the first part not found."""
    here, fields = resolve(path)
    lines = [f"KIND:     {KIND}", f"VERSION:  {API_GROUP}/{API_VERSION}", ""]
    if here is not None:
        lines += [f"FIELD:    {here.key} <{type_name(here.shape)}>", "", "DESCRIPTION:"]
        lines += _wrap(_describe(here), 5) + [""]
    else:
        lines += ["DESCRIPTION:"] + _wrap(DESCRIPTION, 5) + [""]
    if fields:
        lines.append("FIELDS:")
        lines += _field_lines(fields, 3, recursive)
    return "\n".join(lines).rstrip() + "\n"


def explain_doc(path: str = "", recursive: bool = False) -> dict:
    """What `explain` prints, as data (`omnistage explain -o json`): the field at the path and those below
    it, each with its name, type, whether it is required and its description (with `recursive`, the fields
    below each, all the way down)."""
    here, fields = resolve(path)
    return {"kind": KIND, "version": f"{API_GROUP}/{API_VERSION}",
            "field": None if here is None else _field_doc(here, False),
            "description": DESCRIPTION if here is None else _describe(here),
            "fields": [_field_doc(f, recursive) for f in fields]}


def _field_doc(f: ModelField, recursive: bool) -> dict:
    doc = {"name": f.key, "type": type_name(f.shape), "required": bool(f.api.required), "description": _describe(f)}
    if recursive and (below := _children(f.shape)):
        doc["fields"] = [_field_doc(c, True) for c in below]
    return doc


def _children(shape: Shape) -> tuple[ModelField, ...]:
    while isinstance(shape, (ListOf, MapOf)):
        shape = shape.item if isinstance(shape, ListOf) else shape.value
    return api_fields(shape.cls) if isinstance(shape, Obj) else ()


def _describe(f: ModelField) -> str:
    api = f.api
    text = describe(api)
    facts = []
    if api.required:
        facts.append("Required.")
    if f.has_default and f.default not in ("", (), {}, None) and isinstance(f.shape, Scalar):
        facts.append(f"Default: {str(f.default).lower() if isinstance(f.default, bool) else f.default}.")
    if api.enum:
        facts.append(f"One of: {', '.join(api.enum)}.")
    if api.minimum is not None or api.maximum is not None:
        bounds = [f">= {api.minimum:g}" if api.minimum is not None else "",
                  f"<= {api.maximum:g}" if api.maximum is not None else ""]
        facts.append("Bounds: " + ", ".join(b for b in bounds if b) + ".")
    if api.max_length is not None:
        facts.append(f"At most {api.max_length} characters.")
    if api.list_map_key:
        facts.append(f'Unique by "{api.list_map_key}".')
    if api.catalog is not None:
        facts.append(api.catalog())
    return " ".join([text, *facts]).strip()


def _field_lines(fields: tuple[ModelField, ...], indent: int, recursive: bool) -> list[str]:
    out = []
    for f in fields:
        required = " -required-" if f.api.required else ""
        out.append(" " * indent + f"{f.key}\t<{type_name(f.shape)}>{required}")
        if recursive:
            out += _field_lines(_children(f.shape), indent + 3, True)
        else:
            out += _wrap(_describe(f), indent + 2) + [""]
    return out


def _wrap(text: str, indent: int) -> list[str]:
    return textwrap.wrap(text, 100, initial_indent=" " * indent, subsequent_indent=" " * indent) or [""]
