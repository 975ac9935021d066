"""The run spec: the one validated object the launcher reads.

Hydra composes `conf/` + an experiment into a plain dict; `RunSpec.model_validate` then checks it
strictly. Every section forbids unknown keys, so a typo fails instead of being silently ignored, and
`validate_spec` turns pydantic's errors into one message that lists every problem with the nearest
valid key. The rules across sections are spec/rules.py's.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, model_validator

from molt.spec import rules
from molt.spec.agent import AgentSpec
from molt.spec.algo import AlgoSpec
from molt.spec.data import DataSpec
from molt.spec.logging import LoggingSpec
from molt.spec.model import ModelSpec
from molt.spec.parallel import ParallelSpec
from molt.spec.rollout import RolloutSpec
from molt.spec.strict import Strict, did_you_mean
from molt.spec.train import TrainSpec


class RunSection(Strict):
    name: str = Field("tiny", description="names the run directory, the sweep directory and the W&B run")
    seed: int = Field(0, description="seed of the prompt order and of the engines' sampling")
    dir: str | None = Field(None, description="run directory; the launcher fills it from Hydra's output dir")
    resume: str | None = Field(
        None, description="'auto': continue the newest run of this experiment that has a checkpoint (none: "
                          "start fresh); or a run dir or a checkpoint dir")
    dry_run: bool = Field(False, description="validate, build the inputs as a run would, print the plan, "
                          "then every problem found (exit 2 if any); starts nothing")


class RaySpec(Strict):
    address: str | None = Field(None, description="attach to this Ray cluster (null = start Ray locally)")
    num_cpus: int | None = Field(None, ge=1, description="logical CPUs of a local Ray (null = at least 16 on "
                                 "CPU)")

    @model_validator(mode="after")
    def _local_only(self) -> RaySpec:
        if self.num_cpus is not None and self.address:
            raise ValueError(f"ray.num_cpus={self.num_cpus} with ray.address={self.address}: the CPUs of a "
                             "cluster are its nodes' own (ray start --num-cpus); unset ray.num_cpus")
        return self


class RunSpec(Strict):
    run: RunSection = Field(default_factory=RunSection, description="name, seed, directory, resume")
    model: ModelSpec = Field(default_factory=ModelSpec, description="policy model, reference, critic")
    parallel: ParallelSpec = Field(default_factory=ParallelSpec, description="the trainer's parallel layout")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="sampling, streaming, engines")
    train: TrainSpec = Field(default_factory=TrainSpec, description="optimizer, batch, checkpoints, eval")
    algo: AlgoSpec = Field(default_factory=AlgoSpec, description="estimator, loss, correction, KL, filters")
    agent: AgentSpec = Field(default_factory=AgentSpec, description="the agent that produces rollouts")
    data: DataSpec = Field(default_factory=DataSpec, description="prompt datasets")
    logging: LoggingSpec = Field(default_factory=LoggingSpec, description="W&B, progress bar, dumps, plots")
    ray: RaySpec = Field(default_factory=RaySpec, description="the Ray cluster")

    @property
    def response_budget(self) -> int:
        """The most response tokens one rollout can sample: rollout.max_tokens per turn, agent.max_turns
        turns (seq-mean-token-sum-norm divides by it; the overlong penalty's band sits below it)."""
        return self.rollout.max_tokens * self.agent.max_turns

    @model_validator(mode="after")
    def _rules(self) -> RunSpec:
        rules.check(self)
        return self

class SpecError(ValueError):
    """A config that does not validate; the message lists every problem at once."""


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    """Valid field names of the model that holds the key at `loc`."""
    model: Any = RunSpec
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = field.annotation
    return list(getattr(model, "model_fields", {}))


def unknown_key_message(dotted: str) -> str | None:
    """None if `dotted` names a spec key (or lies inside a free-form dict), else an error with a hint."""
    model: Any = RunSpec
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        fields = getattr(model, "model_fields", None)
        if fields is None:  # a dict / free-form value: anything below is the user's
            return None
        if part not in fields:
            hint = did_you_mean(part, fields, prefix="".join(f"{p}." for p in parts[:i]))
            return f"unknown key '{dotted}'{hint}; valid keys here: {', '.join(fields)}"
        model = fields[part].annotation
    return None


def validate_spec(data: dict[str, Any]) -> RunSpec:
    """Validate a composed config; raise SpecError listing every problem with the nearest valid key."""
    try:
        return RunSpec.model_validate(data)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            loc = tuple(p for p in e["loc"] if not isinstance(p, int))
            dotted = ".".join(str(p) for p in e["loc"])
            if e["type"] == "extra_forbidden":
                hint = did_you_mean(str(loc[-1]), _fields_at(loc), "".join(f"{p}." for p in loc[:-1]))
                lines.append(f"  {dotted}: unknown key{hint}")
            elif e["type"] == "value_error":   # a rule's own message names its keys and values
                message = str(e["ctx"]["error"])
                named = not dotted or message.startswith(dotted)
                lines.append(f"  {'' if named else dotted + ': '}{message}")
            else:
                got = e.get("input")
                shown = "" if isinstance(got, dict) else f" (got {got!r})"
                lines.append(f"  {dotted or 'spec'}: {e['msg']}{shown}")
        if len(lines) == 1:   # one problem, one line
            raise SpecError(f"invalid run spec: {lines[0].strip()}") from None
        raise SpecError(f"invalid run spec ({len(lines)} error(s)):\n" + "\n".join(lines)) from None
