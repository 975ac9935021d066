"""User modules the spec names by a dotted module or a .py file: `agent.module`, `algo.plugins`, a
dataset's `transform`. Importing them is the spec's one rule for all three; what each must export is
checked by its reader (molt.agents.loader, molt.algo.plugins, molt.inputs.data_hub)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any


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


def __getattr__(name: str) -> Any:
    # load_plugins checks names against algo/'s registries, so it lives there (the spec imports no wing);
    # the old import keeps working. tools/import_graph.py leaves such aliases out of the graph.
    if name == "load_plugins":
        warnings.warn("molt.spec.plugins.load_plugins moved: import it from molt.algo.plugins",
                      DeprecationWarning, stacklevel=2)
        from molt.algo.plugins import load_plugins

        return load_plugins
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
