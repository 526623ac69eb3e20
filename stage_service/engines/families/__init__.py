"""The model families this stage service serves: one module each, registered in omnistage's family table
(`omnistage.families`) when the table is first read. `load` is the `omnistage.families` entry point: it
imports every module of this package, so a new family is one new module here (plus its tests).

A family module is light: it imports declarations only. Its `engines()` imports the engine classes, when
a stage of the family starts."""

from __future__ import annotations

import importlib
import pkgutil


def load() -> None:
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")
