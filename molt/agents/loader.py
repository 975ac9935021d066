"""`agent.module` → the runner it exports as `AgentRunner`."""

from __future__ import annotations

from typing import Any

from molt.agents.runner import Runner
from molt.spec import AgentSpec
from molt.spec.user_modules import import_user_module


def load_agent_runner(agent: AgentSpec) -> Any:
    """Import `agent.module` (a dotted module or a .py path) and return its `AgentRunner`.

    Errors name the module and what is wrong: unreadable, no `AgentRunner`, or not a runner. The runner's
    `kind` (env or chat) is the agent's kind: the spec has no key for it.
    """
    name = agent.module
    try:
        module = import_user_module(name, "molt_agent")
    except Exception as err:
        raise ImportError(f"agent.module={name!r} could not be loaded: {type(err).__name__}: {err}") from err
    runner = getattr(module, "AgentRunner", None)
    if runner is None:
        raise ImportError(f"agent.module={name!r} does not export AgentRunner; add e.g. "
                          "`AgentRunner = StepEnvRunner(MyEnv)` or `AgentRunner = ChatAgentRunner(MyAgent)`")
    if not isinstance(runner, Runner):
        raise TypeError(f"{name}.AgentRunner is a {type(runner).__name__}, not a StepEnvRunner or "
                        "ChatAgentRunner")
    return runner
