"""The voice a request speaks in, chosen before any stage runs.

A pipeline's voices are its checkpoint's speakers (`omnistage.checkpoints.voices`, read once at start), its
default the file's `limits.defaultVoice` or the model's own, and `limits.voiceAliases` other names for them.
A request's voice (`params.audio.speaker`, the HTTP door's `audio.voice` / `voice`) omitted, "" or "default"
is the default; any other matches a voice or an alias in any case and is sent to the stages in the
checkpoint's spelling; OpenAI's voice names and anything else are refused, listing this pipeline's voices.

A pipeline that clones (a Qwen3-TTS Base checkpoint) has no named voices: a request's voice is its reference
clip, and any voice name but "" or "default" is refused.

When the checkpoint cannot be read (no model store at the orchestrator), the voices are unknown: the voice
goes on as the request names it (an alias mapped, "default" the file's default or the stage's) and the
Talker checks it, as it always does.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Mapping

from omnistage.api import Pipeline
from omnistage.checkpoints.configs import CheckpointError
from omnistage.checkpoints.voices import audio_stage, pipeline_voices
from omnistage.contract.params import InvalidRequest

log = logging.getLogger("omnistage.orchestrator")

SPEAKER_FIELD = "params.audio.speaker"
DEFAULT = "default"  # the voice name that asks for the pipeline's default
# The voices OpenAI's API offers (speech, chat audio, realtime): clients send them by habit. A pipeline
# speaks them only where its voiceAliases map them to one of its own.
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer", "verse",
                 "marin", "cedar")


class VoiceError(ValueError):
    """A pipeline whose defaultVoice or voiceAliases name no voice of its checkpoint: it does not start."""


@dataclass(frozen=True)
class Voices:
    """A pipeline's voices. `names` empty: unknown (the Talker checks)."""

    names: tuple[str, ...] = ()
    default: str = ""                     # "" only when unknown and the file names none: the stage's default
    aliases: Mapping[str, str] = field(default_factory=dict)   # lower-case name -> voice
    clones: bool = False                  # no named voices: each request's reference clip is its voice

    @property
    def known(self) -> bool:
        return bool(self.names)

    @classmethod
    def of(cls, names: tuple[str, ...], model_default: str, default_voice: str = "",
           aliases: Mapping[str, str] | None = None) -> "Voices":
        """The voices `names` (the checkpoint's; () when unknown) with the file's `default_voice` ("" : the
        model's `model_default`) and `aliases`; VoiceError when either names no voice of a known checkpoint."""
        by_lower = {n.lower(): n for n in names}
        mapped: dict[str, str] = {}
        for alias, voice in (aliases or {}).items():
            if alias.lower() in mapped:
                raise VoiceError(f"limits.voiceAliases: {alias!r} is given twice (names match in any case)")
            if names and voice.lower() not in by_lower:
                raise VoiceError(f"limits.voiceAliases.{alias}: {voice!r} is not a voice of the checkpoint "
                                 f"({', '.join(names)})")
            mapped[alias.lower()] = by_lower.get(voice.lower(), voice)
        chosen = default_voice or model_default
        if names:
            if default_voice and default_voice.lower() not in by_lower and default_voice.lower() not in mapped:
                raise VoiceError(f"limits.defaultVoice: {default_voice!r} is not a voice of the checkpoint "
                                 f"({', '.join(names)})")
            chosen = by_lower.get(chosen.lower()) or mapped.get(chosen.lower()) or names[0]
        elif chosen.lower() in mapped:
            chosen = mapped[chosen.lower()]
        return cls(tuple(names), chosen, mapped)

    @classmethod
    def read(cls, pipeline: Pipeline, root: str | os.PathLike | None = None) -> "Voices | None":
        """`pipeline`'s voices from its checkpoint under the model store `root` (None: the pipeline has no audio
        output). A checkpoint that cannot be read leaves them unknown, with one log line saying why."""
        limits = pipeline.limits
        try:
            found = pipeline_voices(pipeline, root)
        except (CheckpointError, OSError, ValueError) as e:  # ValueError: a model source the store cannot hold
            stage = audio_stage(pipeline)
            log.info("orchestrator: %s (model %s): cannot read the voices (%s); the Talker checks each "
                     "request's voice", stage.name if stage else "?", stage.model if stage else "?", e)
            return cls.of((), "", limits.default_voice, limits.voice_aliases)
        if found is None:
            return None
        if found.clones:
            for key, given in (("defaultVoice", limits.default_voice), ("voiceAliases", limits.voice_aliases)):
                if given:
                    raise VoiceError(f"limits.{key}: this pipeline's checkpoint has no named voices (it speaks in "
                                     "the voice of each request's reference clip)")
            log.info("orchestrator: no named voices (the voice is each request's reference clip)")
            return cls(clones=True)
        voices = cls.of(found.names, found.default, limits.default_voice, limits.voice_aliases)
        log.info("orchestrator: voices %s (default %s)", ", ".join(voices.names), voices.default)
        return voices

    def choose(self, asked: str) -> str:
        """The voice to send the stages for a request that names `asked`; InvalidRequest when this pipeline
        has no such voice."""
        key = asked.lower()
        if key in ("", DEFAULT):
            return self.default
        if self.clones:
            raise InvalidRequest(SPEAKER_FIELD, f'"{asked}": this pipeline has no named voices, it speaks in the '
                                                'voice of the request\'s reference clip (ref_audio); send voice '
                                                '"default" or none')
        if not self.known:
            return self.aliases.get(key, asked)
        for name in self.names:
            if name.lower() == key:
                return name
        if key in self.aliases:
            return self.aliases[key]
        why = "is an OpenAI voice this pipeline does not map" if key in OPENAI_VOICES else "is not a voice of this " \
                                                                                          "pipeline"
        raise InvalidRequest(SPEAKER_FIELD, f'"{asked}" {why}; its voices: {self.listed()}')

    def listed(self) -> str:
        """The voices and aliases as a refusal lists them."""
        text = f"{', '.join(self.names)} (default {self.default})"
        if self.aliases:
            text += "; aliases: " + ", ".join(f"{a} -> {v}" for a, v in self.aliases.items())
        return text
