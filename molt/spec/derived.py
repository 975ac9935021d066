"""Keys that used to be set and are now derived from others: an old config or command line that sets one to
the value it takes anyway is accepted with a one-line message; another value is refused, saying what to
set instead.

RunSpec hands its raw input here before any field is checked (the sections no longer have these keys, so
they would be unknown keys), and molt/spec/config.py keeps them as null in Hydra's node so that
`python -m molt parallel.world_size=2` reaches this check instead of Hydra's "Key not in struct".
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("molt")

# Each removed key and what it is now (the messages name it).
ONE_REPLICA = "1: an engine actor runs one vLLM replica"
DERIVED_KEYS = {
    "parallel.world_size": "dp_size*cp_size*tp_size: the trainer's ranks per role",
    "rollout.engine.dp_size": ONE_REPLICA,
    "agent.judge.engine.dp_size": ONE_REPLICA,
    "agent.kind": "the kind of agent.module's AgentRunner: env (StepEnvRunner) or chat (ChatAgentRunner)",
}

def drop_derived_keys(data: Any) -> Any:
    """`data` (a RunSpec's raw input) without the keys of DERIVED_KEYS; a key set to its derived value is
    reported and dropped, null (the placeholder Hydra's node holds) dropped silently, another value
    refused with a ValueError naming the key and what to set."""
    if not isinstance(data, dict):
        return data
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    parallel = data.get("parallel")
    if isinstance(parallel, dict):
        sizes = [parallel.get(k, 1) for k in ("dp_size", "cp_size", "tp_size")]
        derived = sizes[0] * sizes[1] * sizes[2] if all(isinstance(n, int) for n in sizes) else None
        _check(parallel, "parallel", "world_size", derived,
               f"dp_size*cp_size*tp_size = {'*'.join(map(str, sizes))} = {derived}",
               "set parallel.dp_size (and cp_size, tp_size) to the ranks you want")
    for prefix in ("rollout.engine", "agent.judge.engine"):
        engine = _section(data, prefix)
        if engine is not None:
            _check(engine, prefix, "dp_size", 1, ONE_REPLICA, f"for more replicas raise {prefix}.num_engines "
                   "(the dispatcher balances requests over them)")
    agent = data.get("agent")
    kind = agent.pop("kind", None) if isinstance(agent, dict) else None
    if kind is not None:   # the module's kind is checked where the module is imported (molt.driver.compose)
        if kind not in ("env", "chat"):
            raise ValueError(f"agent.kind={kind}, but it is derived ({DERIVED_KEYS['agent.kind']}); remove "
                             "agent.kind from your config")
        _say(f"agent.kind is derived ({DERIVED_KEYS['agent.kind']}); remove it from your config")
    return data


def _section(data: dict[str, Any], prefix: str) -> dict[str, Any] | None:
    """The dict at dotted `prefix`, copied into `data` so that popping from it leaves the input as it was."""
    node: Any = data
    for part in prefix.split("."):
        child = node.get(part) if isinstance(node, dict) else None
        if not isinstance(child, dict):
            return None
        node[part] = node = dict(child)
    return node


def _check(section: dict[str, Any], prefix: str, key: str, derived: int | None, how: str,
           instead: str) -> None:
    value = section.pop(key, None)
    if value is None or derived is None:   # unset, or the other sizes are invalid (their fields say so)
        return
    if value != derived:
        raise ValueError(f"{prefix}.{key}={value}, but it is derived ({how}); {instead}; remove "
                         f"{prefix}.{key} from your config")
    _say(f"{prefix}.{key} is derived ({how}); remove it from your config")


def _say(message: str) -> None:
    log.warning(message)   # one line on stderr, and in the run's log once logging is set up
