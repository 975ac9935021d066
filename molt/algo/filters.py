"""Batch filters, applied to finished rollouts before advantages (keys of `algo.filters`).

Each filter takes per-rollout tensors — rewards [R], scores [R] (what the score range reads; pass the
rewards when there is no separate score), group_ids [R] (int), truncated [R] (bool: the last turn hit
max_tokens) — plus the AlgoSpec, and returns (indices of the kept rollouts [K], number dropped).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from molt.algo.groups import group_mean

if TYPE_CHECKING:
    from molt.spec import AlgoSpec

Filter = Callable[[Tensor, Tensor, Tensor, Tensor, "AlgoSpec"], tuple[Tensor, int]]


def _kept(keep: Tensor) -> tuple[Tensor, int]:
    return keep.nonzero().flatten(), int((~keep).sum())


def drop_truncated(rewards: Tensor, scores: Tensor, group_ids: Tensor, truncated: Tensor,
                   algo: AlgoSpec) -> tuple[Tensor, int]:
    """Over-long filter: drop each rollout cut at max_tokens (its reward judges an unfinished answer)."""
    return _kept(~truncated.bool())


def drop_equal_rewards(rewards: Tensor, scores: Tensor, group_ids: Tensor, truncated: Tensor,
                       algo: AlgoSpec) -> tuple[Tensor, int]:
    """Dynamic sampling (DAPO): drop groups whose rewards are all equal (a group of one included) —
    a group baseline gives them zero advantage, so they would only dilute the batch."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    size = int(inverse.max()) + 1 if rewards.numel() else 0
    high = torch.full((size,), -torch.inf, dtype=rewards.dtype).scatter_reduce(0, inverse, rewards, "amax")
    low = torch.full((size,), torch.inf, dtype=rewards.dtype).scatter_reduce(0, inverse, rewards, "amin")
    return _kept((high > low)[inverse])


def score_range(rewards: Tensor, scores: Tensor, group_ids: Tensor, truncated: Tensor,
                algo: AlgoSpec) -> tuple[Tensor, int]:
    """Keep groups whose mean score lies in algo.filters.score_range = [low, high] (inclusive)."""
    low, high = algo.filters.score_range or (-torch.inf, torch.inf)
    mean = group_mean(scores.to(torch.float64), group_ids)
    return _kept((mean >= low) & (mean <= high))


# algo.filters.<name> enables FILTERS[name]; apply_filters runs the enabled ones in this order.
FILTERS: dict[str, Filter] = {
    "drop_truncated": drop_truncated, "drop_equal_rewards": drop_equal_rewards, "score_range": score_range,
}


def filter_drops(rewards: Tensor, scores: Tensor, group_ids: Tensor, truncated: Tensor,
                 algo: AlgoSpec) -> list[str | None]:
    """Per rollout, the name of the enabled filter that dropped it (None: kept). The enabled filters run
    in `FILTERS` order, each on the survivors of the previous one."""
    kept = torch.arange(rewards.numel())
    drops: list[str | None] = [None] * rewards.numel()
    for name, fn in FILTERS.items():
        if getattr(algo.filters, name) in (None, False):
            continue
        idx, _ = fn(rewards[kept], scores[kept], group_ids[kept], truncated[kept], algo)
        survivors = kept[idx]
        for i in set(kept.tolist()) - set(survivors.tolist()):
            drops[i] = name
        kept = survivors
    return drops


def apply_filters(rewards: Tensor, scores: Tensor, group_ids: Tensor, truncated: Tensor,
                  algo: AlgoSpec) -> tuple[Tensor, dict[str, Tensor]]:
    """Run every enabled filter on the survivors of the previous one (`filter_drops`).

    Returns the indices [K] of the kept rollouts in the input and metrics, under the names the loop logs:
    `filter/<name>_dropped` (rollouts each enabled filter dropped) and `filter/kept_frac`.
    """
    drops = filter_drops(rewards, scores, group_ids, truncated, algo)
    kept = torch.tensor([i for i, name in enumerate(drops) if name is None], dtype=torch.long)
    metrics = {f"filter/{name}_dropped": torch.tensor(float(drops.count(name))) for name in FILTERS
               if getattr(algo.filters, name) not in (None, False)}
    metrics["filter/kept_frac"] = torch.tensor(kept.numel() / max(rewards.numel(), 1))
    return kept, metrics
