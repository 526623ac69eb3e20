#!/usr/bin/env bash
# Install Qwen3-TTS's own classes: the qwen-tts package its authors publish, pinned, WITHOUT its dependencies.
# It pins transformers==4.57.3 (omnistage runs transformers 5; omnistage/checkpoints/qwen_tts.py bridges the
# names that changed) and pulls torchaudio, sox, onnxruntime and gradio, which only its 25 Hz tokenizer and demo
# use (torchaudio's builds do not load against omnistage's torch). Of its dependencies the 12 Hz models need
# librosa (mel filters), installed with its own. Usage: install_qwen_tts.sh [PYTHON] (default: python).
set -euo pipefail
PY=${1:-python}
QWEN_TTS=0.1.1   # omnistage/checkpoints/qwen_tts.py VERSION
LIBROSA=0.11.0
"$PY" -m pip install -q "librosa==$LIBROSA"
"$PY" -m pip install -q --no-deps "qwen-tts==$QWEN_TTS"
