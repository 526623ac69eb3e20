"""How the OmniPipeline model declares its fields, and how the rest of the package reads them.

The API is written once, as frozen dataclasses in `model.py` whose fields carry an `ApiField` (YAML key,
description, bounds, enum, pattern) in their metadata; the Python type says the shape. Validation,
building the typed objects, the CRD schema and `omnistage explain` all walk the same declarations
through `shape_of` and `api_fields`, so a new field is one line in the model plus its use.

Why dataclass metadata rather than pydantic (installed, and considered): the errors must keep their
exact field paths and hints ('unknown field (did you mean "replicas"?)', every error at once), and the
schema must be a Kubernetes structural schema (no `$ref`, no `anyOf` for optionals, v1.20 keywords only).
Pydantic would need a translation layer in both directions, larger than these declarations and their
four small walkers.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, Callable, NewType, Union

# A Kubernetes resource quantity ("500m", "1Gi", 2): an int-or-string with this pattern.
Quantity = NewType("Quantity", str)
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"


@dataclass(frozen=True)
class ApiField:
    """What the API says about one field besides its Python type."""

    key: str = ""                      # the YAML key; default: the attribute name in camelCase
    doc: str = ""
    required: bool = False
    minimum: float | None = None
    maximum: float | None = None
    enum: tuple[str, ...] = ()
    pattern: str = ""
    pattern_hint: str = ""             # said instead of the pattern when a value does not match
    empty_ok: bool = False             # a string that may be "" (environment values)
    max_length: int | None = None
    length_hint: str = ""              # why max_length, said when a value is too long
    non_empty: bool = False            # a list that must have items
    list_map_key: str = ""             # a list of objects unique by this key (x-kubernetes-list-type: map)
    item: str = ""                     # what one item of such a list is called in errors ("stage")
    unique: bool = False               # a list of unique scalars (x-kubernetes-list-type: set)
    nullable: bool = False             # map values that may be null (meaning: all defaults)
    free_form: bool = False            # a mapping passed through as is (engine arguments)
    int_format: str = ""               # int32 / int64, for status counters
    default_from: str = ""             # the default is another field's value (documented, resolved by loading)
    # What `explain` adds from a table read when asked (the model families' components); never in the CRD.
    catalog: Callable[[], str] | None = None


def api_field(doc: str, *, default: Any = dataclasses.MISSING, default_factory: Any = dataclasses.MISSING,
              **meta: Any) -> Any:
    """A dataclass field of the API model: its description, bounds and YAML key."""
    info = ApiField(doc=doc, **meta)
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"api": info})


# ------------------------------------------------------------------------- shapes

@dataclass(frozen=True)
class Scalar:
    type: type                         # str, int, float, bool or Quantity


@dataclass(frozen=True)
class ListOf:
    item: "Shape"


@dataclass(frozen=True)
class MapOf:
    value: "Shape"


@dataclass(frozen=True)
class Obj:
    cls: type


@dataclass(frozen=True)
class FreeForm:
    pass


Shape = Union[Scalar, ListOf, MapOf, Obj, FreeForm]


def shape_of(hint: Any) -> Shape:
    """The shape of a model type: tuple[X, ...] is a list, Mapping[str, X] a map, a dataclass an object."""
    if hint is Any:
        return FreeForm()
    if hint in (str, int, float, bool, Quantity):
        return Scalar(hint)
    if dataclasses.is_dataclass(hint):
        return Obj(typing.cast(type, hint))   # a type hint: the dataclass itself, never an instance
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return ListOf(shape_of(args[0]))
    if origin in (Mapping, dict, typing.Mapping) and args and args[0] is str:
        value = shape_of(args[1])
        return FreeForm() if isinstance(value, FreeForm) else MapOf(value)
    raise TypeError(f"the API model cannot say {hint!r}")


@dataclass(frozen=True)
class ModelField:
    name: str                          # Python attribute
    key: str                           # YAML key
    shape: Shape
    api: ApiField
    default: Any                       # dataclasses.MISSING when required

    @property
    def has_default(self) -> bool:
        return self.default is not dataclasses.MISSING


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w.title() for w in rest)


@cache
def api_fields(cls: type) -> tuple[ModelField, ...]:
    """The API fields of a model class, in declaration order."""
    hints = typing.get_type_hints(cls, include_extras=False)
    out = []
    for f in dataclasses.fields(cls):
        api = f.metadata.get("api")
        if api is None:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        out.append(ModelField(f.name, api.key or camel(f.name), shape_of(hints[f.name]), api, default))
    return tuple(out)


def field_by_key(cls: type, key: str) -> ModelField:
    for f in api_fields(cls):
        if f.key == key:
            return f
    raise KeyError(key)


def type_name(shape: Shape) -> str:
    """How `explain` and errors name a shape."""
    if isinstance(shape, Scalar):
        return {str: "string", int: "integer", float: "number", bool: "boolean", Quantity: "quantity"}[shape.type]
    if isinstance(shape, ListOf):
        return f"[]{type_name(shape.item)}"
    if isinstance(shape, MapOf):
        return f"map[string]{type_name(shape.value)}"
    if isinstance(shape, Obj):
        return "object"
    return "object (free-form)"


def matches(pattern: str, value: str) -> bool:
    return re.match(pattern, value) is not None
