"""The torch side of a stage's device plan (`omnistage.contract.devices`): what the engine sees and applies."""

from __future__ import annotations

import torch

from omnistage.api import StageDeployment
from omnistage.contract.devices import DevicePlan, DeviceUnavailable, plan_device
from stage_service.runtime.errors import EngineConfigError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def cuda_devices() -> int:
    """CUDA devices this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve(stage: str, sd: StageDeployment) -> DevicePlan:
    """The stage's plan on this host; a stage asking for GPUs it cannot have is an EngineConfigError."""
    try:
        return plan_device(stage, sd, cuda_devices())
    except DeviceUnavailable as e:
        raise EngineConfigError(str(e)) from None


def apply(plan: DevicePlan) -> None:
    """Bound the process's CUDA memory to the plan's fraction of each GPU it uses (torch engines)."""
    if plan.on_cuda and plan.memory_fraction:
        for i in range(plan.gpus):
            torch.cuda.set_per_process_memory_fraction(plan.memory_fraction, i)


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of a loaded model's parameters and buffers (what its KV budget is left after, kv_budget.py)."""
    return sum(stored_bytes(t) for t in [*model.parameters(), *model.buffers()])


def stored_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor really holds: a tensor subclass that wraps others (torchao's int8 weight: its int8 data
    and scales) reports its logical dtype's size as `nbytes`, so its inner tensors are counted instead."""
    inner = getattr(t, "__tensor_flatten__", None)
    if inner is None or type(t) in (torch.Tensor, torch.nn.Parameter):
        return t.nbytes
    names, _ = inner()
    return sum(stored_bytes(getattr(t, name)) for name in names)


def gpu_bytes(where: torch.device) -> int | None:
    """Total memory of the GPU at `where`; None off a GPU."""
    return torch.cuda.get_device_properties(where).total_memory if where.type == "cuda" else None
