"""The pipeline's voices as the HTTP API lists them: in its model card, and at `GET /v1/audio/voices` (the
shape vLLM-Omni serves: `voices`, and `uploaded_voices`, always empty here: voices come from the checkpoint).
The check of a request's voice is the request path's (orchestrator_service/voices.py)."""

from __future__ import annotations

from ..voices import Voices


def card_fields(voices: Voices | None) -> dict:
    """What a model card adds for a pipeline with audio output: its voices and default voice (an empty list
    when the orchestrator could not read them; the default then is the file's, else null)."""
    if voices is None:
        return {}
    return {"voices": list(voices.names), "default_voice": voices.default or None}


def listing(model: str, voices: Voices | None) -> dict:
    """The body of `GET /v1/audio/voices`; a pipeline without audio output lists none."""
    voices = voices or Voices()
    return {"object": "list", "model": model, "voices": list(voices.names), "default_voice": voices.default or None,
            "aliases": dict(voices.aliases), "uploaded_voices": []}
