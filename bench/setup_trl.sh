#!/usr/bin/env bash
# Build the peer benchmark's own environment: bench/.venv-trl with the CPU torch and a pinned TRL.
#
# TRL is never a Molt dependency: it moves transformers past the range vLLM's CPU build accepts, so it
# lives in a separate venv that only bench/trl_peer.py runs in. The CPU torch goes in first, so
# nothing resolves a multi-GB CUDA torch for TRL.
#
#   bash bench/setup_trl.sh            # create or update bench/.venv-trl
#   bash bench/setup_trl.sh --help
set -euo pipefail

TORCH_VERSION=2.13.0
TRL_VERSION=1.16.0
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${MOLT_TRL_VENV:-$HERE/.venv-trl}"

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    echo "Pins: torch==$TORCH_VERSION (CPU wheel), trl==$TRL_VERSION. Venv: $VENV (override: MOLT_TRL_VENV)."
    exit 0
fi

PYTHON="${PYTHON:-python3}"
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# A CPU torch from the local wheel folder / the CPU index, before anything that depends on torch.
"$VENV/bin/pip" install -q "torch==$TORCH_VERSION" \
    || "$VENV/bin/pip" install -q "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu
"$VENV/bin/pip" install -q "trl==$TRL_VERSION" "torch==$TORCH_VERSION"
"$VENV/bin/python" - <<'PY'
import torch, transformers, trl
print(f"bench/.venv-trl ready: torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}")
PY
