"""OpenAI requests -> GenerateRequests for the one request path (pure).

Each translation also records which OpenAI field every request-path field came from
(`Translated.fields`), so that a refusal from the request path (`params.parts[2].image: cannot
decode`) names the field the client sent (`messages[0].content[1]`). A field this API cannot
translate is InvalidRequest naming the OpenAI field; a model it does not serve is UnknownModel.

Speech for an omni pipeline: the Thinker is asked to repeat the input verbatim (a system prompt and
the input as the user turn) with audio as the only output, so the Talker speaks the Thinker's
rendering of it, exactly as in a chat with audio out. The Talker is not fed the input text directly:
that would be a second request path into the middle of the graph.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from omnistage.api import Limits, Pipeline, clones_voices, one_of_each_input, reads_instructions
from omnistage.contract.params import InvalidRequest
from omnistage.contract.request import build_request
from omnistage.v1 import common_pb2, orchestrator_pb2

from ..tool_calls import call_prefix
from . import audio_formats
from .errors import UnknownModel
from .schemas import UINT64, AudioOutput, ChatCompletionRequest, ContentPart, ImageRequest, SpeechRequest
from .stop import MAX_STOPS

REPEAT_VERBATIM = "Repeat the user's text exactly as written, word for word, and say nothing else."
SPEECH_EXTRA_TOKENS = 16   # room beyond one token per input character (end of turn)
CODEC_FRAMES_PER_CHAR = 1  # a 12.5 Hz codec and ~13 spoken characters a second: about one frame each
CHAT_MODALITIES = ("text", "audio")
AUDIO_IN_FORMATS = ("wav", "mp3", "flac", "ogg")  # what the orchestrator's media check decodes
# The reference's chat fields this API cannot honour, refused when a request asks for them.
REFUSED_CHAT_FIELDS = {
    "functions": "the deprecated functions are not supported: send them as tools",
    "function_call": "the deprecated function_call is not supported: use tool_choice",
    "response_format": "structured output is not supported (the answer is free text)",
    "logprobs": "log probabilities are not returned",
    "top_logprobs": "log probabilities are not returned",
    "logit_bias": "logit bias is not supported",
    "presence_penalty": "presence penalty is not supported",
    "frequency_penalty": "frequency penalty is not supported",
    "prediction": "predicted outputs are not supported",
}
# A refused field set to one of these asks for nothing, and passes.
_OFF = (None, False, 0, "", [], {}, "none", "auto", {"type": "text"})
_DATA_URL = re.compile(r"^data:([\w.+-]+/[\w.+-]+)?(?:;[\w.+-]+=[^;,]*)*;base64,", re.IGNORECASE)
_SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")


@dataclass(frozen=True)
class AudioRef:
    """An assistant message's `audio.id`: the text part at `part` is that earlier answer's transcript, filled
    in by the door that kept it (`audio_ids`) before the request is sent."""

    part: int
    id: str
    field: str


@dataclass(frozen=True)
class ToolUse:
    """How the answer's tool calls are read (`tool_calls.ToolCallStream`)."""

    prefix: str = ""                # the forced call's opening (the request's answer_prefix)
    max_calls: int | None = None    # 1 without parallel_tool_calls


@dataclass(frozen=True)
class Translated:
    request: orchestrator_pb2.GenerateRequest
    fields: Mapping[str, str]  # request-path field (as a refusal names it) -> the OpenAI field
    audio_format: str | None = None  # the format the answer's audio is sent in
    stops: tuple[str, ...] = ()
    stream: bool = False  # the answer is sent as it appears (chat: SSE chunks; speech: SSE events)
    include_usage: bool = False  # a streamed chat answer ends with a usage chunk
    tools: ToolUse | None = None  # the answer's tool calls are read out of its text
    audio_refs: tuple[AudioRef, ...] = ()


def check_model(model: str | None, pipeline: Pipeline) -> None:
    if model and model != pipeline.name:
        raise UnknownModel(model, pipeline.name)


def pipeline_outputs(pipeline: Pipeline) -> list[str]:
    return [o.modality for o in pipeline.outputs]


# ------------------------------------------------------------------------------ chat

def chat(body: ChatCompletionRequest, pipeline: Pipeline) -> Translated:
    check_model(body.model, pipeline)
    asked = body.model_extra or {}
    for name, why in REFUSED_CHAT_FIELDS.items():
        if asked.get(name) not in _OFF:
            raise InvalidRequest(name, why)
    if body.n not in (None, 1):
        raise InvalidRequest("n", f"only 1 choice per request is supported (got {body.n}): send one request each")
    stream = bool(body.stream)
    fields: dict[str, str] = {"params.parts": "messages", "params.turns": "messages", "params.prompt": "messages"}
    parts, turns, refs = _conversation(body, fields)
    tools, tool_use, prefix = _tools(body, fields)
    outputs = _chat_outputs(body.modalities, pipeline, fields)
    audio_format, speaker = None, ""
    if "audio" in outputs:
        audio = body.audio or AudioOutput()
        audio_format = audio.format or ("pcm16" if stream else "wav")
        if stream and audio_format != "pcm16":
            raise InvalidRequest("audio.format", f'a stream carries its audio as "pcm16" (as the OpenAI reference '
                                                 f'requires), not "{audio_format}"')
        audio_formats.check(audio_format, "audio.format", audio_formats.CHAT_FORMATS)
        speaker = audio.voice or ""
        fields["params.audio.speaker"] = "audio.voice"
    max_tokens_field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    fields.update({"params.text.max_tokens": max_tokens_field, "params.text.temperature": "temperature",
                   "params.text.top_p": "top_p", "params.text.top_k": "top_k", "params.seed": "seed"})
    request = build_request(
        parts=parts, turns=turns, tools=tools, answer_prefix=prefix,
        max_tokens=body.max_completion_tokens or body.max_tokens or 0,
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k if body.top_k and body.top_k > 0 else None,
        seed=body.seed, ignore_eos=bool(body.ignore_eos), speaker=speaker, outputs=outputs,
        return_trace=bool(body.return_trace))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Translated(request, fields, audio_format, _stops(body.stop), stream, include_usage, tool_use, refs)


# The roles a chat message may have, and the turn each becomes.
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def _conversation(body: ChatCompletionRequest, fields: dict[str, str]) \
        -> tuple[list[common_pb2.ContentPart], list[common_pb2.Turn], tuple[AudioRef, ...]]:
    """The messages as the request path's conversation: every message's content in one list of parts, a turn
    per message (system and developer messages at the start joined into one system turn, as one system
    prompt); an assistant message's earlier audio as a text part its transcript fills (`AudioRef`)."""
    parts: list[common_pb2.ContentPart] = []
    turns: list[common_pb2.Turn] = []
    refs: list[AudioRef] = []
    for i, m in enumerate(body.messages):
        at = f"messages[{i}]"
        role = _ROLES.get(m.role)
        if role is None:
            why = "the deprecated function messages are not supported: send tool messages" if m.role == "function" \
                else f'"{m.role}" is not a role (system, developer, user, assistant, tool)'
            raise InvalidRequest(f"{at}.role", why)
        first = len(parts)
        if role == "system":
            text = _system_text(m.content, at)
            if not text:  # an empty system message says nothing
                continue
            if turns and turns[-1].role == "system" and len(turns) == 1:  # leading ones: one system prompt
                parts[-1].text += "\n\n" + text
                continue
            parts.append(common_pb2.ContentPart(text=text))
        elif role == "assistant":
            _assistant(m, at, parts, refs)
        elif role == "tool":
            if not m.tool_call_id:
                raise InvalidRequest(f"{at}.tool_call_id", "is required on a tool message (the call it answers)")
            parts += _text_parts(m.content, at, "a tool message")
        else:
            if m.content is None:
                raise InvalidRequest(f"{at}.content", "is required")
            contents = [m.content] if isinstance(m.content, str) else m.content
            for j, part in enumerate(contents):
                where = f"{at}.content" if isinstance(m.content, str) else f"{at}.content[{j}]"
                fields[f"params.parts[{len(parts)}]"] = where
                parts.append(common_pb2.ContentPart(text=part) if isinstance(part, str) else _part(part, where))
        for k in range(first, len(parts)):
            fields.setdefault(f"params.parts[{k}]", f"{at}.content")
        t = len(turns)
        fields[f"params.turns[{t}]"] = at
        fields[f"params.turns[{t}].role"] = f"{at}.role"
        fields[f"params.turns[{t}].tool_call_id"] = f"{at}.tool_call_id"
        fields[f"params.turns[{t}].tool_calls"] = f"{at}.tool_calls"
        for j in range(len(m.tool_calls or []) if role == "assistant" else 0):
            call = f"params.turns[{t}].tool_calls[{j}]"
            fields.update({call: f"{at}.tool_calls[{j}]", f"{call}.id": f"{at}.tool_calls[{j}].id",
                           f"{call}.name": f"{at}.tool_calls[{j}].function.name",
                           f"{call}.arguments": f"{at}.tool_calls[{j}].function.arguments"})
        calls = [common_pb2.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
                 for c in (m.tool_calls or [])] if role == "assistant" else []
        turns.append(common_pb2.Turn(role=role, parts=len(parts) - first, tool_calls=calls,
                                     tool_call_id=m.tool_call_id or "" if role == "tool" else ""))
    if not any(t.role == "user" for t in turns):
        raise InvalidRequest("messages", "needs a user message")
    return parts, turns, tuple(refs)


def _assistant(m, at: str, parts: list[common_pb2.ContentPart], refs: list[AudioRef]) -> None:
    """An assistant message's text: its content, else its earlier audio's transcript; none with only tool
    calls."""
    for j, c in enumerate(m.tool_calls or []):
        if c.type != "function":
            raise InvalidRequest(f"{at}.tool_calls[{j}].type", f'"{c.type}" is not supported (function)')
    if m.content not in (None, "", []):
        parts += _text_parts(m.content, at, "an assistant message")
    elif m.audio is not None:
        refs.append(AudioRef(len(parts), m.audio.id, f"{at}.audio.id"))
        parts.append(common_pb2.ContentPart(text=" "))  # the transcript, once the door has it
    elif m.content is None and not m.tool_calls:
        raise InvalidRequest(f"{at}.content", "is required (or audio.id, or tool_calls)")


def _text_parts(content, at: str, what: str) -> list[common_pb2.ContentPart]:
    """A message's text content (a string, or text and refusal parts) as one text part."""
    if content is None:
        raise InvalidRequest(f"{at}.content", "is required")
    if isinstance(content, str):
        return [common_pb2.ContentPart(text=content)] if content else []
    texts = []
    for j, part in enumerate(content):
        if part.type == "text" and part.text is not None:
            texts.append(part.text)
        elif part.type == "refusal" and part.refusal is not None:
            texts.append(part.refusal)
        else:
            raise InvalidRequest(f"{at}.content[{j}]", f"{what} takes text parts only")
    text = "".join(texts)
    return [common_pb2.ContentPart(text=text)] if text else []


def _tools(body: ChatCompletionRequest, fields: dict[str, str]) \
        -> tuple[list[common_pb2.Tool], ToolUse | None, str]:
    """The offered functions, how the answer's calls are read, and the answer prefix that forces a call
    (`tool_choice` "required" or a named function)."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise InvalidRequest("tool_choice", "needs tools (the request offers none)")
        return [], None, ""
    tools = []
    for i, t in enumerate(body.tools):
        if t.type != "function":
            raise InvalidRequest(f"tools[{i}].type", f'"{t.type}" is not supported (function)')
        f = t.function
        fields[f"params.tools[{i}]"] = f"tools[{i}]"
        fields[f"params.tools[{i}].name"] = f"tools[{i}].function.name"
        fields[f"params.tools[{i}].parameters"] = f"tools[{i}].function.parameters"
        tools.append(common_pb2.Tool(name=f.name, description=f.description or "",
                                     parameters=json.dumps(f.parameters) if f.parameters is not None else ""))
    fields["params.tools"] = "tools"
    fields["params.answer_prefix"] = "tool_choice"
    if choice == "none":
        return [], None, ""
    max_calls = 1 if body.parallel_tool_calls is False else None
    if choice in (None, "auto"):
        return tools, ToolUse(max_calls=max_calls), ""
    if choice == "required":
        prefix = call_prefix(None)
    elif isinstance(choice, str):
        raise InvalidRequest("tool_choice", f'"{choice}" is not a choice (none, auto, required, or '
                                            '{"type": "function", "function": {"name": ...}})')
    else:
        if choice.type != "function":
            raise InvalidRequest("tool_choice.type", f'"{choice.type}" is not supported (function)')
        names = [t.name for t in tools]
        if choice.function.name not in names:
            raise InvalidRequest("tool_choice.function.name", f'"{choice.function.name}" is not among the tools '
                                                              f'({", ".join(names)})')
        prefix = call_prefix(choice.function.name)
    return tools, ToolUse(prefix, max_calls), prefix


def _system_text(content, at: str) -> str:
    if isinstance(content, str):
        return content
    for j, part in enumerate(content or []):
        if part.type != "text" or part.text is None:
            raise InvalidRequest(f"{at}.content[{j}]", "a system message takes text parts only")
    return "".join(p.text for p in content or [])


def _part(part: ContentPart, at: str) -> common_pb2.ContentPart:
    kind = part.type
    if kind == "text":
        if part.text is None:
            raise InvalidRequest(f"{at}.text", "is required for a part of type text")
        return common_pb2.ContentPart(text=part.text)
    if kind == "image_url":
        if part.image_url is None:
            raise InvalidRequest(f"{at}.image_url", "is required for a part of type image_url")
        data = data_url(part.image_url.url, f"{at}.image_url.url", "image")
        return common_pb2.ContentPart(image=common_pb2.ImagePart(data=data))
    if kind == "input_audio":
        audio = part.input_audio
        if audio is None:
            raise InvalidRequest(f"{at}.input_audio", "is required for a part of type input_audio")
        if audio.format is not None and audio.format not in AUDIO_IN_FORMATS:
            raise InvalidRequest(f"{at}.input_audio.format", f'"{audio.format}" is not one of: '
                                                             f'{", ".join(AUDIO_IN_FORMATS)}')
        return common_pb2.ContentPart(audio=common_pb2.AudioPart(data=b64decode_field(audio.data,
                                                                                     f"{at}.input_audio.data")))
    if kind == "video_url":
        if part.video_url is None:
            raise InvalidRequest(f"{at}.video_url", "is required for a part of type video_url")
        data = data_url(part.video_url.url, f"{at}.video_url.url", "video")
        return common_pb2.ContentPart(video=common_pb2.VideoPart(data=data))
    raise InvalidRequest(f"{at}.type", f'"{kind}" is not supported (text, image_url, input_audio, video_url)')


def data_url(url: str, param: str, kind: str) -> bytes:
    """The bytes of a base64 data: URL; a network URL is refused (the server fetches nothing)."""
    if url.lower().startswith(("http://", "https://")):
        raise InvalidRequest(param, f"{kind} URLs are not fetched (the server has no network access): send the "
                                    f"{kind} inline as a data: URL (data:{kind}/...;base64,...)")
    m = _DATA_URL.match(url)
    if m is None:
        raise InvalidRequest(param, f"must be a data: URL with base64 content (data:{kind}/...;base64,...)")
    if m.group(1) and not m.group(1).lower().startswith(f"{kind}/"):
        raise InvalidRequest(param, f"is {m.group(1)}, not an {kind}")
    return b64decode_field(url[m.end():], param)


# How an image comes inline where OpenAI's APIs take one (a video's input_reference, the image to edit).
IMAGE_SHAPES = ('must be an image: a file in a multipart body, a data: URL, or {"image_url": "data:image/...;base64,'
                '..."}')


def inline_image(value: Any, param: str) -> bytes:
    """An image as OpenAI's APIs take one, as its bytes: a multipart file's, a data: URL's, or {"image_url": data:
    URL}'s; a file id or a link is refused (the server keeps no files and fetches nothing)."""
    if isinstance(value, bytes):  # a multipart file
        return value
    if isinstance(value, str):
        return data_url(value, param, "image")
    if isinstance(value, dict) and isinstance(value.get("image_url"), str):
        return data_url(value["image_url"], f"{param}.image_url", "image")
    if isinstance(value, dict) and "file_id" in value:
        raise InvalidRequest(f"{param}.file_id", "file ids are not served (there is no files API here): send the "
                                                 "image itself, as a file or a data: URL")
    raise InvalidRequest(param, IMAGE_SHAPES)


def b64decode_field(data: str, param: str) -> bytes:
    """The bytes of a base64 request field; InvalidRequest naming `param` when it is not base64."""
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(param, "is not valid base64") from None


def _chat_outputs(modalities: list[str] | None, pipeline: Pipeline, fields: dict[str, str]) -> list[str]:
    has = pipeline_outputs(pipeline)
    if not set(CHAT_MODALITIES) & set(has):
        raise InvalidRequest("model", f'"{pipeline.name}" answers with {", ".join(has)}, not text or audio (use '
                                      "/v1/images/generations)")
    asked = ["text"] if modalities is None else modalities
    if not asked:
        raise InvalidRequest("modalities", "is empty (text, or text and audio)")
    outputs: list[str] = []
    for i, m in enumerate(asked):
        if m not in CHAT_MODALITIES:
            raise InvalidRequest(f"modalities[{i}]", f'"{m}" is not a chat output ({", ".join(CHAT_MODALITIES)})')
        if m not in outputs:
            fields[f"outputs[{len(outputs)}]"] = f"modalities[{i}]"
            outputs.append(m)
    return outputs


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS:
        raise InvalidRequest("stop", f"has {len(stops)} strings; at most {MAX_STOPS}")
    for i, s in enumerate(stops):
        if not s:
            raise InvalidRequest("stop" if isinstance(stop, str) else f"stop[{i}]", "is empty")
    return tuple(stops)


# ---------------------------------------------------------------------------- speech

def speech(body: SpeechRequest, pipeline: Pipeline) -> Translated:
    check_model(body.model, pipeline)
    has = pipeline_outputs(pipeline)
    if "audio" not in has:
        raise InvalidRequest("model", f'"{pipeline.name}" cannot speak: it has no audio output (it has: '
                                      f'{", ".join(has)})')
    # A text-to-speech stage speaks the input as written and reads the instructions; a Thinker is told to repeat
    # the input, and a Talker has no instructions to read.
    speaks_input = reads_instructions(pipeline)
    instructions = ""
    if body.instructions not in _OFF:
        if not speaks_input:
            raise InvalidRequest("instructions", "are not supported: the voice is the checkpoint's speaker named by "
                                                 "voice")
        if not isinstance(body.instructions, str):
            raise InvalidRequest("instructions", "must be a string: how the voice speaks")
        instructions = body.instructions
    if body.speed not in (None, 1.0):
        raise InvalidRequest("speed", f"only 1.0 is supported, got {body.speed} (another speed needs "
                                      "time-stretching, which this server does not do)")
    if not body.input.strip():
        raise InvalidRequest("input", "is empty")
    limits = pipeline.limits
    _check_speech_budget(len(body.input), limits)
    sse = body.stream_format == "sse"
    fmt = body.response_format or ("pcm" if sse else "mp3")
    if sse and fmt != "pcm":
        raise InvalidRequest("response_format", f'stream_format "sse" sends the audio as "pcm" (16-bit mono '
                                                f'samples), not "{fmt}"; or ask for stream_format "audio"')
    audio_formats.check(fmt, "response_format", audio_formats.SPEECH_FORMATS)
    clip, ref_text = _reference_clip(body, pipeline)
    request = build_request(
        body.input, system_prompt="" if speaks_input else REPEAT_VERBATIM, speaker=body.voice or "",
        instructions=instructions, outputs=["audio"],
        max_tokens=len(body.input) + SPEECH_EXTRA_TOKENS,
        max_codec_frames=max(limits.default_codec_frames, CODEC_FRAMES_PER_CHAR * len(body.input)),
        return_trace=bool(body.return_trace), parts=clip, ref_text=ref_text)
    fields = {"params.prompt": "input", "params.text.max_tokens": "input", "params.audio.max_codec_frames": "input",
              "params.audio.speaker": "voice", "params.audio.instructions": "instructions",
              "params.parts": "ref_audio", "params.audio.ref_text": "ref_text"}
    return Translated(request, fields, fmt, stream=sse)


def _reference_clip(body: SpeechRequest, pipeline: Pipeline) -> tuple[list[common_pb2.ContentPart], str]:
    """A voice-cloning request's reference clip (as the one audio part; none without `ref_audio`) and its
    transcript: `ref_text` selects ICL mode, `x_vector_only_mode` true the clip's sound alone, and a request that
    says both, or either without a clip, or any of them to a pipeline that clones no voice, is refused rather
    than one of them dropped (or the clip heard as the input)."""
    given = [n for n in ("ref_audio", "ref_text", "x_vector_only_mode") if getattr(body, n) is not None]
    if given and not clones_voices(pipeline):
        raise InvalidRequest(given[0], f'is for voice cloning, and "{pipeline.name}" has no stage that clones a voice '
                                       "(a Qwen3-TTS pipeline does)")
    if body.ref_audio is None:
        for name in ("ref_text", "x_vector_only_mode"):
            if getattr(body, name) is not None:
                raise InvalidRequest(name, "is for voice cloning: it goes with ref_audio, the reference clip")
        return [], ""
    if body.x_vector_only_mode and body.ref_text:
        raise InvalidRequest("x_vector_only_mode", "takes the voice from the clip's sound alone, so ref_text would "
                                                   "go unread: send one or the other")
    if body.x_vector_only_mode is False and not body.ref_text:
        raise InvalidRequest("ref_text", "is required when x_vector_only_mode is false (ICL mode reads the clip's "
                                         "transcript)")
    value = body.ref_audio.strip()
    if value.lower().startswith(("data:", "http://", "https://")):
        data = data_url(value, "ref_audio", "audio")
    else:
        data = b64decode_field(value, "ref_audio")
    if not data:
        raise InvalidRequest("ref_audio", "is empty")
    return [common_pb2.ContentPart(audio=common_pb2.AudioPart(data=data))], body.ref_text or ""


def _check_speech_budget(chars: int, limits: Limits) -> None:
    """Speech budgets one text token and one codec frame per input character: an input whose budget is over
    the pipeline's limits is refused rather than spoken cut short."""
    budgets = [(limits.max_codec_frames // CODEC_FRAMES_PER_CHAR, "maxCodecFrames")]
    if limits.max_tokens:  # 0: bounded by the model's context, which the Thinker checks
        budgets.append((limits.max_tokens - SPEECH_EXTRA_TOKENS, "maxTokens"))
    most, limit = min(budgets)
    if chars > most:
        raise InvalidRequest("input", f"has {chars} characters; this pipeline speaks at most {most} in one request "
                                      f"(its {limit} limit): split the text into several requests")


# ---------------------------------------------------------------------------- images

def images(body: ImageRequest, pipeline: Pipeline,
           random_seed: Callable[[], int] = lambda: secrets.randbelow(2**32),
           parts: Sequence[common_pb2.ContentPart] = (), parts_field: str = "") -> list[Translated]:
    """One request per image; with n > 1 their seeds are seed, seed + 1, ... (a random seed when none is
    given, so the images differ). `parts`: media each request carries beside its prompt (the image to edit), which
    a refusal names as `parts_field`."""
    check_model(body.model, pipeline)
    has = pipeline_outputs(pipeline)
    if "image" not in has:
        raise InvalidRequest("model", f'"{pipeline.name}" makes no images (it has: {", ".join(has)})')
    if not parts and "image" in one_of_each_input(pipeline):
        raise InvalidRequest("model", f'"{pipeline.name}" edits images: send the image and the prompt to '
                                      "POST /v1/images/edits")
    if body.response_format not in (None, "b64_json"):
        raise InvalidRequest("response_format", f'"{body.response_format}" is not supported: images come back '
                                                'inline as "b64_json" (this server keeps no files to link to)')
    if body.output_format not in (None, "png"):
        raise InvalidRequest("output_format", f'"{body.output_format}" is not supported: images are png')
    if body.stream or body.partial_images:
        raise InvalidRequest("stream" if body.stream else "partial_images",
                             "streaming partial images is not supported: the denoise stage hands its latents on "
                             "once, after the last step")
    width, height = image_size(body.size)
    n = body.n or 1
    seed = body.seed if body.seed is not None else (random_seed() if n > 1 else None)
    fields = {"params.prompt": "prompt", "params.image.width": "size", "params.image.height": "size",
              "params.image.num_inference_steps": "num_inference_steps",
              "params.image.guidance_scale": "guidance_scale", "params.image.negative_prompt": "negative_prompt",
              "params.image.true_cfg_scale": "true_cfg_scale", "params.seed": "seed"}
    if parts:
        fields |= {"params.parts": parts_field}
    return [Translated(build_request(body.prompt, width=width, height=height,
                                     num_inference_steps=body.num_inference_steps or 0,
                                     guidance_scale=body.guidance_scale, negative_prompt=body.negative_prompt or "",
                                     true_cfg_scale=body.true_cfg_scale or 0.0,
                                     seed=None if seed is None else (seed + i) % (UINT64 + 1), outputs=["image"],
                                     return_trace=bool(body.return_trace), parts=parts),
                       fields)
            for i in range(n)]


def image_size(size: str | None) -> tuple[int, int]:
    """"WxH" -> (W, H); "auto" or none: (0, 0), the pipeline's default."""
    if size in (None, "auto"):
        return 0, 0
    m = _SIZE.match(size)
    if m is None:
        raise InvalidRequest("size", f'must be "WIDTHxHEIGHT" (such as "256x256") or "auto", got "{size}"')
    return int(m.group(1)), int(m.group(2))
