"""A Realtime session's configuration: what `session.update` (and a response's own parameters) may set,
checked against the pipeline; what this server cannot honour is refused naming the field, and nothing of
that update is applied. Its reference shape (`as_dict`) is what `session.created` / `session.updated` carry."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Sequence

from omnistage.api import Pipeline
from omnistage.contract import conversation
from omnistage.contract.params import InvalidRequest
from omnistage.v1 import common_pb2

from ...tool_calls import call_prefix
from .events import AudioConfig, AudioFormat, FunctionTool, RealtimeError, ResponseParams, Session, TurnDetection
from .limits import SAMPLE_RATE

DEFAULT_VOICE = ""  # the pipeline's own speaker
PCM = {"type": "audio/pcm", "rate": SAMPLE_RATE}
# server_vad's defaults, as the reference gives them.
DEFAULT_PREFIX_PADDING_MS = 300
DEFAULT_SILENCE_MS = 500
DEFAULT_THRESHOLD = 0.5
TOOL_CHOICES = ("auto", "none", "required")
# Fields the reference has that this server does not serve: refused when set to anything but off.
REFUSED = {
    "prompt": "stored prompts are not supported",
    "reasoning": "reasoning settings are not supported",
    "include": "input transcription log probabilities are not returned",
    "audio.input.transcription": "input audio is not transcribed (the model hears it as audio)",
    "audio.input.noise_reduction": "noise reduction is not supported",
    "input": "out-of-band input is not supported: create the items in the conversation",
}
_OFF: tuple = (None, "auto", "disabled", [], {})


@dataclass(frozen=True)
class Vad:
    """server_vad's settings."""

    threshold: float = DEFAULT_THRESHOLD
    prefix_padding_ms: int = DEFAULT_PREFIX_PADDING_MS
    silence_duration_ms: int = DEFAULT_SILENCE_MS
    create_response: bool = True
    interrupt_response: bool = True

    def as_dict(self) -> dict:
        return {"type": "server_vad", **dataclasses.asdict(self), "idle_timeout_ms": None}


@dataclass(frozen=True)
class ToolUse:
    """What one response offers: the tools, the answer prefix forcing a call (tool_choice required or named),
    the calls read at most (1 without parallel_tool_calls)."""

    tools: tuple[common_pb2.Tool, ...] = ()
    prefix: str = ""
    max_calls: int | None = None


@dataclass(frozen=True)
class SessionConfig:
    id: str
    model: str
    modalities: tuple[str, ...]  # what the pipeline can answer with
    token_bound: int = 0  # the pipeline's maxTokens (0: the model's context, the stage's to check)
    instructions: str = ""
    output_modalities: tuple[str, ...] = ("audio",)
    voice: str = DEFAULT_VOICE
    vad: Vad | None = field(default_factory=Vad)  # None: turn_detection null (the client commits)
    max_output_tokens: int | None = None  # None: "inf" (the pipeline's own bound)
    tools: tuple[common_pb2.Tool, ...] = ()
    tool_choice: str | dict = "auto"  # auto, none, required, or {"type": "function", "name": ...}
    parallel_tool_calls: bool = True

    @classmethod
    def initial(cls, session_id: str, pipeline: Pipeline) -> SessionConfig:
        outputs = tuple(o.modality for o in pipeline.outputs if o.modality in ("text", "audio"))
        return cls(session_id, pipeline.name, outputs, pipeline.limits.max_tokens,
                   output_modalities=("audio",) if "audio" in outputs else ("text",))

    def updated(self, s: Session) -> SessionConfig:
        """This configuration with the fields `s` sets."""
        if s.type == "transcription":
            raise RealtimeError("invalid_value", "transcription sessions are not served: use a realtime session",
                                "session.type")
        if s.model is not None and s.model != self.model:
            raise RealtimeError("model_not_found", f'the model "{s.model}" is not served (this server serves '
                                                   f'"{self.model}")', "session.model")
        for name in ("prompt", "reasoning", "include"):
            _refuse_if_set(getattr(s, name), name, "session.")
        for name, allowed in (("tracing", ("auto",)), ("truncation", ("auto", "disabled"))):
            value = getattr(s, name)
            if value is not None and value not in allowed:
                raise RealtimeError("unsupported_value", f"session.{name}: only {', '.join(allowed)} is served",
                                    f"session.{name}")
        changes = self._answer_changes(s, "session")
        if s.audio is not None:
            changes.update(self._audio(s.audio, "session.audio"))
        return dataclasses.replace(self, **changes)

    def _answer_changes(self, x, where: str) -> dict:
        """What a session.update or a response.create (`where`) sets of how answers are made, checked."""
        changes: dict = {}
        if x.instructions is not None:
            changes["instructions"] = x.instructions
        if x.output_modalities is not None:
            changes["output_modalities"] = self._modalities(x.output_modalities, f"{where}.output_modalities")
        if x.max_output_tokens is not None:
            changes["max_output_tokens"] = self._tokens(x.max_output_tokens, f"{where}.max_output_tokens")
        if x.tools is not None:
            changes["tools"] = tools_of(x.tools, f"{where}.tools")
        if x.tool_choice is not None:
            changes["tool_choice"] = tool_choice_of(x.tool_choice, f"{where}.tool_choice")
        if x.parallel_tool_calls is not None:
            changes["parallel_tool_calls"] = x.parallel_tool_calls
        return changes

    def for_response(self, r: ResponseParams | None) -> SessionConfig:
        """The configuration one response runs with: the session's, with what `response.create` sets."""
        if r is None:
            return self
        _refuse_if_set(r.input, "input", "response.")
        _refuse_if_set(r.prompt, "prompt", "response.")
        _refuse_if_set(r.reasoning, "reasoning", "response.")
        if r.conversation not in (None, "auto"):
            raise RealtimeError("unsupported_value", "response.conversation: only \"auto\" is served (each response "
                                                     "answers the conversation and joins it)",
                                "response.conversation")
        changes = self._answer_changes(r, "response")
        if r.audio is not None:
            if r.audio.input is not None:
                raise RealtimeError("unknown_parameter", "response.audio.input: a response sets its output only",
                                    "response.audio.input")
            changes.update(self._audio(r.audio, "response.audio"))
        return dataclasses.replace(self, **changes)

    def tool_use(self) -> ToolUse:
        """The tools a response offers and how its calls are read; a choice that names what is not offered
        is refused (checked when a response is asked for: the session's tools and choice change apart)."""
        choice = self.tool_choice
        if choice == "none" or not self.tools:
            if choice not in ("none", "auto"):
                raise RealtimeError("invalid_value", "tool_choice: needs tools (the session offers none)",
                                    "tool_choice")
            return ToolUse()
        max_calls = None if self.parallel_tool_calls else 1
        if choice == "auto":
            return ToolUse(self.tools, "", max_calls)
        if choice == "required":
            return ToolUse(self.tools, call_prefix(None), max_calls)
        name = choice["name"]  # type: ignore[index]
        if name not in [t.name for t in self.tools]:
            raise RealtimeError("invalid_value", f'tool_choice.name: "{name}" is not among the tools '
                                                 f'({", ".join(t.name for t in self.tools)})', "tool_choice.name")
        return ToolUse(self.tools, call_prefix(name), max_calls)

    def reserved_chars(self) -> int:
        """What a response's request takes of the text bound besides the conversation's items."""
        use = self.tool_use()
        return len(self.instructions) + len(use.prefix) + sum(len(t.name) + len(t.description) + len(t.parameters)
                                                              for t in use.tools)

    # ------------------------------------------------------------------ parts
    def _tokens(self, asked: int | str, param: str) -> int | None:
        if asked == "inf":
            return None
        if self.token_bound and int(asked) > self.token_bound:
            raise RealtimeError("invalid_value", f"{param}: at most {self.token_bound} (the pipeline's maxTokens), "
                                                 f'or "inf"; got {asked}', param)
        return int(asked)

    def _modalities(self, asked: Sequence[str], param: str) -> tuple[str, ...]:
        for m in asked:
            if m not in self.modalities:
                raise RealtimeError("unsupported_value", f'{param}: this pipeline answers with '
                                                         f'{", ".join(self.modalities)}, not "{m}"', param)
        return tuple(asked)

    def _audio(self, audio: AudioConfig, at: str) -> dict:
        changes: dict = {}
        if audio.input is not None:
            _check_format(audio.input.format, f"{at}.input.format")
            _refuse_if_set(audio.input.transcription, "audio.input.transcription", "session.")
            _refuse_if_set(audio.input.noise_reduction, "audio.input.noise_reduction", "session.")
            if "turn_detection" in audio.input.model_fields_set:
                changes["vad"] = vad_of(audio.input.turn_detection, f"{at}.input.turn_detection")
        if audio.output is not None:
            _check_format(audio.output.format, f"{at}.output.format")
            if audio.output.speed not in (None, 1.0):
                raise RealtimeError("unsupported_value", f"{at}.output.speed: only 1.0 is served",
                                    f"{at}.output.speed")
            voice = audio.output.voice
            if isinstance(voice, dict):
                raise RealtimeError("unsupported_value", f"{at}.output.voice: custom voices are not served; name "
                                                         "one of the pipeline's voices", f"{at}.output.voice")
            if voice is not None:
                changes["voice"] = "" if voice == "default" else voice
        return changes

    def as_dict(self) -> dict:
        """The session as `session.created` / `session.updated` show it."""
        return {
            "type": "realtime", "object": "realtime.session", "id": self.id, "model": self.model,
            "instructions": self.instructions, "output_modalities": list(self.output_modalities),
            "audio": {
                "input": {"format": PCM, "transcription": None, "noise_reduction": None,
                          "turn_detection": self.vad.as_dict() if self.vad else None},
                "output": {"format": PCM, "voice": self.voice or "default", "speed": 1.0},
            },
            "tools": [{"type": "function", "name": t.name, "description": t.description,
                       "parameters": json.loads(t.parameters) if t.parameters else {}} for t in self.tools],
            "tool_choice": self.tool_choice, "parallel_tool_calls": self.parallel_tool_calls,
            "max_output_tokens": self.max_output_tokens if self.max_output_tokens is not None else "inf",
            "tracing": None, "truncation": "auto", "prompt": None, "include": None,
        }


def _refuse_if_set(value, name: str, prefix: str) -> None:
    if value not in _OFF:
        raise RealtimeError("unsupported_value", f"{prefix}{name}: {REFUSED[name]}", f"{prefix}{name}")


def _check_format(fmt: AudioFormat | None, param: str) -> None:
    if fmt is None:
        return
    if fmt.type not in (None, "audio/pcm"):
        raise RealtimeError("unsupported_value", f'{param}.type: only "audio/pcm" (pcm16 at {SAMPLE_RATE} Hz) is '
                                                 f'served, not "{fmt.type}"', f"{param}.type")
    if fmt.rate not in (None, SAMPLE_RATE):
        raise RealtimeError("unsupported_value", f"{param}.rate: audio/pcm is {SAMPLE_RATE} Hz, not {fmt.rate}",
                            f"{param}.rate")


def vad_of(td: TurnDetection | None, param: str) -> Vad | None:
    if td is None:
        return None
    if td.type != "server_vad":
        raise RealtimeError("unsupported_value", f'{param}.type: "{td.type}" is not served; use "server_vad" or '
                                                 "null (the client commits)", f"{param}.type")
    if td.idle_timeout_ms is not None:
        raise RealtimeError("unsupported_value", f"{param}.idle_timeout_ms: idle timeouts are not served",
                            f"{param}.idle_timeout_ms")
    if td.threshold is not None and not 0.0 <= td.threshold <= 1.0:
        raise RealtimeError("invalid_value", f"{param}.threshold: must be from 0 to 1, got {td.threshold}",
                            f"{param}.threshold")
    given = {k: v for k, v in td.model_dump(exclude_none=True).items()
             if k in ("threshold", "prefix_padding_ms", "silence_duration_ms", "create_response",
                      "interrupt_response")}
    return Vad(**given)


def tools_of(tools: list[FunctionTool], param: str) -> tuple[common_pb2.Tool, ...]:
    out = []
    for i, t in enumerate(tools):
        at = f"{param}[{i}]"
        if t.type != "function":
            raise RealtimeError("unsupported_value", f'{at}.type: only "function" tools are served', f"{at}.type")
        if not t.name:
            raise RealtimeError("missing_required_parameter", f"{at}.name: a function tool needs a name",
                                f"{at}.name")
        if not conversation.TOOL_NAME.fullmatch(t.name):
            raise RealtimeError("invalid_value", f"{at}.name: must be 1 to 64 letters, digits, _ . or -",
                                f"{at}.name")
        if t.parameters:  # checked here, so that a session never holds a tool no response could offer
            try:
                conversation.check_schema(t.parameters, f"{at}.parameters")
            except InvalidRequest as e:
                raise RealtimeError("invalid_value", str(e), e.field) from None
        try:
            parameters = json.dumps(t.parameters, allow_nan=False) if t.parameters else ""
        except ValueError:
            raise RealtimeError("invalid_value", f"{at}.parameters: holds NaN or Infinity, which JSON has not",
                                f"{at}.parameters") from None
        out.append(common_pb2.Tool(name=t.name, description=t.description or "", parameters=parameters))
    return tuple(out)


def tool_choice_of(choice: str | dict, param: str) -> str | dict:
    if choice in TOOL_CHOICES:
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str) \
            and set(choice) == {"type", "name"}:
        return {"type": "function", "name": choice["name"]}
    raise RealtimeError("invalid_value", f'{param}: one of {", ".join(TOOL_CHOICES)} or {{"type": "function", '
                                         f'"name": ...}}', param)
