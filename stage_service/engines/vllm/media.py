"""Images and video into the omni Thinkers on vLLM: each request's 3-D multimodal rotary positions and
Qwen3-Omni's visual "deepstack" rows, carried into vLLM's engine core and laid over each step's batch.

Route (docs/stages.md, "Stages on vLLM"), vLLM's public extension points only:

1. Stage process (`PositionsOnly`, `media_payload`): `omni_media.prompt_rows` computes, as for the
   transformers Thinker, the prompt's input rows (media rows at their placeholders; text positions are
   zero rows here, vLLM embeds their ids), its [3, P] M-RoPE positions, the `rope_delta` every later
   position carries, and the deepstack rows per layer. Positions, delta and deepstack rows go to vLLM in
   the request's `SamplingParams.extra_args[EXTRA_KEY]` (bytes: vLLM's msgpack transport carries them).
2. Engine core, scheduler side (`MediaCursor`, in our KV connector `vllm_rows_connector`): per step and
   per scheduled request that has a payload, the KV-cache slots of the positions fed this step, their
   3-D positions and the deepstack rows of the visual ones among them (`MediaStep`), in the step's
   connector metadata.
3. Worker, our decoder class (`vllm_thinker_text`): before the forward it lays the steps over the batch
   through the forward context's slot mapping (`batch_inputs`): [3, N] positions (text-only requests
   keep their 1-D position on all axes) and, per deepstack layer, rows added to the residual stream
   after that layer at the visual positions; the attention layers' rotary embedding is vLLM's
   `MRotaryEmbedding` (3-D positions; 1-D positions give plain RoPE).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

EXTRA_KEY = "omnistage_media"  # SamplingParams.extra_args key of a request's payload
# vLLM's MRotaryEmbedding caches cos/sin for max_position_embeddings times this (its default factor).
POSITIONS_FACTOR = 4


def media_refusal(vllm_config) -> str | None:
    """Why this engine cannot carry images and video (None when it can; pure): the per-step positions and
    deepstack rows are Python inputs of an eager forward over one slot mapping per step."""
    if not vllm_config.model_config.enforce_eager:
        return ("images and video on the vLLM Thinker need an eager engine (engineArgs: enforce_eager: true): "
                "their per-step 3-D rotary positions and deepstack rows are inputs a compiled or CUDA graph "
                "would not see; or serve this stage with engine: transformers")
    parallel = vllm_config.parallel_config
    if parallel.use_ubatching or parallel.decode_context_parallel_size > 1:
        return ("images and video on the vLLM Thinker map each request to its rows by one slot mapping per "
                "step: micro-batching and decode context parallelism split it; turn them off or serve this "
                "stage with engine: transformers")
    return None


class PositionsOnly(torch.nn.Module):
    """What `omni_media.prompt_rows` reads of a Thinker, without its weights: the Thinker config, the
    family Thinker class's own `get_rope_index`, and zero input embeddings (the text positions of a vLLM
    prompt go as ids, so their rows are never read). Runs on the CPU."""

    def __init__(self, thinker_cls, thinker_config, dtype: torch.dtype = torch.float32):
        super().__init__()
        self._cls = thinker_cls
        self.config = thinker_config
        self.spatial_merge_size = thinker_config.vision_config.spatial_merge_size
        self.hidden_size = thinker_config.text_config.hidden_size
        self.dtype_ = dtype

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def get_input_embeddings(self):
        return lambda ids: torch.zeros(len(ids), self.hidden_size, dtype=self.dtype_)

    def get_rope_index(self, *args, **kwargs):
        return self._cls.get_rope_index(self, *args, **kwargs)

    def get_llm_pos_ids_for_vision(self, *args, **kwargs):
        return self._cls.get_llm_pos_ids_for_vision(self, *args, **kwargs)

    def get_chunked_index(self, *args, **kwargs):  # Qwen2.5-Omni's get_rope_index uses it
        return self._cls.get_chunked_index(self, *args, **kwargs)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _tensor(raw: bytes, dtype: str, shape) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).view(*shape)


def media_payload(positions: torch.Tensor, rope_delta: int, visual_mask: torch.Tensor | None = None,
                  deepstack: list[torch.Tensor] | None = None) -> dict:
    """A request's `extra_args[EXTRA_KEY]` (pure): its [3, P] positions, the delta of every position
    from P on, and the deepstack rows (per layer, [visual positions, H]) with the positions they go to."""
    positions = positions.to(torch.int64).cpu()
    out = {"prompt_len": int(positions.shape[1]), "delta": int(rope_delta), "positions": _bytes(positions)}
    if deepstack:
        visual = visual_mask.nonzero().flatten().to(torch.int64).cpu()
        rows = torch.stack([d.cpu() for d in deepstack])
        if rows.shape[1] != len(visual):
            raise ValueError(f"deepstack rows {list(rows.shape)} for {len(visual)} visual positions")
        out.update(visual=_bytes(visual), deepstack=_bytes(rows), deepstack_shape=list(rows.shape),
                   dtype=str(rows.dtype).removeprefix("torch."))
    return out


@dataclass
class MediaStep:
    """One request's share of a step: the cache slot of each position it feeds, their [3, n] positions,
    and the deepstack rows [layers, k, H] of the k visual ones (at `visual`, offsets into the n)."""

    req_id: str
    slots: list[int]
    positions: torch.Tensor
    visual: torch.Tensor | None = None
    deepstack: torch.Tensor | None = None


class MediaPrompt:
    """A request's payload, decoded once in the engine core."""

    def __init__(self, payload: dict):
        self.prompt_len, self.delta = payload["prompt_len"], payload["delta"]
        self.positions = _tensor(payload["positions"], "int64", (3, self.prompt_len))
        self.visual = self.deepstack = None
        if "deepstack" in payload:
            self.deepstack = _tensor(payload["deepstack"], payload["dtype"], payload["deepstack_shape"])
            self.visual = _tensor(payload["visual"], "int64", (self.deepstack.shape[1],))

    def step(self, req_id: str, start: int, end: int, slots: list[int]) -> MediaStep:
        """Positions [start, end): prompt positions as computed, later ones p + delta on every axis."""
        cut = min(max(start, self.prompt_len), end)
        later = torch.arange(cut, end, dtype=torch.int64) + self.delta
        positions = torch.cat([self.positions[:, start:cut], later.expand(3, -1)], dim=1)
        visual = deepstack = None
        if self.deepstack is not None and start < self.prompt_len:
            inside = (self.visual >= start) & (self.visual < end)
            if bool(inside.any()):
                visual, deepstack = self.visual[inside] - start, self.deepstack[:, inside]
        return MediaStep(req_id, slots, positions, visual, deepstack)


def slots_of(blocks: list[int], block_size: int, start: int, end: int) -> list[int]:
    """Cache slots of positions [start, end) of a request holding `blocks` (pure)."""
    return [blocks[p // block_size] * block_size + p % block_size for p in range(start, end)]


class MediaCursor:
    """Scheduler side (no vLLM object needed): per request with a payload, its block table in the
    attention layers' cache group; per step, its `MediaStep`. Requests without one cost nothing."""

    def __init__(self, group: int, block_size: int):
        self.group, self.block = group, block_size
        self.prompts: dict[str, MediaPrompt] = {}
        self.blocks: dict[str, list[int]] = {}

    def step(self, so) -> list[MediaStep]:
        computed: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            extra = (new.sampling_params.extra_args or {}) if new.sampling_params is not None else {}
            if EXTRA_KEY in extra:  # taken out: not shipped on to the workers nor held by the request
                self.prompts[new.req_id] = MediaPrompt(extra.pop(EXTRA_KEY))
            if new.req_id in self.prompts:
                self.blocks[new.req_id] = list(new.block_ids[self.group])
                computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid not in self.prompts:
                continue
            added = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:  # preempted and back: new blocks, positions recomputed
                self.blocks[rid] = list(added[self.group]) if added is not None else []
            elif added is not None:
                self.blocks[rid].extend(added[self.group])
            computed[rid] = cached.num_computed_tokens[i]
        steps = []
        for rid, n in so.num_scheduled_tokens.items():
            if rid in computed:
                start = computed[rid]
                steps.append(self.prompts[rid].step(rid, start, start + n,
                                                    slots_of(self.blocks[rid], self.block, start, start + n)))
        return steps

    def finished(self, rid: str) -> None:
        self.prompts.pop(rid, None)
        self.blocks.pop(rid, None)


def batch_inputs(steps: list[MediaStep], slot_mapping: torch.Tensor, positions: torch.Tensor,
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The step's [3, N] positions and, per deepstack layer, rows [N, H] to add (pure): each request's
    positions laid over the rows of the batch that feed its slots (`slot_mapping`, the forward context's,
    [>= N]); the other rows keep their 1-D `positions` [N] on all three axes."""
    n = positions.shape[-1]
    out = positions.unsqueeze(0).expand(3, n).clone()
    row_of = {s: i for i, s in enumerate(slot_mapping[:n].tolist())}
    deep: list[torch.Tensor] = []
    for st in steps:
        try:
            rows = torch.tensor([row_of[s] for s in st.slots], dtype=torch.long, device=positions.device)
        except KeyError as e:
            raise RuntimeError(f"request {st.req_id}: cache slot {e.args[0]} is not in this step's batch") from None
        out[:, rows] = st.positions.to(out.device, out.dtype)
        if st.deepstack is not None:
            if not deep:  # made where the step runs: only the request's own rows cross to the device
                deep = [torch.zeros(n, st.deepstack.shape[-1], dtype=st.deepstack.dtype, device=positions.device)
                        for _ in range(st.deepstack.shape[0])]
            at = rows[st.visual.to(rows.device)]
            for layer, d in enumerate(deep):
                d[at] = st.deepstack[layer].to(d.device, d.dtype)
    return out, deep
