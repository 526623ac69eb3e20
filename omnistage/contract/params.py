"""Request parameters: resolve defaults and check them against a pipeline's limits.

Pure functions over the GenerationParams message. The orchestrator resolves a request once, at admission,
and sends every stage the resolved values (`fill_resolved`); each stage resolves what it is sent again, which
checks it (a stage may be called by others than the orchestrator) and, on resolved values, gives back the
very same RequestParams: one set of defaults, applied once.
Content parts are checked here for structure only (count, bytes, text length);
decoding them is the costlier check of `omnistage.media`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from omnistage.api import MODEL_LIMIT_FALLBACKS, Limits
from omnistage.api.model import FALLBACK_GUIDANCE_SCALE, FRAME_STEP
from omnistage.contract import conversation
from omnistage.contract.errors import InvalidRequest as InvalidRequest  # where callers have found it
from omnistage.v1 import common_pb2

# Below this a temperature samples greedily, as vLLM does: logits divided by 1e-45 overflow to inf and the
# softmax to NaN, which would fail the request's step and every request batched beside it.
MIN_TEMPERATURE = 1e-5


# The speaker a request that names none is sent with (Qwen3-Omni's default voice; a pipeline whose voices the
# orchestrator reads sends its own default instead).
DEFAULT_SPEAKER = "ethan"

# Parts of one request, text ones included: a conversation's messages are parts. What they hold is bounded by
# maxPromptChars (text) and maxParts (media); this bounds the count of the list itself.
MAX_PARTS = 4096


def is_greedy(temperature: float | None) -> bool:
    """Whether a request's temperature means greedy decoding (unset, 0, or below MIN_TEMPERATURE)."""
    return not temperature or temperature < MIN_TEMPERATURE


@dataclass(frozen=True)
class RequestParams:
    prompt: str
    prompt_token_ids: tuple[int, ...]
    seed: int
    max_tokens: int
    temperature: float | None
    top_p: float | None
    top_k: int | None
    ignore_eos: bool
    max_codec_frames: int
    speaker: str
    width: int
    height: int
    num_inference_steps: int
    guidance_scale: float
    negative_prompt: str
    # FLUX.1's true classifier-free guidance (FluxPipeline's `true_cfg_scale`): on above 1, with a negative prompt.
    true_cfg_scale: float = 1.0
    # Video pipelines: frames (1 + FRAME_STEP x k) and their rate.
    num_frames: int = 1
    fps: int = 0
    # Chat: a system turn before the prompt, or the prompt sent as written (no chat template applied).
    system_prompt: str = ""
    raw_prompt: bool = False
    # The user turn as ordered content parts (the ContentPart messages as given); `prompt`, when also set,
    # is one more text part after them (see `content`).
    parts: tuple[common_pb2.ContentPart, ...] = ()
    # A conversation instead of one user turn (`omnistage.contract.conversation`): its turns over `parts`, the
    # functions the model may call, the text its answer starts with.
    turns: tuple[common_pb2.Turn, ...] = ()
    tools: tuple[common_pb2.Tool, ...] = ()
    answer_prefix: str = ""
    # The language spoken in the audio parts ("" = not given): speech recognition stages force it; a
    # text-to-speech stage speaks in it.
    language: str = ""
    # How a text-to-speech stage speaks the text ("" = as its voice does).
    instructions: str = ""
    # A voice-cloning text-to-speech stage: the transcript of its reference clip (the request's audio part).
    ref_text: str = ""

    @property
    def true_cfg(self) -> bool:
        """Whether true classifier-free guidance runs: a scale above 1 and a negative prompt, as FluxPipeline asks."""
        return self.true_cfg_scale > 1.0 and bool(self.negative_prompt)

    @property
    def prompt_field(self) -> str:
        """The request field a refusal of the whole prompt names."""
        return "params.turns" if self.turns else "params.parts" if self.parts else "params.prompt"

    @property
    def content(self) -> tuple[common_pb2.ContentPart, ...]:
        """The user turn in order: `parts`, then `prompt` as a last text part when there is one."""
        return self.parts + ((common_pb2.ContentPart(text=self.prompt),) if self.prompt else ())

    @property
    def text(self) -> str:
        """The user turn's text, for stages that read text only: its text parts and the prompt, in order,
        as written (no separator added)."""
        if not self.parts:
            return self.prompt
        return "".join(x.text for x in self.content if x.WhichOneof("part") == "text")


def resolve(p: common_pb2.GenerationParams, limits: Limits) -> RequestParams:
    """Defaults filled in; InvalidRequest names the first field out of bounds.

    A request says what to answer with `prompt`, `prompt_token_ids` or `parts`. With `parts`, `prompt`
    (when set) is one more text part after them, and their text and the prompt together count against
    max_prompt_chars; `parts` do not go with `prompt_token_ids`, and media parts not with `raw_prompt`
    (media is placed by the chat template)."""
    parts = tuple(p.parts)
    if not p.prompt and not p.prompt_token_ids and not parts:
        raise InvalidRequest("params.prompt", "is required (or params.prompt_token_ids, or params.parts)")
    if len(p.prompt) > limits.max_prompt_chars:
        raise InvalidRequest("params.prompt", f"is {len(p.prompt)} characters; the limit is {limits.max_prompt_chars}")
    extra = conversation.check(p, limits.max_prompt_chars)
    if parts:
        _check_request_parts(p, parts, limits, extra)
    if len(p.prompt_token_ids) > limits.max_prompt_chars:
        raise InvalidRequest("params.prompt_token_ids",
                             f"has {len(p.prompt_token_ids)} tokens; the limit is {limits.max_prompt_chars}")
    if any(t < 0 for t in p.prompt_token_ids):
        raise InvalidRequest("params.prompt_token_ids", "token ids must be >= 0")
    t = p.text
    max_tokens = (t.max_tokens or limits.default_max_tokens
                  or min(MODEL_LIMIT_FALLBACKS["default_max_tokens"], limits.max_tokens or 1 << 31))
    _bound("params.text.max_tokens", max_tokens, 1, limits.max_tokens or None)  # None: the engine's context
    temperature = t.temperature if t.HasField("temperature") else None
    if temperature is not None and not (0.0 <= temperature <= 100.0 and math.isfinite(temperature)):
        raise InvalidRequest("params.text.temperature", f"must be between 0 and 100, got {temperature}")
    top_p = t.top_p if t.HasField("top_p") else None
    if top_p is not None and not (0.0 < top_p <= 1.0):
        raise InvalidRequest("params.text.top_p", f"must be in (0, 1], got {top_p}")
    top_k = t.top_k if t.HasField("top_k") else None
    if top_k is not None:
        _bound("params.text.top_k", top_k, 1, 1_000_000)
    frames = p.audio.max_codec_frames or limits.default_codec_frames
    _bound("params.audio.max_codec_frames", frames, 1, limits.max_codec_frames)
    img = p.image
    side = limits.default_image_side or min(MODEL_LIMIT_FALLBACKS["default_image_side"], limits.max_image_side)
    width = img.width or limits.default_width or side
    height = img.height or limits.default_height or side
    for name, side in (("width", width), ("height", height)):
        _bound(f"params.image.{name}", side, 8, limits.max_image_side)
        if side % 8:
            raise InvalidRequest(f"params.image.{name}", f"must be a multiple of 8, got {side}")
    steps = (img.num_inference_steps or limits.default_inference_steps
             or min(MODEL_LIMIT_FALLBACKS["default_inference_steps"], limits.max_inference_steps))
    _bound("params.image.num_inference_steps", steps, 1, limits.max_inference_steps)
    guidance = (img.guidance_scale if img.HasField("guidance_scale")
                else limits.default_guidance_scale or FALLBACK_GUIDANCE_SCALE)
    if not (0.0 <= guidance <= 100.0 and math.isfinite(guidance)):
        raise InvalidRequest("params.image.guidance_scale", f"must be between 0 and 100, got {guidance}")
    true_cfg = img.true_cfg_scale or 1.0
    if not (0.0 <= true_cfg <= 100.0 and math.isfinite(true_cfg)):
        raise InvalidRequest("params.image.true_cfg_scale", f"must be between 0 and 100, got {true_cfg}")
    if len(img.negative_prompt) > limits.max_prompt_chars:
        raise InvalidRequest("params.image.negative_prompt", f"is longer than {limits.max_prompt_chars} characters")
    num_frames, fps = _video(p.video, limits)
    if len(p.system_prompt) > limits.max_prompt_chars:
        raise InvalidRequest("params.system_prompt", f"is longer than {limits.max_prompt_chars} characters")
    if p.system_prompt and p.raw_prompt:
        raise InvalidRequest("params.system_prompt",
                             "cannot be used with params.raw_prompt (no chat template is applied)")
    if len(p.audio.speaker) > 64:
        raise InvalidRequest("params.audio.speaker", "is longer than 64 characters")
    if len(p.audio.language) > 64:
        raise InvalidRequest("params.audio.language", "is longer than 64 characters")
    if len(p.audio.instructions) > limits.max_prompt_chars:
        raise InvalidRequest("params.audio.instructions", f"is longer than {limits.max_prompt_chars} characters")
    if len(p.audio.ref_text) > limits.max_prompt_chars:
        raise InvalidRequest("params.audio.ref_text", f"is longer than {limits.max_prompt_chars} characters")
    return RequestParams(
        prompt=p.prompt, prompt_token_ids=tuple(p.prompt_token_ids), seed=p.seed if p.HasField("seed") else 0,
        max_tokens=max_tokens, temperature=None if is_greedy(temperature) else temperature, top_p=top_p, top_k=top_k,
        ignore_eos=t.ignore_eos,
        max_codec_frames=frames, speaker=p.audio.speaker or DEFAULT_SPEAKER, width=width, height=height,
        num_inference_steps=steps, guidance_scale=guidance, negative_prompt=img.negative_prompt,
        true_cfg_scale=true_cfg, num_frames=num_frames, fps=fps, system_prompt=p.system_prompt,
        raw_prompt=p.raw_prompt, parts=parts, turns=tuple(p.turns),
        tools=tuple(p.tools), answer_prefix=p.answer_prefix, language=p.audio.language,
        instructions=p.audio.instructions, ref_text=p.audio.ref_text)


def fill_resolved(p: common_pb2.GenerationParams, params: RequestParams) -> common_pb2.GenerationParams:
    """`p` with every field that resolve() defaults written as `params` (resolved from `p`) has it, in place,
    and returned: the request as the stages are sent it. In place, because `p` may hold megabytes of media
    parts, and they are not copied; the message is the orchestrator's own (parsed for this call, or built by
    the HTTP door).

    resolve() of the result, under the same limits, is `params` again: each defaulted number is now set and
    non-zero (taken as given), speaker, seed and guidance scale are set, every value written passed the same
    bounds, and a temperature read as greedy is cleared, which reads as greedy too; the fields resolve() does
    not default are left as they were."""
    p.text.max_tokens = params.max_tokens
    if params.temperature is None:
        p.text.ClearField("temperature")
    else:
        p.text.temperature = params.temperature
    p.seed = params.seed
    p.audio.max_codec_frames = params.max_codec_frames
    p.audio.speaker = params.speaker
    p.image.width, p.image.height = params.width, params.height
    p.image.num_inference_steps = params.num_inference_steps
    p.image.guidance_scale = params.guidance_scale
    p.image.true_cfg_scale = params.true_cfg_scale
    p.video.num_frames, p.video.fps = params.num_frames, params.fps
    return p


def valid_frames(n: int) -> bool:
    """Whether `n` frames is a count a video pipeline makes (1 + FRAME_STEP x k)."""
    return n >= 1 and (n - 1) % FRAME_STEP == 0


def nearest_frames(n: int, most: int) -> list[int]:
    """The valid frame counts either side of `n` (within 1..`most`), nearest first."""
    below = n - (n - 1) % FRAME_STEP if n >= 1 else 1
    found = [c for c in (below, below + FRAME_STEP) if 1 <= c <= most and c != n]
    return sorted(found, key=lambda c: (abs(c - n), c))


def _video(v: common_pb2.VideoParams, limits: Limits) -> tuple[int, int]:
    """(num_frames, fps): given or defaulted, within the limits; a frame count no video VAE decodes is refused
    with the nearest ones it does (rounding it silently would make another video than asked)."""
    frames = v.num_frames
    if not frames:
        frames = limits.default_frames or min(MODEL_LIMIT_FALLBACKS["default_frames"], limits.max_frames)
        frames -= (frames - 1) % FRAME_STEP  # the pipeline's own default within maxFrames: the valid one below
    _bound("params.video.num_frames", frames, 1, limits.max_frames)
    if not valid_frames(frames):
        nearest = " or ".join(str(c) for c in nearest_frames(frames, limits.max_frames))
        raise InvalidRequest("params.video.num_frames", f"must be {FRAME_STEP}k + 1 frames (the video VAE makes "
                                                        f"{FRAME_STEP} frames per latent frame after the first): "
                                                        f"{nearest}, got {frames}")
    fps = v.fps or limits.default_fps
    _bound("params.video.fps", fps, 1, limits.max_fps)
    return frames, fps


def check_parts(parts, limits: Limits) -> None:
    """The cheap checks of content parts: how many (media parts against `maxParts`), each one set, each within
    the byte limit, no empty text. Decoding them (`omnistage.media.decode_parts`) is the costly check."""
    media = sum(1 for x in parts if x.WhichOneof("part") not in ("text", None))
    if media > limits.max_parts:
        raise InvalidRequest("params.parts", f"has {media} media parts; the limit is {limits.max_parts}")
    if len(parts) > MAX_PARTS:
        raise InvalidRequest("params.parts", f"has {len(parts)} parts; the limit is {MAX_PARTS}")
    for i, part in enumerate(parts):
        kind = part.WhichOneof("part")
        if kind is None:
            raise InvalidRequest(f"params.parts[{i}]", "empty part (set text, image, audio or video)")
        size = part.ByteSize()
        if size > limits.max_part_bytes:
            raise InvalidRequest(f"params.parts[{i}].{kind}", f"is {size} bytes; the limit is {limits.max_part_bytes}")
        if kind == "text" and not part.text:
            raise InvalidRequest(f"params.parts[{i}].text", "is empty")


def has_media(parts) -> bool:
    """Some part is an image, audio or video."""
    return any(x.WhichOneof("part") not in ("text", None) for x in parts)


def _check_request_parts(p: common_pb2.GenerationParams, parts, limits: Limits, extra: int = 0) -> None:
    if p.prompt_token_ids:
        raise InvalidRequest("params.parts", "cannot be used with params.prompt_token_ids (parts go through the "
                                             "chat template)")
    check_parts(parts, limits)
    chars = len(p.prompt) + sum(len(x.text) for x in parts if x.WhichOneof("part") == "text")
    if chars + extra > limits.max_prompt_chars:
        what = "text parts and prompt" if not extra else "text parts, tool calls and tools"
        raise InvalidRequest("params.parts", f"{what} are {chars + extra} characters together; the limit "
                                             f"is {limits.max_prompt_chars}")
    if p.raw_prompt and has_media(parts):
        raise InvalidRequest("params.raw_prompt", "cannot be used with media parts (media is placed by the chat "
                                                  "template)")


def _bound(field: str, value: int, lo: int, hi: int | None) -> None:
    if hi is None:
        if value < lo:
            raise InvalidRequest(field, f"must be at least {lo}, got {value}")
    elif not lo <= value <= hi:
        raise InvalidRequest(field, f"must be between {lo} and {hi}, got {value}")
