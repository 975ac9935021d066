"""The learning-rate schedule of a trained role: a multiplier of its base LR per optimizer step.

The schedule counts the generated batches a role trains on (one `update` each, however many optimizer
steps `train.minibatches` / `train.epochs` take). The critic trains on every batch of the run; the
policy sits out the first `train.critic_warmup_steps` batches, so its schedule is that much shorter:
both decay to 0 at the run's last step.
"""

from __future__ import annotations

import math

from molt.spec import RunSpec


def lr_factor(spec: RunSpec, role: str, step: int) -> float:
    """Base-LR multiplier of `role` at its `step`-th update (0-based): linear warm-up over its first
    `train.warmup_steps` updates, then constant, or cosine / linear decay reaching 0 right after its last
    update (the run's last step)."""
    train = spec.train
    horizon = train.steps - (train.critic_warmup_steps if role == "policy" else 0)
    if step < train.warmup_steps:
        return (step + 1) / train.warmup_steps
    if train.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - train.warmup_steps) / max(1, horizon - train.warmup_steps))
    return 0.5 * (1 + math.cos(math.pi * progress)) if train.lr_schedule == "cosine" else 1 - progress
