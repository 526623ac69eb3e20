"""The denoise loop's step cache (first-block caching, `engineArgs.step_cache_threshold`): a DiT whose first
block's residual (what the block adds to its input) has barely moved since the last step its request computed in
full skips its remaining blocks and reuses what they added then.

At every step the DiT runs its input embedding and first transformer block over every row of the batch. Then,
for each request on its own (its [unconditional, conditional] rows under guidance decide together), the relative
L1 change of the first block's residual since the last step computed in full for that request is compared with
the threshold (the first block's residual, not its output: the output carries the embedded input, position
embedding included, which moves little whatever the step, so a change in it would read small where the blocks'
work has moved a lot):

- below it, the request takes its cached residual (that step's final hidden states minus its first block's
  output) on top of this step's first-block output, and its rows skip the remaining blocks;
- otherwise its rows go through the remaining blocks, with those of the other requests that need them (the
  rows are gathered, stepped, and put back in place), and its residuals are cached.

The first `step_cache_warmup` steps and the last step of each request are always computed. Every row then
goes through the model's output layers. A request's decision reads only its own rows, and every kernel on the
way is batch-invariant (invariance.py), so batching never changes a request's result, cached or not.

What is class-specific is only how a DiT's forward splits after its first block: a `DitBlocks` per class,
given by its `DENOISERS` entry (denoisers.py). The per-request part (`StepCacheState`) lives in the request's
`DenoiseState` and is released with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass
class FirstBlock:
    """A batch after the DiT's embeddings and first block: its hidden states [rows, tokens, width], the per-row
    tensors the remaining blocks and the output layers read (batch first), and what every row shares."""

    hidden: torch.Tensor
    before: torch.Tensor  # the hidden states the first block took (the embedded input)
    rows: dict[str, torch.Tensor]
    shared: dict[str, Any] = field(default_factory=dict)

    def select(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: v.index_select(0, index) for k, v in self.rows.items()}


Rows = dict[str, torch.Tensor]


@dataclass(frozen=True)
class DitBlocks:
    """A DiT's forward in three parts, together the model's own forward, operation for operation:
    `head(model, **forward arguments)` the embeddings and first block; `rest(model, hidden, rows, shared)` the
    remaining blocks over some rows; `out(model, hidden, rows, shared)` the output layers (and unpatchify)."""

    head: Callable[..., FirstBlock]
    rest: Callable[[torch.nn.Module, torch.Tensor, Rows, dict[str, Any]], torch.Tensor]
    out: Callable[[torch.nn.Module, torch.Tensor, Rows, dict[str, Any]], torch.Tensor]
    count: Callable[[dict[str, Any]], int]  # the model's transformer blocks, from its config


@dataclass(eq=False)
class StepCacheState:
    """One request's cache: its first block's residual at its last step computed in full (the signal), and what the
    remaining blocks added then."""

    signal: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    computed: int = 0  # steps run through every block
    reused: int = 0    # steps that took the residual instead

    def held_bytes(self) -> int:
        return sum(t.nbytes for t in (self.signal, self.residual) if t is not None)

    def release(self) -> None:
        self.signal = self.residual = None


def relative_change(now: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """Mean absolute change relative to the mean magnitude before (float32, whatever the stage dtype; inf where
    before is all zeros), as a 0-d tensor: read with the batch's others at once."""
    now, before = now.float(), before.float()
    scale = before.abs().mean()
    return torch.where(scale > 0, (now - before).abs().mean() / scale, torch.full_like(scale, float("inf")))


@dataclass(frozen=True)
class StepCachePolicy:
    threshold: float  # relative L1 change of the first block's residual under which a step reuses
    warmup: int = 1   # steps always computed at the start

    def may_reuse(self, cache: StepCacheState, step: int, steps: int) -> bool:
        """Whether a request at `step` (of `steps`) may take its cached residual (then its change decides)."""
        return cache.signal is not None and cache.residual is not None and self.warmup <= step < steps - 1


@dataclass(frozen=True)
class CachedRequest:
    """A request's part of a batched step: its cache, its row count, its step and how many it takes."""

    cache: StepCacheState
    rows: int
    step: int
    steps: int


def cached_forward(model: torch.nn.Module, blocks: DitBlocks, policy: StepCachePolicy,
                   requests: list[CachedRequest], forward: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """The model's output for the batch (`forward`: its forward arguments, rows in `requests`' order), the
    remaining blocks run only for the rows of requests that do not reuse their cached residual; and how many
    requests reused theirs."""
    head = blocks.head(model, **forward)
    signals = head.hidden - head.before  # what the first block added, each row
    starts = [sum(r.rows for r in requests[:k]) for k in range(len(requests))]
    candidates = [k for k, req in enumerate(requests) if policy.may_reuse(req.cache, req.step, req.steps)]
    changes = torch.stack([relative_change(signals[starts[k]:starts[k] + requests[k].rows],
                                           requests[k].cache.signal)  # type: ignore[arg-type]
                           for k in candidates]).tolist() if candidates else []  # one read for the batch
    reusing = {k for k, change in zip(candidates, changes) if change < policy.threshold}
    firsts: list[tuple[CachedRequest, torch.Tensor, torch.Tensor, bool]] = []
    computed: list[int] = []
    for k, req in enumerate(requests):
        i = starts[k]
        reuse = k in reusing
        firsts.append((req, head.hidden[i:i + req.rows], signals[i:i + req.rows], reuse))
        if not reuse:
            computed.extend(range(i, i + req.rows))
    rest = None
    if len(computed) == len(head.hidden):  # every row: as the model's own forward runs them
        rest = blocks.rest(model, head.hidden, head.rows, head.shared)
    elif computed:
        index = torch.tensor(computed, device=head.hidden.device)
        rest = blocks.rest(model, head.hidden.index_select(0, index), head.select(index), head.shared)
    parts, j = [], 0
    for req, first, signal, reuse in firsts:
        if reuse:
            assert req.cache.residual is not None  # may_reuse() saw it
            parts.append(first + req.cache.residual)
            req.cache.reused += 1
            continue
        assert rest is not None
        done = rest[j:j + req.rows]
        j += req.rows
        req.cache.signal, req.cache.residual = signal.clone(), done - first
        req.cache.computed += 1
        parts.append(done)
    hidden = rest if not reusing and rest is not None else torch.cat(parts)  # every row ran: no copy
    reused = len(reusing)
    return blocks.out(model, hidden, head.rows, head.shared), reused


# ------------------------------------------------------------ SD3Transformer2DModel

def sd3_head(model, hidden_states, encoder_hidden_states, pooled_projections, timestep) -> FirstBlock:
    height, width = hidden_states.shape[-2:]
    hidden = model.pos_embed(hidden_states).contiguous()
    temb = model.time_text_embed(timestep, pooled_projections)
    context = model.context_embedder(encoder_hidden_states)
    before = hidden
    context, hidden = model.transformer_blocks[0](hidden_states=hidden, encoder_hidden_states=context, temb=temb)
    return FirstBlock(hidden, before, {"temb": temb, "context": context}, {"height": height, "width": width})


def sd3_rest(model, hidden: torch.Tensor, rows: Rows, shared: dict[str, Any]) -> torch.Tensor:
    context = rows["context"]
    for block in model.transformer_blocks[1:]:
        context, hidden = block(hidden_states=hidden, encoder_hidden_states=context, temb=rows["temb"])
    return hidden


def sd3_out(model, hidden: torch.Tensor, rows: Rows, shared: dict[str, Any]) -> torch.Tensor:
    hidden = model.proj_out(model.norm_out(hidden, rows["temb"]))
    p, c = model.config.patch_size, model.out_channels
    h, w = shared["height"] // p, shared["width"] // p
    hidden = torch.einsum("nhwpqc->nchpwq", hidden.reshape(hidden.shape[0], h, w, p, p, c))
    return hidden.reshape(hidden.shape[0], c, h * p, w * p)


SD3_BLOCKS = DitBlocks(head=sd3_head, rest=sd3_rest, out=sd3_out, count=lambda cfg: cfg["num_layers"])


# ------------------------------------------------------------ WanTransformer3DModel

def wan_head(model, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image=None) -> FirstBlock:
    if timestep.ndim != 1:  # a timestep per token (Wan 2.2 TI2V's expand_timesteps): refused when the stage loads
        raise ValueError(f"the Wan step-cache split takes one timestep per row, got a timestep of {timestep.ndim} "
                         "dimensions (denoisers.wan_unserved refuses such a pipeline)")
    rotary = model.rope(hidden_states)
    hidden = model.patch_embedding(hidden_states).flatten(2).transpose(1, 2).contiguous()
    temb, projected, context, image = model.condition_embedder(timestep, encoder_hidden_states,
                                                               encoder_hidden_states_image, timestep_seq_len=None)
    projected = projected.unflatten(1, (6, -1))
    if image is not None:
        context = torch.concat([image, context], dim=1)
    before = hidden
    hidden = model.blocks[0](hidden, context, projected, rotary)
    return FirstBlock(hidden, before, {"temb": temb, "projected": projected, "context": context},
                      {"rotary": rotary, "shape": hidden_states.shape})


def wan_rest(model, hidden: torch.Tensor, rows: Rows, shared: dict[str, Any]) -> torch.Tensor:
    for block in model.blocks[1:]:
        hidden = block(hidden, rows["context"], rows["projected"], shared["rotary"])
    return hidden


def wan_out(model, hidden: torch.Tensor, rows: Rows, shared: dict[str, Any]) -> torch.Tensor:
    temb = rows["temb"]
    shift, scale = (model.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)
    shift, scale = shift.to(hidden.device), scale.to(hidden.device)
    hidden = (model.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
    hidden = model.proj_out(hidden)
    _, _, frames, height, width = shared["shape"]
    p_t, p_h, p_w = model.config.patch_size
    hidden = hidden.reshape(hidden.shape[0], frames // p_t, height // p_h, width // p_w, p_t, p_h, p_w, -1)
    return hidden.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)


WAN_BLOCKS = DitBlocks(head=wan_head, rest=wan_rest, out=wan_out, count=lambda cfg: cfg["num_layers"])


# ------------------------------------------------------------ FluxTransformer2DModel

def flux_head(model, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids,
              guidance=None) -> FirstBlock:
    """The first of its dual-stream blocks; the rest of them and then every single-stream block follow in `rest`."""
    hidden = model.x_embedder(hidden_states)
    timestep = timestep.to(hidden.dtype) * 1000
    if guidance is None:
        temb = model.time_text_embed(timestep, pooled_projections)
    else:
        temb = model.time_text_embed(timestep, guidance.to(hidden.dtype) * 1000, pooled_projections)
    context = model.context_embedder(encoder_hidden_states)
    rotary = model.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
    before = hidden
    context, hidden = model.transformer_blocks[0](hidden_states=hidden, encoder_hidden_states=context, temb=temb,
                                                  image_rotary_emb=rotary)
    return FirstBlock(hidden, before, {"temb": temb, "context": context}, {"rotary": rotary})


def flux_rest(model, hidden: torch.Tensor, rows: Rows, shared: dict[str, Any]) -> torch.Tensor:
    context = rows["context"]
    for block in [*model.transformer_blocks[1:], *model.single_transformer_blocks]:
        context, hidden = block(hidden_states=hidden, encoder_hidden_states=context, temb=rows["temb"],
                                image_rotary_emb=shared["rotary"])
    return hidden


def flux_out(model, hidden: torch.Tensor, rows: Rows, shared: dict[str, Any]) -> torch.Tensor:
    return model.proj_out(model.norm_out(hidden, rows["temb"]))  # still packed: the loop unpacks it


FLUX_BLOCKS = DitBlocks(head=flux_head, rest=flux_rest, out=flux_out,
                        count=lambda cfg: cfg["num_layers"] + cfg["num_single_layers"])


# ------------------------------------------------------------ QwenImageTransformer2DModel

def qwen_image_head(model, hidden_states, encoder_hidden_states, timestep, img_shapes,
                    encoder_hidden_states_mask=None) -> FirstBlock:
    """The first of its dual-stream blocks (the embeddings as its forward makes them: `zero_cond_t`,
    `use_additional_t_cond` and guidance are refused when the stage loads, denoisers.qwen_image_unserved)."""
    from diffusers.models.transformers.transformer_qwenimage import compute_text_seq_len_from_mask

    hidden = model.img_in(hidden_states)
    timestep = timestep.to(hidden.dtype)
    context = model.txt_in(model.txt_norm(encoder_hidden_states))
    tokens, _, mask = compute_text_seq_len_from_mask(context, encoder_hidden_states_mask)
    temb = model.time_text_embed(timestep, hidden)
    rotary = model.pos_embed(img_shapes, max_txt_seq_len=tokens, device=hidden.device)
    before = hidden
    context, hidden = model.transformer_blocks[0](hidden_states=hidden, encoder_hidden_states=context,
                                                  encoder_hidden_states_mask=mask, temb=temb, image_rotary_emb=rotary)
    rows = {"temb": temb, "context": context, **({} if mask is None else {"mask": mask})}
    return FirstBlock(hidden, before, rows, {"rotary": rotary})


def qwen_image_rest(model, hidden: torch.Tensor, rows: Rows, shared: dict[str, Any]) -> torch.Tensor:
    context = rows["context"]
    for block in model.transformer_blocks[1:]:
        context, hidden = block(hidden_states=hidden, encoder_hidden_states=context,
                                encoder_hidden_states_mask=rows.get("mask"), temb=rows["temb"],
                                image_rotary_emb=shared["rotary"])
    return hidden


def qwen_image_out(model, hidden: torch.Tensor, rows: Rows, shared: dict[str, Any]) -> torch.Tensor:
    return model.proj_out(model.norm_out(hidden, rows["temb"]))  # still packed: the loop unpacks it


QWEN_IMAGE_BLOCKS = DitBlocks(head=qwen_image_head, rest=qwen_image_rest, out=qwen_image_out,
                              count=lambda cfg: cfg["num_layers"])
