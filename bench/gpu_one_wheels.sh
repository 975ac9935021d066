#!/usr/bin/env bash
# The wheels bench/gpu_one.py needs beyond a GPU image's torch, transformers and numpy (none of them builds
# from source, 16 MB), and their install into a folder on the GPU machine (docs/install.md):
#   bash bench/gpu_one_wheels.sh download   # here, with the package registries: into bench/out/gpu_one_wheels
#   bash bench/gpu_one_wheels.sh install    # there, offline: into bench/out/gpu_one_deps (PYTHONPATH it)
# hydra-core, omegaconf, antlr4 (Hydra's parser; its sdist built into a wheel here) and pydantic compose and
# validate the spec the memory plan reads; nemo-automodel (its own wheel, none of its dependencies: the
# parallelizer imports without them) is the trainer's sharding. pydantic-core is compiled: one wheel per
# Python the GPU image may have.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=bench/out/gpu_one_wheels
PY="${PYTHON:-python}"
PACKAGES=(hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 pydantic==2.14.4 pydantic-core==2.50.5
          annotated-types==0.8.0 typing-inspection==0.4.5 nemo-automodel==0.7.0)
case "${1:-}" in
  download)
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    "$PY" -m pip download -q --no-deps -d "$WHEELS" hydra-core==1.3.8 omegaconf==2.3.1 pydantic==2.14.4 \
      annotated-types==0.8.0 typing-inspection==0.4.5 nemo-automodel==0.7.0
    "$PY" -m pip wheel -q --no-deps -w "$WHEELS" antlr4-python3-runtime==4.9.3
    rm -f "$WHEELS"/*.tar.gz
    for version in 3.10 3.11 3.12 3.13 3.14; do
      "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$version" \
        --platform manylinux2014_x86_64 -d "$WHEELS" pydantic-core==2.50.5
    done
    du -sh "$WHEELS" && ls "$WHEELS" ;;
  install)
    if "$PY" -m pip --version >/dev/null 2>&1; then
      "$PY" -m pip install -q --no-index --no-deps --find-links "$WHEELS" --target bench/out/gpu_one_deps \
        "${PACKAGES[@]}"
    else   # an image without pip: a wheel is a zip of what installs, unpacked as is (pydantic-core: this Python's)
      tag=$("$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
      for wheel in "$WHEELS"/*.whl; do
        case "$wheel" in *pydantic_core-*) [[ "$wheel" == *"-$tag-$tag-"* ]] || continue ;; esac
        "$PY" -m zipfile -e "$wheel" bench/out/gpu_one_deps
      done
    fi
    echo "installed into bench/out/gpu_one_deps: PYTHONPATH=bench/out/gpu_one_deps:. $PY bench/gpu_one.py" ;;
  *) echo "usage: bash bench/gpu_one_wheels.sh download|install" >&2; exit 2 ;;
esac
