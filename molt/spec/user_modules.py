"""User modules the spec names by a dotted module or a .py file: `agent.module`, `algo.plugins`, a
dataset's `transform`. Importing them is the spec's one rule for all three; what each must export is
checked by its reader (molt.agents.loader, molt.algo.plugins, molt.inputs.data_hub)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def import_user_module(name: str, prefix: str) -> ModuleType:
    """Import a dotted module, or execute a .py file (relative to the current directory) as module
    PREFIX_STEM."""
    if not name.endswith(".py"):
        return importlib.import_module(name)
    path = Path(name).resolve()
    spec = importlib.util.spec_from_file_location(f"{prefix}_{path.stem}", path)
    if spec is None or spec.loader is None or not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses and pickling look the module up by name
    spec.loader.exec_module(module)
    return module
