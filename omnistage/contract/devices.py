"""Which device and dtype a stage's engine runs on: one rule for every engine, pure, table-tested.

A stage with `gpus > 0` runs on CUDA; where its process finds no CUDA device (or fewer than it asks
for) it refuses to start, naming the field, unless its deployment says `device: cpu`. A stage with
`gpus: 0` runs on the CPU. dtype `auto` is bfloat16 on a GPU and float32 on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.api import StageDeployment

CPU, CUDA = "cpu", "cuda"
AUTO_DTYPE = {CUDA: "bfloat16", CPU: "float32"}


class DeviceUnavailable(ValueError):
    """The deployment asks for GPUs this process does not have."""


@dataclass(frozen=True)
class DevicePlan:
    device: str                    # "cuda" or "cpu"
    dtype: str                     # "float32", "bfloat16" or "float16"
    gpus: int = 0                  # CUDA devices the engine uses (0 on the CPU)
    memory_fraction: float = 0.0   # of each GPU; 0: the whole GPU

    @property
    def on_cuda(self) -> bool:
        return self.device == CUDA


def uses_gpus(sd: StageDeployment) -> bool:
    """Whether the spec puts the stage's engine on GPUs: it has some and is not pinned to the CPU."""
    return sd.gpus > 0 and sd.device != CPU


def plan_device(stage: str, sd: StageDeployment, cuda_devices: int) -> DevicePlan:
    """The device and dtype of `stage`'s engine given the CUDA devices its process sees."""
    path = f"spec.deployment.stages.{stage}"
    if not uses_gpus(sd):
        dtype = AUTO_DTYPE[CPU] if sd.dtype == "auto" else sd.dtype
        return DevicePlan(CPU, dtype)
    if cuda_devices < sd.gpus:
        seen = "no CUDA device" if cuda_devices == 0 else f"only {cuda_devices} CUDA device(s)"
        raise DeviceUnavailable(f"{path}.gpus asks for {sd.gpus} GPU(s) but this process sees {seen} (check "
                                f"CUDA_VISIBLE_DEVICES and the driver); set {path}.device: cpu to run it on the CPU")
    dtype = AUTO_DTYPE[CUDA] if sd.dtype == "auto" else sd.dtype
    return DevicePlan(CUDA, dtype, sd.gpus, sd.gpu_memory_fraction)
