"""Helpers of the fault suite: paths and run specs with small budgets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from molt.spec import RunSpec
from molt.trainer.batch import make_batch
from molt.trajectory import Segment

REPO = Path(__file__).resolve().parents[2]
FAULTY = str(REPO / "examples" / "agents" / "faulty.py")


def small_spec(agent: dict | None = None, **sections) -> RunSpec:
    """The default tiny run with 8-token turns, a 512-token context, no evaluation and no periodic
    checkpoints unless asked for, and `agent` / other sections."""
    data = {"model": {"max_model_len": 512}, "rollout": {"max_tokens": 8, "samples_per_prompt": 4},
            "train": {"micro_batch_size": 8, "eval_every": 0, "save_every": 0}, "agent": agent or {}}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return RunSpec.model_validate(data)


def train_once(group: Any) -> None:
    """One real optimizer step on a small fixed batch, so the weights move away from the checkpoint."""
    ids = list(range(3, 40))
    segment = Segment(ids, [0] * 5 + [1] * 32, [0.0] * 5 + [-2.0] * 32, [-1] * 5 + [0] * 32, "r", "g",
                      prompt_len=5)
    batch = make_batch([segment], 0)
    batch.update(old_logp=group.logprobs(batch), advantages=torch.ones_like(batch["loss_mask"]))
    group.update(batch)
