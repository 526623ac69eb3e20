"""Every JSON body the API takes, as its model under a pipeline's limits: the chat, speech and images bodies
(schemas.py) and the completions body (which lives with its endpoint)."""

from __future__ import annotations

from pydantic import BaseModel

from omnistage.api import Limits

from . import completions, schemas


def bounded(limits: Limits) -> dict[type[BaseModel], type[BaseModel]]:
    """Each request model -> its subclass under `limits` (`schemas.bounded`, `completions.bounded`)."""
    return {**schemas.bounded(limits), completions.CompletionRequest: completions.bounded(limits)}
