"""The `logging` section of the run spec: Weights & Biases, the progress bar, rollout dumps, plots."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from molt.spec.strict import Strict


class WandbSpec(Strict):
    project: str = Field("molt", description="W&B project")
    entity: str | None = Field(None, description="W&B entity (team or user; null = the default)")
    mode: Literal["online", "offline", "disabled", "auto"] = Field(
        "auto", description="auto: online with WANDB_API_KEY, else offline (WANDB_MODE wins)")
    name: str | None = Field(None, description="W&B run name (null = run.name; a sweep job: its choices)")
    group: str | None = Field(None, description="W&B group (null; a sweep sets the sweep directory's name)")
    job_type: str | None = Field(None, description="W&B job type (null = the algo group's choice)")
    tags: list[str] = Field(default_factory=list, description="W&B tags")

class LoggingSpec(Strict):
    wandb: WandbSpec = Field(default_factory=WandbSpec, description="Weights & Biases")
    progress: bool = Field(True, description="show a progress bar with reward, step time and tokens/s")
    dump_rollouts: bool = Field(True, description="write each step's rollouts to rollouts/step_*.jsonl")
    dump_trainer: bool = Field(True, description="the dump also holds the trainer's side of every trained "
                               "token (logprob, advantage, importance weight, entropy; python -m "
                               "molt.inspect)")
    dump_keep_steps: int = Field(100, ge=0, description="keep the rollout dumps of the last N steps (0: all)")
    plots: bool = Field(True, description="write PNG plots into plots/ at the end of the run")
