"""What one trainer `update` reports: sums over its micro-batches and updates on this rank, reduced over
the ranks into the names the run logs (`critic/*` for the critic, `train/*` for the policy, `mismatch/*`
for the trainer/engine gap).

Loss and grad_norm are means per update; the loss terms' metrics are token-weighted means over every
micro-batch of every rank (`w/` sums); `tokens` counts the batch once; with several updates per batch,
`<metric>_last` is the last update's alone (`l/` sums); the gap's max is a max over the ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from molt.algo import gap_metrics, gap_sums

# The metrics whose last update's value is also logged (`<name>_last`) when a batch has several updates.
LAST_UPDATE_METRICS = ("ratio_mean", "approx_kl", "clip_frac_low", "clip_frac_high")


class StepMetrics:
    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.max_abs = 0.0                  # the largest trainer/engine gap on this rank
        self.grad_norms: list[float] = []   # one per optimizer step

    def add(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + float(value)

    def micro_batch(self, loss: torch.Tensor, tokens: int, metrics: dict[str, Any], threads: float,
                    first_pass: bool, last: bool) -> None:
        """One micro-batch's loss and metrics, weighted by its `tokens` (sampled tokens); `first_pass`:
        its tokens count towards `tokens` (the first epoch); `last`: it belongs to the last of several
        updates."""
        self.add("loss", loss.detach())
        self.add("weight", tokens)
        self.add("tokens", tokens if first_pass else 0)
        self.add("w/threads", threads * tokens)
        for key, value in metrics.items():
            self.add(f"w/{key}", float(value) * tokens)
            if last and key in LAST_UPDATE_METRICS:
                self.add(f"l/{key}", float(value) * tokens)
        if last:
            self.add("l/weight", tokens)

    def gap(self, diff: torch.Tensor) -> None:
        """The trainer/engine logprob gap of the tokens the held weights sampled (`diff`, flat)."""
        for key, value in gap_sums(diff).items():
            if key == "max_abs":
                self.max_abs = max(self.max_abs, value)
            else:
                self.add(f"mismatch/{key}", value)

    def totals(self, keys: list[str], all_sum: Callable[[list[float]], list[float]],
               device: Any) -> dict[str, float]:
        """`keys`' sums over the ranks, and the gap's max over them as `mismatch/max_abs` (a collective:
        every rank passes the same keys)."""
        total = dict(zip(keys, all_sum([self.sums.get(k, 0.0) for k in keys]), strict=True))
        peak = torch.tensor([self.max_abs], device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return {**total, "mismatch/max_abs": float(peak)}

    def reduce(self, section: str, lr: float, several_updates: bool,
               all_sum: Callable[[list[float]], list[float]], device: Any) -> dict[str, float]:
        """The metrics under `section` (train/ or critic/), the same on every rank (a collective: every rank
        calls it, also one whose shard held no sampled token)."""
        keys = sorted(self.sums)
        objs: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(objs, keys)
        total = self.totals(sorted(set().union(*objs)), all_sum, device)
        peak = total.pop("mismatch/max_abs")
        updates = len(self.grad_norms)
        out = {f"{section}loss": total.pop("loss") / updates,
               f"{section}grad_norm": sum(self.grad_norms) / updates, f"{section}lr": lr,
               f"{section}tokens": max(total.pop("tokens", 0.0), 1.0)}
        if several_updates:
            out[f"{section}updates"] = float(updates)
        weight, last_weight = max(total.pop("weight"), 1.0), max(total.pop("l/weight", 0.0), 1.0)
        for key, value in total.items():
            if key.startswith("w/"):
                out[f"{section}{key[2:]}"] = value / weight
            elif key.startswith("l/"):
                out[f"{section}{key[2:]}_last"] = value / last_weight
        if "mismatch/abs_sum" in total:   # the trainer/engine gap, under the names the run logs
            out.update(gap_metrics({"tokens": total["mismatch/tokens"], "abs_sum": total["mismatch/abs_sum"],
                                    "k3_sum": total["mismatch/k3_sum"], "max_abs": peak}))
        return out
