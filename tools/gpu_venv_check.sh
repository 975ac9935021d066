#!/usr/bin/env bash
# Installs the GPU dependency set into a separate venv on a machine without a GPU, imports every module the
# GPU path imports (tools/gpu_modules.txt), and dry-runs every GPU experiment with it:
#   bash tools/gpu_venv_check.sh [VENV]
#   VENV (default /tmp/molt-gpu-venv) is created if missing and reused if present; delete it afterwards.
# The set is `bash install.sh gpu --resolve` (the install script's own inputs and overrides), installed
# without resolving again: CUDA wheels install anywhere, and the set holds no nvcc source build
# (tests/test_install.py checks that); pure-Python source releases (antlr4 for Hydra) build as usual.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-/tmp/molt-gpu-venv}"
UV=".venv/bin/uv"
start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  "$UV" venv -q --python 3.11 "$VENV"
  bash install.sh gpu --resolve > "$VENV/gpu-requirements.txt"
  (unset UV_FIND_LINKS UV_EXTRA_INDEX_URL PIP_FIND_LINKS
   "$UV" pip install -q --python "$VENV/bin/python" --no-deps --index-strategy unsafe-best-match \
     -r "$VENV/gpu-requirements.txt"
   "$UV" pip install -q --python "$VENV/bin/python" --no-deps -e .)
fi
echo "install: $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
modules_file="$(pwd)/tools/gpu_modules.txt"
cd /tmp   # import the checkout's molt through the editable install, not from the working directory
MOLT_GPU_MODULES="$modules_file" "$VENV/bin/python" - <<'PY'
import importlib, os, sys, traceback
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
import torch
assert torch.version.cuda, f"torch {torch.__version__} has no CUDA"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), GPUs visible: {torch.cuda.device_count()}")
modules = [line.split("#")[0].strip() for line in open(os.environ["MOLT_GPU_MODULES"])]
modules = [name for name in modules if name]   # tools/gpu_modules.txt
failed = []
for name in modules:
    try:
        importlib.import_module(name)
    except Exception as error:   # report every module, not only the first that fails
        failed.append(name)
        print(f"FAIL import {name}: {type(error).__name__}: {error}")
        traceback.print_exc(limit=-3)
from nemo_automodel import NeMoAutoModelForCausalLM, NeMoAutoModelForImageTextToText  # noqa: F401
from torch.distributed import ProcessGroupNCCL   # molt/refit.py's NCCL branch
ProcessGroupNCCL.Options()._timeout
from vllm.platforms import current_platform
print(f"imported {len(modules) - len(failed)}/{len(modules)} modules; vLLM platform here: "
      f"{type(current_platform).__name__}")
try:   # vLLM's CUDA kernels: they link against the driver's libcuda, which only a GPU machine has
    importlib.import_module("vllm._C_stable_libtorch")
    print("vllm._C_stable_libtorch (CUDA kernels) loads")
except ImportError as error:
    if "libcuda.so" not in str(error):
        failed.append("vllm._C_stable_libtorch")
    print(f"vllm._C_stable_libtorch (CUDA kernels): {error}")
sys.exit(1 if failed else 0)
PY
cd - >/dev/null
rc=0
gpu_experiments=$("$VENV/bin/python" -c "
from pathlib import Path; from molt.driver.compose import compose
print(' '.join(p.stem for p in sorted(Path('experiments').glob('*.yaml'))
               if compose([f'+experiment={p.stem}']).parallel.device == 'cuda'))")
for name in $gpu_experiments; do
  # HF_HUB_OFFLINE: a hub dataset that is not cached fails at once instead of after network retries
  if out=$(HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" "$VENV/bin/python" -m molt "+experiment=$name" \
           run.dry_run=true 2>&1); then
    echo "dry run $name: ok"; echo "$out" | grep "total:" | sed 's/^/    /'
  elif echo "$out" | grep -q "needs DeepEP"; then   # check_expert_dispatch: an install without deep-ep
    echo "dry run $name: refused, needs DeepEP (docs/install.md#gpu)"
  elif echo "$out" | grep -q "could not be loaded with datasets.load_dataset"; then
    echo "dry run $name: its hub dataset is neither cached nor reachable here (HF_HUB_OFFLINE=0 to fetch)"
  elif echo "$out" | grep -q "dataset file not found: 'runs/data/"; then   # written by a command first
    echo "dry run $name: its data files are not written here (the experiment's header names the command)"
  else
    rc=1; echo "dry run $name: FAILED"; echo "$out" | tail -5 | sed 's/^/    /'
  fi
done
echo "gpu_venv_check: $(( $(date +%s) - start )) s in all, rc=$rc"
exit $rc
