"""Hydra composition → the RunSpec a run starts from: validated by the spec, then checked against what
the spec names (algo/'s registries, the placement and memory plans), before Ray or any engine starts.

The spec imports none of the code it configures (molt/spec/config.py composes and validates); the checks
that need that code run here, the one step every command that runs or plans a run goes through.
"""

from __future__ import annotations

from collections.abc import Sequence

from omegaconf import DictConfig, OmegaConf

from molt.algo import load_plugins
from molt.plan import memory
from molt.plan.arch import arch_of
from molt.plan.placement import plan
from molt.spec import RunSpec, SpecError
from molt.spec.config import compose_config, validate_config


def to_spec(cfg: DictConfig) -> RunSpec:
    """Validate a composed config, then the checks that need more than the spec: `algo.plugins` imported
    and the algorithm names found in the registries they extend; on CUDA the placement plan and its
    memory estimate, so an over-subscribed layout or one that cannot fit a GPU's memory fails before Ray
    starts (CPU devices are time-shared: nothing to total)."""
    spec = validate_config(cfg)
    try:
        load_plugins(spec)
        check_agent_kind(spec, OmegaConf.select(cfg, "agent.kind"))
        check_context_parallel(spec)
        if spec.parallel.device == "cuda":
            plan(spec)
            memory.check(spec)
    except ValueError as err:
        raise SpecError(f"invalid run spec: {err}") from None
    return spec


def check_agent_kind(spec: RunSpec, stated: str | None) -> None:
    """The agent's kind is its module's (molt/spec/derived.py): the module is imported here only for an old
    config's `agent.kind` (the spec dropped it; it must be the module's)."""
    if stated is None:
        return
    from molt.agents import load_agent_runner

    try:
        runner = load_agent_runner(spec.agent)
    except (ImportError, TypeError) as err:   # the module is the user's: a one-line refusal, as at launch
        raise ValueError(str(err)) from None
    if stated != runner.kind:
        raise ValueError(f"agent.kind={stated}, but agent.module={spec.agent.module} is a "
                         f"{type(runner).__name__} (kind {runner.kind}): the kind is derived from "
                         "agent.module; remove agent.kind from your config (or name a module of that kind)")


def check_context_parallel(spec: RunSpec) -> None:
    """Context parallel splits the attention heads of each tensor-parallel rank over the cp ranks
    (molt/trainer/context_parallel.py): refused when cp_size does not divide them, for every trainer role
    whose architecture the plan knows (a hub id without model.arch is checked when the trainer loads it)."""
    par = spec.parallel
    if par.cp_size == 1:
        return
    roles = ["policy"] + (["reference"] if spec.model.reference else [])
    for role in roles:
        a = arch_of(spec, role)
        if a is not None and (a.num_heads % par.tp_size or a.num_heads // par.tp_size % par.cp_size):
            raise ValueError(f"parallel.cp_size={par.cp_size} must divide the {role}'s attention heads per "
                             f"tensor-parallel rank ({a.num_heads} / tp_size={par.tp_size}): context "
                             "parallel splits them over the cp ranks")


def compose(overrides: Sequence[str] = ()) -> RunSpec:
    """Compose conf/ with Hydra overrides (e.g. ["+experiment=qwen30b_tools", "train.lr=1e-5"]) and check
    the spec as a run would."""
    return to_spec(compose_config(overrides))
