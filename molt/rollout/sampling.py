"""Sampling parameters for `EngineActor.generate`, from the run spec: training rollouts and evaluation."""

from __future__ import annotations

from typing import Any


def train_sampling(rollout: Any) -> dict[str, Any]:
    """`rollout.temperature/top_p/top_k/max_tokens` (a `RolloutSpec`)."""
    return {"temperature": rollout.temperature, "top_p": rollout.top_p, "top_k": rollout.top_k,
            "max_tokens": rollout.max_tokens}


def eval_sampling(rollout: Any) -> dict[str, Any]:
    """`rollout.eval`: its own temperature, top_p, top_k, max_tokens, and `n` samples per prompt."""
    e = rollout.eval
    return {"temperature": e.temperature, "top_p": e.top_p, "top_k": e.top_k, "max_tokens": e.max_tokens,
            "n": e.n}
