"""Transcriptions and translations (`/v1/audio/transcriptions`, `/v1/audio/translations`): an uploaded audio
file as a GenerateRequest for a pipeline whose Thinker hears audio, and the Thinker's text as the answer in
the asked `response_format`, or as `transcript.text.delta` / `transcript.text.done` server-sent events.

For a pipeline that reads text parts (an omni Thinker), the request is the audio as one content part and an
instruction as a text part after it (transcribe it, or translate it into English; the client's `language` and
`prompt` folded in as context), under a fixed system prompt. A pipeline that reads audio alone is a speech
recognition model, whose prompt is its own (Qwen3-ASR: its processor's): the request is the audio part alone,
the client's `prompt` as the system prompt (the context its model reads there) and `language` as
`params.audio.language` (its model forces it); such a model transcribes only. Either way text is the only
output: the request path runs the stages text needs and none of the speech stages. The orchestrator's media
check decodes and bounds the audio as for any audio part (its format, its seconds); its refusals name `file`.

The model gives no timestamps: verbose_json has one segment, and srt / vtt one cue, spanning the whole clip
(its length read from the decoded audio).
"""

from __future__ import annotations

import asyncio
import io
import math
import re
from dataclasses import dataclass
from typing import AsyncIterator

import soundfile
from starlette.responses import JSONResponse, Response

from omnistage.api import Limits, Pipeline, accepted_inputs
from omnistage.contract.params import InvalidRequest
from omnistage.contract.request import build_request
from omnistage.v1 import common_pb2

from . import multipart_form
from .call import Call, ClientGone
from .errors import ApiError
from .responses import sse_event, with_trace
from .translate import Translated, check_model, pipeline_outputs

TRANSCRIBE, TRANSLATE = "transcribe", "translate"
SYSTEM_PROMPT = "You are a speech recognition and translation system. You answer with the requested text only."
INSTRUCTIONS = {
    TRANSCRIBE: "Transcribe the speech in this audio exactly as spoken, in the language it is spoken in.",
    TRANSLATE: "Translate the speech in this audio into English.",
}
RESPONSE_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
STREAM_FORMATS = ("json", "text")  # a stream is transcript.text events: the other formats have no events
TRANSLATION_LANGUAGE = "english"  # what verbose_json names as a translation's language (the reference's word)
# A transcription's language when the client named none: an omni Thinker detects none, and a speech recognition
# stage's detected language (its answer's header) is not passed on.
UNKNOWN_LANGUAGE = "unknown"
# ISO-639-1 (or -3) codes, as the reference takes `language`, optionally with a region (en-US).
_LANGUAGE = re.compile(r"^[A-Za-z]{2,3}(-[A-Za-z0-9]{2,8})?$")
# The reference's fields this API cannot honour, refused when a request asks for them.
REFUSED_FIELDS = {
    "include": "log probabilities are not returned",
    "known_speaker_names": "diarization is not supported",
    "known_speaker_references": "diarization is not supported",
}
# A UTF-8 character at its longest: the form's text fields (the prompt) are bounded in characters.
UTF8_BYTES_PER_CHAR = 4
# The form around the file and the prompt: the other fields, their part headers (a filename of up to a few
# hundred bytes) and the boundaries.
FORM_SLACK = 64 << 10
# The audio's blocks read to count its length (frames): as media.py reads it, never the whole clip at once.
_BLOCK_FRAMES = 1 << 16
_BOOL = {"true": True, "1": True, "false": False, "0": False}


@dataclass(frozen=True)
class Transcription(Translated):
    """A transcription or translation request, translated, with how its answer is shaped."""

    task: str = TRANSCRIBE
    response_format: str = "json"
    language: str = UNKNOWN_LANGUAGE


def upload_body_limit(limits: Limits) -> int:
    """The largest upload the pipeline's limits admit: the file at its largest, the prompt at its longest."""
    return limits.max_part_bytes + limits.max_prompt_chars * UTF8_BYTES_PER_CHAR + FORM_SLACK


# ---------------------------------------------------------------------- the request

def transcription(body: bytes, content_type: str, pipeline: Pipeline) -> Transcription:
    return _translated(multipart_form.parse(body, content_type), pipeline, TRANSCRIBE)


def translation(body: bytes, content_type: str, pipeline: Pipeline) -> Transcription:
    return _translated(multipart_form.parse(body, content_type), pipeline, TRANSLATE)


def _translated(form: multipart_form.Form, pipeline: Pipeline, task: str) -> Transcription:
    check_model(form.text("model"), pipeline)
    takes, makes = sorted(accepted_inputs(pipeline)), pipeline_outputs(pipeline)
    if "audio" not in takes or "text" not in makes:
        raise InvalidRequest("model", f'"{pipeline.name}" cannot {task} speech: that needs a pipeline that takes '
                                      f'audio and answers with text (it takes {", ".join(takes)} and answers with '
                                      f'{", ".join(makes)})')
    for name, why in REFUSED_FIELDS.items():
        if form.texts(name):
            raise InvalidRequest(name, why)
    if "word" in form.texts("timestamp_granularities"):
        raise InvalidRequest("timestamp_granularities", "word timestamps are not supported: the model gives none")
    if form.text("chunking_strategy") not in (None, "auto"):
        raise InvalidRequest("chunking_strategy", 'only "auto" is supported (the clip is heard whole)')
    files = form.files.get("file", [])
    if len(files) != 1:
        raise InvalidRequest("file", "is required: the audio, uploaded as a file" if not files else
                             f"came {len(files)} times; one file per request")
    response_format = form.text("response_format") or "json"
    if response_format not in RESPONSE_FORMATS:
        raise InvalidRequest("response_format", f'"{response_format}" is not one of: {", ".join(RESPONSE_FORMATS)}')
    stream = _flag(form, "stream")
    if stream and response_format not in STREAM_FORMATS:
        raise InvalidRequest("response_format", f'a stream sends transcript.text events: "{response_format}" cannot '
                                                f'be streamed (ask for {" or ".join(STREAM_FORMATS)}, or stream=false)')
    language = form.text("language") or ""
    if language and not _LANGUAGE.match(language):
        raise InvalidRequest("language", f'must be an ISO-639-1 code such as "en", got "{language}"')
    prompt = form.text("prompt") or ""
    audio = common_pb2.ContentPart(audio=common_pb2.AudioPart(data=files[0].data))
    temperature, trace = _number(form, "temperature"), bool(_flag(form, "return_trace"))
    fields = {"params.parts": "file", "params.parts[0]": "file", "params.parts[1]": "prompt",
              "params.prompt": "prompt", "params.text.temperature": "temperature", "outputs": "model"}
    if "text" not in takes:  # a speech recognition model: its own prompt, the client's context and language
        if task == TRANSLATE:
            raise InvalidRequest("model", f'"{pipeline.name}" is a speech recognition model: it transcribes, and '
                                          "does not translate (use /v1/audio/transcriptions)")
        # The region of a code (en-US) is the model's concern no more than the reference's: the language alone.
        request = build_request(parts=[audio], system_prompt=prompt, language=language.split("-")[0],
                                temperature=temperature, outputs=["text"], return_trace=trace)
        fields |= {"params.system_prompt": "prompt", "params.audio.language": "language"}
    else:
        asked = instruction(task, language, prompt)
        if len(asked) > pipeline.limits.max_prompt_chars:  # the prompt is all of the instruction that can grow
            room = pipeline.limits.max_prompt_chars - len(instruction(task, language, "-")) + 1
            raise InvalidRequest("prompt", f"has {len(prompt)} characters; this pipeline takes at most {room} "
                                           f"(its maxPromptChars, less the instruction around it)")
        request = build_request(parts=[audio, asked], system_prompt=SYSTEM_PROMPT, temperature=temperature,
                                outputs=["text"], return_trace=trace)
    shown_language = TRANSLATION_LANGUAGE if task == TRANSLATE else language or UNKNOWN_LANGUAGE
    return Transcription(request, fields, stream=stream, task=task, response_format=response_format,
                         language=shown_language)


def instruction(task: str, language: str, prompt: str) -> str:
    """What the Thinker is asked, after the audio: the task, then the client's language and prompt as context."""
    text = INSTRUCTIONS[task]
    if language:
        text += f" The speech is in the language with ISO-639 code \"{language}\"."
    if prompt:
        text += f" Context for the speech (earlier words, names and their spelling):\n{prompt}"
    return text + "\nAnswer with the text only."


def _flag(form: multipart_form.Form, name: str) -> bool:
    raw = form.text(name)
    if raw is None or raw == "":
        return False
    value = _BOOL.get(raw.strip().lower())
    if value is None:
        raise InvalidRequest(name, f'must be true or false, got "{raw}"')
    return value


def _number(form: multipart_form.Form, name: str) -> float | None:
    raw = form.text(name)
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise InvalidRequest(name, f'must be a number, got "{raw}"')
    return value


# ---------------------------------------------------------------------- the answer

async def whole(call: Call, plan: Transcription) -> Response:
    """The whole answer in the asked response_format."""
    text, final = [], None
    async for ev in call:
        kind = ev.WhichOneof("event")
        if kind == "text":
            text.append(ev.text.text)
        elif kind == "final":
            final = ev.final
    transcript, fmt, headers = "".join(text).strip(), plan.response_format, {"X-Request-Id": call.request_id}
    # The reference's usage: a transcription's json in tokens, its verbose_json in seconds; a translation's none.
    if fmt == "json":
        answer = {"text": transcript} | ({"usage": usage(final)} if plan.task == TRANSCRIBE else {})
        return JSONResponse(with_trace(answer, final), headers=headers)
    if fmt == "text":
        return Response(transcript, media_type="text/plain; charset=utf-8", headers=headers)
    # Reading the clip's length decodes it (seconds for long compressed audio): off the event loop.
    seconds = await asyncio.to_thread(audio_seconds, plan.request.params.parts[0].audio.data)
    if fmt == "verbose_json":
        return JSONResponse(with_trace(verbose(plan, transcript, seconds), final), headers=headers)
    if fmt == "srt":
        return Response(f"1\n{cue_time(0, ',')} --> {cue_time(seconds, ',')}\n{transcript}\n\n",
                        media_type="application/x-subrip; charset=utf-8", headers=headers)
    return Response(f"WEBVTT\n\n{cue_time(0, '.')} --> {cue_time(seconds, '.')}\n{transcript}\n\n",
                    media_type="text/vtt; charset=utf-8", headers=headers)


async def stream(call: Call) -> AsyncIterator[bytes]:
    """`transcript.text.delta` events as the text comes, then `transcript.text.done` with the whole text and
    the usage; a failure after the first event is one error event, and the stream ends."""
    text, final = [], None
    try:
        async for ev in call:
            kind = ev.WhichOneof("event")
            if kind == "text" and ev.text.text:
                text.append(ev.text.text)
                yield sse_event({"type": "transcript.text.delta", "delta": ev.text.text})
            elif kind == "final":
                final = ev.final
        yield sse_event(with_trace({"type": "transcript.text.done", "text": "".join(text), "usage": usage(final)},
                                   final))
    except ApiError as e:
        yield sse_event(e.body())
    except ClientGone:
        return


def usage(final) -> dict:
    """Token usage as the reference's transcription usage (`type: tokens`)."""
    used_in = final.usage.prompt_tokens if final else 0
    used_out = final.usage.completion_tokens if final else 0
    return {"type": "tokens", "input_tokens": used_in, "output_tokens": used_out, "total_tokens": used_in + used_out}


def verbose(plan: Transcription, text: str, seconds: float) -> dict:
    """verbose_json: one segment spanning the clip (the model gives no timestamps, nor log probabilities: those
    fields are zero); a transcription's usage is the clip's seconds, as the reference's."""
    temperature = plan.request.params.text.temperature if plan.request.params.text.HasField("temperature") else 0.0
    segment = {"id": 0, "seek": 0, "start": 0.0, "end": seconds, "text": text, "tokens": [],
               "temperature": temperature, "avg_logprob": 0.0, "compression_ratio": 0.0, "no_speech_prob": 0.0}
    answer = {"task": plan.task, "language": plan.language, "duration": seconds, "text": text, "segments": [segment]}
    if plan.task == TRANSCRIBE:  # the reference's translation has no usage
        answer["usage"] = {"type": "duration", "seconds": seconds}
    return answer


def cue_time(seconds: float, decimal: str) -> str:
    """HH:MM:SS,mmm (srt; `decimal` ",") or HH:MM:SS.mmm (vtt; ".")."""
    ms = round(seconds * 1000)
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{decimal}{ms % 1000:03d}"


def audio_seconds(data: bytes) -> float:
    """The clip's length as decoded (its frames counted block by block; the header's count is not trusted).
    Called once the request path's media check accepted the file."""
    with soundfile.SoundFile(io.BytesIO(data)) as f:
        frames = 0
        while n := len(f.read(_BLOCK_FRAMES, dtype="int16", always_2d=True)):
            frames += n
        return round(frames / f.samplerate, 3)
