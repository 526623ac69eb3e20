"""Whether a stage's memory plan fits where it runs: its share of its GPUs, or its container's memory limit.

Pure: the plans (`plan.py`), the deployment and the memory of one GPU in, one line per stage that does not
fit out, with the numbers (`talker needs 31.2 GiB at maxModelLen 32768 x maxBatch 64 per GPU;
gpuMemoryFraction 0.3 of 80 GiB gives 24 GiB`). `omnistage models check --plan` and `omnistage serve` refuse
a file with such a line before anything loads.

Where a stage runs:
- on GPUs (`gpus` > 0, device auto): each GPU holds the plan split over the replica's tensor x pipeline
  parallel GPUs (a vLLM stage; a torch engine uses one GPU), and gives the stage `gpuMemoryFraction` of
  itself (0: vLLM's default 0.9, the whole GPU for a torch engine);
- a transformers AR stage on a GPU share has a KV budget (the share less its weights and activations,
  stage_service/runtime/kv_budget.py): it needs room for those and one sequence at the whole context, and
  its budget bounds the rest (`plan.kv_bounded`);
- on the CPU with `resources.limits.memory`: the limit holds the whole plan (the process's own runtime,
  its Python and libraries, comes on top and is not planned);
- on the CPU without a limit: nothing to check.
"""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.api import Stage, StageDeployment
from omnistage.api.memory_plan import gib, parse_bytes
from omnistage.checkpoints.plan import StagePlan
from omnistage.contract.devices import uses_gpus

VLLM_DEFAULT_FRACTION = 0.9  # vLLM's gpu_memory_utilization when the stage sets no gpuMemoryFraction


@dataclass(frozen=True)
class Room:
    bytes: int         # what one GPU (or the container) gives the stage
    split: int         # GPUs the plan is split over (1 on the CPU)
    why: str           # how that room is found, for the refusal: "gpuMemoryFraction 0.3 of 80 GiB gives 24 GiB"


def room(stage: Stage, dep: StageDeployment, gpu_bytes: int | None) -> Room | None:
    """The memory the stage's plan must fit in, per GPU or container; None where there is nothing to check
    (a CPU stage without a memory limit, or a GPU stage when the GPU's memory is unknown)."""
    if uses_gpus(dep):
        if gpu_bytes is None:
            return None
        vllm = stage.engine == "vllm"
        split = dep.parallelism.tensor * dep.parallelism.pipeline if vllm else 1
        fraction = dep.gpu_memory_fraction or (VLLM_DEFAULT_FRACTION if vllm else 1.0)
        given = int(fraction * gpu_bytes)
        named = (f"gpuMemoryFraction {fraction:g}" if dep.gpu_memory_fraction
                 else f"vLLM's default {fraction:g}" if vllm else "the whole GPU")
        return Room(given, split, f"{named} of {gib(gpu_bytes)} gives {gib(given)}")
    limit = dep.resources.limits.get("memory")
    if limit is None:
        return None
    return Room(parse_bytes(limit), 1, f"resources.limits.memory {limit} gives {gib(parse_bytes(limit))}")


def misfit(plan: StagePlan, stage: Stage, dep: StageDeployment, gpu_bytes: int | None) -> str | None:
    """One line naming the stage and the numbers when its plan does not fit its room; None when it fits."""
    r = room(stage, dep, gpu_bytes)
    if r is None:
        return None
    total = plan.total_bytes
    if plan.kv_bounded and uses_gpus(dep) and dep.gpu_memory_fraction:
        # Its KV budget is what the share leaves beside the weights and activations: it needs room for one
        # sequence at the whole context (fewer at once, more queued or preempted, past that).
        total = plan.weights_bytes + plan.activation_bytes + min(plan.kv_bytes, plan.kv_bytes_per_token * plan.context)
    need = -(-total // r.split)
    if need <= r.bytes:
        return None
    at = f" at maxModelLen {plan.context} x maxBatch {plan.batch}" if plan.context else ""
    if total != plan.total_bytes:
        at = f" with one sequence at maxModelLen {plan.context} (its KV budget bounds the rest)"
    per = f" per GPU (split over {r.split})" if r.split > 1 else " per GPU" if uses_gpus(dep) else ""
    return f"{plan.stage} needs {gib(need)}{at}{per}; {r.why}"
