"""The OpenAI request bodies this API takes, as pydantic models.

Types are checked here (bodies are validated strictly from JSON: a string where a number belongs is a
400 naming the field); values are checked where they are used (translate.py, then the request path's
own validation against the pipeline's limits). Every optional field takes `null` as "not given", as the
reference does; its default is applied in translate.py. Unknown fields are ignored, as the OpenAI reference
does, except that the reference's fields this API cannot honour are refused by name when a request asks
for them (translate.py).

Every list and every short string has a static cap, checked as it is parsed: a list past its cap is refused
without validating its items one by one, and a list of wrong items stops at the first (`fail_fast`), so a
refusal names a few errors, never one per item. The pipeline's own bounds (parts, prompt characters, part
bytes) are the caps of each model's subclass for that pipeline (`bounded`); the body's size and count of JSON
values, which bound what parsing builds, are checked before it is parsed (body_limits.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from omnistage.api import Limits

from .body_limits import base64_bytes

UINT32 = 2**32 - 1
UINT64 = 2**64 - 1
MAX_IMAGES = 10  # `n` of one images request (each image is one request down the request path)
MAX_EDIT_IMAGES = 16  # images one edit request may list (OpenAI's bound); a pipeline edits fewer, refused by name
# Messages of one conversation: a long agent session's turns; what they hold is bounded by the body's size
# and JSON values (body_limits.py) and the pipeline's prompt characters.
MAX_MESSAGES = 1024
MAX_TOOLS = 128  # functions one request offers (OpenAI's reference allows 128)
MAX_TOOL_CALLS = 128  # calls one assistant message made
MAX_CONTENT_PARTS = 1024  # the largest maxParts a pipeline may set (omnistage.api Limits)
MAX_MODALITIES = 8  # text and audio, each named once or twice
# Names, roles, types, formats, voices, sizes, user labels: a pipeline's name (a Kubernetes name, 253
# characters) is the longest of them.
MAX_NAME_CHARS = 256
MAX_STOP_CHARS = 256  # a stop string: held back from the stream while it might still begin one
DATA_URL_PREFIX_CHARS = 256  # "data:image/png;base64," with parameters, before a data: URL's base64

Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
# On a union (a string or a list): the JSON value is built once as Python objects, and each branch validates
# those. Without it each branch that fails keeps its own copy of the input in its error: a text past its
# bound, or a whole list of parts, once per branch.
BuiltOnce = BeforeValidator(lambda value: value)
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------- chat completions

class ImageUrl(Body):
    url: str
    detail: Name | None = None


class InputAudio(Body):
    data: str  # base64 of the encoded file
    format: Name | None = None


class VideoUrl(Body):
    url: str


class ContentPart(Body):
    """One part of a message's content; `type` says which of the others is set."""

    type: Name
    text: str | None = None
    image_url: ImageUrl | None = None
    input_audio: InputAudio | None = None
    video_url: VideoUrl | None = None  # vLLM's extension: a video as a data: URL
    refusal: str | None = None  # an assistant message's refusal part, read as its text


class FunctionCall(Body):
    name: Name
    arguments: str  # JSON text, as the model wrote it


class ToolCall(Body):
    id: Name
    type: Name = "function"
    function: FunctionCall


class AssistantAudio(Body):
    id: Name  # an earlier answer's message.audio.id: its transcript is that turn's text


class Message(Body):
    role: Name
    content: Annotated[str | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS, fail_fast=True)] | None,
                       BuiltOnce] = None
    name: Name | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS, fail_fast=True)] | None = None
    tool_call_id: Name | None = None
    audio: AssistantAudio | None = None
    refusal: str | None = None


class FunctionDefinition(Body):
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Body):
    type: Name
    function: FunctionDefinition


class NamedFunction(Body):
    name: Name


class NamedToolChoice(Body):
    type: Name
    function: NamedFunction


class AudioOutput(Body):
    voice: Name | None = None
    format: Name | None = None


class StreamOptions(Body):
    include_usage: bool | None = None


class ChatCompletionRequest(Body):
    # Unknown fields are kept (and otherwise ignored): the reference's fields this API cannot honour are
    # among them, refused by translate.py (REFUSED_CHAT_FIELDS) when a request asks for them.
    model_config = ConfigDict(extra="allow")

    model: Name | None = None
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES, fail_fast=True)
    modalities: Annotated[list[Name], Field(max_length=MAX_MODALITIES, fail_fast=True)] | None = None
    audio: AudioOutput | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, le=UINT32)
    max_completion_tokens: int | None = Field(None, ge=1, le=UINT32)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=0, le=UINT64)
    # How many: translate.py (MAX_STOPS), naming the count; the body's JSON value bound keeps the list small.
    stop: Annotated[StopString | Annotated[list[StopString], Field(fail_fast=True)] | None, BuiltOnce] = None
    n: int | None = Field(None, ge=1)
    user: Name | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS, fail_fast=True)] | None = None
    tool_choice: Annotated[Name | NamedToolChoice | None, BuiltOnce] = None
    parallel_tool_calls: bool | None = None
    # vLLM's extensions
    top_k: int | None = Field(None, ge=-1, le=UINT32)  # -1 or 0: off
    ignore_eos: bool | None = None
    # omnistage's: the per-stage trace in the answer (as the header X-Omnistage-Trace: 1)
    return_trace: bool | None = None


# ------------------------------------------------------------------------ speech

class SpeechRequest(Body):
    model: Name | None = None
    input: str
    voice: Name | None = None
    response_format: Name | None = None  # mp3 (binary) or pcm (SSE) when not given, as the reference
    speed: float | None = None
    stream_format: Literal["sse", "audio"] | None = None
    instructions: Any = None
    return_trace: bool | None = None  # omnistage's (stream_format "sse" only: the audio body has no room)
    # Voice cloning (a Base checkpoint), by vLLM-Omni's names: the reference clip (a data: URL or bare base64 of
    # an audio file), its transcript (ICL mode), and x-vector-only mode (the clip's sound alone, no transcript).
    ref_audio: str | None = None
    ref_text: str | None = None
    x_vector_only_mode: bool | None = None


# ------------------------------------------------------------------------ images

class ImageRequest(Body):
    model: Name | None = None
    prompt: str
    n: int | None = Field(None, ge=1, le=MAX_IMAGES)
    size: Name | None = None
    response_format: Name | None = None
    output_format: Name | None = None
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(None, ge=1, le=UINT32)
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None  # omnistage's: FLUX.1's true classifier-free guidance
    seed: int | None = Field(None, ge=0, le=UINT64)
    stream: bool | None = None
    partial_images: int | None = None
    user: Name | None = None
    return_trace: bool | None = None  # omnistage's


class ImageReference(Body):
    """OpenAI's image reference object in a JSON body: the image inline (a data: URL), or a file id (refused)."""
    image_url: str | None = None
    file_id: Name | None = None


class ImageEditRequest(ImageRequest):
    """`/v1/images/edits` as JSON: the image to edit inline (`image`: a data: URL or a reference object, or a list
    of them; OpenAI's `images`: reference objects), an optional `mask` alike."""
    image: str | ImageReference | Annotated[list[str | ImageReference], Field(max_length=MAX_EDIT_IMAGES)] | None \
        = None
    images: Annotated[list[ImageReference], Field(max_length=MAX_EDIT_IMAGES)] | None = None
    mask: str | ImageReference | None = None


# ------------------------------------------------------------- a pipeline's bounds

def bounded(limits: Limits) -> dict[type[BaseModel], type[BaseModel]]:
    """Each request model -> its subclass under a pipeline's limits: content[] at most `maxParts`, every text
    (a text part, a message's content, speech's input, a prompt) at most `maxPromptChars` characters, base64
    data at most `maxPartBytes` in base64. A string past its bound is refused as it is parsed, before it is
    built (and before a text is copied into the request or base64 decoded). The request path checks the same
    limits again, exactly (the parts' total text, each part's decoded bytes)."""
    prompt_text = Annotated[str, Field(max_length=limits.max_prompt_chars)]
    base64_data = Annotated[str, Field(max_length=base64_bytes(limits.max_part_bytes))]
    data_url = Annotated[str, Field(max_length=base64_bytes(limits.max_part_bytes) + DATA_URL_PREFIX_CHARS)]

    class BoundedImageUrl(ImageUrl):
        url: data_url

    class BoundedInputAudio(InputAudio):
        data: base64_data

    class BoundedVideoUrl(VideoUrl):
        url: data_url

    class BoundedContentPart(ContentPart):
        text: prompt_text | None = None
        image_url: BoundedImageUrl | None = None
        input_audio: BoundedInputAudio | None = None
        video_url: BoundedVideoUrl | None = None

    class BoundedMessage(Message):
        content: Annotated[prompt_text | Annotated[list[BoundedContentPart],
                                                   Field(max_length=limits.max_parts, fail_fast=True)] | None,
                           BuiltOnce] = None  # type: ignore[assignment]  # a list of narrower parts

    class BoundedChat(ChatCompletionRequest):
        messages: list[BoundedMessage] = Field(  # type: ignore[assignment]  # a list of narrower messages
            min_length=1, max_length=MAX_MESSAGES, fail_fast=True)

    class BoundedSpeech(SpeechRequest):
        input: prompt_text

    class BoundedImages(ImageRequest):
        prompt: prompt_text
        negative_prompt: prompt_text | None = None

    class BoundedImageReference(ImageReference):
        image_url: data_url | None = None

    one_image = data_url | BoundedImageReference

    class BoundedImageEdits(ImageEditRequest):
        prompt: prompt_text
        negative_prompt: prompt_text | None = None
        image: one_image | Annotated[list[one_image],
                                     Field(max_length=MAX_EDIT_IMAGES)] | None = None  # type: ignore[assignment]
        images: Annotated[list[BoundedImageReference],
                          Field(max_length=MAX_EDIT_IMAGES)] | None = None  # type: ignore[assignment]  # narrower
        mask: one_image | None = None

    return {ChatCompletionRequest: BoundedChat, SpeechRequest: BoundedSpeech, ImageRequest: BoundedImages,
            ImageEditRequest: BoundedImageEdits}
