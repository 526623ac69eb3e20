"""The local GPU assignment of `omnistage serve`: table tests, invariants, how the machine's GPUs are found,
and the environment each stage replica process gets (no process started)."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnistage.api import StageDeployment
from omnistage.local.gpu_placement import (
    ENV_DEVICE_ORDER,
    ENV_GPU_MEMORY,
    ENV_GPUS,
    ENV_VISIBLE,
    PCI_ORDER,
    GpuPlacementError,
    MachineGpus,
    assign_gpus,
    assignment_lines,
    gpu_memory,
    machine_gpus,
    replica_env,
    smi_ids,
    visible_ids,
)
from omnistage.local.serve import LaunchError, LocalPipeline

from ..harness import example

GPUS_2 = ("0", "1")
GPUS_4 = ("0", "1", "2", "3")


def sd(gpus: int = 0, fraction: float = 0.0, replicas: int = 1, device: str = "auto") -> StageDeployment:
    return StageDeployment(gpus=gpus, gpu_memory_fraction=fraction, replicas=replicas, device=device)


# (case, stage deployments in stage order, machine's GPUs, expected assignment)
PLACED = [
    ("exclusive: whole GPUs in stage order, lowest ids first",
     {"a": sd(1), "b": sd(1)}, GPUS_2, {("a", 0): ("0",), ("b", 0): ("1",)}),
    ("CPU stages get nothing, on a machine without GPUs too",
     {"a": sd(0), "b": sd(0, replicas=2)}, (), {("a", 0): (), ("b", 0): (), ("b", 1): ()}),
    ("device: cpu is not placed whatever gpus says",
     {"a": sd(1, device="cpu"), "b": sd(1)}, ("7",), {("a", 0): (), ("b", 0): ("7",)}),
    ("shared fractions summing to 1 exactly (counted in millionths: 0.1 + 0.2 + 0.7 fits)",
     {"a": sd(1, 0.1), "b": sd(1, 0.2), "c": sd(1, 0.7)}, ("0",),
     {("a", 0): ("0",), ("b", 0): ("0",), ("c", 0): ("0",)}),
    ("largest fractions first: 0.7 and 0.3 pair up, 0.6 and 0.4 pair up",
     {"a": sd(1, 0.3), "b": sd(1, 0.6), "c": sd(1, 0.7), "d": sd(1, 0.4)}, GPUS_2,
     {("a", 0): ("0",), ("b", 0): ("1",), ("c", 0): ("0",), ("d", 0): ("1",)}),
    ("mixed: whole GPUs first, the shared ones on what is left",
     {"thinker": sd(1, 0.5), "talker": sd(1, 0.5), "code2wav": sd(1)}, GPUS_2,
     {("thinker", 0): ("1",), ("talker", 0): ("1",), ("code2wav", 0): ("0",)}),
    ("replicas > 1: each replica its own whole GPU",
     {"a": sd(1, replicas=3)}, GPUS_4, {("a", 0): ("0",), ("a", 1): ("1",), ("a", 2): ("2",)}),
    ("replicas > 1 sharing: 0.5 each, two per GPU",
     {"a": sd(1, 0.5, replicas=3)}, GPUS_2, {("a", 0): ("0",), ("a", 1): ("0",), ("a", 2): ("1",)}),
    ("gpus 2 per replica, whole",
     {"llm": sd(2, replicas=2)}, GPUS_4, {("llm", 0): ("0", "1"), ("llm", 1): ("2", "3")}),
    ("gpus 2 per replica with a fraction: two distinct GPUs with room",
     {"llm": sd(2, 0.5), "enc": sd(1, 0.5)}, GPUS_2, {("llm", 0): ("0", "1"), ("enc", 0): ("0",)}),
    ("ids as CUDA_VISIBLE_DEVICES named them are handed on",
     {"a": sd(1), "b": sd(1, 0.3)}, ("2", "GPU-abc"), {("a", 0): ("2",), ("b", 0): ("GPU-abc",)}),
    ("first fit strands the 0.2 (0.5+0.4 | 0.3x3): the search finds 0.5+0.3+0.2 | 0.4+0.3+0.3",
     {"a": sd(1, 0.5), "b": sd(1, 0.4), "c": sd(1, 0.3, replicas=3), "d": sd(1, 0.2)}, GPUS_2,
     {("a", 0): ("0",), ("b", 0): ("1",), ("c", 0): ("0",), ("c", 1): ("1",), ("c", 2): ("1",), ("d", 0): ("0",)}),
]


@pytest.mark.parametrize("case,deployments,gpus,expected", PLACED, ids=[c[0] for c in PLACED])
def test_placed(case, deployments, gpus, expected):
    assert assign_gpus(deployments, gpus) == expected


# (case, stage deployments, machine's GPUs, what the message says)
REFUSED = [
    ("over-subscription by whole GPUs",
     {"a": sd(1, replicas=2), "b": sd(1)}, GPUS_2,
     ["asks for 3 whole GPUs across 3 stage replicas", "this machine has 2 GPUs", "a 2 x 1 whole", "b 1 x 1 whole"]),
    ("over-subscription by fractions",
     {"a": sd(1, 0.6), "b": sd(1, 0.5)}, ("0",),
     ["asks for 0 whole GPUs and 1.1 of shared ones across 2 stage replicas", "this machine has 1 GPU",
      "do not fit", "a 1 x 1 at 0.6, b 1 x 1 at 0.5"]),
    ("fractions whose total fits but that cannot be packed (0.6 three times on two GPUs)",
     {"a": sd(1, 0.6, replicas=3)}, ("0", "1"), ["1.8 of shared ones", "has 2 GPUs", "a 3 x 1 at 0.6"]),
    ("mixed: the whole GPU leaves too little for the shared ones",
     {"a": sd(1), "b": sd(1, 0.6), "c": sd(1, 0.6)}, GPUS_2,
     ["1 whole GPU and 1.2 of shared ones across 3 stage replicas", "the 1 GPU the whole ones leave"]),
    ("a shared replica needs 2 distinct GPUs",
     {"llm": sd(2, 0.3)}, ("0",), ["0.6 of shared ones", "has 1 GPU", "llm 1 x 2 at 0.3"]),
    ("zero GPUs machine with a GPU stage",
     {"llm": sd(1), "cpu": sd(1, device="cpu")}, (), ["asks for 1 whole GPU across 1 stage replica",
                                                      "this machine has 0 GPUs", "llm 1 x 1 whole"]),
]


@pytest.mark.parametrize("case,deployments,gpus,says", REFUSED, ids=[c[0] for c in REFUSED])
def test_refused(case, deployments, gpus, says):
    with pytest.raises(GpuPlacementError) as e:
        assign_gpus(deployments, gpus)
    for part in says:
        assert part in str(e.value)
    assert "\n" not in str(e.value)


def test_the_refusal_names_how_the_machine_s_gpus_were_found():
    machine = MachineGpus(GPUS_2, f"{ENV_VISIBLE}=0,1")
    with pytest.raises(GpuPlacementError, match=r"this machine has 2 GPUs \(CUDA_VISIBLE_DEVICES=0,1\)"):
        assign_gpus({"a": sd(1, replicas=3)}, machine)


def test_replica_counts_override_the_deployments():
    assert assign_gpus({"a": sd(1)}, GPUS_2, {"a": 2}) == {("a", 0): ("0",), ("a", 1): ("1",)}
    with pytest.raises(GpuPlacementError, match="3 whole GPUs"):
        assign_gpus({"a": sd(1)}, GPUS_2, {"a": 3})


def test_deterministic_and_stable_by_stage_order():
    deployments = {"a": sd(1, 0.4, replicas=2), "b": sd(1, 0.4), "c": sd(1, 0.2, replicas=3), "d": sd(1)}
    first = assign_gpus(deployments, GPUS_4)
    assert all(assign_gpus(deployments, GPUS_4) == first for _ in range(5))
    assert list(first) == [("a", 0), ("a", 1), ("b", 0), ("c", 0), ("c", 1), ("c", 2), ("d", 0)]
    # the whole GPU first; equal fractions fill in stage order: a's two replicas on GPU 1, b's on GPU 2
    assert first[("d", 0)] == ("0",) and first[("a", 0)] == first[("a", 1)] == ("1",) and first[("b", 0)] == ("2",)


def test_printed_lines_one_per_stage_replica_only_when_some_stage_has_gpus():
    deployments = {"thinker": sd(1), "talker": sd(1, 0.4, replicas=2), "vae": sd(0)}
    assignment = assign_gpus(deployments, GPUS_2)
    assert assignment_lines(deployments, assignment) == [
        "gpu  thinker/0 -> GPU 0 (whole)", "gpu  talker/0 -> GPU 1 (0.4)", "gpu  talker/1 -> GPU 1 (0.4)",
        "gpu  vae/0 -> CPU"]
    two = {"llm": sd(2)}
    assert assignment_lines(two, assign_gpus(two, GPUS_2)) == ["gpu  llm/0 -> GPUs 0,1 (whole)"]
    cpu = {"a": sd(0), "b": sd(1, device="cpu")}
    assert assignment_lines(cpu, assign_gpus(cpu, GPUS_2)) == []


# ---------------------------------------------------------------- invariants

stage_deployments = st.lists(
    st.tuples(st.integers(0, 3),                                              # gpus
              st.sampled_from([0.0, 0.1, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.75, 1.0]),  # fraction
              st.integers(1, 3),                                              # replicas
              st.sampled_from(["auto", "auto", "cpu"])),
    min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(stage_deployments, st.integers(0, 6))
def test_placement_invariants(stages, n_gpus):
    deployments = {f"s{i}": sd(g, f if g else 0.0, r, dev) for i, (g, f, r, dev) in enumerate(stages)}
    gpus = tuple(str(i) for i in range(n_gpus))
    try:
        assignment = assign_gpus(deployments, gpus)
    except GpuPlacementError:
        whole = sum(d.gpus * d.replicas for d in deployments.values()
                    if d.gpus and d.device != "cpu" and not d.gpu_memory_fraction)
        shared = sum(d.gpus * d.replicas * d.gpu_memory_fraction for d in deployments.values()
                     if d.gpus and d.device != "cpu")
        if whole == 0 and shared == 0:
            raise AssertionError("refused a pipeline that asks for no GPU")
        return
    load = {g: 0.0 for g in gpus}
    whole_users: dict[str, int] = {}
    users: dict[str, int] = {}
    for (stage, _), ids in assignment.items():
        d = deployments[stage]
        on_gpu = d.gpus > 0 and d.device != "cpu"
        assert len(ids) == (d.gpus if on_gpu else 0) and len(set(ids)) == len(ids)  # exactly gpus, distinct
        for g in ids:
            assert g in load
            users[g] = users.get(g, 0) + 1
            if d.gpu_memory_fraction:
                load[g] += d.gpu_memory_fraction
            else:
                whole_users[g] = whole_users.get(g, 0) + 1
    for g in gpus:
        assert load[g] <= 1.0 + 1e-9                       # no GPU over 1.0
        if whole_users.get(g):
            assert users[g] == 1                           # an exclusive GPU is never shared
    assert sum(1 for _ in assignment) == sum(d.replicas for d in deployments.values())


gpu_contents = st.lists(st.sampled_from([0.1, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6]), min_size=1, max_size=4).filter(
    lambda shares: math.fsum(shares) <= 1.0 + 1e-9)


@settings(max_examples=200, deadline=None)
@given(st.lists(gpu_contents, min_size=1, max_size=4), st.data())
def test_shares_that_can_be_packed_are_never_refused(packing, data):
    """Built from a packing that exists, in any stage order: first fit may miss it, the search does not."""
    fractions = data.draw(st.permutations([f for shares in packing for f in shares]))
    deployments = {f"s{i}": sd(1, f) for i, f in enumerate(fractions)}
    assign_gpus(deployments, tuple(str(i) for i in range(len(packing))))


# ---------------------------------------------------------------- the machine's GPUs

def _never_run(*a, **kw):
    raise AssertionError("nvidia-smi must not run")


@pytest.mark.parametrize("environ,ids,source", [
    ({ENV_GPUS: "2", ENV_VISIBLE: "5"}, ("0", "1"), "OMNISTAGE_GPUS=2"),
    ({ENV_VISIBLE: "0,1"}, ("0", "1"), "CUDA_VISIBLE_DEVICES=0,1"),
    ({ENV_VISIBLE: "3, 1"}, ("3", "1"), "CUDA_VISIBLE_DEVICES=3, 1"),
    ({ENV_VISIBLE: ""}, (), "CUDA_VISIBLE_DEVICES="),
    ({ENV_VISIBLE: "0,-1,2"}, ("0",), "CUDA_VISIBLE_DEVICES=0,-1,2"),
    ({ENV_VISIBLE: "GPU-aa,GPU-bb"}, ("GPU-aa", "GPU-bb"), "CUDA_VISIBLE_DEVICES=GPU-aa,GPU-bb"),
])
def test_machine_gpus_from_the_environment(environ, ids, source):
    machine = machine_gpus(environ, run=_never_run)
    assert machine.ids == ids and machine.source == source and machine.device_order is None


def test_machine_gpus_refuses_a_count_that_is_not_one():
    with pytest.raises(GpuPlacementError, match="OMNISTAGE_GPUS"):
        machine_gpus({ENV_GPUS: "two"})


SMI = """GPU 0: NVIDIA H200 (UUID: GPU-0a)
GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-1b)
  MIG 3g.20gb     Device  0: (UUID: MIG-1b-0)
  MIG 3g.20gb     Device  1: (UUID: MIG-1b-1)
"""


def _fake_smi(tmp_path: Path) -> dict[str, str]:
    tool = tmp_path / "nvidia-smi"
    tool.write_text("#!/bin/sh\nexit 0\n")
    tool.chmod(0o755)
    return {"PATH": str(tmp_path)}


def test_machine_gpus_from_nvidia_smi_in_pci_order_with_mig_instances_by_uuid(tmp_path):
    def run(argv, **kw):
        assert argv == ["nvidia-smi", "-L"]
        return subprocess.CompletedProcess(argv, 0, SMI, "")

    machine = machine_gpus(_fake_smi(tmp_path), run=run)
    assert machine.ids == ("0", "MIG-1b-0", "MIG-1b-1") and machine.device_order == PCI_ORDER
    assert replica_env(("0",), machine) == {ENV_VISIBLE: "0", ENV_DEVICE_ORDER: PCI_ORDER}
    assert replica_env((), machine) == {ENV_VISIBLE: ""}


def test_machine_gpus_where_nvidia_smi_fails_is_none(tmp_path):
    def run(argv, **kw):
        return subprocess.CompletedProcess(argv, 9, "", "NVIDIA-SMI has failed because it couldn't communicate "
                                                        "with the NVIDIA driver\n")

    machine = machine_gpus(_fake_smi(tmp_path), run=run)
    assert machine.ids == () and "nvidia-smi -L exited 9: NVIDIA-SMI has failed" in machine.source


def test_without_nvidia_smi_torch_counts_only_when_already_imported(tmp_path, monkeypatch):
    class Cuda:
        is_available = staticmethod(lambda: True)
        device_count = staticmethod(lambda: 2)

    class Torch:
        cuda = Cuda

    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert machine_gpus({"PATH": str(tmp_path)}, run=_never_run).ids == ()
    monkeypatch.setitem(sys.modules, "torch", Torch)
    machine = machine_gpus({"PATH": str(tmp_path)}, run=_never_run)
    assert machine.ids == ("0", "1") and machine.source == "torch.cuda.device_count()"


def test_this_cpu_machine_finds_no_gpu():
    import torch

    if ENV_VISIBLE in os.environ or ENV_GPUS in os.environ or shutil.which("nvidia-smi") or torch.cuda.is_available():
        pytest.skip("this machine shows GPUs (or says which): the test is for a machine without")
    assert machine_gpus().ids == ()


def test_id_parsers():
    assert visible_ids("1,,2") == ("1",) and visible_ids(" ") == ()
    assert smi_ids("") == () and smi_ids("GPU 0: x\nGPU 1: y\n") == ("0", "1")


# ---------------------------------------------------------------- the launcher (no process started)

def _gpu_pipeline(tmp_path: Path, edits: dict[str, dict], printed: list[str]) -> LocalPipeline:
    def edit(doc):
        for stage, fields in edits.items():
            doc["spec"]["deployment"]["stages"][stage].update(fields)

    lp = LocalPipeline(tmp_path / "p.yaml", example("text-to-image-tiny", edit), tmp_path / "models",
                       log_dir=tmp_path / "logs", progress=printed.append, tls=False)
    lp.check_models = lambda: None
    return lp


def test_each_stage_replica_process_sees_only_its_gpus(tmp_path, monkeypatch):
    printed: list[str] = []
    lp = _gpu_pipeline(tmp_path, {"text-encoder": {"gpus": 1, "gpuMemoryFraction": 0.3},
                                  "denoise": {"gpus": 1, "replicas": 2},
                                  "vae-decode": {"gpus": 1, "device": "cpu"}}, printed)
    lp.extra_env = {ENV_GPUS: "3"}
    spawned: dict[str, dict[str, str]] = {}
    monkeypatch.setattr(lp, "_spawn", lambda proc, env: spawned.__setitem__(proc.name, env))

    def stop_waiting(procs, timeout):
        raise LaunchError("stopped here: the test starts no process")

    monkeypatch.setattr(lp, "_wait_ready", stop_waiting)
    with pytest.raises(LaunchError, match="stopped here"):
        lp.start()
    visible = {name: env[ENV_VISIBLE] for name, env in spawned.items()}
    assert visible == {"stage text-encoder[0]": "2", "stage denoise[0]": "0", "stage denoise[1]": "1",
                       "stage vae-decode[0]": ""}
    assert [p.gpus for p in lp.stages] == [("2",), ("0",), ("1",), ()]
    assert printed[:5] == ["GPUs: 3 GPUs (OMNISTAGE_GPUS=3)", "gpu  text-encoder/0 -> GPU 2 (0.3)",
                           "gpu  denoise/0 -> GPU 0 (whole)", "gpu  denoise/1 -> GPU 1 (whole)",
                           "gpu  vae-decode/0 -> CPU"]


def test_a_file_asking_for_more_gpus_than_the_machine_has_starts_nothing(tmp_path, monkeypatch):
    printed: list[str] = []
    lp = _gpu_pipeline(tmp_path, {"denoise": {"gpus": 1}}, printed)
    lp.extra_env = {ENV_VISIBLE: ""}
    monkeypatch.setattr(lp, "_spawn", _never_run)
    with pytest.raises(LaunchError, match=r"asks for 1 whole GPU across 1 stage replica; this machine has 0 GPUs "
                                          r"\(CUDA_VISIBLE_DEVICES=\)"):
        lp.start()
    assert lp.stages == [] and lp.tls_root is None and printed == []


# ---------------------------------------------------------------- the memory of its GPUs (for the plan's check)

def test_gpu_memory_from_the_override_then_nvidia_smi_smallest_first(tmp_path):
    assert gpu_memory({ENV_GPU_MEMORY: "80Gi"}, run=_never_run) == 80 << 30
    with pytest.raises(GpuPlacementError, match="OMNISTAGE_GPU_MEMORY: 'much' is not a size"):
        gpu_memory({ENV_GPU_MEMORY: "much"}, run=_never_run)

    def run(argv, **kw):
        assert argv == ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
        return subprocess.CompletedProcess(argv, 0, "143771\n40960\n", "")

    assert gpu_memory(_fake_smi(tmp_path), run=run) == 40960 << 20


def test_gpu_memory_unknown_is_none(tmp_path, monkeypatch):
    def fails(argv, **kw):
        return subprocess.CompletedProcess(argv, 9, "", "no driver")

    assert gpu_memory(_fake_smi(tmp_path), run=fails) is None
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert gpu_memory({"PATH": str(tmp_path / "none")}, run=_never_run) is None
