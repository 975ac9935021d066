"""`algo.plugins`: user modules that add estimators or policy losses, imported before names are checked.

A plugin is a dotted module or a .py file, like `agent.module`; importing it runs its registrations
(`@register_estimator(...)`, `POLICY_LOSSES[name] = fn`). Registries live in each process, so the
driver loads the plugins before it checks a spec against them (`molt.driver.compose.check_algorithm`) and
every trainer rank loads them again before it computes a loss.
"""

from __future__ import annotations

from molt.spec import RunSpec
from molt.spec.user_modules import import_user_module

_LOADED: set[str] = set()   # plugins this process imported: a second import would register twice


def load_plugins(spec: RunSpec) -> None:
    """Import `spec.algo.plugins`, each once per process; ValueError names a plugin that fails to import."""
    for name in spec.algo.plugins:
        if name in _LOADED:
            continue
        try:
            import_user_module(name, "molt_plugin")
        except Exception as err:   # user code: any failure is reported as the plugin's
            raise ValueError(f"algo.plugins: {name!r} could not be imported: {type(err).__name__}: "
                             f"{err}") from err
        _LOADED.add(name)
