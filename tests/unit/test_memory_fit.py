"""Whether a stage's memory plan fits where it runs (omnistage/checkpoints/fit.py): sizes as Kubernetes and
people write them, the room of a GPU stage (its fraction, vLLM's default, a torch engine's whole GPU, split
over tensor x pipeline parallel GPUs) and of a CPU stage with a memory limit, and the one-line refusal."""

from __future__ import annotations

import pytest

from omnistage.api import Stage, StageDeployment
from omnistage.api.memory_plan import parse_bytes
from omnistage.api.model import Parallelism, Resources
from omnistage.checkpoints.fit import misfit, room
from omnistage.checkpoints.plan import StagePlan

GiB = 1 << 30


@pytest.mark.parametrize("text, value", [("80Gi", 80 * GiB), ("80GiB", 80 * GiB), ("141G", 141 * 10**9),
                                         ("512Mi", 512 << 20), ("1.5Ti", int(1.5 * (1 << 40))), ("1024", 1024),
                                         (" 2 Gi ", 2 * GiB), (4096, 4096)])
def test_sizes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "lots", "80 GB GB", "-1Gi", "80Xi", "1e9"])
def test_not_sizes_are_named(text):
    with pytest.raises(ValueError, match="is not a size"):
        parse_bytes(text)


def _stage(engine="transformers", kind="ar") -> Stage:
    return Stage(name="talker", kind=kind, engine=engine, model="m", emits=("codes",))


def _plan(total: int, context=32768, batch=64) -> StagePlan:
    return StagePlan("talker", total, 1, context, batch, 0, 0, total)


def test_the_room_of_each_kind_of_stage():
    gpu = 80 * GiB
    assert room(_stage(), StageDeployment(gpus=1, gpu_memory_fraction=0.3), gpu).bytes == int(0.3 * gpu)
    assert room(_stage(), StageDeployment(gpus=1), gpu).bytes == gpu                     # a torch engine: all
    vllm = room(_stage("vllm"), StageDeployment(gpus=4, parallelism=Parallelism(tensor=2, pipeline=2)), gpu)
    assert (vllm.bytes, vllm.split) == (int(0.9 * gpu), 4)                               # vLLM's default 0.9
    assert room(_stage(), StageDeployment(gpus=1), None) is None                        # GPU memory unknown
    assert room(_stage(), StageDeployment(gpus=1, device="cpu"), gpu) is None            # CPU, no limit
    limited = StageDeployment(resources=Resources(limits={"memory": "8Gi"}))
    assert room(_stage(), limited, None).bytes == 8 * GiB


def test_a_plan_that_does_not_fit_is_one_line_with_the_numbers():
    dep = StageDeployment(gpus=1, gpu_memory_fraction=0.3)
    assert misfit(_plan(int(24 * GiB)), _stage(), dep, 80 * GiB) is None                # exactly full fits
    assert misfit(_plan(int(31.2 * GiB)), _stage(), dep, 80 * GiB) == (
        "talker needs 31.2 GiB at maxModelLen 32768 x maxBatch 64 per GPU; "
        "gpuMemoryFraction 0.3 of 80.0 GiB gives 24.0 GiB")
    split = StageDeployment(gpus=2, parallelism=Parallelism(tensor=2))
    assert misfit(_plan(150 * GiB), _stage("vllm"), split, 80 * GiB) == (
        "talker needs 75.0 GiB at maxModelLen 32768 x maxBatch 64 per GPU (split over 2); "
        "vLLM's default 0.9 of 80.0 GiB gives 72.0 GiB")
    cpu = StageDeployment(resources=Resources(limits={"memory": "2Gi"}))
    assert misfit(_plan(3 * GiB, context=0), _stage(kind="generation"), cpu, None) == (
        "talker needs 3.0 GiB; resources.limits.memory 2Gi gives 2.0 GiB")


def test_a_stage_with_a_kv_budget_needs_room_for_one_sequence_and_its_budget_bounds_the_rest():
    plan = StagePlan("talker", 10 * GiB, 1 << 20, 8192, 64, 64 * 8 * GiB, 2 * GiB, 532 * GiB, kv_bounded=True)
    shared = StageDeployment(gpus=1, gpu_memory_fraction=0.3)
    assert misfit(plan, _stage(), shared, 80 * GiB) is None  # 10 + 2 + 8 GiB of 24
    assert misfit(plan, _stage(), shared, 64 * GiB) == (
        "talker needs 20.0 GiB with one sequence at maxModelLen 8192 (its KV budget bounds the rest) per GPU; "
        "gpuMemoryFraction 0.3 of 64.0 GiB gives 19.2 GiB")
    whole = StageDeployment(gpus=1)  # no share: no budget from it, the whole plan must fit
    assert misfit(plan, _stage(), whole, 80 * GiB).startswith("talker needs 532.0 GiB at maxModelLen 8192 x maxBatch")
