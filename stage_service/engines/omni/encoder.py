"""An omni Thinker's encoders as a stage of their own (`kind: encoder`): the vision and audio towers on
their own replicas, so they scale apart from the LLM.

The stage reads only the towers' tensors of the combined checkpoint (`thinker.visual.`,
`thinker.audio_tower.`), plus the tokenizer, chat template and processor settings. Per request it runs
the same processor and encoders the Thinker runs inline (`omni_media`) and emits one chunk: the prompt's
token ids and the encoders' rows (`EncodedPrompt.to_tensors`); the Thinker merges them into its prompt.
A request without media gets its prompt ids only. Decoding and processing run on the stage's media
threads (`media_work`: bounded, refused when full); the towers run on the stage's step scheduler, every
request of a step in one call per tower (`encode_batch`), padded for batch invariance (`invariance.py`) as the
Thinker pads its inline towers: otherwise the rows differ from inline ones in the last bits.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import AsyncIterator

from omnistage.checkpoints.names import THINKER_TOWERS
from omnistage.checkpoints.shards import ShardedCheckpoint
from omnistage.contract.params import InvalidRequest, RequestParams, has_media
from stage_service.engines.omni.media import EncodedPrompt, Family, MediaInputs, OmniProcessor, encode, encode_batch
from stage_service.engines.omni.thinker import prepare_turn
from stage_service.runtime.base import OutputChunk, StageInputs, StageRequest, SteppedEngine
from stage_service.runtime.chat import load_chat_template, prompt_ids
from stage_service.runtime.components import Piece
from stage_service.runtime.invariance import make_batch_invariant
from stage_service.runtime.media_work import MediaStage
from stage_service.runtime.scheduler import StepState

VISUAL, AUDIO = THINKER_TOWERS


def tower_pieces(classes: tuple, thinker_config) -> tuple[Piece, Piece]:
    """The encoder stage's two modules, from the family's `classes()` (the mapping check builds the same)."""
    _, _, vision_cls, audio_cls = classes
    return (Piece(VISUAL, vision_cls, thinker_config.vision_config),
            Piece(AUDIO, audio_cls, thinker_config.audio_config))


class Towers(SimpleNamespace):
    """The Thinker's encoders without its LLM: `get_image_features`, `get_video_features` and
    `get_audio_features` are the Thinker class's own, over these towers."""

    def __init__(self, thinker_cls, visual, audio_tower, config):
        super().__init__(visual=visual, audio_tower=audio_tower, config=config)
        self._cls = thinker_cls

    def get_image_features(self, *args, **kwargs):
        return self._cls.get_image_features(self, *args, **kwargs)

    def get_video_features(self, *args, **kwargs):
        return self._cls.get_video_features(self, *args, **kwargs)

    def get_audio_features(self, *args, **kwargs):
        return self._cls.get_audio_features(self, *args, **kwargs)


class EncodeState(StepState):
    def __init__(self, inputs: MediaInputs):
        self.inputs: MediaInputs | None = inputs
        self.cost = 1

    def held_bytes(self) -> int:
        i = self.inputs
        return 0 if i is None else sum(t.nbytes for t in (i.pixel_values, i.pixel_values_videos, i.input_features)
                                       if t is not None)

    def release(self) -> None:
        self.inputs = None


class OmniEncoderEngine(MediaStage, SteppedEngine):
    """Subclasses set `MEDIA_FAMILY`, `DEFAULT_SYSTEM_PROMPT` and `classes()`: the family's
    config, Thinker, vision encoder and audio encoder classes."""

    MEDIA_FAMILY: Family
    DEFAULT_SYSTEM_PROMPT = ""
    unit = "requests"

    @staticmethod
    def classes():
        raise NotImplementedError

    def load(self) -> None:
        from transformers import AutoTokenizer

        from stage_service.runtime.components import read_config

        classes = self.classes()
        thinker_cls = classes[1]
        thinker = read_config(self.model_dir, classes[0]).thinker_config
        self.checkpoint = ShardedCheckpoint(self.model_dir)
        visual, audio = (p.load(self.checkpoint, self.dtype, self.device) for p in tower_pieces(classes, thinker))
        if self.batch_invariant:  # as the Thinker pads its inline towers (DecoderLm): the same rows either way
            for tower in (visual, audio):
                make_batch_invariant(tower)
        self.towers = Towers(thinker_cls, visual, audio, thinker)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.chat_template = load_chat_template(self.model_dir, self.tokenizer)
        self.processor = OmniProcessor(self.model_dir, self.MEDIA_FAMILY, self.tokenizer, self.chat_template)

    def step(self, states: list[EncodeState]) -> list[EncodedPrompt]:
        out = encode_batch(self.towers, [st.inputs for st in states])
        for st in states:
            st.finished = True
        return out

    def prepare(self, p: RequestParams) -> MediaInputs:
        if not has_media(p.parts):
            return MediaInputs(ids=prompt_ids(p, self.tokenizer, self.chat_template, self.DEFAULT_SYSTEM_PROMPT))
        return prepare_turn(self.processor, p, self.pipeline, self.DEFAULT_SYSTEM_PROMPT)

    async def generate(self, req: StageRequest, inputs: StageInputs) -> AsyncIterator[OutputChunk]:
        started = time.perf_counter()
        prepared = await self.media.run(self.prepare, req.params)
        if not prepared.ids:
            raise InvalidRequest("params.prompt", "encodes to no tokens")
        queue_ms = compute_ms = 0.0
        if prepared.has_media:
            async with self.scheduler.submit(req.request_id, EncodeState(prepared)) as stream:
                enc = await stream.next()
            queue_ms, compute_ms = stream.queue_ms, stream.compute_ms
        else:
            enc = encode(self.towers, prepared)  # ids only: no tower runs
        encode_ms = (time.perf_counter() - started) * 1e3 - queue_ms
        yield OutputChunk(tensors=enc.to_tensors(), last=True, queue_ms=queue_ms, compute_ms=compute_ms,
                          encode_ms=encode_ms)
