"""A request's class: the modalities it brings and those it asks for, e.g. "text+image->text+audio".

The stage planner sizes stages from the demand each class of request puts on each of them (a request's
units per stage, from its trace): requests of one class walk the same stages and do alike amounts of work
there, while a text-only answer skips the speech stages altogether. The class is a label on the
orchestrator's per-class counters (metrics.py), so it is drawn from a fixed vocabulary only, never from
what a client writes: at most 15 input sets times the pipeline's output sets.
"""

from __future__ import annotations

from typing import Iterable

from omnistage.contract.params import RequestParams

# The one order modalities are written in, on both sides of the arrow (the spec's output modalities are among
# them: tests/unit/test_request_class.py checks it).
MODALITY_ORDER = ("text", "image", "audio", "video")
_RANK = {m: i for i, m in enumerate(MODALITY_ORDER)}


def input_modalities(params: RequestParams) -> frozenset[str]:
    """What the request brings: text when it has a prompt (as text, token ids or text parts), and the kind of
    each media part."""
    kinds = {x.WhichOneof("part") for x in params.parts} - {None}
    if params.prompt or params.prompt_token_ids:
        kinds.add("text")
    return frozenset(kinds)


def joined(modalities: Iterable[str]) -> str:
    """Modalities "+"-joined in MODALITY_ORDER, each once."""
    return "+".join(sorted(set(modalities), key=lambda m: (_RANK.get(m, len(_RANK)), m)))


def request_class(params: RequestParams, outputs: Iterable[str]) -> str:
    """"<inputs>-><outputs>" for a request with `params` (resolved) asking for `outputs` (modality names)."""
    return f"{joined(input_modalities(params))}->{joined(outputs)}"
