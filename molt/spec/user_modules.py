"""User modules the spec names by a dotted module or a .py file: `agent.module`, `algo.plugins`, a
dataset's `transform`. Importing them is the spec's one rule for all three; what each must export is
checked by its reader (molt.agents.loader, molt.algo.plugins, molt.inputs.data_hub)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[2]   # molt/spec/user_modules.py -> the repository


def candidate_paths(path: str | Path) -> list[Path]:
    """Where a path the spec names may be: an absolute one as is; a relative one in the current directory,
    then the repository root, so the checkout's examples/ are found from any folder (data files and .py
    modules alike)."""
    p = Path(path).expanduser()
    return [p] if p.is_absolute() else list(dict.fromkeys([Path.cwd() / p, REPO_ROOT / p]))


def user_file(path: str | Path) -> Path:
    """The first of `candidate_paths` that is a file (the first candidate when none is)."""
    candidates = candidate_paths(path)
    return next((c for c in candidates if c.is_file()), candidates[0]).resolve()


def import_user_module(name: str, prefix: str) -> ModuleType:
    """Import a dotted module, or execute a .py file (`user_file`: the current directory, then the
    repository root) as module PREFIX_STEM."""
    if not name.endswith(".py"):
        return importlib.import_module(name)
    path = user_file(name)
    spec = importlib.util.spec_from_file_location(f"{prefix}_{path.stem}", path)
    if spec is None or spec.loader is None or not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses and pickling look the module up by name
    spec.loader.exec_module(module)
    return module
