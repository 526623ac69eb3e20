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

Sequences at different lengths would attend one group each. With `pad_to` (the Talker's), a sequence's
keys are read up to its length rounded up to a multiple of `pad_to` (its own length alone decides it), with
a bool mask hiding the rows past its own (zeros, never written) and the rows after each query: sequences
with as many new rows whose lengths round to the same multiple share one call, each at its own length in
its slot, and a sequence alone pads and masks just as it does in any group, so it gets the same numbers.

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
        return 0 if self._block is None else self._block.length(layer, self._slot)

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
    [slots, kv_heads, capacity, head_dim], each slot holding its own number of rows (all the same, unless
    the block is padded: `pad_to`).

    Capacity doubles when full, up to the most rows a member will ever hold (its `limit`; under a KV budget
    it grows by its members' `page` rows instead), so a step writes
    its new rows in place instead of copying the cache into a new tensor. Only the first `length` rows are
    read: the spare room never changes a number, and attention over a view of the buffers is bit for bit
    attention over a contiguous copy (checked in tests/unit/test_batching.py). A padded block's buffers are
    zeros past every slot's rows, and their capacity whole multiples of `pad_to`, so that each slot's keys
    can be read up to its padded length."""

    MIN_ROWS = 32  # the smallest capacity: a short prompt and its first tokens without regrowing

    def __init__(self, members: list[SequenceKV], pad_to: int | None = None) -> None:
        self.members = members  # by slot
        self.slots = len(members)
        self.page = members[0].page
        self.pad_to = pad_to
        limits = [m.limit for m in members]
        self.limit = None if None in limits else max(limits)  # the most rows a slot will ever need
        self.live = len(members)  # members that still hold it (not cleared, not moved to another block)
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}
        self._len: dict[int, list[int]] = {}  # per layer, the rows each slot holds

    @classmethod
    def of(cls, members: list[SequenceKV], pad_to: int | None = None) -> "_KvBlock":
        """The block whose slots are exactly `members` (of equal lengths, unless padded): theirs, or a new
        one their rows are copied into (one gather per layer from each block they come from)."""
        block = members[0]._block
        if block is not None and block.slots == len(members) and block.pad_to == pad_to and all(
                m is b and m._block is block for m, b in zip(members, block.members)):
            return block
        block = cls(members, pad_to)
        sources: dict[int, tuple[_KvBlock, list[int], list[int]]] = {}  # by block: (it, its slots, new slots)
        for i, m in enumerate(members):
            if m._block is not None:
                src = sources.setdefault(id(m._block), (m._block, [], []))
                src[1].append(m._slot)
                src[2].append(i)
        layers = sorted({layer for src, _, _ in sources.values() for layer in src._len})
        for layer in layers:
            lengths = [m.length(layer) for m in members]
            block._k[layer] = _gathered(sources.values(), layer, "_k", max(lengths), block)
            block._v[layer] = _gathered(sources.values(), layer, "_v", max(lengths), block)
            block._len[layer] = lengths
        for i, m in enumerate(members):
            m._leave()
            m._block, m._slot = block, i
        return block

    def length(self, layer: int, slot: int = 0) -> int:
        lengths = self._len.get(layer)
        return 0 if lengths is None else lengths[slot]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, at: torch.Tensor | None = None,
               read: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Add rows k, v [slots, kv_heads, n, head_dim], each slot's after its own rows (`at` [slots, n]:
        the rows they go to, where the slots hold different numbers); returns every slot's cache of `layer`
        up to `read` rows (by default its length), as [slots, kv_heads, read, head_dim] views."""
        n = k.shape[2]
        pasts = self._len.get(layer) or [0] * self.slots
        past, end = max(pasts), max(pasts) + n
        read = end if read is None else read
        buf_k = self._k.get(layer)
        if buf_k is None or max(end, read) > buf_k.shape[2]:
            self._k[layer] = buf_k = _grown(buf_k, k, past, max(end, read), self)
            self._v[layer] = _grown(self._v.get(layer), v, past, max(end, read), self)
        buf_v = self._v[layer]
        if at is None:  # every slot at the same row
            buf_k.narrow(2, past, n).copy_(k)
            buf_v.narrow(2, past, n).copy_(v)
        else:
            slots = torch.arange(self.slots, device=at.device)[:, None]
            buf_k[slots, :, at] = k.transpose(1, 2)
            buf_v[slots, :, at] = v.transpose(1, 2)
        self._len[layer] = [p + n for p in pasts]
        return buf_k.narrow(2, 0, read), buf_v.narrow(2, 0, read)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for d in (self._k, self._v) for t in d.values())


def _capacity(rows: int, block: "_KvBlock") -> int:
    """Rows to allocate for `rows`: as many again (at least MIN_ROWS) but no more than its members will ever
    hold, or under a budget whole pages; padded, a whole multiple of `pad_to`."""
    if block.page is not None:
        return -(-rows // block.page) * block.page
    grown = max(2 * rows, _KvBlock.MIN_ROWS)
    grown = grown if block.limit is None else max(rows, min(grown, block.limit))
    return grown if block.pad_to is None else _padded(grown, block.pad_to)


def _padded(rows: int, pad_to: int) -> int:
    return -(-rows // pad_to) * pad_to


def _new_buffer(like: torch.Tensor, slots: int, rows: int, block: _KvBlock) -> torch.Tensor:
    """[slots, kv_heads, capacity for `rows`, head_dim] like `like`: zeros when padded (rows past a slot's own
    are read, masked), uninitialised otherwise (never read)."""
    shape = (slots, like.shape[-3], _capacity(rows, block), like.shape[-1])
    return like.new_zeros(shape) if block.pad_to is not None else like.new_empty(shape)


def _gathered(sources, layer: int, which: str, rows: int, block: _KvBlock) -> torch.Tensor:
    """A buffer for `block` holding, in its new slots, the first `rows` rows (each slot's own, then zeros or
    nothing it reads) of its members' slots in the blocks they come from."""
    out = None
    for src, old, new in sources:
        buf = getattr(src, which)[layer]
        out = _new_buffer(buf, block.slots, rows, block) if out is None else out
        part = buf.narrow(2, 0, min(rows, buf.shape[2]))
        if len(old) == 1:
            out[new[0], :, :part.shape[2]] = part[old[0]]
        else:
            idx = torch.tensor(old, device=buf.device)
            out[torch.tensor(new, device=buf.device), :, :part.shape[2]] = part.index_select(0, idx)
    assert out is not None
    return out


def _grown(buf: torch.Tensor | None, new: torch.Tensor, past: int, end: int, block: _KvBlock) -> torch.Tensor:
    """A buffer shaped like `new` with room for `end` rows (`_capacity`), holding the first `past` rows of
    `buf`."""
    grown = _new_buffer(new, new.shape[0], end, block)
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
    mask: torch.Tensor | None  # new rows after a cached prefix: causal, aligned bottom-right (padded: per slot)
    at: torch.Tensor | None = None  # padded, slots at different lengths: the rows each slot's new rows go to
    read: int | None = None  # padded: the rows of keys every slot reads (its padded length)


def _groups(segments: list[_Segment], device: torch.device, pad_to: int | None = None) -> list[_Group]:
    """The step's sequences grouped by (new rows, cached rows), or with `pad_to` by (new rows, length after
    the step rounded up to a multiple of `pad_to`), on every device (stacked calls against lone ones: checked
    bit for bit in tests/unit/test_batching.py, its CUDA twin on a GPU only); padding rows are in none. A
    paged cache (under a KV budget) keeps a block of its own, so it is a group of its own, never padded."""
    by_shape: dict[tuple[int, ...], list[_Segment]] = {}
    for seg in segments:
        if seg.kv is None:
            continue
        if seg.kv.page is not None:
            key: tuple[int, ...] = (seg.length, seg.past(), 0, id(seg))
        elif pad_to is not None:
            key = (seg.length, _padded(seg.past() + seg.length, pad_to), 1)
        else:
            key = (seg.length, seg.past(), 0)
        by_shape.setdefault(key, []).append(seg)
    groups = []
    for (n, size, padded, *_), segs in by_shape.items():
        rows = torch.tensor([r for s in segs for r in range(s.start, s.start + n)], device=device)
        if padded:
            groups.append(_padded_group(segs, n, size, rows, pad_to, device))
            continue
        mask = None
        if n > 1 and size:
            mask = torch.ones(n, size + n, dtype=torch.bool, device=device).tril(size)[None, None]
        groups.append(_Group(_KvBlock.of([s.kv for s in segs]), rows, mask))
    return groups


def _padded_group(segs: list[_Segment], n: int, read: int, rows: torch.Tensor, pad_to: int | None,
                  device: torch.device) -> _Group:
    """A group of sequences with `n` new rows each whose keys are read up to `read` rows: each query row
    sees its own sequence's rows up to itself, none past them (a mask row per slot, the same alone)."""
    pasts = [s.past() for s in segs]
    past = torch.tensor(pasts, device=device)[:, None] + torch.arange(n, device=device)  # [slots, n]
    mask = (torch.arange(read, device=device) <= past[:, :, None])[:, None]  # [slots, 1, n, read]
    at = None if len(set(pasts)) == 1 else past
    return _Group(_KvBlock.of([s.kv for s in segs if s.kv is not None], pad_to), rows, mask, at, read)


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
        k, v = group.block.append(layer, new_k, new_v, group.at, group.read)
        q = q_rows.index_select(0, group.rows).view(n, -1, *q_rows.shape[1:]).transpose(1, 2)
        if group.read is None:
            o, _ = sdpa_attention_forward(module, q, k, v, group.mask, dropout=0.0, scaling=scaling, is_causal=True)
        else:
            o = padded_sdpa(module, q, k, v, group.mask, scaling)
        out.index_copy_(0, group.rows, o.flatten(0, 1))
    return out[None], None


def padded_sdpa(module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                scaling: float | None) -> torch.Tensor:
    """A padded group's attention ([slots, new rows, heads, head_dim]). On the CPU, SDPA with the mask groups
    the query heads over the KV heads itself (half the time of transformers' path, which repeats the keys
    and values for a masked call to keep CUDA off its math kernel); elsewhere transformers' path."""
    if q.device.type != "cpu":
        return sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=scaling, is_causal=True)[0]
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    return o.transpose(1, 2).contiguous()


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
                   deepstack: Sequence[tuple[torch.Tensor, list[torch.Tensor]] | None] | None = None,
                   pad_to: int | None = None):
    """One forward of a transformers decoder (`...Model`, not `...ForCausalLM`) over several sequences.

    `inputs[i]` are sequence i's new rows: token ids [n] when `embed` is given, else embeddings [n, H].
    `position_ids[i]`, where given, are its rows' positions ([rope_axes, n]; by default they follow its
    cache). `deepstack[i]`, where given, is (mask [n] of its visual rows, per decoder layer the rows
    added there): the model's deepstack inputs, laid out over the packed step. `pad_to`: each sequence's keys
    padded to a multiple of it and masked (the module docstring), so sequences at nearby lengths share an
    attention call.
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
    _step.groups = _groups(segments, device, pad_to)
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
