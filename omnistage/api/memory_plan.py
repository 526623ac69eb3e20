"""The memory plan as a pipeline carries it to the cluster: the annotation `omnistage.io/memory-plan`.

The plan is computed where the checkpoints are (`omnistage models check FILE --plan --annotate`, reading
configs and headers only) and travels in the manifest as JSON: `{"stage": bytes, ...}`, each stage's
planned total (weights, KV cache at its context and batch, activations). The operator reads no
checkpoints; with the annotation it requests that much memory for a CPU stage whose file sets no memory
request, and validation (the CLI's and the admission webhook's) refuses a CPU stage whose memory limit is
below its plan. Sizes in the spec are Kubernetes quantities (`parse_bytes`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

ANNOTATION_MEMORY_PLAN = "omnistage.io/memory-plan"
GIB = float(1 << 30)
_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
          "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?B?\s*$")


def parse_bytes(text: str | int) -> int:
    """A size as Kubernetes writes quantities (`80Gi`, `512M`, `1.5Ti`), also with a trailing B (`80GiB`)."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size (write e.g. 80Gi, 80GiB, 512M or a number of bytes)")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def memory_request(planned: int) -> str:
    """The memory request of a stage planned at `planned` bytes, as a quantity: whole MiB, rounded up."""
    return f"{-(-planned // (1 << 20))}Mi"


def planned_bytes(annotations: Any, stages: set[str] | frozenset[str]) -> dict[str, int]:
    """The plan an object's annotations carry, by stage (empty without one). ValueError names what is wrong:
    not JSON, not an object of stage names to positive byte counts, or a stage the pipeline does not have."""
    raw = annotations.get(ANNOTATION_MEMORY_PLAN) if isinstance(annotations, Mapping) else None
    if raw is None:
        return {}
    try:
        plan = json.loads(raw) if isinstance(raw, str) else None
    except ValueError as e:
        raise ValueError(f"is not JSON ({e})") from None
    if not isinstance(plan, dict) or not all(type(v) is int and v > 0 for v in plan.values()):
        raise ValueError('must be a JSON object of stage names to planned bytes (positive integers), as '
                         '`omnistage models check FILE --plan --annotate` writes it')
    unknown = sorted(set(plan) - set(stages))
    if unknown:
        raise ValueError(f"names stages the pipeline does not have: {', '.join(unknown)}")
    return plan


def annotate(doc: dict, plan: Mapping[str, int]) -> dict:
    """`doc` (an OmniPipeline document) with the plan in its annotations, in place; returns it."""
    meta = doc.setdefault("metadata", {})
    meta.setdefault("annotations", {})[ANNOTATION_MEMORY_PLAN] = json.dumps(dict(plan), separators=(",", ":"))
    return doc
