"""Hydra composition → validated RunSpec, shared by `python -m molt`, `python -m molt.diff` and tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from molt.spec import RunSpec, SpecError, unknown_key_message, validate_spec

CONFIG_MODULE = "molt.conf"
GROUPS = ("model", "parallel", "algo", "agent", "experiment")


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
    if problems:
        raise SpecError("invalid override(s):\n" + "\n".join(problems))


def to_spec(cfg: DictConfig) -> RunSpec:
    """Resolve interpolations and validate."""
    data: Any = OmegaConf.to_container(cfg, resolve=True)
    return validate_spec(data)


def compose(overrides: Sequence[str] = ()) -> RunSpec:
    """Compose conf/ with Hydra overrides (e.g. ["+experiment=qwen30b_tools", "train.lr=1e-5"])."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    check_overrides(overrides)
    with initialize_config_module(CONFIG_MODULE, version_base=None):
        cfg = hydra_compose("config", overrides=list(overrides))
    return to_spec(cfg)


def spec_yaml(spec: RunSpec) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(spec.model_dump(mode="json")))
