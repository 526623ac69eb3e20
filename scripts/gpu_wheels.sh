#!/usr/bin/env bash
# Wheels the GPU check's machine lacks, for its Python 3.12 (it has no network), into gpu-wheels/ (git-ignored),
# to be copied there with the checkout. The machine is expected to have (issue 15): torch 2.11
# (CUDA 13), transformers 5.17, grpcio, protobuf, prometheus-client, numpy, pyyaml, uvloop, pytest,
# hypothesis, safetensors, accelerate. Everything it needs besides is downloaded by this script, in priority
# order, within a budget (the checkout and gpu-wheels/ together stay under 64 MiB, to be copied as one):
# what does not fit is left out and said.
#   scripts/gpu_wheels.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-gpu-wheels}
budget_mb=${GPU_WHEELS_BUDGET_MB:-56}
pip=${PIP:-.venv/bin/pip}
mkdir -p "$dir"

# Groups, most needed first: one group is kept whole or left out whole.
groups=(
  # the generated gRPC code needs a runtime at least as new as the protoc that made it
  "grpcio==1.85.3 protobuf==7.36.2 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1"
  # the orchestrator's HTTP API, TLS for the pipeline's processes, audio input, process info
  "starlette==1.10.0 uvicorn==0.54.0 h11==0.16.0 click==8.5.1 anyio==4.16.0 pydantic==2.14.4 pydantic_core==2.50.5
   annotated-types==0.8.0 typing-inspection==0.4.5 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
   soundfile==0.14.0 psutil==7.2.2 pillow==13.0.0"
  # diffusion stages
  "diffusers==0.42.1 importlib_metadata==10.2.0 zipp==4.1.2 requests==2.34.2 urllib3==2.8.0 idna==3.20
   certifi==2026.10.19.post1 charset-normalizer==3.5.3"
  # UCX with CUDA transports (cuda_copy, cuda_ipc) for device-to-device edges
  # (ucxx imports cuda.core, which needs cuda-bindings and cuda-pathfinder; only librmm, not rmm, is loaded)
  "ucxx-cu13==0.52.0 libucxx-cu13==0.52.0 libucx-cu13==1.22.0 librmm-cu13==26.10.0 rapids-logger
   cuda-core==1.2.2 cuda-bindings==13.* cuda-pathfinder nvidia-ml-py"
)
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
tree_mb=$(( $(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) >> 20 ))
used=$tree_mb
left_out=()
for g in "${groups[@]}"; do
  tmp=$(mktemp -d)
  # shellcheck disable=SC2086
  if ! "$pip" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$tmp" $g 2> >(grep -v "is ignored: it is neither" >&2); then
    left_out+=("$g (not downloadable)"); rm -rf "$tmp"; continue
  fi
  size=$(( $(du -cb "$tmp"/*.whl | tail -1 | cut -f1) >> 20 ))
  if (( used + size > budget_mb )); then
    left_out+=("$(echo $g | tr -s ' \n' ' ') (${size} MiB: over the ${budget_mb} MiB budget)")
    rm -rf "$tmp"; continue
  fi
  mv "$tmp"/*.whl "$dir"/; rm -rf "$tmp"
  used=$((used + size))
done
echo "gpu wheels: $(ls "$dir" | wc -l) files, $(du -sm "$dir" | cut -f1) MiB in $dir (tree ${tree_mb} MiB)"
for g in "${left_out[@]}"; do echo "left out: $g"; done
