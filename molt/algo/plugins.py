"""`algo.plugins`: user modules that add estimators or policy losses, imported before names are checked.

A plugin is a dotted module or a .py file, like `agent.module`; importing it runs its registrations
(`@register_estimator(...)`, `POLICY_LOSSES[name] = fn`). Registries live in each process, so the
driver loads the plugins when it checks a spec (`molt.driver.compose.to_spec`, `molt.driver.launch.launch`)
and every trainer rank loads them again before it computes a loss.
"""

from __future__ import annotations

from typing import Any

from molt.algo.estimators import ESTIMATORS, GROUP_BASELINE, TURN_CREDIT
from molt.algo.surrogates import POLICY_LOSSES
from molt.spec import RunSpec
from molt.spec.strict import did_you_mean
from molt.spec.user_modules import import_user_module

_LOADED: set[str] = set()   # plugins this process imported: a second import would register twice


def load_plugins(spec: RunSpec) -> None:
    """Import `spec.algo.plugins` (each once per process), then check the algorithm names against the
    registries; raises ValueError naming the bad key, the nearest name and the registered ones."""
    for name in spec.algo.plugins:
        if name in _LOADED:
            continue
        try:
            import_user_module(name, "molt_plugin")
        except Exception as err:   # user code: any failure is reported as the plugin's
            raise ValueError(f"algo.plugins: {name!r} could not be imported: {type(err).__name__}: "
                             f"{err}") from err
        _LOADED.add(name)
    _registered("estimator", spec.algo.estimator, ESTIMATORS)
    _registered("algo.loss.policy", spec.algo.loss.policy, POLICY_LOSSES)
    sampled = spec.train.objective == "rl"   # SFT samples nothing: its groups are not the estimator's
    if sampled and spec.algo.estimator in GROUP_BASELINE and spec.rollout.samples_per_prompt < 2:
        raise ValueError(f"algo.estimator={spec.algo.estimator} compares samples of one prompt, and "
                         "rollout.samples_per_prompt=1 makes every advantage 0; use >= 2 samples, or a "
                         "batch-baseline estimator (reinforce_pp)")
    if spec.algo.turn_credit == "turn" and spec.algo.estimator not in TURN_CREDIT:
        takers = ", ".join(sorted(TURN_CREDIT))
        raise ValueError(f"algo.turn_credit=turn with algo.estimator={spec.algo.estimator}: per-turn "
                         f"returns feed only the estimators that take them: {takers}; use one of those, "
                         "or algo.turn_credit=rollout")


def _registered(what: str, value: str, registry: dict[str, Any]) -> None:
    if value not in registry:
        raise ValueError(f"unknown {what} '{value}'{did_you_mean(value, registry)}; registered: "
                         f"{', '.join(sorted(registry))} (a plugin of your own: "
                         "algo.plugins=[module or file.py])")
