"""Which GPUs each stage replica of `omnistage serve` gets: the machine's GPUs, the assignment, its lines.

`machine_gpus` finds the GPUs the launcher may hand out; `assign_gpus` is the pure assignment, table-tested:
for every stage replica (stage, replica index) the tuple of GPU ids its process is given as
CUDA_VISIBLE_DEVICES (empty: the CPU). The memory fraction itself is enforced inside the stage process
(`stage_service/runtime/device.py`, vLLM's gpu_memory_utilization); here it only decides who may share.

Rules:
- A replica of a stage with `gpus: 0` or `device: cpu` gets no GPU.
- `gpuMemoryFraction: 0` (the whole GPU): the replica gets `gpus` GPUs nobody else uses, in stage order,
  lowest ids first.
- `gpuMemoryFraction` f > 0: the replica needs `gpus` distinct GPUs on each of which f is still free. It
  shares them with other shared replicas, never with a whole-GPU one; the fractions on a GPU add up to at
  most 1 (counted in millionths, so 0.1 + 0.2 + 0.7 fits exactly). Packing is first-fit decreasing (largest
  fraction first, then most GPUs, then stage order), lowest free ids first; where first fit leaves one out
  a bounded depth-first search tries the other choices, so a file is refused only when no packing exists.
- A file that asks for more than the machine has is refused with one GpuPlacementError naming what it asks
  for in total, what the machine has and each stage's part.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from omnistage.api import StageDeployment
from omnistage.contract.devices import uses_gpus

ENV_VISIBLE = "CUDA_VISIBLE_DEVICES"
ENV_DEVICE_ORDER = "CUDA_DEVICE_ORDER"
ENV_GPUS = "OMNISTAGE_GPUS"        # override: the machine has this many GPUs, ids 0..N-1 (tests; odd drivers)
ENV_GPU_MEMORY = "OMNISTAGE_GPU_MEMORY"  # override: the memory of each GPU (80Gi), for the memory plan's check
NVIDIA_SMI = "nvidia-smi"
PCI_ORDER = "PCI_BUS_ID"           # nvidia-smi numbers GPUs in PCI bus order; CUDA's default is fastest first
UNITS = 1_000_000                  # a whole GPU, in the millionths shares are counted in
SEARCH_BUDGET = 20_000             # placements the search tries past first fit before it gives up

ReplicaKey = tuple[str, int]       # (stage name, replica index)


class GpuPlacementError(ValueError):
    """The pipeline asks for GPUs this machine does not have."""


@dataclass(frozen=True)
class MachineGpus:
    ids: tuple[str, ...]           # as a child's CUDA_VISIBLE_DEVICES names them
    source: str                    # how they were found, for messages: "CUDA_VISIBLE_DEVICES=0,1", "nvidia-smi -L"
    device_order: str | None = None  # CUDA_DEVICE_ORDER the ids assume (None: the parent's)

    def describe(self) -> str:
        return f"{len(self.ids)} GPU{'' if len(self.ids) == 1 else 's'} ({self.source})"


def machine_gpus(environ: Mapping[str, str] | None = None,
                 run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> MachineGpus:
    """The GPUs serve may hand out, without touching CUDA in the launcher.

    In order: OMNISTAGE_GPUS=N (an explicit count); the parent's CUDA_VISIBLE_DEVICES when set (its ids, as
    the user restricted them; set and empty: none); `nvidia-smi -L` when on PATH (the driver's own list, in
    PCI order, MIG instances by UUID; it needs neither torch nor CUDA in the launcher, whose CUDA context
    would hold memory on GPU 0 while the stages load); torch.cuda.device_count() only when torch is already
    imported (importing it just to count costs seconds; serve's model check has imported it, so a machine
    with CUDA but no nvidia-smi, as some containers are, is still counted); otherwise none.
    """
    env = os.environ if environ is None else environ
    if env.get(ENV_GPUS) is not None:
        n = env[ENV_GPUS].strip()
        if not n.isdigit():
            raise GpuPlacementError(f"{ENV_GPUS}={env[ENV_GPUS]!r}: expected a count of GPUs (0, 1, 2, ...)")
        return MachineGpus(tuple(str(i) for i in range(int(n))), f"{ENV_GPUS}={n}")
    if env.get(ENV_VISIBLE) is not None:
        return MachineGpus(visible_ids(env[ENV_VISIBLE]), f"{ENV_VISIBLE}={env[ENV_VISIBLE]}")
    if shutil.which(NVIDIA_SMI, path=env.get("PATH")):
        try:
            out = run([NVIDIA_SMI, "-L"], capture_output=True, text=True, timeout=15)
        except (OSError, subprocess.TimeoutExpired) as e:
            return MachineGpus((), f"{NVIDIA_SMI} -L failed: {e}")
        if out.returncode != 0:   # no driver loaded: no GPU to hand out
            why = (out.stderr or out.stdout).strip().splitlines()[:1]
            return MachineGpus((), f"{NVIDIA_SMI} -L exited {out.returncode}{': ' + why[0] if why else ''}")
        return MachineGpus(smi_ids(out.stdout), f"{NVIDIA_SMI} -L", PCI_ORDER)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return MachineGpus(tuple(str(i) for i in range(torch.cuda.device_count())), "torch.cuda.device_count()")
    return MachineGpus((), f"no {ENV_VISIBLE}, no {NVIDIA_SMI}")


def gpu_memory(environ: Mapping[str, str] | None = None,
               run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> int | None:
    """Bytes of the smallest GPU of the machine, for the memory plan's check; None when unknown. In order:
    OMNISTAGE_GPU_MEMORY (a size: 80Gi); `nvidia-smi --query-gpu=memory.total` (MiB); torch's device
    properties only when torch is already imported; otherwise None (GPU stages are then not checked)."""
    from omnistage.api.memory_plan import parse_bytes

    env = os.environ if environ is None else environ
    if env.get(ENV_GPU_MEMORY):
        try:
            return parse_bytes(env[ENV_GPU_MEMORY])
        except ValueError as e:
            raise GpuPlacementError(f"{ENV_GPU_MEMORY}: {e}") from None
    if shutil.which(NVIDIA_SMI, path=env.get("PATH")):
        try:
            out = run([NVIDIA_SMI, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                      capture_output=True, text=True, timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            return None
        sizes = [int(x) for x in out.stdout.split() if x.strip().isdigit()] if out.returncode == 0 else []
        return min(sizes) << 20 if sizes else None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    return None


def visible_ids(value: str) -> tuple[str, ...]:
    """The devices a CUDA_VISIBLE_DEVICES value names: as CUDA reads it, a negative entry hides it and the rest."""
    ids = []
    for part in value.split(","):
        part = part.strip()
        if not part or part.startswith("-"):
            break
        ids.append(part)
    return tuple(ids)


_SMI_GPU = re.compile(r"^GPU (\d+):")
_SMI_MIG = re.compile(r"^\s+MIG .*\(UUID: (MIG-[^)]+)\)")


def smi_ids(listing: str) -> tuple[str, ...]:
    """The ids in `nvidia-smi -L` output: a GPU's index, or the UUIDs of its MIG instances where it is split
    (CUDA_VISIBLE_DEVICES names a MIG instance by UUID only)."""
    ids: list[str] = []
    for line in listing.splitlines():
        if m := _SMI_GPU.match(line):
            ids.append(m.group(1))
        elif m := _SMI_MIG.match(line):
            if ids and not ids[-1].startswith("MIG-"):
                ids.pop()   # its parent GPU: split into instances, not itself a device
            ids.append(m.group(1))
    return tuple(ids)


# ---------------------------------------------------------------- the assignment

@dataclass(frozen=True)
class _Demand:
    key: ReplicaKey
    gpus: int
    share: int        # millionths of each GPU; 0: whole GPUs


def assign_gpus(deployments: Mapping[str, StageDeployment], gpus: Sequence[str] | MachineGpus,
                replicas: Mapping[str, int] | None = None) -> dict[ReplicaKey, tuple[str, ...]]:
    """Every stage replica's GPU ids, in stage order. `deployments`: stage name -> its deployment, in the
    pipeline's stage order; `gpus`: the machine's GPU ids; `replicas`: the replicas each stage runs (default:
    each deployment's). Raises GpuPlacementError when the GPUs asked for do not fit."""
    machine = gpus if isinstance(gpus, MachineGpus) else MachineGpus(tuple(gpus), ",".join(gpus) or "none")
    counts = {name: (replicas or {}).get(name, sd.replicas) for name, sd in deployments.items()}
    out: dict[ReplicaKey, tuple[str, ...]] = {}
    demands: list[_Demand] = []
    for name, sd in deployments.items():
        for i in range(counts[name]):
            out[(name, i)] = ()
            if uses_gpus(sd):
                share = max(1, round(sd.gpu_memory_fraction * UNITS)) if sd.gpu_memory_fraction else 0
                demands.append(_Demand((name, i), sd.gpus, share))
    whole = [d for d in demands if d.share == 0]
    need_whole = sum(d.gpus for d in whole)
    if need_whole > len(machine.ids):
        raise GpuPlacementError(_refusal(deployments, counts, machine, "the whole ones alone do not fit"))
    free = list(machine.ids)
    for d in whole:
        out[d.key], free = tuple(free[:d.gpus]), free[d.gpus:]
    shared = sorted((d for d in demands if d.share), key=lambda d: (-d.share, -d.gpus))  # stable: stage order
    packed = _pack(shared, len(free))
    if packed is None:
        left = f"the {len(free)} GPU{'' if len(free) == 1 else 's'} the whole ones leave" if whole else "them"
        raise GpuPlacementError(_refusal(deployments, counts, machine,
                                         f"the shared ones do not fit on {left} (the fractions on a GPU add up "
                                         "to at most 1, and a replica's GPUs are distinct)"))
    for d, slots in zip(shared, packed):
        out[d.key] = tuple(free[j] for j in slots)
    return out


def _pack(demands: Sequence[_Demand], n: int) -> list[tuple[int, ...]] | None:
    """For each demand the indices of its GPUs among `n` free ones, or None when they cannot be packed.
    Depth-first in first-fit order (a loop, not recursion: a stage may have hundreds of replicas): its first
    complete answer is first-fit decreasing's whenever that fits."""
    used = [0] * n

    def choices(d: _Demand):
        room = [j for j in range(n) if used[j] + d.share <= UNITS]
        for combo in itertools.combinations(room, d.gpus):
            # GPUs with the same load are interchangeable: only the lowest-indexed of each load are tried
            if all(used[k] != used[j] or k in combo for j in combo for k in room if k < j):
                yield combo

    chosen: list[tuple[int, ...]] = []                        # for demands[0 .. len(chosen) - 1]
    tries = [choices(demands[0])] if demands else []          # for demands[len(chosen)]
    budget = SEARCH_BUDGET
    while len(chosen) < len(demands):
        combo = next(tries[-1], None)
        if combo is None:                                     # nothing left for this demand: back up one
            tries.pop()
            if not chosen:
                return None
            for j in chosen.pop():
                used[j] -= demands[len(chosen)].share
            continue
        budget -= 1
        if budget < 0:
            return None
        for j in combo:
            used[j] += demands[len(chosen)].share
        chosen.append(combo)
        if len(chosen) < len(demands):
            tries.append(choices(demands[len(chosen)]))
    return chosen


def _share(x: float) -> str:
    return f"{round(x, 3):g}"


def _refusal(deployments: Mapping[str, StageDeployment], counts: Mapping[str, int], machine: MachineGpus,
             why: str) -> str:
    """One message: what the file asks for in total, what the machine has, why it does not fit, each stage's part."""
    whole = shared = replicas = 0
    parts = []
    for name, sd in deployments.items():
        n = counts[name]
        if not uses_gpus(sd) or n == 0:
            continue
        replicas += n
        if sd.gpu_memory_fraction:
            shared += n * sd.gpus * sd.gpu_memory_fraction
            parts.append(f"{name} {n} x {sd.gpus} at {_share(sd.gpu_memory_fraction)}")
        else:
            whole += n * sd.gpus
            parts.append(f"{name} {n} x {sd.gpus} whole")
    asks = f"{whole} whole GPU{'' if whole == 1 else 's'}"
    if shared:
        asks += f" and {_share(shared)} of shared ones"
    return (f"the pipeline asks for {asks} across {replicas} stage replica{'' if replicas == 1 else 's'}; this "
            f"machine has {machine.describe()}: {why}. Per stage (replicas x GPUs each): {', '.join(parts)}. "
            "Set device: cpu on a stage, lower its gpus or replicas, or let stages share a GPU with "
            "gpuMemoryFraction")


def assignment_lines(deployments: Mapping[str, StageDeployment],
                     assignment: Mapping[ReplicaKey, tuple[str, ...]]) -> list[str]:
    """What serve prints, one line per stage replica (`gpu  talker/0 -> GPU 1 (0.4)`); none when no replica
    has a GPU."""
    if not any(assignment.values()):
        return []
    lines = []
    for (stage, i), ids in assignment.items():
        sd = deployments[stage]
        if not ids:
            where = "CPU"
        else:
            share = f"{_share(sd.gpu_memory_fraction)}" if sd.gpu_memory_fraction else "whole"
            where = f"GPU{'s' if len(ids) > 1 else ''} {','.join(ids)} ({share})"
        lines.append(f"gpu  {stage}/{i} -> {where}")
    return lines


def replica_env(ids: tuple[str, ...] = (), machine: MachineGpus | None = None) -> dict[str, str]:
    """A process's device environment: its GPUs only (none: "", so a CPU stage never touches a GPU)."""
    env = {ENV_VISIBLE: ",".join(ids)}
    if ids and machine is not None and machine.device_order:
        env[ENV_DEVICE_ORDER] = machine.device_order
    return env
