"""Importance correction between the trainer's logprobs and the engine's behaviour logprobs.

The engine samples with slightly different numerics (and, with async / partial rollouts, older
weights) than the trainer, so every sampled token carries rho_t = exp(old_logp_t - behaviour_logp_t).
`algo.correction.level` picks the statistic that is gated (the token's rho, the sequence product, or
its geometric mean); `mode` picks what happens outside the band [low, high]: `mask` rejects (token, or
whole sequence for seq/geo; kept sequences keep their per-token rho), `clip` clamps to the band,
`trunc` caps at `high` only (TIS). The weight multiplies the per-token policy loss; it carries no grad.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from molt.algo.masked import masked_max, masked_mean

if TYPE_CHECKING:
    from molt.spec import CorrectionSpec


def _token(log_rho: Tensor, mask: Tensor) -> Tensor:
    return log_rho


def _seq(log_rho: Tensor, mask: Tensor) -> Tensor:
    return log_rho.sum(-1, keepdim=True)


def _geo(log_rho: Tensor, mask: Tensor) -> Tensor:
    return log_rho.sum(-1, keepdim=True) / (mask > 0).sum(-1, keepdim=True).clamp(min=1)


# algo.correction.level -> log of the gated statistic, [B, T] (token) or [B, 1] (one per sequence).
CORRECTIONS: dict[str, Callable[[Tensor, Tensor], Tensor] | None] = {
    "off": None, "token": _token, "seq": _seq, "geo": _geo,
}


def _mask(stat: Tensor, rho: Tensor, low: float, high: float) -> Tensor:
    return rho * ((stat >= low) & (stat <= high))


def _clip(stat: Tensor, rho: Tensor, low: float, high: float) -> Tensor:
    return stat.clamp(low, high).expand_as(rho)


def _trunc(stat: Tensor, rho: Tensor, low: float, high: float) -> Tensor:
    return stat.clamp(max=high).expand_as(rho)


# algo.correction.mode -> weight [B, T] from (statistic, token rho, low, high).
CORRECTION_MODES: dict[str, Callable[[Tensor, Tensor, float, float], Tensor]] = {
    "mask": _mask, "clip": _clip, "trunc": _trunc,
}


def importance_weights(old_logp: Tensor, behaviour_logp: Tensor, loss_mask: Tensor,
                       spec: CorrectionSpec) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token importance weights for the policy loss.

    Inputs [B, T]: trainer logprobs before the update (`old_logp`), engine sampling logprobs
    (`behaviour_logp`), `loss_mask` (1 on sampled tokens). Returns weights [B, T] (1 where
    level is off; 0 on rejected tokens; detached) and 0-dim metrics: is_ratio_mean / is_ratio_max /
    is_ratio_min (token rho), is_masked_frac (sampled tokens rejected), is_clipped_frac (sampled tokens
    whose weight differs from rho), is_weight_mean, is_logp_diff (mean |old_logp - behaviour_logp|).
    """
    mask = loss_mask > 0
    log_rho = torch.where(mask, (old_logp - behaviour_logp).detach(), torch.zeros_like(old_logp))
    rho = log_rho.exp()
    level = CORRECTIONS[spec.level]
    if level is None:
        weights = torch.ones_like(rho)
    else:
        stat = level(log_rho, loss_mask).exp()
        weights = CORRECTION_MODES[spec.mode](stat, rho, spec.low, spec.high)
    weights = torch.where(mask, weights, torch.zeros_like(weights))
    changed = (weights != rho) if level is not None else torch.zeros_like(mask)
    metrics = {
        "is_ratio_mean": masked_mean(rho, mask),
        "is_ratio_max": masked_max(rho, mask),
        "is_ratio_min": -masked_max(-rho, mask),
        "is_masked_frac": masked_mean((weights == 0).to(rho.dtype), mask),
        "is_clipped_frac": masked_mean(changed.to(rho.dtype), mask),
        "is_weight_mean": masked_mean(weights, mask),
        "is_logp_diff": masked_mean(log_rho.abs(), mask),
    }
    return weights, metrics


def gap_sums(gap: Tensor) -> dict[str, float]:
    """Additive sums of the trainer/engine gap (`gap` = trainer logprob − engine logprob, over the tokens
    the trainer's current weights sampled), reduced across micro-batches and ranks by sum, except
    `max_abs` (by max); `gap_metrics` turns the reduced sums into the logged invariant-3 metrics."""
    return {"tokens": float(gap.numel()), "abs_sum": float(gap.abs().sum()),
            "k3_sum": float((gap.exp() - 1 - gap).sum()),   # k3 estimate of KL(engine || trainer)
            "max_abs": float(gap.abs().max())}


def gap_metrics(sums: dict[str, float]) -> dict[str, float]:
    """`mismatch/mean_abs`, `mismatch/kl_k3`, `mismatch/max_abs` from reduced `gap_sums`."""
    return {"mismatch/mean_abs": sums["abs_sum"] / sums["tokens"],
            "mismatch/kl_k3": sums["k3_sum"] / sums["tokens"], "mismatch/max_abs": sums["max_abs"]}
