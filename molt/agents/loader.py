"""`agent.module` → the runner it exports as `AgentRunner`."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from molt.agents.runner import Runner
from molt.spec import AgentSpec


def load_agent_runner(agent: AgentSpec) -> Any:
    """Import `agent.module` (a dotted module or a .py path) and return its `AgentRunner`.

    Errors name the module and what is wrong: unreadable, no `AgentRunner`, not a runner, or a runner of
    another kind than `agent.kind`.
    """
    name = agent.module
    try:
        if name.endswith(".py"):
            path = Path(name).resolve()
            spec = importlib.util.spec_from_file_location(f"molt_agent_{path.stem}", path)
            if spec is None or not path.is_file():
                raise FileNotFoundError(f"no such file: {path}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module   # dataclasses and pickling look the module up by name
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(name)
    except Exception as err:
        raise ImportError(f"agent.module={name!r} could not be loaded: {type(err).__name__}: {err}") from err
    runner = getattr(module, "AgentRunner", None)
    if runner is None:
        raise ImportError(f"agent.module={name!r} does not export AgentRunner; add e.g. "
                          "`AgentRunner = StepEnvRunner(MyEnv)` or `AgentRunner = ChatAgentRunner(MyAgent)`")
    if not isinstance(runner, Runner):
        raise TypeError(f"{name}.AgentRunner is a {type(runner).__name__}, not a StepEnvRunner or "
                        "ChatAgentRunner")
    if runner.kind != agent.kind:
        raise ValueError(f"{name}.AgentRunner is a {type(runner).__name__} (kind '{runner.kind}') but "
                         f"agent.kind='{agent.kind}'")
    return runner
