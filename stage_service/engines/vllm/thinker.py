"""The omni Thinkers on vLLM (`engine: vllm`, `component: thinker`; Qwen3-Omni and Qwen2.5-Omni): vLLM's
engine (continuous batching, paged KV cache, CUDA graphs on a GPU) decodes, and each chunk carries,
beside its tokens and text, the rows the Talker is conditioned on, as the transformers Thinker sends
them: `embeds` (input embeddings) and `hidden` (Qwen3-Omni: the layer `talker_config.accept_hidden_layer`
names; Qwen2.5-Omni: the last layer after the final norm) of every position fed.

- The model: a Thinker's text decoder has a plain LM's layout (Qwen3-MoE, Qwen2); vLLM loads it from
  the combined checkpoint through our registered classes (`vllm_models`), given a view of the checkpoint
  (`thinker_text_view`: a config of its own beside links to the checkpoint's files; no weight copied).
- The rows: vLLM's `extract_hidden_states` method plus our KV connector (`vllm_rows`,
  `vllm_rows_connector`). vLLM's last-layer row is taken before the final norm, so the stage applies
  the Thinker's norm where the Talker takes the last layer (as transformers' last hidden state).
- Prompts: text (and token ids); audio, images and video through an encoder stage (`kind: encoder`),
  sent to vLLM as a mixed prompt (text positions as ids, media positions as the encoder's rows). Audio
  and text positions are consecutive on all three M-RoPE axes, so plain RoPE is exact for them. Images
  and video get 3-D positions (and Qwen3-Omni deepstack rows): `omni_media.prompt_rows` computes them
  here, they travel in the request's `SamplingParams.extra_args`, our KV connector hands each step's
  share to our decoder class, which runs M-RoPE (`vllm_media`). Without an encoder stage the pipeline
  admits text only (the adapter's inputs).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from omnistage.checkpoints.shards import ShardedCheckpoint
from omnistage.contract.params import InvalidRequest, has_media
from omnistage.families import family_of
from stage_service.engines.omni.media import EncodedPrompt, prompt_rows
from stage_service.engines.omni.spoken import SpokenRows, tool_tag_ids
from stage_service.engines.qwen2_5_omni.steps import SPEECH_SYSTEM_PROMPT
from stage_service.engines.qwen2_5_omni.steps import _stop_ids as qwen2_5_stop_ids
from stage_service.engines.qwen3_omni.steps import _generation_eos
from stage_service.engines.vllm.ar import VllmEngine
from stage_service.engines.vllm.media import EXTRA_KEY, POSITIONS_FACTOR, PositionsOnly, media_payload, media_refusal
from stage_service.engines.vllm.models import QWEN2_5_OMNI_THINKER_TEXT, QWEN3_OMNI_THINKER_TEXT
from stage_service.engines.vllm.rows import LENGTH_MARGIN, RowsReceiver, engine_length, rows_engine_args
from stage_service.engines.vllm.thinker_text import MROPE_KEY
from stage_service.runtime.base import EngineConfigError, InputError
from stage_service.runtime.components import read_config


@dataclass(frozen=True)
class ThinkerFamily:
    """What differs between the omni families' Thinkers on vLLM."""

    architecture: str                        # our vLLM class (vllm_models)
    model_type: str                          # the plain LM its decoder is laid out as
    keys: tuple[str, ...]                    # text_config keys that LM's config shares
    hidden_layer: Callable[[dict], int]      # the layer the Talker takes (hidden_states index)
    stop_ids: Callable[[Path, dict, Any], set[int]]  # (root, config, tokenizer): as the transformers Thinker's
    default_system: str = ""                 # the system turn a request without one gets
    classes: tuple[str, str] = ("", "")      # transformers' combined config and Thinker classes (positions)

    def transformers_classes(self):
        import transformers

        return tuple(getattr(transformers, name) for name in self.classes)


COMMON_KEYS = ("attention_dropout", "hidden_act", "hidden_size", "intermediate_size", "max_position_embeddings",
               "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "rms_norm_eps", "vocab_size",
               "sliding_window", "use_sliding_window", "max_window_layers")

FAMILIES = {
    "qwen3_omni": ThinkerFamily(
        QWEN3_OMNI_THINKER_TEXT, "qwen3_moe",
        COMMON_KEYS + ("attention_bias", "decoder_sparse_step", "head_dim", "mlp_only_layers",
                       "moe_intermediate_size", "norm_topk_prob", "num_experts", "num_experts_per_tok"),
        lambda cfg: cfg["talker_config"]["accept_hidden_layer"],
        lambda root, cfg, tok: {cfg["im_end_token_id"], *_generation_eos(root)},
        classes=("Qwen3OmniMoeConfig", "Qwen3OmniMoeThinkerForConditionalGeneration")),
    "qwen2_5_omni": ThinkerFamily(
        QWEN2_5_OMNI_THINKER_TEXT, "qwen2", COMMON_KEYS + ("tie_word_embeddings",),
        lambda cfg: cfg["thinker_config"]["text_config"]["num_hidden_layers"],
        lambda root, cfg, tok: set(qwen2_5_stop_ids(root, tok)), SPEECH_SYSTEM_PROMPT,
        classes=("Qwen2_5OmniConfig", "Qwen2_5OmniThinkerForConditionalGeneration")),
}


def thinker_family(config: dict) -> ThinkerFamily:
    arch = (config.get("architectures") or [""])[0]
    family = family_of(arch)
    if family is None or family.name not in FAMILIES:
        raise EngineConfigError(f"the vLLM Thinker serves Qwen3-Omni and Qwen2.5-Omni checkpoints; this one holds a "
                                f"{arch or 'model of no known architecture'} (use engine: transformers)")
    return FAMILIES[family.name]


def thinker_text_config(config: dict) -> dict:
    """The plain-LM config of an omni checkpoint's Thinker text decoder (pure). Text positions have equal
    ids on the three M-RoPE axes, so the multimodal rotary embedding is plain RoPE for them; the M-RoPE
    sections go under our own key (`MROPE_KEY`), which our decoder class reads: under vLLM's
    `rope_parameters` they would make vLLM compute positions from its multimodal processor's inputs."""
    family = thinker_family(config)
    text = config["thinker_config"]["text_config"]
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    theta = rope.get("rope_theta", text.get("rope_theta"))
    if theta is None:
        raise EngineConfigError("thinker_config.text_config has no rope_theta")
    out = {k: text[k] for k in family.keys if k in text}
    if rope.get("mrope_section"):
        out[MROPE_KEY] = {"section": list(rope["mrope_section"]),
                          "interleaved": bool(rope.get("mrope_interleaved", rope.get("interleaved", False)))}
    out.setdefault("tie_word_embeddings", False)
    out.update(architectures=[family.architecture], model_type=family.model_type,
               rope_parameters={"rope_type": "default", "rope_theta": theta},
               torch_dtype=text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "float32")
    return out


def thinker_text_view(checkpoint: Path, config: dict, into: Path) -> Path:
    """A directory vLLM loads as the Thinker's text decoder: `config.json` of its own (from the checkpoint's
    `config`) and links to every other file of the checkpoint (weights, tokenizer, chat template, ...)."""
    into.mkdir(parents=True, exist_ok=True)
    text_config = thinker_text_config(config)
    for f in checkpoint.iterdir():
        if f.name != "config.json" and f.is_file():
            os.symlink(f.resolve(), into / f.name)
    (into / "config.json").write_text(json.dumps(text_config, indent=1) + "\n")
    return into


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Qwen decoders' RMSNorm (float32 inside, as transformers computes it)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class VllmThinkerEngine(VllmEngine):

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.shutdown()  # no engine, socket or view left behind by a stage that did not start
            raise

    async def _start(self) -> None:
        config = json.loads((self.model_dir / "config.json").read_text())
        self.family = thinker_family(config)
        self.default_system = self.family.default_system
        text = config["thinker_config"]["text_config"]
        layers = self.layers_total = text["num_hidden_layers"]
        accept = self.family.hidden_layer(config)
        if not 0 <= accept <= layers:
            raise EngineConfigError(f"{self.model_dir / 'config.json'}: talker_config.accept_hidden_layer is "
                                    f"{accept}, but the Thinker has {layers} layers")
        self.accept_layer = accept
        self.layers = sorted({0, accept})
        self.hidden_at = self.layers.index(accept)
        # vLLM's row of the last layer is before the final norm; transformers' last hidden state after it.
        self.final_norm = self._final_norm(text["rms_norm_eps"]) if accept == layers else None
        self.model_positions = text.get("max_position_embeddings")
        config_cls, thinker_cls = self.family.transformers_classes()
        self.rope_index = PositionsOnly(thinker_cls, read_config(self.model_dir, config_cls).thinker_config)
        self.work = Path(tempfile.mkdtemp(prefix=f"omnistage-{self.stage.name}-"))
        self.view = thinker_text_view(self.model_dir, config, self.work / "thinker-text")
        self.rows = RowsReceiver(f"ipc://{self.work / 'rows.sock'}", self._engine_dead)
        self.rows.start()
        await super().start()
        self.eos_ids = sorted(self.family.stop_ids(self.model_dir, config, self.tokenizer))
        self.tool_tags = tool_tag_ids(self.tokenizer)  # a tool call's rows are not spoken (`chunk_marks`)

    def _engine_dead(self) -> BaseException | None:
        llm = getattr(self, "llm", None)
        return llm.dead_error if llm is not None and llm.errored else None

    def _final_norm(self, eps: float):
        weight = ShardedCheckpoint(self.model_dir).read("thinker.model.norm.weight")
        return lambda x: rms_norm(x, weight.to(x.dtype), eps)

    async def _prompt(self, req, inputs):
        if not self.stage.inputs and has_media(req.params.parts):
            raise InvalidRequest("params.parts", "the vLLM Thinker takes media only from an encoder stage "
                                 "(kind: encoder); this pipeline has none")
        return await super()._prompt(req, inputs)

    def _upstream_prompt(self, chunks):
        if not chunks:
            raise InputError("the encoder stage sent nothing")
        enc = EncodedPrompt.from_tensors(chunks[0].tensors).to(torch.device("cpu"))
        ids = enc.ids.tolist()
        if any(t < 0 or t >= self.vocab for t in ids):
            raise InputError(f"prompt_token_ids from the encoder stage must lie in [0, {self.vocab})")
        if enc.audio is None and enc.image is None and enc.video is None:
            return {"prompt_token_ids": ids}, ids, len(ids)
        return self._media_prompt(enc, ids)

    def _media_prompt(self, enc: EncodedPrompt, ids: list[int]):
        """A mixed prompt: text positions as ids (vLLM embeds them), media positions as the encoder's rows;
        with images or video, their 3-D positions and deepstack rows in the request's extra_args."""
        for kind in ("audio", "image", "video"):
            rows = getattr(enc, kind)
            if rows is not None and (rows.dim() != 2 or rows.shape[-1] != self.hidden_size):
                raise InputError(f"the encoder's {kind} rows are {list(rows.shape)}, expected [n, {self.hidden_size}]")
        layers = set()
        for kind in ("image", "video"):
            deep = getattr(enc, f"{kind}_deepstack")
            if deep is None:
                continue
            # a row per placeholder, as the kind's own rows (which prompt_rows checks)
            count = int((enc.ids == getattr(self.rope_index.config, f"{kind}_token_id")).sum())
            if deep.dim() != 3 or deep.shape[1:] != (count, self.hidden_size):
                raise InputError(f"the encoder's {kind} deepstack rows are {list(deep.shape)}, expected "
                                 f"[layers, {count} {kind} placeholders, {self.hidden_size}]")
            layers.add(deep.shape[0])
        if len(layers) > 1:
            raise InputError(f"the encoder's image and video deepstack rows have {sorted(layers)} layers: one count")
        media = [getattr(enc, k) for k in ("audio", "image", "video") if getattr(enc, k) is not None]
        rows = prompt_rows(self.rope_index, enc)  # checks each kind's placeholders against its rows
        fed = torch.ones(len(ids), dtype=torch.bool)
        for kind in ("audio", "image", "video"):
            if getattr(enc, kind) is not None:
                fed &= enc.ids != getattr(self.rope_index.config, f"{kind}_token_id")
        prompt = {"prompt_embeds": rows.embeds.to(media[0].dtype), "prompt_token_ids": ids,
                  "prompt_is_token_ids": fed.tolist()}
        if enc.image is not None or enc.video is not None:
            refusal = media_refusal(self.llm.vllm_config)
            if refusal is not None:
                raise InputError(refusal)
            layers = len(rows.deepstack)
            if layers > self.layers_total:
                raise InputError(f"the encoder sent deepstack rows for {layers} layers; the Thinker has "
                                 f"{self.layers_total}")
            limit = self.model_positions * POSITIONS_FACTOR if self.model_positions else None
            low = int(rows.positions.min())
            if low < 0:  # MRotaryEmbedding would index its cos/sin cache out of range (a device assert on CUDA)
                raise InputError(f"the prompt's multimodal positions go down to {low}; they must be >= 0")
            top = max(int(rows.positions.max()), self.max_model_len + LENGTH_MARGIN + rows.rope_delta)
            if limit is not None and top >= limit:
                raise InputError(f"the prompt's multimodal positions reach {top}; the Thinker's rotary table "
                                 f"holds {limit}")
            # deepstack rows in the encoder's dtype (prompt_rows works in float32: the round trip is exact)
            prompt[EXTRA_KEY] = media_payload(rows.positions, rows.rope_delta, rows.visual_mask,
                                              [d.to(media[0].dtype) for d in rows.deepstack])
        return prompt, ids, len(ids)

    def sampling_extra_args(self, prompt: dict) -> dict | None:
        payload = prompt.pop(EXTRA_KEY, None)
        return None if payload is None else {EXTRA_KEY: payload}

    def vllm_model_dir(self):
        return self.view

    def more_engine_args(self, max_model_len: int | None) -> dict[str, Any]:
        if max_model_len is None and self.model_positions is None:
            raise EngineConfigError(f"spec.deployment.stages.{self.stage.name}.engineArgs.max_model_len: the "
                                    "Thinker's config declares no max_position_embeddings; set the context here")
        engine_len, self.max_model_len = engine_length(max_model_len, self.model_positions)
        return rows_engine_args(self.layers, self.rows.endpoint, engine_len)

    def stop_ids(self, p) -> list[int]:
        return [] if p.ignore_eos else self.eos_ids

    def chunk_marks(self, prompt_ids: list[int] | None, p) -> SpokenRows | None:
        """With tools in play, which rows the Talker speaks (not a tool call's: `spoken`)."""
        if not (p.tools or p.answer_prefix) or prompt_ids is None or self.tool_tags is None:
            return None
        return SpokenRows(self.tool_tags, prompt_ids)

    def open_request(self, call_id: str) -> None:
        self.rows.open(call_id)

    def close_request(self, call_id: str) -> None:
        self.rows.release(call_id)

    async def chunk_tensors(self, call_id: str, n_prompt: int, before: int, after: int) -> dict[str, torch.Tensor]:
        # Generated token t comes from the step that fed positions [0, P) (t = 0) or position P + t - 1.
        start, end = (0 if before == 0 else n_prompt + before - 1), n_prompt + after - 1
        if end <= start:
            return {}
        rows = await self.rows.take(call_id, start, end)
        hidden = rows[:, self.hidden_at]
        if self.final_norm is not None:
            hidden = self.final_norm(hidden)
        return {"embeds": rows[:, 0].contiguous(), "hidden": hidden.contiguous()}

    async def shutdown(self) -> None:
        try:
            await super().shutdown()
        finally:
            if getattr(self, "rows", None) is not None:
                await self.rows.close()
                self.rows = None
            if getattr(self, "work", None) is not None:
                shutil.rmtree(self.work, ignore_errors=True)
                self.work = None

