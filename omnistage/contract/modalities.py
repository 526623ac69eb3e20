"""Output modalities: the spec's names (`omnistage.api.MODALITIES`) and the orchestrator API's
`Modality` enum, mapped once for the client, the command line and the orchestrator."""

from __future__ import annotations

from omnistage.api import MODALITIES
from omnistage.v1 import orchestrator_pb2

MODALITY_CODES = {name: orchestrator_pb2.Modality.Value(name.upper()) for name in MODALITIES}
MODALITY_NAMES = {code: name for name, code in MODALITY_CODES.items()}
