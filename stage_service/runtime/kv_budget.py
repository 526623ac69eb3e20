"""A stage's KV memory budget: how big it is, what a sequence holds in it, whom to admit and whom to preempt.

Pure policy, no tensors. The budget is in bytes: `engineArgs.kvCacheBytes`, or on a GPU the stage's
`gpuMemoryFraction` of the GPU's memory less the loaded weights and its largest step's activations (as the
memory plan counts them); neither given: unbounded (admission by
`maxBatch` alone). Under a budget every sequence's cache grows by whole pages of `KV_PAGE_TOKENS` tokens
(`packed.SequenceKV`), so what it reserves is what it really allocates: `KvPages.bytes_for(tokens)`.

The scheduler (`scheduler.py`) asks each state the KV bytes it will hold after its next step. Admission:
a queued state joins only while the running states' bytes after their next step plus its own fit.
Preemption by recompute, as vLLM does: before a step whose running states would outgrow the budget, the
most recently admitted ones that can be recomputed drop their KV and go back to the front of the queue;
readmitted, they prefill their prompt and the tokens they generated again and go on from there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# Tokens per page of a cache under a budget: at most a page of spare room per sequence. Each new page regrows
# the cache (a copy of its rows, per layer): a 32k-token sequence regrows 2048 times where doubling would
# regrow some 10; the price of knowing before a step what it will hold.
KV_PAGE_TOKENS = 16


@dataclass(frozen=True)
class KvPages:
    """How a sequence's cache is sized under a budget: `per_token` bytes (every layer's keys and values),
    allocated `page` tokens at a time."""

    per_token: int
    page: int = KV_PAGE_TOKENS

    def bytes_for(self, tokens: int) -> int:
        """Bytes a cache holding `tokens` tokens allocates: whole pages."""
        return -(-tokens // self.page) * self.page * self.per_token


def resolve_budget(stage: str, kv_cache_bytes: int | None, memory_fraction: float, total_memory: int | None,
                   weights_bytes: int, activation_bytes: int = 0) -> int | None:
    """The stage's KV budget in bytes: `kv_cache_bytes` when given; else on a GPU (`total_memory` is its
    bytes, None off a GPU) with a `memory_fraction`, that share of it less the weights and the activations
    of its largest step (the memory plan's, `omnistage.checkpoints.plan.ar_plan`); else None (unbounded). A
    fraction the weights and activations alone fill is an error naming the field."""
    if kv_cache_bytes is not None:
        return kv_cache_bytes
    if total_memory is None or not memory_fraction:
        return None
    budget = int(memory_fraction * total_memory) - weights_bytes - activation_bytes
    if budget <= 0:
        raise ValueError(f"spec.deployment.stages.{stage}.gpuMemoryFraction: {memory_fraction:g} of the GPU's "
                         f"{total_memory} bytes leaves no room for the KV cache beside the weights "
                         f"({weights_bytes} bytes) and the activations of its largest step ({activation_bytes} "
                         "bytes); raise it, bound a step's tokens (engineArgs.max_num_batched_tokens) or set "
                         "engineArgs.kvCacheBytes")
    return budget


def admits(running_next: Sequence[int], candidate_next: int, budget: int) -> bool:
    """Whether a queued state whose KV after its first step is `candidate_next` bytes may join running states
    that hold `running_next` bytes after their next step. With none running it always may (a state that could
    never fit alone is refused before it queues), so nothing waits forever."""
    return not running_next or sum(running_next) + candidate_next <= budget


def to_preempt(running_next: Sequence[int], preemptible: Sequence[bool], budget: int,
               keep_oldest: bool = True) -> list[int]:
    """Indices (running states in admission order, oldest first) to preempt so that the rest fit `budget` after
    their next step: the most recently admitted that can be recomputed first. The oldest running state only
    where one that cannot be recomputed runs too: that one reserved the most it will ever hold when it was
    admitted (its `kv_bytes_next`), so once every other is preempted the rest fit, and it always makes
    progress; else the oldest always stays (it is the one that makes progress), unless not `keep_oldest` (the
    budget is what others out of the running set leave: they make progress when they come back). Empty when
    they fit, or when nothing more can be preempted."""
    total, out = sum(running_next), []
    last = 0 if not all(preemptible) or not keep_oldest else 1
    for i in range(len(running_next) - 1, last - 1, -1):
        if total <= budget:
            break
        if preemptible[i]:
            out.append(i)
            total -= running_next[i]
    return out


def never_fits(stage: str, tokens: int, pages: KvPages, budget: int) -> str | None:
    """Why a sequence whose KV reaches `tokens` tokens can never run under `budget` (None: it can)."""
    need = pages.bytes_for(tokens)
    if need <= budget:
        return None
    return (f"needs {need} bytes of KV cache ({tokens} tokens x {pages.per_token} bytes per token, in pages of "
            f"{pages.page} tokens), more than stage {stage}'s whole KV budget of {budget} bytes "
            f"(engineArgs.kvCacheBytes or gpuMemoryFraction): lower max_tokens or shorten the prompt")
