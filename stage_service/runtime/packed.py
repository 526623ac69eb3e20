"""Packed batching for transformers decoder models: many sequences in one forward, each with its own KV cache.

The tokens of every sequence in a step (a whole prompt for a sequence that
joins, one token for one that decodes) are laid end to end in one row, as
vLLM does. The dense layers see one [1, tokens, hidden] batch; attention is
computed against each sequence's own cache, registered with transformers as an
attention implementation. A sequence that leaves simply drops its `SequenceKV`.

Attention is one SDPA call per group of sequences with as many new and cached
rows (all those decoding in step, in the common case), stacked along the batch
dimension, over caches kept side by side in a `_KvBlock`: per layer and step a
handful of tensor ops for the whole group, not a few per sequence.

Batch invariance (see `invariance.py`): a step is padded to at least
`min_rows` tokens, so that the matmuls a module calls directly (an MoE router)
take the same kernel whatever the batch; the padding rows have no cache and are
attended to by nothing. Stacking keeps it: SDPA computes each batch entry on
its own, and over a view of a bigger buffer exactly as over a copy (both
checked bit for bit in tests/unit/test_batching.py; the CUDA twin of the stacked-vs-lone check there is
skipped without a GPU and has to run on one to say anything about CUDA).

Under a KV budget (`kv_budget.py`) a cache grows by whole pages instead of doubling and keeps a block of
its own, so the bytes it holds are its own and known in advance; its attention is then one call per
sequence.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from stage_service.runtime.invariance import MIN_MATMUL_ROWS

ATTENTION = "omnistage_packed"
_step = threading.local()  # the layout of the forward running on this thread


class SequenceKV:
    """One sequence's KV cache: per layer, keys and values [kv_heads, length, head_dim].

    The rows live in one slot of a `_KvBlock`, shared with the sequences it steps with. A step finds the
    block of each group of sequences that share an attention call (`_Group`); when the group is not
    exactly one block's members (someone joined, left, or grew apart) their rows move into a new block
    for it, once, and the following steps of that group cost one copy of new rows and no concatenation.
    """

    def __init__(self, page: int | None = None, limit: int | None = None) -> None:
        self.page = page  # None: capacity doubles and blocks are shared; rows: grows by pages, a block of its own
        self.limit = limit  # the most rows it will ever hold (prompt + max_tokens): doubling stops there
        self._block: _KvBlock | None = None
        self._slot = 0

    def length(self, layer: int = 0) -> int:
        return 0 if self._block is None else self._block.length(layer)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add rows k, v [1, kv_heads, n, head_dim] (this sequence alone); returns the whole cache of
        `layer` as [1, kv_heads, length, head_dim] views."""
        return _KvBlock.of([self]).append(layer, k, v)

    @property
    def nbytes(self) -> int:
        """Its share of the bytes its block holds (spare room included) among the block's members still
        holding it: a sequence whose block-mates left counts the whole block until its next step moves its
        rows into one of its own."""
        block = self._block  # read once: the loop may clear it while the step thread asks (kv_held)
        return 0 if block is None else block.nbytes // max(block.live, 1)

    def clear(self) -> None:
        """Leave the block (its memory goes with the last sequence that holds it)."""
        self._leave()

    def _leave(self) -> None:
        if self._block is not None:
            self._block.live -= 1
            self._block = None


class _KvBlock:
    """The caches of sequences that step together, one slot each: per layer, keys and values
    [slots, kv_heads, capacity, head_dim], every slot holding the same number of rows.

    Capacity doubles when full, up to the most rows a member will ever hold (its `limit`; under a KV budget
    it grows by its members' `page` rows instead), so a step writes
    its new rows in place instead of copying the cache into a new tensor. Only the first `length` rows are
    read: the spare room never changes a number, and attention over a view of the buffers is bit for bit
    attention over a contiguous copy (checked in tests/unit/test_batching.py)."""

    MIN_ROWS = 32  # the smallest capacity: a short prompt and its first tokens without regrowing

    def __init__(self, members: list[SequenceKV]) -> None:
        self.members = members  # by slot
        self.slots = len(members)
        self.page = members[0].page
        limits = [m.limit for m in members]
        self.limit = None if None in limits else max(limits)  # the most rows a slot will ever need
        self.live = len(members)  # members that still hold it (not cleared, not moved to another block)
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}
        self._len: dict[int, int] = {}

    @classmethod
    def of(cls, members: list[SequenceKV]) -> "_KvBlock":
        """The block whose slots are exactly `members` (of equal lengths): theirs, or a new one their rows
        are copied into."""
        block = members[0]._block
        if block is not None and block.slots == len(members) and all(
                m is b and m._block is block for m, b in zip(members, block.members)):
            return block
        block = cls(members)
        # Every member has as many rows in the same layers (the group's key): those of the first.
        for layer, past in ({} if members[0]._block is None else members[0]._block._len).items():
            block._k[layer] = _stacked([m._block._k[layer][m._slot, :, :past] for m in members], past, block)
            block._v[layer] = _stacked([m._block._v[layer][m._slot, :, :past] for m in members], past, block)
            block._len[layer] = past
        for i, m in enumerate(members):
            m._leave()
            m._block, m._slot = block, i
        return block

    def length(self, layer: int) -> int:
        return self._len.get(layer, 0)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add rows k, v [slots, kv_heads, n, head_dim]; returns every slot's whole cache of `layer`
        ([slots, kv_heads, length, head_dim] views)."""
        past = self._len.get(layer, 0)
        end = past + k.shape[2]
        buf_k = self._k.get(layer)
        if buf_k is None or end > buf_k.shape[2]:
            self._k[layer] = buf_k = _grown(buf_k, k, past, end, self)
            self._v[layer] = _grown(self._v.get(layer), v, past, end, self)
        buf_v = self._v[layer]
        buf_k.narrow(2, past, end - past).copy_(k)
        buf_v.narrow(2, past, end - past).copy_(v)
        self._len[layer] = end
        return buf_k.narrow(2, 0, end), buf_v.narrow(2, 0, end)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for d in (self._k, self._v) for t in d.values())


def _capacity(rows: int, block: "_KvBlock") -> int:
    """Rows to allocate for `rows`: as many again (at least MIN_ROWS) but no more than its members will ever
    hold, or under a budget whole pages."""
    if block.page is not None:
        return -(-rows // block.page) * block.page
    grown = max(2 * rows, _KvBlock.MIN_ROWS)
    return grown if block.limit is None else max(rows, min(grown, block.limit))


def _stacked(rows: list[torch.Tensor], past: int, block: _KvBlock) -> torch.Tensor:
    """A buffer [len(rows), kv_heads, capacity, head_dim] holding each of `rows` [kv_heads, past, head_dim]."""
    out = rows[0].new_empty(len(rows), rows[0].shape[0], _capacity(past, block), rows[0].shape[2])
    for i, r in enumerate(rows):
        out[i, :, :past] = r
    return out


def _grown(buf: torch.Tensor | None, new: torch.Tensor, past: int, end: int, block: _KvBlock) -> torch.Tensor:
    """A buffer shaped like `new` with room for `end` rows (`_capacity`), holding the `past` rows of `buf`."""
    grown = new.new_empty(*new.shape[:2], _capacity(end, block), *new.shape[3:])
    if buf is not None:
        grown.narrow(2, 0, past).copy_(buf.narrow(2, 0, past))
    return grown


@dataclass
class _Segment:
    start: int
    length: int
    kv: SequenceKV | None  # None: padding rows, attended to by nothing and cached nowhere

    def past(self) -> int:
        """Rows its cache holds (read before the step's forward, which adds this step's)."""
        return 0 if self.kv is None else self.kv.length()


@dataclass
class _Group:
    """Sequences of a step with as many new rows and as many cached rows: one attention call for all.

    Their queries, keys and values have equal shapes, so they stack along the batch dimension, and SDPA
    computes each batch entry on its own (checked bit for bit in tests/unit/test_batching.py, on the CPU
    and, by a test that has to run on a GPU, on CUDA), so a sequence gets the same numbers in a group of
    any size, alone included."""

    block: _KvBlock  # the group's caches, one slot per sequence in step order
    rows: torch.Tensor  # the step rows of its sequences, sequence by sequence
    mask: torch.Tensor | None  # new rows after a cached prefix: causal, aligned bottom-right


def _groups(segments: list[_Segment], device: torch.device) -> list[_Group]:
    """The step's sequences grouped by (new rows, cached rows), on every device (stacked calls against lone
    ones: checked bit for bit in tests/unit/test_batching.py, its CUDA twin on a GPU only); padding rows are
    in none. A paged cache (under a KV budget) keeps a block of its own, so it is a group of its own."""
    by_shape: dict[tuple[int, ...], list[_Segment]] = {}
    for seg in segments:
        if seg.kv is not None:
            key = (seg.length, seg.past()) if seg.kv.page is None else (seg.length, seg.past(), id(seg))
            by_shape.setdefault(key, []).append(seg)
    groups = []
    for (n, past, *_), segs in by_shape.items():
        rows = torch.tensor([r for s in segs for r in range(s.start, s.start + n)], device=device)
        mask = None
        if n > 1 and past:
            mask = torch.ones(n, past + n, dtype=torch.bool, device=device).tril(past)[None, None]
        groups.append(_Group(_KvBlock.of([s.kv for s in segs]), rows, mask))
    return groups


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention of each sequence's new rows against its own cache (registered as `ATTENTION`): one SDPA
    call per `_Group`. Padding rows attend to nothing: their output is zeros."""
    layer = module.layer_idx
    q_rows = query.transpose(1, 2)[0]  # [step rows, heads, head_dim]
    out = torch.zeros_like(q_rows)
    for group in _step.groups:
        n = group.block.slots
        new_k, new_v = (t.index_select(2, group.rows).view(t.shape[1], n, -1, t.shape[3]).transpose(0, 1)
                        for t in (key, value))
        k, v = group.block.append(layer, new_k, new_v)
        q = q_rows.index_select(0, group.rows).view(n, -1, *q_rows.shape[1:]).transpose(1, 2)
        o, _ = sdpa_attention_forward(module, q, k, v, group.mask, dropout=0.0, scaling=scaling, is_causal=True)
        out.index_copy_(0, group.rows, o.flatten(0, 1))
    return out[None], None


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
    segments, start = [], 0
    for x, c in zip(rows, caches):
        segments.append(_Segment(start, len(x), c))
        start += len(x)
    if start < min_rows:  # pad: see the module docstring
        rows.append(torch.zeros(min_rows - start, rows[0].shape[1], dtype=rows[0].dtype, device=device))
        segments.append(_Segment(start, min_rows - start, None))
    flat = torch.cat(rows)[None]
    position_ids = _positions(segments, position_ids or [None] * len(inputs), rope_axes, device)
    extra = (_deepstack_inputs(deepstack, segments, device) if deepstack and any(d is not None for d in deepstack)
             else {})
    _step.groups = _groups(segments, device)
    try:
        out = model(inputs_embeds=flat, position_ids=position_ids, use_cache=False,
                    output_hidden_states=hidden_states, **extra)
    finally:
        _step.groups = ()
    real = segments[:len(inputs)]
    last = out.last_hidden_state[0].index_select(0, torch.tensor([s.start + s.length - 1 for s in real], device=device))
    if not hidden_states:
        return last, None
    per_seq = [tuple(h[0, s.start:s.start + s.length] for h in out.hidden_states) for s in real]
    return last, per_seq


def _positions(segments: list[_Segment], given: Sequence[torch.Tensor | None], rope_axes: int,
               device: torch.device) -> torch.Tensor:
    """Position ids of a step's rows, [1, rows] or [rope_axes, 1, rows]: a sequence's as `given`, or following
    its cache; padding rows from 0. One tensor made from a list when none is given (text): no op per sequence."""
    if all(g is None for g in given):
        p = torch.tensor([i for s in segments for i in range(s.past(), s.past() + s.length)], device=device)
        p = p if rope_axes == 0 else p.expand(rope_axes, -1)
    else:
        p = torch.cat([g if g is not None else positions(s.past(), s.length, rope_axes, device)
                       for s, g in itertools.zip_longest(segments, given)], dim=-1)
    return p[None] if rope_axes == 0 else p[:, None]


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
