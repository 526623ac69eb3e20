#!/usr/bin/env bash
# Install what pyproject.toml's [tool.omnistage] table pins under no-deps, WITHOUT its dependencies: Qwen3-TTS's
# own classes, the qwen-tts package its authors publish. It pins transformers==4.57.3 (omnistage runs
# transformers 5; omnistage/checkpoints/qwen_tts.py bridges the names that changed) and pulls torchaudio, sox,
# onnxruntime and gradio, which only its 25 Hz tokenizer and demo use (torchaudio's builds do not load against
# omnistage's torch). Of its dependencies the 12 Hz models need librosa (mel filters), one of omnistage's own, so
# run this after installing the project: scripts/setup.sh does for the dev venv, the Dockerfile for the image.
# Besides python it calls shell builtins only (tests/unit/test_dockerfile.py runs it with python stubbed).
# Usage: install_qwen_tts.sh [PYTHON] (default: python).
set -euo pipefail
PY=${1:-python}
here=${BASH_SOURCE[0]%/*}
[ "$here" != "${BASH_SOURCE[0]}" ] || here=.
pins=$("$PY" -c 'import sys, tomllib; print(" ".join(tomllib.load(open(sys.argv[1], "rb"))["tool"]["omnistage"]["no-deps"]))' \
  "$here/../pyproject.toml")
read -ra pins <<< "$pins"
"$PY" -m pip install -q --no-deps "${pins[@]}"
