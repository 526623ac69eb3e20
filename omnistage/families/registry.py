"""The one table of model families. Each family module registers itself once (`register`); the spec
validator, `omnistage models check`, `explain` and the stage service read this table alone.

Families are found through the `omnistage.families` entry-point group, loaded the first time the table
is read: the project's own (`stage_service.engines.families`) and any installed package's, the way vLLM
finds its plugins. Loading a family module imports no engine: its `engines()` does, when a stage starts.
"""

from __future__ import annotations

import threading
from importlib.metadata import entry_points

from omnistage.families.types import ENGINES, Adapter, Family

ENTRY_POINT_GROUP = "omnistage.families"

_families: dict[str, Family] = {}
_lock = threading.RLock()
_loaded = False


class FamilyConflict(ValueError):
    """A family that cannot join the table: a name taken, an unknown engine, or an adapter that serves
    the same stages as another family's but reads or emits something else."""


class NoFamilies(RuntimeError):
    """Nothing is installed under the entry point: omnistage is run from a tree it was not installed from."""


def register(family: Family) -> Family:
    """Add a family to the table (once; registering the same family again changes nothing). The installed
    families load first, so a name or adapter clash is found whatever the order."""
    _load()
    with _lock:
        known = _families.get(family.name)
        if known is not None:
            if known is family:
                return family
            raise FamilyConflict(f'a model family named "{family.name}" is already registered')
        _check(family)
        _families[family.name] = family
        return family


def unregister(name: str) -> None:
    with _lock:
        _families.pop(name, None)


def _check(family: Family) -> None:
    for a in family.adapters:
        unknown = [e for e in a.engines if e not in ENGINES]
        if unknown:
            raise FamilyConflict(f"family {family.name}: adapter {a.name} names engine(s) {', '.join(unknown)}; "
                                 f"known engines: {', '.join(ENGINES)}")
        for e in a.engines:
            for other in _adapters_of(tuple(_families.values()), e, a.kind, a.component):
                if other.contract() != a.contract():
                    raise FamilyConflict(
                        f"family {family.name}: adapter {a.name} serves the same stages as {other.name} ({e}, kind "
                        f"{a.kind}, component \"{a.component}\") but reads or emits different things: validation "
                        "could not tell which one a stage gets")


def _load() -> None:
    global _loaded
    with _lock:
        if _loaded:
            return
        found = entry_points(group=ENTRY_POINT_GROUP)
        if not found:
            raise NoFamilies(f"no model families: nothing is installed under the {ENTRY_POINT_GROUP} entry point "
                                 "(install omnistage itself, e.g. `pip install -e .`, so its families are found)")
        _loaded = True
        for ep in found:
            ep.load()()


def families() -> tuple[Family, ...]:
    """Every registered family, in registration order."""
    _load()
    with _lock:
        return tuple(_families.values())


def family_named(name: str) -> Family:
    found = next((f for f in families() if f.name == name), None)
    if found is None:
        raise KeyError(f'no model family "{name}" (known: {", ".join(f.name for f in families())})')
    return found


def family_of(architecture: str) -> Family | None:
    """The family whose checkpoints carry this class name (exact names before suffix rules)."""
    fams = families()
    return (next((f for f in fams if not f.suffix and f.matches(architecture)), None)
            or next((f for f in fams if f.suffix and f.matches(architecture)), None))


def served_architectures() -> str:
    names = [("*" if f.suffix else "") + a for f in families() for a in f.architectures[:1]]
    return ", ".join(names)


def component_catalog() -> str:
    """The stage components each family serves, as `explain` shows them."""
    shown = [f"{f.name} ({', '.join(c or 'none' for c in f.components)})" for f in families()]
    return "Components by model family: " + "; ".join(shown) + "."


def all_adapters() -> tuple[Adapter, ...]:
    """Every adapter of every family, each once, in registration order."""
    return tuple(dict.fromkeys(a for f in families() for a in f.adapters))


def engine_names() -> tuple[str, ...]:
    return tuple(dict.fromkeys(e for a in all_adapters() for e in a.engines))


def engines_for_kind(kind: str) -> tuple[str, ...]:
    """Engines with some adapter for this kind of stage, in `ENGINES` order (not the order in which the families
    happen to register: a new family module must not reorder a message that lists them)."""
    found = {e for a in all_adapters() if a.kind == kind for e in a.engines}
    return tuple(e for e in ENGINES if e in found)


def components_for(engine: str, kind: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(a.component for a in all_adapters() if a.kind == kind and engine in a.engines))


def _adapters_of(fams: tuple[Family, ...], engine: str, kind: str, component: str) -> tuple[Adapter, ...]:
    found = (a for f in fams for a in f.adapters)
    return tuple(dict.fromkeys(a for a in found if engine in a.engines and a.kind == kind and a.component == component))


def adapters_for(engine: str, kind: str, component: str) -> tuple[Adapter, ...]:
    """Every adapter that may serve such a stage (one per family), in table order."""
    return _adapters_of(families(), engine, kind, component)


def adapter_for(engine: str, kind: str, component: str) -> Adapter | None:
    """The contract validation checks such a stage against (every adapter of `adapters_for` agrees on it)."""
    found = adapters_for(engine, kind, component)
    return found[0] if found else None
