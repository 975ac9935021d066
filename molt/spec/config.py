"""Hydra composition → validated RunSpec: conf/ and the overrides, checked by the spec alone.

What needs more than the spec (the algorithm names in algo/'s registries, the placement and memory plans)
is checked one step up, in molt.driver.compose, before anything starts; `python -m molt.diff` and
`--help` read specs and stop here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from molt.spec import RunSpec, SpecError, unknown_key_message, validate_spec

CONFIG_MODULE = "molt.conf"
GROUPS = ("experiment", "model", "parallel", "algo", "agent")
SPEC_DEFAULTS = "spec_defaults"   # conf/config.yaml's first default: every key at the spec's default


def _store_spec_defaults() -> None:
    """Give Hydra every key at its `RunSpec` default, so `key=value` overrides any key (Hydra refuses a
    key its config lacks) while molt/spec/ stays the one source of defaults: conf/ sets only choices.
    Inside a free-form dict that starts empty (rollout.engine.extra_args, model.chat_template_kwargs,
    model.reference_tiny) a new entry is an addition, `+key.entry=value`, as Hydra's error says."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SPEC_DEFAULTS, node=RunSpec().model_dump(mode="json"))


_store_spec_defaults()


def check_overrides(overrides: Sequence[str]) -> None:
    """Reject override keys the spec does not have, naming the nearest valid key.

    Hydra refuses `parallel.ep_sise=8` without a hint and silently adds `+parallel.ep_sise=8`; checking
    against the schema first gives one clear message for both forms, before anything starts.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    problems = []
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        key = override.key_or_group
        if key.split(".")[0] in GROUPS + ("hydra",) and "." not in key or key.startswith("hydra"):
            continue
        message = unknown_key_message(key)
        if message:
            problems.append(f"  {message}")
    if len(problems) == 1:
        raise SpecError(f"invalid override: {problems[0].strip()}")
    if problems:
        raise SpecError("invalid overrides:\n" + "\n".join(problems))


def validate_config(cfg: DictConfig) -> RunSpec:
    """Resolve interpolations and validate (a `hydra` node, as `compose_config` keeps, is left out)."""
    data: Any = {key: OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
                 for key, value in cfg.items() if key != "hydra"}
    return validate_spec(data)


def compose_config(overrides: Sequence[str] = (), config_dir: Path | None = None,
                   search_path: Path | None = None) -> DictConfig:
    """The composed config with its `hydra` node (group choices, run and sweep directories).

    `config_dir` replaces the installed conf/ (a checkout of another revision); `search_path` adds a
    folder whose `experiment/` holds extra experiment files. A missing group option raises SpecError
    with one line naming the options that exist.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir, initialize_config_module
    from hydra.errors import MissingConfigException

    check_overrides(overrides)
    extra = [f"hydra.searchpath=[file://{search_path}]"] if search_path else []
    init = initialize_config_dir(str(config_dir), version_base=None) if config_dir else \
        initialize_config_module(CONFIG_MODULE, version_base=None)
    try:
        with init:
            return hydra_compose("config", overrides=[*overrides, *extra], return_hydra_config=True)
    except MissingConfigException as err:
        group, _, name = (err.missing_cfg_file or "").rpartition("/")
        raise SpecError(f"unknown {group or 'config'} '{name}'; available: "
                        f"{', '.join(err.options or [])}") from None


def choices_of(cfg: DictConfig) -> dict[str, str]:
    """Config-group options a composed config used, e.g. {"algo": "grpo", "model": "tiny", ...}."""
    chosen = cfg.hydra.runtime.choices
    return {g: str(chosen[g]) for g in GROUPS if chosen.get(g) is not None}


def spec_yaml(spec: RunSpec) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(spec.model_dump(mode="json")))
