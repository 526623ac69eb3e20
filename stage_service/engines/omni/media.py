"""Media into an omni Thinker: the checkpoint's processor, the Thinker's own encoders, and the prompt
rows the decoder is fed.

Three steps, each a pure function of its inputs, so the Thinker stage can run them inline and an
encoder stage can run the middle one on its own replicas:

1. `OmniProcessor.prepare`: the request's ordered parts (`omnistage.media`) become what the model's
   processor makes of them: the chat template renders the user turn with one placeholder per part, in
   order; the image processor, the Whisper feature extractor and the video processor turn each medium
   into patches and mel features; the processor's own placeholder expansion repeats each placeholder
   once per embedding row the encoder will produce. Settings come from the checkpoint's
   `preprocessor_config.json`, placeholder expansion and video defaults from the family's processor
   class (`Qwen3OmniMoeProcessor`, `Qwen2_5OmniProcessor`).
2. `encode`: the vision and audio towers turn patches and features into embedding rows (and, for
   Qwen3-Omni, the deepstack rows the first decoder layers add at visual positions).
3. `prompt_rows`: the rows are scattered into the prompt's embeddings at their placeholders, and the
   multimodal RoPE positions (time-aligned for audio and video, as the model's `get_rope_index`
   computes them) are taken, with the offset every later decode position carries.

Transformers' video processors need torchvision, which a CPU machine here does not have: video frames
are resized, normalized and patched here, as Qwen2-VL's video processor does it (PIL's bicubic resize
instead of torchvision's, so pixels may differ in the last bits from a torchvision install).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import numpy as np
import torch

from omnistage import media
from omnistage.checkpoints.names import PROCESSOR_CONFIG, THINKER_TOWERS
from omnistage.checkpoints.shards import CheckpointError
from omnistage.contract.params import InvalidRequest
from stage_service.runtime.chat import render_conversation
from stage_service.runtime.chat_tokens import ClientText, chat_ids
from stage_service.runtime.errors import InputError

# The encoders: sub-modules of every omni Thinker's model (`thinker.visual.*` -> `visual`).
TOWERS = tuple(prefix.split(".")[1] for prefix in THINKER_TOWERS)
# What processing raises on input it cannot take (StopIteration must not cross a thread into asyncio:
# it would never be delivered).
PROCESSING_ERRORS = (ValueError, StopIteration, IndexError, RuntimeError, TypeError)
# Rotary positions a prompt may reach: the int32 range, beyond any Thinker's rotary table or context (the
# vLLM Thinker checks its own table's size too).
MAX_POSITION = 2**31 - 1
IMAGE_KEYS = ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels", "image_mean",
              "image_std")


@dataclass(frozen=True)
class Family:
    """What differs between the omni families' processors."""

    processor: str            # transformers' processor class: placeholder expansion and video defaults
    audio_padding: object     # the feature extractor's padding, as the processor asks for it
    default_fps: float        # frames per second the processor assumes for a video without timestamps

    def processor_class(self):
        import transformers

        return getattr(transformers, self.processor)

    def audio_tokens(self, mel_frames: torch.Tensor) -> torch.Tensor:
        """Embedding rows the audio tower makes of each clip's mel frames (as the processor counts them)."""
        if self.processor == "Qwen3OmniMoeProcessor":
            from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

            return _get_feat_extract_output_lengths(mel_frames)
        after_conv = (mel_frames - 1) // 2 + 1
        return (after_conv - 2) // 2 + 1


QWEN3_OMNI = Family("Qwen3OmniMoeProcessor", audio_padding=True, default_fps=1.0)
QWEN2_5_OMNI = Family("Qwen2_5OmniProcessor", audio_padding="max_length", default_fps=2.0)


@dataclass
class MediaInputs:
    """A request's prompt as the processor makes it: token ids with expanded placeholders, and the
    encoders' inputs (None where the request has no such part)."""

    ids: list[int]
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    video_second_per_grid: torch.Tensor | None = None
    input_features: torch.Tensor | None = None
    feature_attention_mask: torch.Tensor | None = None
    audio_tokens: list[int] = field(default_factory=list)  # encoder rows of each audio clip

    @property
    def has_media(self) -> bool:
        return any(x is not None for x in (self.pixel_values, self.pixel_values_videos, self.input_features))


@dataclass
class EncodedPrompt:
    """The token ids and the encoders' rows of one request: what an encoder stage hands the Thinker.
    Deepstack rows are [layers, n, H] (empty when the model has none)."""

    ids: torch.Tensor                               # [P] int64
    image: torch.Tensor | None = None               # [image rows, H]
    image_deepstack: torch.Tensor | None = None
    video: torch.Tensor | None = None
    video_deepstack: torch.Tensor | None = None
    audio: torch.Tensor | None = None               # [audio rows, H]
    image_grid_thw: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    video_second_per_grid: torch.Tensor | None = None
    audio_seqlens: torch.Tensor | None = None       # mel frames of each clip

    @property
    def has_media(self) -> bool:
        return any(x is not None for x in (self.image, self.video, self.audio))

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors of a chunk (names `prompt_token_ids` and `mm_<field>`)."""
        out = {"prompt_token_ids": self.ids}
        out.update({f"mm_{f.name}": getattr(self, f.name) for f in fields(self)
                    if f.name != "ids" and getattr(self, f.name) is not None})
        return out

    def to(self, device: torch.device) -> "EncodedPrompt":
        """Every tensor on `device` (those already there as they are)."""
        return EncodedPrompt(**{f.name: None if (t := getattr(self, f.name)) is None else t.to(device)
                                for f in fields(self)})

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "EncodedPrompt":
        if "prompt_token_ids" not in tensors:
            raise InputError("the encoder's chunk has no prompt_token_ids")
        names = {f.name for f in fields(cls)} - {"ids"}
        return cls(ids=tensors["prompt_token_ids"],
                   **{n[3:]: t for n, t in tensors.items() if n.startswith("mm_") and n[3:] in names})


@dataclass
class PromptRows:
    """What the decoder is fed for a prompt with media: its input rows, their RoPE positions, the offset
    of every later position, and the deepstack rows added at visual positions."""

    embeds: torch.Tensor                       # [P, H]
    positions: torch.Tensor | None             # [3, P]; None: plain RoPE, the positions follow the cache
    rope_delta: int
    visual_mask: torch.Tensor | None = None    # [P] bool
    deepstack: list[torch.Tensor] = field(default_factory=list)  # per layer [visual rows, H]

    @property
    def nbytes(self) -> int:
        positions = 0 if self.positions is None else self.positions.nbytes
        return self.embeds.nbytes + positions + sum(t.nbytes for t in self.deepstack)


class OmniProcessor:
    """The checkpoint's processor, built from its files: the PIL Qwen2-VL image processor, Whisper's
    feature extractor, a frame processor for video, and the family processor's placeholder expansion."""

    def __init__(self, root: Path, family: Family, tokenizer, chat_template: str | None):
        from transformers import WhisperFeatureExtractor
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        file = Path(root) / PROCESSOR_CONFIG
        if not file.exists():
            raise CheckpointError(f"{file}: missing (the processor's image and audio settings live there)")
        try:
            cfg = json.loads(file.read_text())
        except ValueError:
            raise CheckpointError(f"{file}: not JSON") from None
        self.family, self.tokenizer, self.chat_template = family, tokenizer, chat_template
        self.image = Qwen2VLImageProcessorPil(**{k: cfg[k] for k in IMAGE_KEYS if k in cfg})
        self.audio = WhisperFeatureExtractor.from_pretrained(root)
        cls = family.processor_class()
        video_defaults = cls.valid_processor_kwargs._defaults["videos_kwargs"]
        self.video = FrameProcessor(self.image, video_defaults["size"])
        self.position_id_per_seconds = video_defaults["position_id_per_seconds"]
        self.seconds_per_chunk = video_defaults["seconds_per_chunk"]
        self._expand = cls.replace_multimodal_special_tokens
        # What the expansion reads of the processor: its components' merge sizes and the tokenizer's tokens.
        self._tokens = SimpleNamespace(
            image_processor=self.image, video_processor=self.video,
            **{name: getattr(tokenizer, name) for name in ("image_token", "audio_token", "video_token",
                                                          "vision_bos_token", "vision_eos_token",
                                                          "audio_bos_token", "audio_eos_token")
               if hasattr(tokenizer, name)})
        if cls.__name__ == "Qwen2_5OmniProcessor":  # its tokenizer names its tokens differently
            self._tokens.audio_token, self._tokens.image_token = "<|AUDIO|>", "<|IMAGE|>"
            self._tokens.video_token = "<|VIDEO|>"

    @property
    def sampling_rate(self) -> int:
        return self.audio.sampling_rate

    def clip(self, audio) -> np.ndarray:
        """A clip at the feature extractor's rate, at least one analysis window long (silence after a
        shorter one: the extractor's centred STFT cannot take less)."""
        samples = media.resample(audio.samples, audio.sample_rate, self.sampling_rate)
        return np.pad(samples, (0, max(0, self.audio.n_fft - len(samples))))

    def prepare(self, parts: list, system: str = "", prompt_at: int | None = None) -> MediaInputs:
        """Token ids and encoder inputs of a user turn made of `parts` (decoded media, in order; the one at
        `prompt_at`, if any, is the request's `prompt`). The client's text is plain text (`chat_tokens`):
        a placeholder written in it is text, not a stand-in for media that is not there."""
        content = [ClientText(p.text, "params.prompt" if i == prompt_at else f"params.parts[{i}].text")
                   if isinstance(p, media.Text) else {"type": p.modality} for i, p in enumerate(parts)]
        sys_text = ClientText(system, "params.system_prompt") if system else None
        return self._processed(parts, lambda expand: chat_ids(self.tokenizer, self.chat_template, sys_text,
                                                             content, expand))

    def prepare_conversation(self, parts: list, p, default_system: str = "") -> MediaInputs:
        """As `prepare`, for a request's conversation (`p.turns` over the decoded `parts`, in their order)."""
        if self.chat_template is None:
            raise InputError("this checkpoint has no chat template to place media parts")
        template = self.chat_template

        def item(i: int, _part) -> ClientText | dict:
            x = parts[i]
            return ClientText(x.text, f"params.parts[{i}].text") if isinstance(x, media.Text) else {"type": x.modality}
        return self._processed(parts, lambda expand: render_conversation(p, self.tokenizer, template, default_system,
                                                                        item, expand))

    def _processed(self, parts: list, ids_of: Callable[[Callable[[str], str]], list[int]]) -> MediaInputs:
        try:
            return self._prepare(parts, ids_of)
        except (InvalidRequest, InputError):
            raise
        except PROCESSING_ERRORS as e:  # what the processor's components raise on media they cannot take
            raise InvalidRequest("params.parts", f"the model's processor refused them: {e or type(e).__name__}") \
                from None

    def _prepare(self, parts: list, ids_of: Callable[[Callable[[str], str]], list[int]]) -> MediaInputs:
        if self.chat_template is None:
            raise InputError("this checkpoint has no chat template to place media parts")
        out = MediaInputs(ids=[])
        images = [p.pixels for p in parts if isinstance(p, media.Image)]
        clips = [self.clip(p) for p in parts if isinstance(p, media.Audio)]
        videos = [p for p in parts if isinstance(p, media.Video)]
        audio_tokens, image_grids, video_grids, seconds = [], [], [], []
        if clips:
            feats = self.audio(clips, sampling_rate=self.sampling_rate, padding=self.family.audio_padding,
                               return_attention_mask=True, return_tensors="pt")
            out.input_features, out.feature_attention_mask = feats["input_features"], feats["attention_mask"]
            out.audio_tokens = audio_tokens = self.family.audio_tokens(out.feature_attention_mask.sum(-1)).tolist()
        if images:
            img = self.image(images=images, input_data_format="channels_last", return_tensors="pt")
            out.pixel_values, out.image_grid_thw = img["pixel_values"], img["image_grid_thw"]
            image_grids = list(out.image_grid_thw)
        if videos:
            out.pixel_values_videos, out.video_grid_thw, per_grid = self.video(videos, self.family.default_fps)
            out.video_second_per_grid = torch.tensor(per_grid)
            video_grids, seconds = list(out.video_grid_thw), per_grid

        def expand(rendered: str) -> str:
            return self._expand(self._tokens, [rendered], iter(audio_tokens), iter(image_grids), iter(video_grids),
                                video_second_per_grid=iter(seconds), use_audio_in_video=False,
                                position_id_per_seconds=self.position_id_per_seconds,
                                seconds_per_chunk=self.seconds_per_chunk)[0]

        out.ids = ids_of(expand)
        return out


class FrameProcessor:
    """Video frames into patches as Qwen2-VL's video processor makes them: every frame resized to one
    size (smart resize within the processor's video pixel bounds), rescaled and normalized, the frame
    count padded to the temporal patch by repeating the last frame, then patched in its order."""

    def __init__(self, image_processor, size: dict):
        self.image = image_processor
        self.patch_size = image_processor.patch_size
        self.merge_size = image_processor.merge_size
        self.temporal_patch_size = image_processor.temporal_patch_size
        self.min_pixels, self.max_pixels = size["shortest_edge"], size["longest_edge"]

    def __call__(self, videos: list, default_fps: float) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
        from PIL import Image
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        ip, p, m, tp = self.image, self.patch_size, self.merge_size, self.temporal_patch_size
        patches, grids, seconds = [], [], []
        for video in videos:
            t, h, w, _ = video.frames.shape
            rh, rw = smart_resize(h, w, factor=p * m, min_pixels=self.min_pixels, max_pixels=self.max_pixels)
            frames = np.stack([np.asarray(Image.fromarray(f).resize((rw, rh), Image.BICUBIC), dtype=np.float32)
                               for f in video.frames]).transpose(0, 3, 1, 2)
            frames = (frames * ip.rescale_factor - np.asarray(ip.image_mean, np.float32)[:, None, None]) \
                / np.asarray(ip.image_std, np.float32)[:, None, None]
            if pad := -t % tp:
                frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
            gt, gh, gw = len(frames) // tp, rh // p, rw // p
            x = frames.reshape(gt, tp, 3, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
            patches.append(torch.from_numpy(np.ascontiguousarray(x.reshape(gt * gh * gw, 3 * tp * p * p))))
            grids.append([gt, gh, gw])
            seconds.append(tp / frames_per_second(video.timestamps, default_fps))
        return torch.cat(patches), torch.tensor(grids, dtype=torch.int64), seconds


def frames_per_second(timestamps, default: float) -> float:
    """The frame rate the timestamps say (mean spacing); `default` for a single frame."""
    if len(timestamps) < 2 or timestamps[-1] <= timestamps[0]:
        return default
    return (len(timestamps) - 1) / (timestamps[-1] - timestamps[0])


def model_device(model) -> torch.device:
    """Where the encoders' weights are (`model`: a Thinker, or `Towers`, which is no Module itself)."""
    return model.device if isinstance(model, torch.nn.Module) else model.visual.device


def encode(model, inputs: MediaInputs) -> EncodedPrompt:
    """The Thinker's towers over one request's encoder inputs (`model`: the family's
    `...ThinkerForConditionalGeneration`, or `Towers`)."""
    return encode_batch(model, [inputs])[0]


@torch.inference_mode()
def encode_batch(model, batch: list[MediaInputs]) -> list[EncodedPrompt]:
    """The towers over several requests at once: every image of every request in one vision call, every
    video in one, every audio clip in one (the towers keep each item apart), the rows split back per
    request in order. The processor's tensors go to the towers' device; the rows stay there."""
    device = model_device(model)
    out = [EncodedPrompt(ids=torch.tensor(i.ids, dtype=torch.int64), image_grid_thw=i.image_grid_thw,
                         video_grid_thw=i.video_grid_thw, video_second_per_grid=i.video_second_per_grid)
           for i in batch]
    for kind, pixels, grid in (("image", "pixel_values", "image_grid_thw"),
                               ("video", "pixel_values_videos", "video_grid_thw")):
        have = [(n, i) for n, i in enumerate(batch) if getattr(i, pixels) is not None]
        if not have:
            continue
        features = getattr(model, f"get_{kind}_features")(torch.cat([getattr(i, pixels) for _, i in have]).to(device),
                                                          torch.cat([getattr(i, grid) for _, i in have]).to(device),
                                                          return_dict=True)
        per_item = list(features.pooler_output)  # one entry per image / video, in order
        deep = getattr(features, "deepstack_features", None)
        if deep:  # transformers < 5.19 gives each layer as one tensor over every item: split it per item
            sizes = [len(p) for p in per_item]
            deep = [torch.split(layer, sizes) if torch.is_tensor(layer) else layer for layer in deep]
        at = 0
        for n, i in have:
            count = len(getattr(i, grid))
            setattr(out[n], kind, torch.cat(per_item[at:at + count]))
            if deep:
                setattr(out[n], f"{kind}_deepstack", torch.stack([torch.cat(layer[at:at + count]) for layer in deep]))
            at += count
    have = [(n, i) for n, i in enumerate(batch) if i.input_features is not None]
    if have:
        frames = max(i.input_features.shape[-1] for _, i in have)  # pad every clip's features to one length
        feats = torch.cat([torch.nn.functional.pad(i.input_features, (0, frames - i.input_features.shape[-1]))
                           for _, i in have])
        masks = torch.cat([torch.nn.functional.pad(i.feature_attention_mask,
                                                   (0, frames - i.feature_attention_mask.shape[-1])) for _, i in have])
        rows = model.get_audio_features(feats.to(device), masks.to(device), return_dict=True).last_hidden_state
        at = 0
        for n, i in have:
            count = sum(i.audio_tokens)
            out[n].audio, out[n].audio_seqlens = rows[at:at + count].clone(), i.feature_attention_mask.sum(-1)
            at += count
    return out


def place_rows(embeds: torch.Tensor, ids: torch.Tensor, token_id: int, rows: torch.Tensor | None,
               kind: str) -> torch.Tensor:
    """The encoder's `rows` written into `embeds` at the prompt's placeholders (`token_id` in `ids`), in
    order; the placeholders' mask. A count that does not match is refused (InputError)."""
    mask = ids == token_id
    count = 0 if rows is None else len(rows)
    if int(mask.sum()) != count:
        raise InputError(f"the prompt has {int(mask.sum())} {kind} placeholders but the encoder made {count} rows")
    if rows is not None and count:
        embeds[mask] = rows.to(embeds.dtype)
    return mask


@torch.inference_mode()
def prompt_rows(model, enc: EncodedPrompt) -> PromptRows:
    """The decoder's input rows for an encoded prompt: media rows at their placeholders, M-RoPE positions;
    made on the model's device, whatever device the encoder's tensors arrived on."""
    cfg = model.config
    enc = enc.to(model_device(model))
    ids = enc.ids
    embeds = model.get_input_embeddings()(ids).clone()
    masks = {}
    for kind, rows in (("audio", enc.audio), ("image", enc.image), ("video", enc.video)):
        mask = place_rows(embeds, ids, getattr(cfg, f"{kind}_token_id"), rows, kind)
        if rows is not None and len(rows):
            masks[kind] = mask
    visual = [k for k in ("image", "video") if k in masks and getattr(enc, f"{k}_deepstack") is not None]
    visual_mask, deepstack = None, []
    if visual:
        visual_mask = masks.get("image", torch.zeros_like(ids, dtype=torch.bool)) | masks.get(
            "video", torch.zeros_like(ids, dtype=torch.bool))
        layers = getattr(enc, f"{visual[0]}_deepstack").shape[0]
        for layer in range(layers):  # the image and video rows of each layer, in prompt order
            joint = embeds.new_zeros(int(visual_mask.sum()), embeds.shape[1])
            for k in visual:
                joint[masks[k][visual_mask]] = getattr(enc, f"{k}_deepstack")[layer].to(embeds.dtype)
            deepstack.append(joint)
    try:
        positions, delta = model.get_rope_index(
            ids[None], enc.image_grid_thw, enc.video_grid_thw, torch.ones_like(ids)[None], False,
            enc.audio_seqlens, enc.video_second_per_grid)
    except PROCESSING_ERRORS as e:  # grids that do not fit the prompt's placeholders
        raise InputError(f"the encoder rows do not fit the prompt: {e or type(e).__name__}") from None
    low, high = float(positions.min()), float(positions.max())
    # Extreme seconds per grid overflow the model's time positions: to INT64_MIN where it casts them
    # (Qwen2.5-Omni), to 1e20 or inf where it keeps float32 (Qwen3-Omni).
    if not (math.isfinite(low) and math.isfinite(high) and 0 <= low and high < MAX_POSITION):
        raise InputError(f"the prompt's multimodal positions run from {low:g} to {high:g} (the limits are 0 and "
                         f"{MAX_POSITION}): the video's timestamps or grids are out of range")
    return PromptRows(embeds=embeds, positions=positions[:, 0], rope_delta=int(delta.reshape(-1)[0]),
                      visual_mask=visual_mask, deepstack=deepstack)
