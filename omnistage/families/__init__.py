"""Model families: the one table the spec validator, the checkpoint check and the stage service read
(`registry.py`), what a family declares (`types.py`), and the adapters engine runtimes share
(`adapters.py`). A family is one module that calls `register` once; see docs/models.md."""

from omnistage.families.registry import (
                                         ENTRY_POINT_GROUP,
                                         FamilyConflict,
                                         adapter_for,
                                         adapters_for,
                                         all_adapters,
                                         component_catalog,
                                         components_for,
                                         engine_names,
                                         engines_for_kind,
                                         families,
                                         family_named,
                                         family_of,
                                         register,
                                         served_architectures,
                                         unregister,
)
from omnistage.families.types import ENGINES, Adapter, EngineTable, Family, Part, PipelinePart

__all__ = [
    "ENGINES", "ENTRY_POINT_GROUP", "Adapter", "EngineTable", "Family", "FamilyConflict", "Part", "PipelinePart",
    "adapter_for", "adapters_for", "all_adapters", "component_catalog", "components_for", "engine_names",
    "engines_for_kind", "families",
    "family_named", "family_of", "register", "served_architectures", "unregister",
]
