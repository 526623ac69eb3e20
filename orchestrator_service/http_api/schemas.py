"""The OpenAI request bodies this API takes, as pydantic models.

Types are checked here (bodies are validated strictly from JSON: a string where a number belongs is a
400 naming the field); values are checked where they are used (translate.py, then the request path's
own validation against the pipeline's limits). Every optional field takes `null` as "not given", as the
reference does; its default is applied in translate.py. Unknown fields are ignored, as the OpenAI reference
does, except that the reference's fields this API cannot honour are refused by name when a request asks
for them (translate.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

UINT32 = 2**32 - 1
UINT64 = 2**64 - 1
MAX_IMAGES = 10  # `n` of one images request (each image is one request down the request path)


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------- chat completions

class ImageUrl(Body):
    url: str
    detail: str | None = None


class InputAudio(Body):
    data: str  # base64 of the encoded file
    format: str | None = None


class VideoUrl(Body):
    url: str


class ContentPart(Body):
    """One part of a message's content; `type` says which of the others is set."""

    type: str
    text: str | None = None
    image_url: ImageUrl | None = None
    input_audio: InputAudio | None = None
    video_url: VideoUrl | None = None  # vLLM's extension: a video as a data: URL


class Message(Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class AudioOutput(Body):
    voice: str | None = None
    format: str | None = None


class StreamOptions(Body):
    include_usage: bool | None = None


class ChatCompletionRequest(Body):
    # Unknown fields are kept (and otherwise ignored): the reference's fields this API cannot honour are
    # among them, refused by translate.py (REFUSED_CHAT_FIELDS) when a request asks for them.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    modalities: list[str] | None = None
    audio: AudioOutput | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, le=UINT32)
    max_completion_tokens: int | None = Field(None, ge=1, le=UINT32)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=0, le=UINT64)
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1)
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = Field(None, ge=-1, le=UINT32)  # -1 or 0: off
    ignore_eos: bool | None = None
    # omnistage's: the per-stage trace in the answer (as the header X-Omnistage-Trace: 1)
    return_trace: bool | None = None


# ------------------------------------------------------------------------ speech

class SpeechRequest(Body):
    model: str | None = None
    input: str
    voice: str | None = None
    response_format: str | None = None  # mp3 (binary) or pcm (SSE) when not given, as the reference
    speed: float | None = None
    stream_format: Literal["sse", "audio"] | None = None
    instructions: Any = None
    return_trace: bool | None = None  # omnistage's (stream_format "sse" only: the audio body has no room)


# ------------------------------------------------------------------------ images

class ImageRequest(Body):
    model: str | None = None
    prompt: str
    n: int | None = Field(None, ge=1, le=MAX_IMAGES)
    size: str | None = None
    response_format: str | None = None
    output_format: str | None = None
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(None, ge=1, le=UINT32)
    guidance_scale: float | None = None
    seed: int | None = Field(None, ge=0, le=UINT64)
    stream: bool | None = None
    partial_images: int | None = None
    user: str | None = None
    return_trace: bool | None = None  # omnistage's
