"""Packed batching for transformers decoder models: many sequences in one forward, each with its own KV cache.

The tokens of every sequence in a step (a whole prompt for a sequence that
joins, one token for one that decodes) are laid end to end in one row, as
vLLM does. The dense layers see one [1, tokens, hidden] batch; attention is
computed per sequence against that sequence's own cache, registered with
transformers as an attention implementation. A sequence that leaves simply
drops its `SequenceKV`.

Batch invariance (see `invariance.py`): a step is padded to at least
`min_rows` tokens, so that the matmuls a module calls directly (an MoE router)
take the same kernel whatever the batch; the padding rows have no cache and are
attended to by nothing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .invariance import MIN_MATMUL_ROWS

ATTENTION = "omnistage_packed"
_step = threading.local()  # the layout of the forward running on this thread


class SequenceKV:
    """One sequence's KV cache: per layer, keys and values [1, kv_heads, length, head_dim]."""

    def __init__(self) -> None:
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}

    def length(self, layer: int = 0) -> int:
        k = self._k.get(layer)
        return 0 if k is None else k.shape[2]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self._k:
            k = torch.cat([self._k[layer], k], dim=2)
            v = torch.cat([self._v[layer], v], dim=2)
        else:  # own the rows: a slice would keep the whole step's tensor alive
            k, v = k.clone(), v.clone()
        self._k[layer], self._v[layer] = k, v
        return k, v

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for d in (self._k, self._v) for t in d.values())

    def clear(self) -> None:
        self._k.clear()
        self._v.clear()


@dataclass
class _Segment:
    start: int
    length: int
    kv: SequenceKV | None  # None: padding rows, attended to by nothing and cached nowhere


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention of each sequence's new tokens against its own cache (registered as `ATTENTION`)."""
    layer = module.layer_idx
    outs = []
    for seg in _step.segments:
        s, e = seg.start, seg.start + seg.length
        q, k, v = query[:, :, s:e], key[:, :, s:e], value[:, :, s:e]
        past = seg.kv.length(layer) if seg.kv is not None else 0
        if seg.kv is not None:
            k, v = seg.kv.append(layer, k, v)
        mask = None
        if seg.length > 1 and past:  # new tokens after a cached prefix: causal, aligned bottom-right
            mask = torch.ones(seg.length, past + seg.length, dtype=torch.bool, device=q.device).tril(past)[None, None]
        out, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=scaling, is_causal=True)
        outs.append(out)
    return torch.cat(outs, dim=1), None


AttentionInterface.register(ATTENTION, packed_attention)


def use_packed_attention(model: torch.nn.Module) -> None:
    """Route a decoder model's attention through `packed_attention` (its config only, not its siblings')."""
    model.config._attn_implementation = ATTENTION


def positions(past: int, n: int, rope_axes: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Position ids of n new tokens after `past`: [n], or [rope_axes, n] for multimodal RoPE (text: equal axes)."""
    p = torch.arange(past, past + n, device=device)
    return p if rope_axes == 0 else p.expand(rope_axes, n)


def packed_forward(model: torch.nn.Module, inputs: Sequence[torch.Tensor], caches: Sequence[SequenceKV],
                   rope_axes: int = 0, embed: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   hidden_states: bool = False, min_rows: int = MIN_MATMUL_ROWS,
                   position_ids: Sequence[torch.Tensor | None] | None = None,
                   deepstack: Sequence[tuple[torch.Tensor, list[torch.Tensor]] | None] | None = None):
    """One forward of a transformers decoder (`...Model`, not `...ForCausalLM`) over several sequences.

    `inputs[i]` are sequence i's new rows: token ids [n] when `embed` is given, else embeddings [n, H].
    `position_ids[i]`, where given, are its rows' positions ([rope_axes, n]; by default they follow its
    cache). `deepstack[i]`, where given, is (mask [n] of its visual rows, per decoder layer the rows
    added there): the model's deepstack inputs, laid out over the packed step.
    Each cache grows by its sequence's rows. Returns (last hidden rows [k, H] per sequence, and when asked
    every layer's hidden rows per sequence: a list of tuples of [n_i, H]).
    """
    rows = [embed(x) if embed is not None else x for x in inputs]
    device = rows[0].device  # the model's: every row, position and mask of the step is made there
    given = position_ids or [None] * len(rows)
    pos = [g if g is not None else positions(c.length(), len(x), rope_axes, device)
           for x, c, g in zip(rows, caches, given)]
    segments, start = [], 0
    for x, c in zip(rows, caches):
        segments.append(_Segment(start, len(x), c))
        start += len(x)
    if start < min_rows:  # pad: see the module docstring
        pad = min_rows - start
        rows.append(torch.zeros(pad, rows[0].shape[1], dtype=rows[0].dtype, device=device))
        pos.append(positions(0, pad, rope_axes, device))
        segments.append(_Segment(start, pad, None))
    flat = torch.cat(rows)[None]
    position_ids = torch.cat(pos, dim=-1)
    position_ids = position_ids[None] if rope_axes == 0 else position_ids[:, None]
    extra = (_deepstack_inputs(deepstack, segments, device) if deepstack and any(d is not None for d in deepstack)
             else {})
    _step.segments = segments
    try:
        out = model(inputs_embeds=flat, position_ids=position_ids, use_cache=False,
                    output_hidden_states=hidden_states, **extra)
    finally:
        _step.segments = ()
    real = segments[:len(inputs)]
    last = torch.cat([out.last_hidden_state[0, s.start + s.length - 1:s.start + s.length] for s in real])
    if not hidden_states:
        return last, None
    per_seq = [tuple(h[0, s.start:s.start + s.length] for h in out.hidden_states) for s in real]
    return last, per_seq


def _deepstack_inputs(deepstack, segments: list[_Segment], device: torch.device) -> dict:
    """The model's `visual_pos_masks` [1, step rows] and `deepstack_visual_embeds` (per layer, the visual
    rows of every sequence in step order) for the sequences that carry some."""
    mask = torch.zeros(1, sum(s.length for s in segments), dtype=torch.bool, device=device)
    layers: list[list[torch.Tensor]] = []
    for d, seg in zip(deepstack, segments):
        if d is None:
            continue
        seq_mask, rows = d
        mask[0, seg.start:seg.start + seg.length] = seq_mask
        layers = layers or [[] for _ in rows]
        for acc, r in zip(layers, rows):
            acc.append(r)
    return {"visual_pos_masks": mask, "deepstack_visual_embeds": [torch.cat(acc) for acc in layers]}
